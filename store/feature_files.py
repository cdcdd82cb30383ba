"""The DuckDB store's feature vectors, kept as Parquet files beside the database file.

The `features` table holds each stored request's feature space and where its vector lies (a file of this
folder and a row of it). Writing a segment's vectors as one Parquet column is cheaper than copying them
into DuckDB's blocks, and is the layout DuckLake gives a catalog (docs/infra.md). A file is durable
before the transaction that references it commits, so a crash leaves at most an unreferenced file; a
file's name derives from its content (`file_name`), so a rerun writes the same name again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from leap_io.durable import write_durably
from store.feature_encoding import features_from_bytes

FOLDER_SUFFIX = ".features"
"""The folder of a store's feature files is the database file's path with this suffix appended."""


def feature_folder(store_path: str | Path) -> Path:
    """Where the store at `store_path` keeps its feature files."""
    store_path = Path(store_path)
    return store_path.with_name(store_path.name + FOLDER_SUFFIX)


def file_name(segment: str, checksum: str) -> str:
    """The file holding the features a segment's content stored: one name per (segment, checksum)."""
    digest = hashlib.sha256(f"{segment}\0{checksum}".encode()).hexdigest()[:40]
    return f"{digest}.parquet"


def write_feature_file(folder: Path, name: str, blobs: pa.Array) -> None:
    """Write `blobs` (one feature vector's bytes per row) as `folder/name`, durably, replacing any file
    of that name (a rerun's: see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_durably(folder / name, lambda path: pq.write_table(
        pa.table({"feature": blobs}), path, compression="none", use_dictionary=False, write_statistics=False))


def read_features(folder: Path, files: Sequence[str], rows: np.ndarray, dim: int) -> np.ndarray:
    """The (n, dim) float32 vectors stored at (`files[i]`, `rows[i]`), in that order.

    Each file is read once, whatever number of rows it gives. FileNotFoundError names a missing
    file; ValueError, a row past a file's end or a file of another dim.
    """
    n = len(files)
    out = np.empty((n, dim), dtype=np.float32)
    if not n:
        return out
    files = np.asarray(files, dtype=object)
    rows = np.asarray(rows, dtype=np.int64)
    order = np.argsort(files, kind="stable")
    boundaries = np.flatnonzero(files[order][1:] != files[order][:-1]) + 1
    for group in np.split(order, boundaries):
        name = files[group[0]]
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"the store's feature file {path} is missing: its rows cannot be read")
        with pq.ParquetFile(path) as parquet:
            matrix = features_from_bytes(parquet.read(columns=["feature"]).column("feature"), dim)
        wanted = rows[group]
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= len(matrix)):
            raise ValueError(f"the store references row {int(wanted.max())} of {path}, which holds {len(matrix)}")
        out[group] = matrix[wanted]
    return out
