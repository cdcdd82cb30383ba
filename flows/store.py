"""The DuckDB log store: finished requests, their features, quarantined rows and the ingest ledger.

DuckDB lets one process at a time open a file read-write (no other process can open it at all
meanwhile), so connections are short-lived and opening one retries with backoff before giving up
with `StoreBusyError`.

Feature encoding. Each feature vector is stored as a BLOB of its `dim` little-endian float32 values
(`feature_bytes`), next to its `dim`: one table holds several feature spaces whose dims differ, which
a fixed-size `FLOAT[dim]` column cannot, and a BLOB is copied into the table as one value, where a
`FLOAT[]` list is appended float by float (that append was half of DuckDB's ingest time). Ingest
views a segment's float32 buffer as fixed-size binary values without copying it, and
`features_from_bytes` views the blobs a query returns as one (n, dim) array, so features never
travel row by row in either direction.

Writers attach the file with small row groups: DuckDB writes each complete row group a transaction
appends straight into the database file, so a feedback segment's features are written once instead
of into the write-ahead log and again at the next checkpoint.

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
chunk by chunk through Arrow.

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from leap_io.feedback_schema import NOT_TRAINING_FINISH_REASONS, TRAINING_FINISH_REASONS, feedback_schema

FINISH_REASONS = TRAINING_FINISH_REASONS + NOT_TRAINING_FINISH_REASONS
"""Every finish reason a row may carry; any other is quarantined."""

SCHEMA_VERSION = 4
"""Version of the store's tables; see the module docstring for what each version added."""

FEATURE_DTYPE = np.dtype("<f4")
"""How the store encodes one feature value: little-endian float32, whatever the host's byte order."""

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


SCHEMA_DDL = (
    _requests_ddl(),
    """CREATE TABLE IF NOT EXISTS features (
  request_id VARCHAR PRIMARY KEY,
  dim INTEGER NOT NULL,
  layer INTEGER NOT NULL,
  model_fingerprint VARCHAR NOT NULL,
  feature BLOB NOT NULL,
  recipe VARCHAR
)""",
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


def _migrate(con: duckdb.DuckDBPyConnection) -> None:
    """Create missing tables and bring an older store to SCHEMA_VERSION, in one transaction."""
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
        if _column_type(con, "features", "feature") != "BLOB":  # version 3 -> 4: FLOAT[] to float32 bytes
            con.execute(f"ALTER TABLE features ALTER COLUMN feature TYPE BLOB USING {_LIST_TO_BYTES}(feature)")
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
                _migrate(con)
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
        """Contents found at an already-ingested segment's path and left out (see `flows.ingest`)."""
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
            "SELECT r.request_id, f.dim, f.feature, r.output_tokens, r.finish_reason, r.domain, "
            f"r.arrival_time, r.max_tokens, {RECIPE_SQL} AS recipe FROM requests r JOIN features f USING (request_id)"
            + where + " ORDER BY r.arrival_time, r.request_id"
        )
        with self.connect(read_only=True) as con:
            # 64-bit offsets: a frame's feature bytes may pass the 2 GiB a 32-bit binary column can index
            con.execute("SET arrow_large_buffer_size = true")
            table = con.sql(query, params=params).to_arrow_table()
        return _frame_from_arrow(table)

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


