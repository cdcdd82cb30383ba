"""The DuckDB log store: finished requests, their features, quarantined rows and the ingest ledger.

DuckDB lets one process at a time open a file read-write (no other process can open it at all
meanwhile), so connections are short-lived and opening one retries with backoff before giving up
with `StoreBusyError`.

Feature encoding. Each feature vector is `dim` little-endian float32 values (`store.feature_encoding`).
The vectors are kept in Parquet files beside the database file (`store.feature_files`): the
`features` table holds each stored request's feature space and the file and row of its vector, so
one table holds several feature spaces whose dims differ, and ingest writes a segment's vectors as
one column instead of copying them into DuckDB's blocks (a third of the cost). Ingest views a
segment's float32 buffer as fixed-size binary values without copying it, and reading a frame views
each file's column as one (n, dim) array, so features never travel row by row in either direction.
A request's row in `features` exists only where its `requests` row does (ingest writes both for
the rows it inserts, in one transaction), so `request_id` is unique there without an index.

Writers attach the file with small row groups: DuckDB writes each complete row group a transaction
appends straight into the database file, so a feedback segment's rows are written once instead of
into the write-ahead log and again at the next checkpoint.

Finish reasons. A row is stored whatever way its request finished, as long as the reason is one the
serving side writes (`FINISH_REASONS`); only `stop` and `length` rows are training labels
(`TRAINING_FINISH_REASONS`): a stopped request's length is its true length, and a length-capped
one's is the budget M, which is what a readout clipped to [1, M] must predict for it. `abort`,
`error` and `repetition` rows end where something cut the request off (a client, an engine error, a
repetition detector), not where the model would have stopped, so they are kept for the record but
never trained on, and every place that leaves them out counts them by reason. Any other reason is
quarantined as unknown.

Schema versions. `SCHEMA_VERSION` is written to `store_meta`; opening an older file (read-only too)
migrates it once under the write lock: version 2 added `requests.replica_id` (the serving replica
whose feedback sub-folder held the row; NULL for rows ingested before, or from top-level segments)
and the `changed_segments` table; version 3 added `features.recipe`; version 4 stores
`features.feature` as little-endian float32 bytes (BLOB) instead of `FLOAT[]`, converted in place
chunk by chunk through Arrow; version 5 moves the vectors out to feature files (`features.file`,
`features.file_row`), keyset page by keyset page, and drops the index on `features.request_id`.

Feature recipes. Each feature row records the capture recipe (`leap_core.recipes`) its vector was
captured with, from the segment's metadata: which blocks the vector holds, in order. NULL (rows ingested
before version 3, and segments that record none) means `last@<layer>`, the one recipe there was before;
`RECIPE_SQL` is that rule in SQL. A feature space is (model fingerprint, layer, recipe): the dim check
and the training frames keep recipes apart, since two recipes of one layer hold different columns even
when their dims agree.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from store.feature_encoding import FEATURE_DTYPE, features_from_bytes, matrix_bytes
from store.feature_files import feature_folder, file_name, read_features, write_feature_file
from leap_io.feedback_schema import NOT_TRAINING_FINISH_REASONS, TRAINING_FINISH_REASONS, feedback_schema

FINISH_REASONS = TRAINING_FINISH_REASONS + NOT_TRAINING_FINISH_REASONS
"""Every finish reason a row may carry; any other is quarantined."""

SCHEMA_VERSION = 5
"""Version of the store's tables; see the module docstring for what each version added."""

SCALAR_COLUMNS = tuple(name for name in feedback_schema(1).names if name != "feature")
"""Every column of a feedback segment except the feature vector, in schema order."""

REQUIRED_COLUMNS = frozenset(
    {
        "request_id",
        "model_fingerprint",
        "layer",
        "arrival_time",
        "finish_time",
        "prompt_tokens",
        "output_tokens",
        "finish_reason",
    }
)
"""Scalar columns without which a row cannot serve as a training example."""

_SQL_TYPES = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.float64(): "DOUBLE",
    pa.float32(): "FLOAT",
}


