"""The DuckDB log store: finished requests, their features, quarantined rows and the ingest ledger.

DuckDB lets one process at a time open a file read-write, so connections are short-lived and opening
one retries with backoff before `StoreBusyError`. Shared reads are `store.sql`'s, row checks
`store.validation`'s, ingest writes `store.duckdb_writer`'s. Feature vectors are kept in Parquet files
beside the database (`store.feature_files`) and never travel row by row in either direction. Opening an
older file migrates it once under the write lock (`SCHEMA_VERSION`; the versions are listed in
docs/architecture.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from leap_io.feedback_schema import TRAINING_FINISH_REASONS
from store.duckdb_writer import DuckDBWriter, stored_dims
from store.feature_encoding import FEATURE_DTYPE, features_from_bytes, matrix_bytes
from store.feature_files import feature_folder, file_name, read_features, write_feature_file
from store.frame import TrainingFrame, frame_from_arrow
from store.sql import (
    DUCKDB,
    FRAME_COLUMNS,
    SCHEMA_VERSION_QUERY,
    SqlStore,
    frame_query,
    requests_ddl,
    schema_version_sql,
    table_ddl,
)

__all__ = [
    "SCHEMA_DDL",
    "SCHEMA_VERSION",
    "TRAINING_FINISH_REASONS",
    "LogStore",
    "StoreBusyError",
    "TrainingFrame",
]

SCHEMA_VERSION = 9
"""Version of the store's tables; see the module docstring for what each version added."""

FEATURES_DDL = """CREATE TABLE IF NOT EXISTS {table} (
  request_id VARCHAR NOT NULL,
  dim INTEGER NOT NULL,
  layer INTEGER NOT NULL,
  model_fingerprint VARCHAR NOT NULL,
  file VARCHAR NOT NULL,
  file_row INTEGER NOT NULL,
  recipe VARCHAR
)"""
"""Where each stored request's feature vector lies (`store.feature_files`), and its feature space."""

SCHEMA_DDL = (
    requests_ddl(DUCKDB),
    FEATURES_DDL.format(table="features"),
    table_ddl(DUCKDB, "quarantine"),
    table_ddl(DUCKDB, "ingest_ledger"),
    table_ddl(DUCKDB, "changed_segments"),
    table_ddl(DUCKDB, "segment_stamps"),
    table_ddl(DUCKDB, "store_meta"),
)

GATES_DDL = table_ddl(DUCKDB, "gates")
"""The gate verdicts the pipeline records (`flows.tasks.record_gate`), created on first use."""


def _column_types(con: duckdb.DuckDBPyConnection, table: str) -> dict[str, str]:
    """The type of each column of `table`."""
    return dict(con.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ? "
        "AND table_catalog = current_database()", [table]).fetchall())


