"""Writes real feedback segments for tests, clean or with chosen rows broken in known ways.

Each corruption breaks its own rows (no row is broken twice), so a test knows exactly how many rows
ingest must quarantine for each reason and which rows are duplicates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from leap_io.feedback_schema import (
    META_DIM,
    META_LAYER,
    META_MODEL_FINGERPRINT,
    META_MODEL_ID,
    META_SCHEMA_VERSION,
    SCHEMA_VERSION,
    feedback_schema,
)

ROW_CORRUPTIONS = (
    "null_id",
    "empty_id",
    "nan_feature",
    "inf_feature",
    "wrong_dim_feature",  # stores the feature column as a variable list; these rows get dim + 1 floats
    "negative_prompt_tokens",
    "negative_output_tokens",
    "nan_output_tokens",  # stores output_tokens as float64
    "zero_output_tokens",
    "finish_before_arrival",
    "unknown_finish_reason",
    "null_arrival_time",
    "duplicate_id",  # reuses the id of an earlier clean row
    "nul_in_id",  # a NUL inside the request id (PostgreSQL text cannot hold one)
    "nul_in_domain",  # a NUL inside the domain
)
"""Corruptions that take a number of rows."""


def _with_nul(values: np.ndarray, rows) -> np.ndarray:
    values = values.copy()
    for row in rows:
        values[row] = f"{values[row]}\x00"
    return values


@dataclass
class FuzzedSegment:
    path: Path
    table: pa.Table  # exactly what was written
    broken_rows: dict[str, np.ndarray] = field(default_factory=dict)  # corruption -> row indices

    @property
    def clean_rows(self) -> np.ndarray:
        broken = np.concatenate([np.asarray(rows, dtype=np.int64) for rows in self.broken_rows.values()] or [[]])
        return np.setdiff1d(np.arange(self.table.num_rows), broken)


def write_segment(
    path: str | Path,
    n: int,
    dim: int,
    seed: int,
    corrupt: dict | None = None,
    *,
    id_prefix: str | None = None,
    id_offset: int = 0,
    model_fingerprint: str = "fp-fuzz",
    layer: int = 20,
    start_time: float = 1_700_000_000.0,
    domains: tuple[str, ...] = ("chat", "code", "math"),
    finish_reasons: tuple[str, ...] = ("stop", "length", "abort"),
    overrides: dict[str, list] | None = None,
) -> FuzzedSegment:
    """Write a segment of `n` rows the way the serving process does (temporary name, then rename).

    `corrupt` maps a name of ROW_CORRUPTIONS to a row count, and may also hold
    `drop_columns` (names left out of the file), `metadata_dim` (a dim written to the metadata
    instead of `dim`), `metadata_layer` (a layer written to the metadata instead of `layer`),
    `null_layer` (a count of rows, from the first, whose layer column is null, so that they need the
    metadata's layer) and `invalid_utf8` (string column -> a count of rows, from the first, whose
    bytes there are not UTF-8: Parquet and Arrow read them, Arrow's string kernels and DuckDB refuse
    them).
    `finish_reasons` is what each row's finish reason is drawn from; `overrides` maps a column name to
    the values written instead (one a row, in the column's type).
    """
    corrupt = dict(corrupt or {})
    drop_columns = list(corrupt.pop("drop_columns", []))
    metadata_dim = int(corrupt.pop("metadata_dim", dim))
    metadata_layer = int(corrupt.pop("metadata_layer", layer))
    null_layer = int(corrupt.pop("null_layer", 0))
    invalid_utf8 = dict(corrupt.pop("invalid_utf8", {}))
    unknown = set(corrupt) - set(ROW_CORRUPTIONS)
    if unknown:
        raise ValueError(f"unknown corruptions {sorted(unknown)}")
    rng = np.random.default_rng(seed)
    prefix = f"s{seed}-" if id_prefix is None else id_prefix

    order = rng.permutation(n)
    broken: dict[str, np.ndarray] = {}
    taken = 0
    for name in ROW_CORRUPTIONS:
        count = int(corrupt.get(name, 0))
        if name == "duplicate_id":
            continue  # chosen last, among the rows left clean
        broken[name] = np.sort(order[taken:taken + count])
        taken += count
    clean = np.sort(order[taken:])
    n_duplicates = int(corrupt.get("duplicate_id", 0))
    if n_duplicates >= max(len(clean), 1):
        raise ValueError("not enough clean rows to duplicate")
    duplicates = np.sort(rng.choice(clean[1:], size=n_duplicates, replace=False)) if n_duplicates else clean[:0]
    broken = {name: rows for name, rows in broken.items() if len(rows)}
    if n_duplicates:
        broken["duplicate_id"] = duplicates

    ids = np.array([f"{prefix}{i + id_offset:08d}" for i in range(n)], dtype=object)
    sources = np.setdiff1d(clean, duplicates)
    for row in duplicates:
        ids[row] = ids[rng.choice(sources[sources < row])]
    for row in broken.get("nul_in_id", []):
        ids[row] = ids[row] + "\x00x"

    arrival = start_time + np.sort(rng.uniform(0, 3600, n))
    first_token = arrival + rng.uniform(0.01, 0.5, n)
    finish = first_token + rng.uniform(0.1, 30.0, n)
    prompt_tokens = rng.integers(1, 2048, n).astype(np.float64)
    output_tokens = rng.integers(1, 4096, n).astype(np.float64)
    finish_reason = rng.choice(np.array(finish_reasons, dtype=object), n)
    features = rng.standard_normal((n, dim)).astype(np.float32)

    ids_null = np.zeros(n, dtype=bool)
    ids_null[broken.get("null_id", [])] = True
    ids[broken.get("empty_id", [])] = ""
    features[broken.get("nan_feature", []), 0] = np.nan
    features[broken.get("inf_feature", []), -1] = np.inf
    prompt_tokens[broken.get("negative_prompt_tokens", [])] = -3
    output_tokens[broken.get("negative_output_tokens", [])] = -1
    output_tokens[broken.get("nan_output_tokens", [])] = np.nan
    output_tokens[broken.get("zero_output_tokens", [])] = 0
    finish[broken.get("finish_before_arrival", [])] = arrival[broken.get("finish_before_arrival", [])] - 1.0
    finish_reason[broken.get("unknown_finish_reason", [])] = "exploded"
    arrival_null = np.zeros(n, dtype=bool)
    arrival_null[broken.get("null_arrival_time", [])] = True

    schema = feedback_schema(dim)
    columns: dict[str, pa.Array] = {
        "request_id": pa.array(ids, pa.string(), mask=ids_null),
        "client_request_id": pa.array([f"client-{i}" for i in range(n)], pa.string()),
        "model_id": pa.array(["fuzz-model"] * n, pa.string()),
        "model_fingerprint": pa.array([model_fingerprint] * n, pa.string()),
        "layer": pa.array(np.full(n, layer, dtype=np.int32), mask=np.arange(n) < null_layer),
        "policy": pa.array(["leap"] * n, pa.string()),
        "arrival_time": pa.array(arrival, pa.float64(), mask=arrival_null),
        "first_token_time": pa.array(first_token, pa.float64()),
        "finish_time": pa.array(finish, pa.float64()),
        "prompt_tokens": pa.array(prompt_tokens.astype(np.int32)),
        "max_tokens": pa.array(np.full(n, 4096, dtype=np.int32)),
        "decoding": pa.array(['{"temperature": 0.0}'] * n, pa.string()),
        "domain": pa.array(_with_nul(rng.choice(np.array(domains, dtype=object), n), broken.get("nul_in_domain", [])),
                           pa.string()),
        "tenant": pa.array(rng.choice(np.array(["a", "b"], dtype=object), n), pa.string()),
        "predicted_at_admission": pa.array(rng.uniform(1, 500, n).astype(np.float32)),
        "predicted_latest": pa.array(rng.uniform(1, 500, n).astype(np.float32)),
        "readout_version": pa.array(["v1"] * n, pa.string()),
        "shadow_predicted": pa.nulls(n, pa.float32()),  # no readout held in shadow
        "shadow_version": pa.nulls(n, pa.string()),
        "client_arrival_time": pa.nulls(n, pa.float64()),  # no client planned an arrival
        "finish_reason": pa.array(finish_reason, pa.string()),
    }
    if "nan_output_tokens" in broken:
        columns["output_tokens"] = pa.array(output_tokens, pa.float64())
    else:
        columns["output_tokens"] = pa.array(output_tokens.astype(np.int32))
    if "wrong_dim_feature" in broken:
        wrong = set(broken["wrong_dim_feature"].tolist())
        rows = [list(features[i]) + ([0.5] if i in wrong else []) for i in range(n)]
        columns["feature"] = pa.array(rows, pa.list_(pa.float32()))
    else:
        columns["feature"] = pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), dim)

    for name, values in (overrides or {}).items():
        columns[name] = pa.array(values, columns[name].type)
    for name, count in invalid_utf8.items():
        values = [b"\xff\xfe not utf-8" if i < count else (None if v is None else str(v).encode())
                  for i, v in enumerate(columns[name].to_pylist())]
        as_bytes = pa.array(values, pa.binary())
        columns[name] = pa.Array.from_buffers(pa.string(), n, as_bytes.buffers())  # unchecked bytes

    fields = []
    for schema_field in schema:
        if schema_field.name in drop_columns:
            continue
        fields.append(pa.field(schema_field.name, columns[schema_field.name].type))  # all nullable
    metadata = {
        META_SCHEMA_VERSION: SCHEMA_VERSION.encode(),
        META_DIM: str(metadata_dim).encode(),
        META_LAYER: str(metadata_layer).encode(),
        META_MODEL_ID: b"fuzz-model",
        META_MODEL_FINGERPRINT: model_fingerprint.encode(),
    }
    table = pa.table({f.name: columns[f.name] for f in fields}, schema=pa.schema(fields, metadata=metadata))

    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temporary)
    os.replace(temporary, path)
    return FuzzedSegment(path=path, table=table, broken_rows=broken)


def truncate(path: str | Path, nbytes: int) -> bytes:
    """Cut the file to its first `nbytes` bytes, as a crash during a copy would; returns the original."""
    path = Path(path)
    original = path.read_bytes()
    with open(path, "r+b") as handle:
        handle.truncate(nbytes)
    return original


def assert_reconciles(store) -> None:
    """Every row read is accounted for once, in the ledger and in the tables alike."""
    counts = store.counts()
    assert counts["rows_read"] == counts["rows_accepted"] + counts["rows_quarantined"] + counts["rows_duplicate"]
    assert counts["requests"] == counts["features"] == counts["rows_accepted"]
    # one quarantine row stands for each segment quarantined whole
    whole_segments = counts["segments_unreadable"] + counts["segments_failed"] + counts["segments_changed"]
    assert counts["quarantine"] == counts["rows_quarantined"] + whole_segments
    for entry in store.ledger():
        assert entry["rows_read"] == entry["rows_accepted"] + entry["rows_quarantined"] + entry["rows_duplicate"]