def _requests_ddl() -> str:
    schema = feedback_schema(1)
    columns = []
    for name in SCALAR_COLUMNS:
        sql_type = _SQL_TYPES[schema.field(name).type]
        if name == "request_id":
            columns.append(f"{name} {sql_type} PRIMARY KEY")
        else:
            columns.append(f"{name} {sql_type}{' NOT NULL' if name in REQUIRED_COLUMNS else ''}")
    # replica_id last: version 1 stores get it by ALTER TABLE, which appends, so both orders agree
    columns += ["segment VARCHAR NOT NULL", "ingested_at TIMESTAMP NOT NULL", "replica_id VARCHAR"]
    return "CREATE TABLE IF NOT EXISTS requests (\n  " + ",\n  ".join(columns) + "\n)"


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
    _requests_ddl(),
    FEATURES_DDL.format(table="features"),
    """CREATE TABLE IF NOT EXISTS quarantine (
  segment VARCHAR NOT NULL,
  row_index BIGINT NOT NULL,
  request_id VARCHAR,
  reason VARCHAR NOT NULL,
  raw JSON,
  quarantined_at TIMESTAMP NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS ingest_ledger (
  segment VARCHAR PRIMARY KEY,
  checksum VARCHAR NOT NULL,
  rows_read BIGINT NOT NULL,
  rows_accepted BIGINT NOT NULL,
  rows_quarantined BIGINT NOT NULL,
  rows_duplicate BIGINT NOT NULL,
  ingested_at TIMESTAMP NOT NULL,
  status VARCHAR NOT NULL,
  CHECK (rows_read = rows_accepted + rows_quarantined + rows_duplicate)
)""",
    # New content found at the path of a segment already ingested: never ingested (its rows would
    # mix with the first content's), kept here so later runs skip it, and quarantined with a reason.
    """CREATE TABLE IF NOT EXISTS changed_segments (
  segment VARCHAR NOT NULL,
  checksum VARCHAR NOT NULL,
  ingested_checksum VARCHAR NOT NULL,
  size_bytes BIGINT NOT NULL,
  seen_at TIMESTAMP NOT NULL,
  PRIMARY KEY (segment, checksum)
)""",
    """CREATE TABLE IF NOT EXISTS store_meta (
  key VARCHAR PRIMARY KEY,
  value VARCHAR NOT NULL
)""",
)

GATES_DDL = """CREATE TABLE IF NOT EXISTS gates (
  gate_key VARCHAR PRIMARY KEY,
  time TIMESTAMP NOT NULL,
  name VARCHAR NOT NULL,
  challenger VARCHAR NOT NULL,
  champion VARCHAR,
  passed BOOLEAN NOT NULL,
  verdict JSON NOT NULL,
  results JSON NOT NULL,
  mlflow_run_id VARCHAR
)"""
"""The gate verdicts the pipeline records (`flows.tasks.record_gate`), created on first use."""


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> set[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
        "AND table_catalog = current_database()", [table]).fetchall()
    return {name for (name,) in rows}


