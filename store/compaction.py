"""Compaction of the DuckDB store's feature files: many small files become a few large ones.

Ingest writes one feature file per segment (`store.feature_files`), so a fleet of small segments would
leave a file per segment for every training frame to open. `compact_features` rewrites the files holding
fewer than `small_rows` referenced vectors into files of about `target_rows`. New files are durable before
the transaction that points rows at them, old ones are deleted only `grace_s` later (a reader may still
open them), and names derive from what they replace, so a crash or rerun is safe. PostgreSQL keeps
vectors in its `features` table and has nothing to compact.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import pyarrow as pa

from store.duckdb import LogStore
from store.feature_encoding import matrix_bytes
from store.feature_files import read_features, write_feature_file

RETIRED_DDL = """CREATE TABLE IF NOT EXISTS retired_feature_files (
  file VARCHAR PRIMARY KEY,
  retired_at DOUBLE NOT NULL
)"""
"""Feature files no row references any more, kept for readers that looked them up just before."""


def _batches(small: list[tuple[str, int, int]], target_rows: int) -> list[tuple[int, list[str]]]:
    """Groups of at least two small files of one dim, each about `target_rows` rows at most."""
    batches: list[tuple[int, list[str]]] = []
    by_dim: dict[int, list[tuple[str, int]]] = {}
    for name, dim, rows in small:
        by_dim.setdefault(dim, []).append((name, rows))
    for dim, files in sorted(by_dim.items()):
        group: list[str] = []
        total = 0
        for name, rows in files:
            if group and total + rows > target_rows:
                batches.append((dim, group))
                group, total = [], 0
            group.append(name)
            total += rows
        batches.append((dim, group))
    return [(dim, group) for dim, group in batches if len(group) > 1]


def _compacted_name(files: list[str]) -> str:
    digest = hashlib.sha256("\0".join(sorted(files)).encode()).hexdigest()[:40]
    return f"compact-{digest}.parquet"


def _delete_retired(store: LogStore, con: Any, grace_s: float, now: float) -> int:
    due = [name for (name,) in con.execute("SELECT file FROM retired_feature_files WHERE retired_at <= ?",
                                           [now - grace_s]).fetchall()]
    for name in due:
        (store.features_folder / name).unlink(missing_ok=True)
    if due:
        con.execute("DELETE FROM retired_feature_files WHERE retired_at <= ?", [now - grace_s])
    return len(due)


def compact_features(store: LogStore, *, small_rows: int = 20_000, target_rows: int = 200_000,
                     grace_s: float = 3600.0) -> dict[str, Any]:
    """Rewrite the feature files holding fewer than `small_rows` referenced rows into files of up to about
    `target_rows`; delete the files retired at least `grace_s` ago. Returns {"files_before",
    "files_after", "files_compacted", "files_written", "rows_moved", "retired_files_deleted"}."""
    if small_rows < 1 or target_rows < 2:
        raise ValueError(f"small_rows must be >= 1 and target_rows >= 2, not {small_rows}, {target_rows}")
    now = time.time()
    with store.connect() as con:
        con.execute(RETIRED_DDL)
        deleted = _delete_retired(store, con, grace_s, now)
        counts = con.execute("SELECT file, min(dim), count(*) FROM features GROUP BY file ORDER BY file").fetchall()
        small = [(name, int(dim), int(rows)) for name, dim, rows in counts if rows < small_rows]
        written, compacted, moved = 0, 0, 0
        for dim, files in _batches(small, target_rows):
            references = con.execute(
                "SELECT file, file_row FROM features WHERE list_contains(?::VARCHAR[], file) ORDER BY file, file_row",
                [files]).fetchall()
            old_files = np.array([file for file, _ in references], dtype=object)
            old_rows = np.array([row for _, row in references], dtype=np.int64)
            vectors = read_features(store.features_folder, old_files, old_rows, dim)
            name = _compacted_name(files)
            write_feature_file(store.features_folder, name, matrix_bytes(vectors))
            mapping = pa.table({"old_file": pa.array(old_files.tolist(), pa.string()),
                                "old_row": pa.array(old_rows.astype(np.int32)),
                                "new_row": pa.array(np.arange(len(old_rows), dtype=np.int32))})
            con.execute("BEGIN TRANSACTION")
            try:
                con.register("_moved", mapping)
                con.execute("UPDATE features SET file = ?, file_row = m.new_row FROM _moved m "
                            "WHERE features.file = m.old_file AND features.file_row = m.old_row", [name])
                con.unregister("_moved")
                con.executemany("INSERT OR REPLACE INTO retired_feature_files VALUES (?, ?)",
                                [[file, now] for file in files])
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            written, compacted, moved = written + 1, compacted + len(files), moved + len(old_rows)
        if grace_s <= 0:
            deleted += _delete_retired(store, con, grace_s, time.time())
        files_after = con.execute("SELECT count(DISTINCT file) FROM features").fetchone()[0]
    return {"files_before": len(counts), "files_after": int(files_after), "files_compacted": compacted,
            "files_written": written, "rows_moved": moved, "retired_files_deleted": deleted}