def _schema_version(con: duckdb.DuckDBPyConnection) -> int:
    """The version written in `store_meta`; 1 for a file from before versions were written, 0 for none."""
    tables = {name for (name,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database()").fetchall()}
    if "store_meta" not in tables:
        return 1 if "requests" in tables else 0
    rows = con.execute(SCHEMA_VERSION_QUERY).fetchall()
    return int(rows[0][0]) if rows else 1


_LIST_TO_BYTES = "leap_float_list_to_bytes"
"""The SQL name under which `_migrate` registers `_list_to_bytes` while it converts `FLOAT[]` features."""


def _list_to_bytes(lists: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A chunk of `FLOAT[]` values as the little-endian float32 bytes version 4 stores (a NULL element,
    which ingest never stored, becomes NaN rather than shifting the values after it)."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths * FEATURE_DTYPE.itemsize, out=offsets[1:])
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(FEATURE_DTYPE)
    return pa.Array.from_buffers(pa.large_binary(), len(lists), [None, pa.py_buffer(offsets), pa.py_buffer(values)])


MIGRATION_PAGE_ROWS = 65_536
"""Feature vectors the move to feature files (version 4 -> 5) reads and writes at a time: one file each."""


def _move_features_to_files(con: duckdb.DuckDBPyConnection, folder: Path) -> None:
    """Version 4 -> 5: every stored vector to a feature file, `features` rebuilt to reference them.

    Runs inside the migration's transaction; each dim's rows are paged by request id (the old
    table's key), so memory holds one page of vectors whatever the store's size. The files are
    written before the transaction commits: a failed migration leaves files nothing references.
    """
    con.execute(FEATURES_DDL.format(table="features_v5"))
    dims = [int(dim) for (dim,) in con.execute("SELECT DISTINCT dim FROM features ORDER BY dim").fetchall()]
    for dim in dims:
        after, page = "", 0
        while True:
            batch = con.sql(
                "SELECT request_id, feature FROM features WHERE dim = ? AND request_id > ? "
                "ORDER BY request_id LIMIT ?", params=[dim, after, MIGRATION_PAGE_ROWS]).to_arrow_table()
            if not batch.num_rows:
                break
            vectors = features_from_bytes(batch.column("feature"), dim)
            name = file_name(f"store schema 4, dim {dim}", str(page))
            write_feature_file(folder, name, matrix_bytes(vectors))
            con.register("_moved", pa.table({
                "request_id": batch.column("request_id"),
                "file_row": pa.array(np.arange(batch.num_rows, dtype=np.int32))}))
            try:
                con.execute("INSERT INTO features_v5 SELECT f.request_id, f.dim, f.layer, f.model_fingerprint, ?, "
                            "m.file_row, f.recipe FROM _moved m JOIN features f USING (request_id)", [name])
            finally:
                con.unregister("_moved")
            after, page = batch.column("request_id")[-1].as_py(), page + 1
    con.execute("DROP TABLE features")
    con.execute("ALTER TABLE features_v5 RENAME TO features")


def _migrate(con: duckdb.DuckDBPyConnection, folder: Path) -> None:
    """Create missing tables and bring an older store to SCHEMA_VERSION, in one transaction;
    `folder` receives the feature files (version 5)."""
    with suppress(duckdb.Error):  # registered by an earlier migration on this connection
        con.remove_function(_LIST_TO_BYTES)
    con.create_function(_LIST_TO_BYTES, _list_to_bytes, ["FLOAT[]"], "BLOB", type="arrow")
    con.execute("BEGIN TRANSACTION")
    try:
        for ddl in SCHEMA_DDL:
            con.execute(ddl)
        requests = _column_types(con, "requests")
        if "replica_id" not in requests:  # version 1 -> 2
            con.execute("ALTER TABLE requests ADD COLUMN replica_id VARCHAR")
        if "client_request_id" not in requests:  # version 6 -> 7: the key was the client's id
            con.execute("ALTER TABLE requests ADD COLUMN client_request_id VARCHAR")
            con.execute("UPDATE requests SET client_request_id = request_id")
        if "shadow_version" not in requests:  # version 7 -> 8: a shadow readout's prediction (NULL before)
            con.execute("ALTER TABLE requests ADD COLUMN shadow_predicted FLOAT")
            con.execute("ALTER TABLE requests ADD COLUMN shadow_version VARCHAR")
        if "client_arrival_time" not in requests:  # version 8 -> 9: the client's planned arrival, as data
            con.execute("ALTER TABLE requests ADD COLUMN client_arrival_time DOUBLE")
        features = _column_types(con, "features")
        if "recipe" not in features:  # version 2 -> 3: NULL is last@<layer>
            con.execute("ALTER TABLE features ADD COLUMN recipe VARCHAR")
        if "feature" in features:
            if features["feature"] != "BLOB":  # version 3 -> 4: FLOAT[] to float32 bytes
                con.execute(f"ALTER TABLE features ALTER COLUMN feature TYPE BLOB USING {_LIST_TO_BYTES}(feature)")
            _move_features_to_files(con, folder)  # version 4 -> 5
        con.execute(schema_version_sql(DUCKDB), [str(SCHEMA_VERSION)])
        con.execute("COMMIT")
    except BaseException:
        with suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise


class StoreBusyError(RuntimeError):
    """Another process holds the DuckDB file's lock for longer than the store is willing to wait."""


_CATALOG = "leap_store"
"""The name a writing connection attaches the file under (and makes its default)."""


def _is_lock_error(error: duckdb.Error) -> bool:
    """Another process holds the file, or another connection of this process attached it."""
    if isinstance(error, duckdb.IOException):
        return "lock" in str(error).lower()
    return isinstance(error, duckdb.ResourceInUseException)


class LogStore(SqlStore):
    """A DuckDB file holding the feedback log; every method opens and closes its own connection.

    Parameters
    ----------
    path:
        The DuckDB file; created with its tables on first use.
    busy_timeout_s:
        How long `connect` keeps retrying while another process holds the file's lock.
    checkpoint_threshold:
        WAL size that triggers a checkpoint. DuckDB's default (16MB) is smaller than one feedback
        segment's features, which would rewrite the table on every ingest commit; the checkpoint
        runs instead when the last connection closes.
    force_compression:
        DuckDB's `force_compression` for checkpoints, or None for DuckDB's own choice. Float32
        hidden states compress little (13% on Gaussian features) while trying costs most of a
        checkpoint's time, so the store keeps them uncompressed by default.
    row_group_rows:
        Rows per row group of writing connections (DuckDB's default is 122,880). A transaction's
        complete row groups bypass the write-ahead log, so with DuckDB's vector size (2048) every
        segment of a few thousand rows is written once, not twice; at 100k rows x 576 floats this
        halved DuckDB's CPU time and its bytes written. None keeps DuckDB's default.
    """

    dialect = DUCKDB

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_s: float = 30.0,
        checkpoint_threshold: str = "1GB",
        force_compression: str | None = "uncompressed",
        row_group_rows: int | None = 2048,
    ) -> None:
        self.path = Path(path)
        self.features_folder = feature_folder(self.path)
        self.busy_timeout_s = busy_timeout_s
        self.checkpoint_threshold = checkpoint_threshold
        self.force_compression = force_compression
        self.row_group_rows = row_group_rows
        self._schema_ready = False
        self._gates_ready = False

    def __repr__(self) -> str:
        return f"LogStore({str(self.path)!r})"

    def _connect_once(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        config = {"checkpoint_threshold": self.checkpoint_threshold}
        if self.force_compression is not None:
            config["force_compression"] = self.force_compression
        if read_only or self.row_group_rows is None:
            return duckdb.connect(str(self.path), read_only=read_only, config=config)
        # The row group size is a setting of one attachment, not of the file, so writers attach.
        config["temp_directory"] = f"{self.path}.tmp"
        con = duckdb.connect(":memory:", config=config)
        try:
            quoted = str(self.path).replace("'", "''")
            con.execute(f"ATTACH '{quoted}' AS {_CATALOG} (ROW_GROUP_SIZE {int(self.row_group_rows)})")
            con.execute(f"USE {_CATALOG}")
        except BaseException:
            con.close()
            raise
        return con

    def _open(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        delay = 0.02
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return self._connect_once(read_only)
            except duckdb.Error as error:
                if not _is_lock_error(error):
                    raise
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreBusyError(
                        f"the log store {self.path} is locked by another process or connection "
                        f"(DuckDB allows one read-write process per file) and stayed locked for "
                        f"{self.busy_timeout_s:.1f}s; lock error: {error}"
                    ) from error
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = self._open(read_only=False)
        try:
            if _schema_version(con) != SCHEMA_VERSION:
                _migrate(con, self.features_folder)
        finally:
            con.close()
        self._schema_ready = True

    def _open_current(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        """A connection to a file at SCHEMA_VERSION. A reader of a current file never takes the write
        lock; a reader of an older file migrates it first (once per LogStore), then reads."""
        if not (read_only and self.path.exists()):
            self._ensure_schema()
            return self._open(read_only)
        con = self._open(read_only=True)
        if self._schema_ready:
            return con
        try:
            current = _schema_version(con) == SCHEMA_VERSION
        except BaseException:
            con.close()
            raise
        if current:
            self._schema_ready = True
            return con
        con.close()
        self._ensure_schema()
        return self._open(read_only=True)

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection closed on exit; raises `StoreBusyError` when the lock stays taken."""
        con = self._open_current(read_only)
        try:
            yield con
        finally:
            con.close()

    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self.connect(read_only=True) as con:
            return con.execute(query, list(params)).fetchall()

    def _dicts(self, query: str) -> list[dict]:
        with self.connect(read_only=True) as con:
            return con.sql(query).to_arrow_table().to_pylist()

    def _execute(self, statement: str, params: Sequence[Any]) -> None:
        with self.connect() as con:
            con.execute(statement, list(params))

    def _ensure_gates(self) -> None:
        """The gates table, created on first use (it is not part of the ingest schema's versions)."""
        if self._gates_ready:
            return
        with self.connect() as con:
            con.execute(GATES_DDL)
        self._gates_ready = True

    def schema_version(self) -> int:
        with self.connect(read_only=True) as con:
            return _schema_version(con)

    def stored_dims(self) -> dict[tuple[str, int, str], int]:
        """The feature dim stored for each feature space (model fingerprint, layer, capture recipe)."""
        with self.connect(read_only=True) as con:
            return stored_dims(con)

    def _frame(self, where: str, params: list) -> TrainingFrame:
        """The rows' scalars from the database, their vectors from the feature files they reference."""
        with self.connect(read_only=True) as con:
            table = con.sql(frame_query(DUCKDB, f"{FRAME_COLUMNS}, f.file, f.file_row", where),
                            params=params).to_arrow_table()
        return frame_from_arrow(table, lambda dim: read_features(
            self.features_folder, table.column("file").to_numpy(zero_copy_only=False),
            table.column("file_row").to_numpy(zero_copy_only=False), dim))

    @contextmanager
    def segment_writer(self) -> Iterator[DuckDBWriter]:
        """The writer `store.ingest` writes segments through: one connection, which holds the file's
        write lock for the whole run, and a thread that writes each segment's feature file."""
        with self.connect() as con, ThreadPoolExecutor(max_workers=1, thread_name_prefix="leap-ingest-files") as files:
            yield DuckDBWriter(con, self.features_folder, files)