def _schema_version(con: duckdb.DuckDBPyConnection) -> int:
    """The version written in `store_meta`; 1 for a file from before versions were written, 0 for none."""
    tables = {name for (name,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database()").fetchall()}
    if "store_meta" not in tables:
        return 1 if "requests" in tables else 0
    rows = con.execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchall()
    return int(rows[0][0]) if rows else 1


_LIST_TO_BYTES = "leap_float_list_to_bytes"
"""The SQL name under which `_migrate` registers `_list_to_bytes` while it converts `FLOAT[]` features."""


def _column_type(con: duckdb.DuckDBPyConnection, table: str, column: str) -> str | None:
    rows = con.execute(
        "SELECT data_type FROM information_schema.columns WHERE table_name = ? AND column_name = ? "
        "AND table_catalog = current_database()", [table, column]).fetchall()
    return rows[0][0] if rows else None


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
        if "replica_id" not in _columns(con, "requests"):  # version 1 -> 2
            con.execute("ALTER TABLE requests ADD COLUMN replica_id VARCHAR")
        if "recipe" not in _columns(con, "features"):  # version 2 -> 3: NULL is last@<layer>
            con.execute("ALTER TABLE features ADD COLUMN recipe VARCHAR")
        if "feature" in _columns(con, "features"):
            if _column_type(con, "features", "feature") != "BLOB":  # version 3 -> 4: FLOAT[] to float32 bytes
                con.execute(f"ALTER TABLE features ALTER COLUMN feature TYPE BLOB USING {_LIST_TO_BYTES}(feature)")
            _move_features_to_files(con, folder)  # version 4 -> 5
        con.execute("INSERT OR REPLACE INTO store_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        con.execute("COMMIT")
    except BaseException:
        with suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise


class StoreBusyError(RuntimeError):
    """Another process holds the DuckDB file's lock for longer than the store is willing to wait."""


class TrainingFrame(NamedTuple):
    """Finished requests joined with their features, ordered by arrival time then request id."""

    request_ids: np.ndarray  # object (n,)
    features: np.ndarray  # float32 (n, d)
    output_tokens: np.ndarray  # int64 (n,)
    finish_reason: np.ndarray  # object (n,)
    domain: np.ndarray  # object (n,), None where unknown
    arrival_time: np.ndarray  # float64 (n,)
    max_tokens: np.ndarray | None = None  # int64 (n,), the request's output budget; 0 where unknown

    def take(self, rows: np.ndarray | slice) -> TrainingFrame:
        """The frame restricted to `rows` (indices, a boolean mask, or a slice for views), in that order."""
        return TrainingFrame(*(None if column is None else column[rows] for column in self))


def recipe_sql(alias: str = "f") -> str:
    """The capture recipe of a `features` row in SQL: its `recipe`, else `last@<layer>`."""
    return f"coalesce({alias}.recipe, 'last@' || CAST({alias}.layer AS VARCHAR))"


RECIPE_SQL = recipe_sql()
"""`recipe_sql()` for the `features` table under the alias `f`."""


def selection(paramstyle: str, *, since: float | None = None, until: float | None = None,
              domains: Sequence[str] | None = None, model_fingerprint: str | None = None, layer: int | None = None,
              recipe: str | None = None) -> tuple[str, list]:
    """(" WHERE ..." or "", parameters) selecting rows of `requests r JOIN features f`: arrival_time in
    [since, until), some domains, one feature space. `paramstyle` is DuckDB's "qmark" (`?`) or psycopg's
    "format" (`%s`); both stores select with this one definition."""
    if paramstyle not in ("qmark", "format"):
        raise ValueError(f"paramstyle is 'qmark' or 'format', not {paramstyle!r}")
    mark = "?" if paramstyle == "qmark" else "%s"
    in_domains = f"list_contains({mark}::VARCHAR[], r.domain)" if paramstyle == "qmark" else f"r.domain = ANY({mark})"
    clauses = (("r.arrival_time >= {}", since, float), ("r.arrival_time < {}", until, float),
               (in_domains.replace(mark, "{}"), domains, list), ("f.model_fingerprint = {}", model_fingerprint, str),
               ("f.layer = {}", layer, int), (f"{RECIPE_SQL} = {{}}", recipe, canonical_recipe))
    where, params = [], []
    for clause, value, convert in clauses:
        if value is not None:
            where.append(clause.format(mark))
            params.append(convert(value))
    return (" WHERE " + " AND ".join(where) if where else ""), params


def canonical_recipe(name: str) -> str:
    """A recipe's canonical name (`leap_core.recipes.Recipe.parse`); RecipeError if it does not parse."""
    from leap_core.recipes import Recipe

    return str(Recipe.parse(name))


_CATALOG = "leap_store"
"""The name a writing connection attaches the file under (and makes its default)."""


def _is_lock_error(error: duckdb.Error) -> bool:
    """Another process holds the file, or another connection of this process attached it."""
    if isinstance(error, duckdb.IOException):
        return "lock" in str(error).lower()
    return isinstance(error, duckdb.ResourceInUseException)


class LogStore:
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

    def schema_version(self) -> int:
        with self.connect(read_only=True) as con:
            return _schema_version(con)

    def counts(self) -> dict[str, int]:
        """Row counts of every table and the ledger's totals (which reconcile row for row)."""
        with self.connect(read_only=True) as con:
            tables = {
                name: con.execute(f"SELECT count(*) FROM {name}").fetchone()[0]
                for name in ("requests", "features", "quarantine")
            }
            row = con.execute(
                """SELECT count(*), count(*) FILTER (WHERE status = 'unreadable'),
                          count(*) FILTER (WHERE status = 'failed'),
                          coalesce(sum(rows_read), 0), coalesce(sum(rows_accepted), 0),
                          coalesce(sum(rows_quarantined), 0), coalesce(sum(rows_duplicate), 0)
                   FROM ingest_ledger"""
            ).fetchone()
            [(changed,)] = con.execute("SELECT count(*) FROM changed_segments").fetchall()
        keys = ("segments", "segments_unreadable", "segments_failed", "rows_read", "rows_accepted",
                "rows_quarantined", "rows_duplicate")
        return {**tables, **{key: int(value) for key, value in zip(keys, row)}, "segments_changed": int(changed)}

    def finish_reasons(self) -> dict[str, int]:
        """How many stored requests finished with each reason (only `TRAINING_FINISH_REASONS` train)."""
        with self.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT finish_reason, count(*) FROM requests GROUP BY ALL ORDER BY finish_reason").fetchall()
        return {reason: int(count) for reason, count in rows}

    def changed_segments(self) -> list[dict]:
        """Contents found at an already-ingested segment's path and left out (see `store.ingest`)."""
        with self.connect(read_only=True) as con:
            table = con.sql("SELECT * FROM changed_segments ORDER BY segment, seen_at").to_arrow_table()
        return table.to_pylist()

    def ledger(self) -> list[dict]:
        """One dict per ingested segment path, ordered by path."""
        with self.connect(read_only=True) as con:
            table = con.sql("SELECT * FROM ingest_ledger ORDER BY segment").to_arrow_table()
        return table.to_pylist()

    def quarantine_reasons(self) -> dict[str, int]:
        """How many quarantined rows each reason holds."""
        with self.connect(read_only=True) as con:
            rows = con.execute(
                "SELECT reason, count(*) FROM quarantine GROUP BY reason ORDER BY reason"
            ).fetchall()
        return {reason: int(count) for reason, count in rows}

    def training_frame(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        domains: Sequence[str] | None = None,
        model_fingerprint: str | None = None,
        layer: int | None = None,
        recipe: str | None = None,
    ) -> TrainingFrame:
        """Requests with arrival_time in [since, until), optionally only some domains / one feature space.

        `recipe`: only rows captured with this recipe (rows that record none are `last@<layer>`).
        Raises ValueError when the selection mixes feature dims or capture recipes (filter by
        fingerprint, layer and recipe): a frame's columns mean one thing.
        """
        where, params = selection("qmark", since=since, until=until, domains=domains,
                                  model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
        query = (
            "SELECT r.request_id, f.dim, f.file, f.file_row, r.output_tokens, r.finish_reason, r.domain, "
            f"r.arrival_time, r.max_tokens, {RECIPE_SQL} AS recipe FROM requests r JOIN features f USING (request_id)"
            + where + " ORDER BY r.arrival_time, r.request_id"
        )
        with self.connect(read_only=True) as con:
            table = con.sql(query, params=params).to_arrow_table()
        return _frame_from_arrow(table, lambda dim: read_features(
            self.features_folder, table.column("file").to_numpy(zero_copy_only=False),
            table.column("file_row").to_numpy(zero_copy_only=False), dim))

    # ------------------------------------------------------------------ what the pipeline's tasks ask

    def latest_feature_space(self, model_fingerprint: str | None = None, layer: int | None = None,
                             recipe: str | None = None) -> tuple[str | None, str, int, str] | None:
        """(model id, fingerprint, layer, recipe) of the most recent feedback, optionally narrowed."""
        where, params = selection("qmark", model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
        query = (f"SELECT min(r.model_id), f.model_fingerprint, f.layer, {RECIPE_SQL} AS recipe "
                 "FROM requests r JOIN features f USING (request_id)"
                 + where + " GROUP BY ALL ORDER BY max(r.arrival_time) DESC LIMIT 1")
        with self.connect(read_only=True) as con:
            row = con.execute(query, params).fetchone()
        if row is None:
            return None
        model_id, fingerprint, found_layer, found_recipe = row
        return model_id, fingerprint, int(found_layer), found_recipe

    def largest_max_tokens(self, model_fingerprint: str, layer: int, recipe: str) -> int | None:
        """The largest output budget among the stored requests of one feature space."""
        with self.connect(read_only=True) as con:
            row = con.execute("SELECT max(r.max_tokens) FROM requests r JOIN features f USING (request_id) "
                              f"WHERE f.model_fingerprint = ? AND f.layer = ? AND {RECIPE_SQL} = ?",
                              [model_fingerprint, int(layer), recipe]).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def recorded_lengths(self, request_ids: Sequence[str],
                         model_fingerprint: str | None = None) -> dict[str, tuple[int, float]]:
        """(output_tokens, arrival_time) of those request ids finished by a training-label reason."""
        query = ("SELECT r.request_id, r.output_tokens, r.arrival_time FROM requests r "
                 "SEMI JOIN _wanted w USING (request_id) WHERE list_contains(?::VARCHAR[], r.finish_reason)")
        params: list = [list(TRAINING_FINISH_REASONS)]
        if model_fingerprint:
            query += " AND r.model_fingerprint = ?"
            params.append(model_fingerprint)
        with self.connect(read_only=True) as con:
            con.register("_wanted", pa.table({"request_id": pa.array(list(request_ids), pa.string())}))
            rows = con.execute(query, params).fetchall()
        return {rid: (int(tokens), float(arrival)) for rid, tokens, arrival in rows}

    def _ensure_gates(self) -> None:
        """The gates table, created on first use (it is not part of the ingest schema's versions)."""
        if self._gates_ready:
            return
        with self.connect() as con:
            con.execute(GATES_DDL)
        self._gates_ready = True

    def recorded_gate(self, name: str, challenger: str, champion: str | None) -> dict | None:
        """The latest gate recorded for this challenger against this champion, or None."""
        self._ensure_gates()
        with self.connect(read_only=True) as con:
            row = con.execute(
                "SELECT gate_key, verdict, mlflow_run_id FROM gates WHERE name = ? AND challenger = ? "
                "AND champion IS NOT DISTINCT FROM ? ORDER BY time DESC LIMIT 1",
                [name, challenger, champion]).fetchone()
        if row is None:
            return None
        return {"gate_key": row[0], "verdict": json.loads(row[1]), "gate_run_id": row[2]}

    def gate_run(self, gate_key: str) -> tuple[bool, str | None]:
        """(whether a gate with this key is recorded, its MLflow run id)."""
        self._ensure_gates()
        with self.connect(read_only=True) as con:
            row = con.execute("SELECT mlflow_run_id FROM gates WHERE gate_key = ?", [gate_key]).fetchone()
        return (True, row[0]) if row is not None else (False, None)

    def record_gate(self, gate_key: str, time: datetime, name: str, challenger: str, champion: str | None,
                    passed: bool, verdict_json: str, results_json: str, run_id: str | None) -> None:
        """Record a gate once (a second record of the same key is ignored)."""
        self._ensure_gates()
        with self.connect() as con:
            con.execute("INSERT OR IGNORE INTO gates VALUES (?, ?, ?, ?, ?, ?, ?::JSON, ?::JSON, ?)",
                        [gate_key, time, name, challenger, champion, passed, verdict_json, results_json, run_id])


def stored_dims(con: duckdb.DuckDBPyConnection) -> dict[tuple[str, int, str], int]:
    """The feature dim already stored for each feature space (model fingerprint, layer, capture recipe)."""
    rows = con.execute(
        f"SELECT f.model_fingerprint, f.layer, {RECIPE_SQL}, min(f.dim) FROM features f GROUP BY ALL"
    ).fetchall()
    return {(fingerprint, int(layer), recipe): int(dim) for fingerprint, layer, recipe, dim in rows}


def _frame_from_arrow(table: pa.Table, features: Callable[[int], np.ndarray] | None = None) -> TrainingFrame:
    """The frame of a query's rows; `features(dim)` reads their vectors, else the `feature` column holds them."""
    dims = pc.unique(table.column("dim")).to_pylist()
    if len(dims) > 1:
        raise ValueError(
            f"the selection mixes feature dims {sorted(dims)}; filter by model_fingerprint and layer"
        )
    recipes = pc.unique(table.column("recipe")).to_pylist()
    if len(recipes) > 1:
        raise ValueError(
            f"the selection mixes capture recipes {sorted(recipes)}; filter by model_fingerprint, layer and recipe"
        )
    dim = dims[0] if dims else 0
    return TrainingFrame(
        request_ids=table.column("request_id").to_numpy(zero_copy_only=False),
        features=features(dim) if features is not None else features_from_bytes(table.column("feature"), dim),
        output_tokens=table.column("output_tokens").to_numpy(zero_copy_only=False).astype(np.int64),
        finish_reason=table.column("finish_reason").to_numpy(zero_copy_only=False),
        domain=table.column("domain").to_numpy(zero_copy_only=False),
        arrival_time=table.column("arrival_time").to_numpy(zero_copy_only=False).astype(np.float64),
        max_tokens=pc.fill_null(table.column("max_tokens"), 0).to_numpy(zero_copy_only=False).astype(np.int64),
    )