def feature_bytes(feature: pa.Array | pa.ChunkedArray, dim: int) -> pa.Array:
    """Feature vectors of `dim` floats each (a list or fixed-size list of float32, without NULL rows
    or elements) as the values the store keeps: `dim * 4` little-endian bytes per row.

    A fixed-size list's float buffer becomes fixed-size binary values without a copy (on a
    little-endian host), so DuckDB receives each vector as one value. ValueError when a row does
    not hold exactly `dim` floats.
    """
    if isinstance(feature, pa.ChunkedArray):  # one chunk is used as it is: combining copies it
        feature = feature.chunk(0) if feature.num_chunks == 1 else feature.combine_chunks()
    n = len(feature)
    if n == 0:  # e.g. a segment whose rows all failed: their list type need not match `dim`
        return pa.array([], pa.binary())
    if feature.null_count:
        raise ValueError(f"{feature.null_count} feature rows are NULL; the store keeps no NULL feature")
    if pa.types.is_fixed_size_list(feature.type):
        if feature.type.list_size != dim:
            raise ValueError(f"the features hold {feature.type.list_size} floats per row, not {dim}")
        values = feature.values.slice(feature.offset * dim, n * dim)
    else:
        lengths = pc.list_value_length(feature).to_numpy(zero_copy_only=False)
        if n and not (lengths == dim).all():
            raise ValueError(f"feature rows hold {sorted(set(lengths.tolist()) - {dim})} floats, not {dim}")
        values = pc.list_flatten(feature)
    if values.type != pa.float32() or values.null_count:
        raise ValueError(f"features must be float32 values without NULL elements, not {values.type} "
                         f"with {values.null_count} NULL")
    floats = values.to_numpy(zero_copy_only=True).astype(FEATURE_DTYPE, copy=False)
    width = dim * FEATURE_DTYPE.itemsize
    if width == 0:  # no fixed-size binary of width 0 to view: every row is the empty blob
        return pa.array([b""] * n, pa.binary())
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(floats)])


def features_from_bytes(blobs: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    """The (n, dim) float32 matrix of feature blobs as `feature_bytes` wrote them, read from the
    blobs' buffers without a per-row step (a view of them when the query returned one chunk)."""
    chunks = blobs.chunks if isinstance(blobs, pa.ChunkedArray) else [blobs]
    width = dim * FEATURE_DTYPE.itemsize
    parts = []
    for chunk in chunks:
        if not len(chunk):
            continue
        if chunk.null_count:
            raise ValueError(f"{chunk.null_count} stored feature rows are NULL")
        if pa.types.is_fixed_size_binary(chunk.type):
            if chunk.type.byte_width != width:
                raise ValueError(f"stored feature rows hold {chunk.type.byte_width} bytes, not {dim} float32 values")
            values = np.frombuffer(chunk.buffers()[1], dtype=FEATURE_DTYPE, count=len(chunk) * dim,
                                   offset=chunk.offset * width)
            parts.append(values.reshape(len(chunk), dim))
            continue
        if not (pa.types.is_binary(chunk.type) or pa.types.is_large_binary(chunk.type)):
            raise TypeError(f"feature blobs must be binary, not {chunk.type}")
        offset_type = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
        offsets = np.frombuffer(chunk.buffers()[1], dtype=offset_type)[chunk.offset:chunk.offset + len(chunk) + 1]
        if not (np.diff(offsets) == width).all():
            raise ValueError(f"stored feature rows do not all hold {dim} float32 values ({width} bytes)")
        values = np.frombuffer(chunk.buffers()[2], dtype=FEATURE_DTYPE, count=len(chunk) * dim,
                               offset=int(offsets[0]))
        parts.append(values.reshape(len(chunk), dim))
    if not parts:
        return np.zeros((0, dim), dtype=np.float32)
    matrix = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return matrix.astype(np.float32, copy=False)


def stored_dims(con: duckdb.DuckDBPyConnection) -> dict[tuple[str, int, str], int]:
    """The feature dim already stored for each feature space (model fingerprint, layer, capture recipe)."""
    rows = con.execute(
        f"SELECT f.model_fingerprint, f.layer, {RECIPE_SQL}, min(f.dim) FROM features f GROUP BY ALL"
    ).fetchall()
    return {(fingerprint, int(layer), recipe): int(dim) for fingerprint, layer, recipe, dim in rows}


def _frame_from_arrow(table: pa.Table) -> TrainingFrame:
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
        features=features_from_bytes(table.column("feature"), dim),
        output_tokens=table.column("output_tokens").to_numpy(zero_copy_only=False).astype(np.int64),
        finish_reason=table.column("finish_reason").to_numpy(zero_copy_only=False),
        domain=table.column("domain").to_numpy(zero_copy_only=False),
        arrival_time=table.column("arrival_time").to_numpy(zero_copy_only=False).astype(np.float64),
        max_tokens=pc.fill_null(table.column("max_tokens"), 0).to_numpy(zero_copy_only=False).astype(np.int64),
    )
