"""How ingest writes the DuckDB file (`store.duckdb.LogStore.segment_writer`).

Rows go in as Arrow tables registered on the connection, never a value at a time, and a segment's
feature vectors go to a feature file of their own (`store.feature_files`), written by a thread of
its own while the segment's requests go into the database.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from datetime import datetime
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from store.feature_encoding import feature_bytes
from store.feature_files import file_name, write_feature_file
from store.protocol import Ledger, SpaceKey
from store.row_masks import rows_in, rows_where
from store.sql import DUCKDB, RECIPE_SQL, SCALAR_COLUMNS, SqlWriter, space_dims


def stored_dims(con: duckdb.DuckDBPyConnection) -> dict[SpaceKey, int]:
    """The feature dim already stored for each feature space (model fingerprint, layer, capture recipe)."""
    return space_dims(con.execute(
        f"SELECT f.model_fingerprint, f.layer, {RECIPE_SQL}, min(f.dim) FROM features f GROUP BY ALL").fetchall())


def _insert_arrow(con: duckdb.DuckDBPyConnection, view: str, table: pa.Table, sql: str, params: list) -> None:
    con.register(view, table)
    try:
        con.execute(sql, params)
    finally:
        with suppress(duckdb.Error):  # fails in an aborted transaction, and must not mask why it aborted
            con.unregister(view)


def _stored_ids(con: duckdb.DuckDBPyConnection, ids: pa.Array) -> pa.Array:
    """Those of `ids` already in the store (an index lookup per id, in one query)."""
    con.register("_incoming_ids", pa.table({"request_id": ids}))
    try:
        stored = con.sql(
            "SELECT request_id FROM _incoming_ids SEMI JOIN requests USING (request_id)"
        ).to_arrow_table().column("request_id")
    finally:
        with suppress(duckdb.Error):
            con.unregister("_incoming_ids")
    return stored.combine_chunks()


class DuckDBWriter(SqlWriter):
    """The DuckDB file's writes, on the connection that holds the file's lock for the whole run: no
    other writer can run meanwhile, so the run's snapshot stays true and nothing needs claiming.

    A segment's feature file (`store.feature_files`) is written by `files`, a thread of its own,
    while the segment's requests go into the database; `insert_features` waits for it, so the file
    is on disk before the transaction that references it commits.
    """

    dialect = DUCKDB
    concurrent = False
    environment_errors = (
        duckdb.IOException,
        duckdb.OutOfMemoryException,
        duckdb.FatalException,
        duckdb.InternalException,
        duckdb.InterruptException,
    )

    def __init__(self, con: duckdb.DuckDBPyConnection, features_folder: Path, files: ThreadPoolExecutor) -> None:
        super().__init__(con)
        self.features_folder = features_folder
        self.files = files
        self._pending: tuple[str, Future] | None = None  # (file name, its write) of the segment being written

    def _wait_file(self) -> str | None:
        """The pending file's name once written (re-raising its error), or None when none is pending."""
        if self._pending is None:
            return None
        (name, write), self._pending = self._pending, None
        write.result()
        return name

    def snapshot(self) -> tuple[Ledger, set[tuple[str, str]], dict[SpaceKey, int]]:
        return *self._ledger_and_changed(), stored_dims(self.con)

    def begin(self) -> None:
        self.con.execute("BEGIN TRANSACTION")

    def commit(self) -> None:
        self.con.execute("COMMIT")

    def rollback(self) -> None:
        with suppress(Exception):  # a file left by the rolled-back segment is referenced by nothing
            self._wait_file()
        with suppress(duckdb.Error):
            self.con.execute("ROLLBACK")

    def claim(self, segment: str, checksum: str) -> tuple[tuple[str, str] | None, bool]:
        raise NotImplementedError("the DuckDB file has one writer; its snapshot needs no claim")

    def store_dims(self, spaces: Sequence[SpaceKey], dim: int | None,
                   known: Mapping[SpaceKey, int]) -> Mapping[SpaceKey, int]:
        return known

    def release_spaces(self, stored: Mapping[SpaceKey, int]) -> None:
        pass

    def insert_requests(self, rows: pa.Table, segment: str, now: datetime, replica_id: str | None) -> np.ndarray:
        ids = rows.column("request_id")
        stored = _stored_ids(self.con, ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids)
        inserted = ~rows_in(ids, stored) if len(stored) else np.ones(rows.num_rows, dtype=bool)
        columns = ", ".join(SCALAR_COLUMNS)
        _insert_arrow(self.con, "_incoming_requests", rows_where(rows, inserted).select(list(SCALAR_COLUMNS)),
                      f"INSERT INTO requests ({columns}, segment, ingested_at, replica_id) "
                      f"SELECT {columns}, ?, ?, ? FROM _incoming_requests", [segment, now, replica_id])
        return inserted

    def prepare_features(self, rows: pa.Table, dim: int, segment: str, checksum: str) -> None:
        """Start writing the vectors of `rows` (those `insert_requests` will find already stored too)
        as the segment's feature file; each row's file row is its index in `rows`."""
        with suppress(Exception):  # a rolled-back segment's write (rollback waits for it): not this one's error
            self._wait_file()
        if not rows.num_rows:
            return
        blobs = feature_bytes(rows.column("feature"), dim or 0)  # a view of the float32 buffer
        name = file_name(segment, checksum)
        self._pending = (name, self.files.submit(write_feature_file, self.features_folder, name, blobs))

    def insert_features(self, rows: pa.Table, inserted: np.ndarray, dim: int, recipe: str | None) -> None:
        """Reference the inserted rows' vectors from `features` once their file is on disk (a file whose
        rows were all found stored already is removed: nothing will reference it)."""
        name = self._wait_file()
        if name is None:
            return
        if not inserted.any():
            (self.features_folder / name).unlink(missing_ok=True)
            return
        references = rows_where(rows, inserted).select(["request_id", "layer", "model_fingerprint"]).append_column(
            "file_row", pa.array(np.flatnonzero(inserted).astype(np.int32)))
        _insert_arrow(self.con, "_incoming_features", references,
                      "INSERT INTO features (request_id, dim, layer, model_fingerprint, file, file_row, recipe) "
                      "SELECT request_id, ?, layer, model_fingerprint, ?, file_row, ? FROM _incoming_features",
                      [dim, name, recipe])

    def insert_quarantine(self, table: pa.Table, now: datetime) -> None:
        _insert_arrow(self.con, "_incoming_quarantine", table,
                      "INSERT INTO quarantine SELECT segment, row_index, request_id, reason, raw::JSON, ? "
                      "FROM _incoming_quarantine", [now])
