"""The log store on PostgreSQL: the same tables and API as the DuckDB store, written by several workers.

Why PostgreSQL. A DuckDB file takes one writing process at a time, which is right on one machine and
stays the default (`store.duckdb.LogStore`). A fleet's ingest workers on several machines need a store
they can all write at once. DuckLake (a catalog in PostgreSQL, Parquet data files in the bucket)
would keep DuckDB's engine, but no DuckLake extension is built for the DuckDB release the project
pins (2.0.1), so the shared store is PostgreSQL itself: the engine platform teams already run
managed, reached through SQLAlchemy (the engine from a `postgresql+psycopg://` URL) and psycopg 3,
whose COPY carries the bulk rows.

Bulk rows by COPY, never a value at a time. A segment's accepted scalar columns go to a temporary
table as CSV written by Arrow's C++ writer, and from there into `requests` (see below); the features
of the rows inserted then go straight into `features` by binary COPY, each row's fields joined by
Arrow around the segment's float32 buffer (`store.duckdb.feature_bytes`, `binary_copy`): one `bytea`
of `dim` little-endian float32 values per row, the DuckDB store's encoding. Measured here (100k rows
x 576 floats, through a temporary table): `bytea` 13.5k rows/s against 5.2k for `real[]`, whose
binary form spends 8 bytes per float and read back 3-5x slower; COPYing the features straight into
`features` instead of through a temporary table and a join then gained 1.2x (50k rows, three
alternating runs). The column is `STORAGE EXTERNAL`: hidden states do not compress, and trying
costs time on every row.
Training frames come back the same way: the scalars as CSV parsed by Arrow, the features as binary
COPY viewed as one (n, dim) array, both read in one repeatable-read transaction.

Several writers at once. Every segment is written in its own transaction, which first takes a
transaction advisory lock on the segment's identity and reads its ledger row again: a segment that
another worker ingested meanwhile is skipped, so a segment ingested twice at once ends up once.
Requests are inserted `ON CONFLICT (request_id) DO NOTHING` from the COPYed table, in request id
order (two segments sharing ids lock them in the same order, so they never deadlock); the rows that
were not inserted count as duplicates, so every segment keeps rows_read == accepted + quarantined +
duplicates, and a request id that two segments carry is stored once, whichever commits first. The
dim check against the store reads `feature_spaces`, one row per (fingerprint, layer, recipe) with
its dim, which a writer inserts before its rows: a second writer of the same new space waits for
the first to commit and then sees its dim, so two dims never enter one space.

Schema versions. `POSTGRES_SCHEMA_VERSION` is written to `store_meta`; every store object creates or
migrates the tables once, under a transaction advisory lock so that workers starting together do not
race on the catalog.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from store.feature_encoding import FEATURE_DTYPE, feature_bytes
from store.duckdb import (
    RECIPE_SQL,
    REQUIRED_COLUMNS,
    SCALAR_COLUMNS,
    TRAINING_FINISH_REASONS,
    TrainingFrame,
    _frame_from_arrow,
    selection,
)
from leap_io.feedback_schema import feedback_schema

POSTGRES_SCHEMA_VERSION = 1
"""Version of the PostgreSQL store's tables (its own line of versions: the DuckDB file's differ)."""

_PG_TYPES = {pa.string(): "TEXT", pa.int32(): "INTEGER", pa.float64(): "DOUBLE PRECISION", pa.float32(): "REAL"}
_SCHEMA_LOCK = 0x4C454150_53544F52  # "LEAPSTOR": the advisory lock key of schema changes


def _scalar_columns_sql(primary: bool) -> list[str]:
    schema = feedback_schema(1)
    columns = []
    for name in SCALAR_COLUMNS:
        sql_type = _PG_TYPES[schema.field(name).type]
        if name == "request_id":
            columns.append(f"request_id TEXT{' PRIMARY KEY' if primary else ''}")
        else:
            columns.append(f"{name} {sql_type}{' NOT NULL' if primary and name in REQUIRED_COLUMNS else ''}")
    return columns


SCHEMA_DDL = (
    "CREATE TABLE IF NOT EXISTS requests (\n  " + ",\n  ".join(
        _scalar_columns_sql(True) + ["segment TEXT NOT NULL", "ingested_at TIMESTAMP NOT NULL", "replica_id TEXT"])
    + "\n)",
    """CREATE TABLE IF NOT EXISTS features (
  request_id TEXT PRIMARY KEY,
  dim INTEGER NOT NULL,
  layer INTEGER NOT NULL,
  model_fingerprint TEXT NOT NULL,
  feature BYTEA NOT NULL,
  recipe TEXT
)""",
    "ALTER TABLE features ALTER COLUMN feature SET STORAGE EXTERNAL",
    """CREATE TABLE IF NOT EXISTS feature_spaces (
  model_fingerprint TEXT NOT NULL,
  layer INTEGER NOT NULL,
  recipe TEXT NOT NULL,
  dim INTEGER NOT NULL,
  PRIMARY KEY (model_fingerprint, layer, recipe)
)""",
    """CREATE TABLE IF NOT EXISTS quarantine (
  segment TEXT NOT NULL,
  row_index BIGINT NOT NULL,
  request_id TEXT,
  reason TEXT NOT NULL,
  raw JSON,
  quarantined_at TIMESTAMP NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS quarantine_segment ON quarantine (segment)",
    """CREATE TABLE IF NOT EXISTS ingest_ledger (
  segment TEXT PRIMARY KEY,
  checksum TEXT NOT NULL,
  rows_read BIGINT NOT NULL,
  rows_accepted BIGINT NOT NULL,
  rows_quarantined BIGINT NOT NULL,
  rows_duplicate BIGINT NOT NULL,
  ingested_at TIMESTAMP NOT NULL,
  status TEXT NOT NULL,
  CHECK (rows_read = rows_accepted + rows_quarantined + rows_duplicate)
)""",
    """CREATE TABLE IF NOT EXISTS changed_segments (
  segment TEXT NOT NULL,
  checksum TEXT NOT NULL,
  ingested_checksum TEXT NOT NULL,
  size_bytes BIGINT NOT NULL,
  seen_at TIMESTAMP NOT NULL,
  PRIMARY KEY (segment, checksum)
)""",
    """CREATE TABLE IF NOT EXISTS gates (
  gate_key TEXT PRIMARY KEY,
  time TIMESTAMP NOT NULL,
  name TEXT NOT NULL,
  challenger TEXT NOT NULL,
  champion TEXT,
  passed BOOLEAN NOT NULL,
  verdict JSON NOT NULL,
  results JSON NOT NULL,
  mlflow_run_id TEXT
)""",
    """CREATE TABLE IF NOT EXISTS store_meta (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL
)""",
)

_INCOMING_DDL = (
    "CREATE TEMPORARY TABLE IF NOT EXISTS _incoming ("
    + ", ".join(_scalar_columns_sql(False)) + ") ON COMMIT DELETE ROWS",
)
"""The per-connection staging table the requests are COPYed into (and inserted from, skipping ids
already stored); it empties itself at every commit and rollback."""

# ---------------------------------------------------------------------------- COPY encodings

_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TRAILER = struct.pack(">h", -1)
_COPY_PREFIX = 2 + 4  # a binary COPY row: int16 field count, then per field int32 length and the bytes


def _csv(table: pa.Table) -> bytes:
    """`table` as CSV rows for `COPY .. (FORMAT csv)`: NULL is an unquoted empty field, strings are
    quoted (so an empty string stays one), floats are written to round-trip."""
    sink = pa.BufferOutputStream()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False, quoting_style="needed"))
    return sink.getvalue().to_pybytes()


def _big_endian(values: np.ndarray, dtype: str) -> pa.Array:
    raw = np.ascontiguousarray(values, dtype=dtype)
    width = raw.dtype.itemsize
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(raw), [None, pa.py_buffer(raw.view(np.uint8))])


def int4_field(values: np.ndarray) -> pa.Array:
    """Integers as the bytes of binary COPY `integer` fields (4 bytes, big-endian), one value per row."""
    return _big_endian(values, ">i4")


def binary_copy(fields: Sequence[pa.Array]) -> bytes:
    """Binary COPY data of rows whose fields are given column by column as the bytes each field holds
    (`text` and `bytea` as they are, `integer` from `int4_field`; NULL stays NULL).

    Each row is its field count (2 bytes), then per field a 4-byte length (-1: NULL) and the bytes;
    Arrow's element-wise binary join assembles every row from those pieces in C++, so no row is
    built in Python.
    """
    n = len(fields[0])
    empty = pa.scalar(b"", pa.large_binary())
    pieces = [_big_endian(np.full(n, len(fields)), ">i2").cast(pa.large_binary())]
    for field in fields:
        values = field.cast(pa.large_binary())
        lengths = pc.fill_null(pc.binary_length(values), -1).to_numpy(zero_copy_only=False)
        pieces += [int4_field(lengths).cast(pa.large_binary()), pc.fill_null(values, empty)]
    rows = pc.binary_join_element_wise(*pieces, empty)
    offsets = np.frombuffer(rows.buffers()[1], np.int64)[rows.offset:rows.offset + n + 1]
    body = memoryview(rows.buffers()[2])[int(offsets[0]):int(offsets[-1])] if n else b""
    return b"".join((_COPY_HEADER, body, _COPY_TRAILER))


def _feature_blobs(data: bytes, n: int, dim: int) -> pa.Array:
    """The binary COPY output of n rows of one `bytea` column, each `dim` float32 values, as Arrow blobs."""
    width = dim * FEATURE_DTYPE.itemsize
    record = _COPY_PREFIX + width
    header = len(_COPY_HEADER)
    if len(data) != header + n * record + len(_COPY_TRAILER):
        raise ValueError(f"stored feature rows do not all hold {dim} float32 values ({width} bytes)")
    rows = np.frombuffer(data, np.uint8, count=n * record, offset=header).reshape(n, record)
    lengths = rows[:, 2:6].copy().view(">i4").reshape(n)
    if n and not (lengths == width).all():
        raise ValueError(f"stored feature rows do not all hold {dim} float32 values ({width} bytes)")
    values = np.ascontiguousarray(rows[:, _COPY_PREFIX:])
    offsets = np.arange(n + 1, dtype=np.int64) * width
    return pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(values)])


# ---------------------------------------------------------------------------- the store

def _check_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername != "postgresql+psycopg":
        raise ValueError(f"the PostgreSQL log store needs a postgresql+psycopg:// URL, not {parsed.drivername}://")
    return parsed.render_as_string(hide_password=False)


class PostgresStore:
    """The log store in a PostgreSQL database; every method uses its own connection and transaction.

    Parameters
    ----------
    url:
        A `postgresql+psycopg://user@host:port/database` URL (`postgresql://` is read as psycopg).
    """

    def __init__(self, url: str) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        self.url = _check_url(url)
        # No pool: a store object is cheap and short-lived, travels into worker processes, and one
        # connection per call keeps a forked child from sharing its parent's socket.
        self.engine = create_engine(self.url, poolclass=NullPool)
        self._schema_ready = False

    def __repr__(self) -> str:
        return f"PostgresStore({self.engine.url.render_as_string(hide_password=True)!r})"

    @contextmanager
    def connect(self) -> Iterator[Any]:
        """A psycopg connection at POSTGRES_SCHEMA_VERSION, closed on exit (uncommitted work rolls back)."""
        self._ensure_schema()
        with self._raw() as con:
            yield con

    @contextmanager
    def _raw(self) -> Iterator[Any]:
        fairy = self.engine.raw_connection()
        try:
            yield fairy.driver_connection
        finally:
            fairy.close()

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        with self._raw() as con:
            if self._version(con) != POSTGRES_SCHEMA_VERSION:
                con.execute("SELECT pg_advisory_xact_lock(%s)", [_SCHEMA_LOCK])
                for ddl in SCHEMA_DDL:
                    con.execute(ddl)
                con.execute("INSERT INTO store_meta VALUES ('schema_version', %s) ON CONFLICT (key) "
                            "DO UPDATE SET value = excluded.value", [str(POSTGRES_SCHEMA_VERSION)])
            con.commit()
        self._schema_ready = True

    @staticmethod
    def _version(con: Any) -> int:
        [(exists,)] = con.execute("SELECT to_regclass('store_meta') IS NOT NULL").fetchall()
        if not exists:
            return 0
        row = con.execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchone()
        return int(row[0]) if row else 0

    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self.connect() as con:
            rows = con.execute(query, list(params)).fetchall()
            con.rollback()
        return rows

    def schema_version(self) -> int:
        with self.connect() as con:
            return self._version(con)

    def counts(self) -> dict[str, int]:
        """Row counts of every table and the ledger's totals (which reconcile row for row)."""
        [row] = self._rows(
            """SELECT (SELECT count(*) FROM requests), (SELECT count(*) FROM features),
                      (SELECT count(*) FROM quarantine), count(*),
                      count(*) FILTER (WHERE status = 'unreadable'), count(*) FILTER (WHERE status = 'failed'),
                      coalesce(sum(rows_read), 0), coalesce(sum(rows_accepted), 0),
                      coalesce(sum(rows_quarantined), 0), coalesce(sum(rows_duplicate), 0),
                      (SELECT count(*) FROM changed_segments)
               FROM ingest_ledger""")
        keys = ("requests", "features", "quarantine", "segments", "segments_unreadable", "segments_failed",
                "rows_read", "rows_accepted", "rows_quarantined", "rows_duplicate", "segments_changed")
        return {key: int(value) for key, value in zip(keys, row)}

    def finish_reasons(self) -> dict[str, int]:
        """How many stored requests finished with each reason (only `TRAINING_FINISH_REASONS` train)."""
        rows = self._rows('SELECT finish_reason, count(*) FROM requests GROUP BY finish_reason ORDER BY finish_reason COLLATE "C"')
        return {reason: int(count) for reason, count in rows}

    def _dicts(self, query: str) -> list[dict]:
        with self.connect() as con:
            cursor = con.execute(query)
            names = [column.name for column in cursor.description]
            rows = [dict(zip(names, row)) for row in cursor.fetchall()]
            con.rollback()
        return rows

    def changed_segments(self) -> list[dict]:
        """Contents found at an already-ingested segment's path and left out (see `store.ingest`)."""
        return self._dicts('SELECT * FROM changed_segments ORDER BY segment COLLATE "C", seen_at')

    def ledger(self) -> list[dict]:
        """One dict per ingested segment, ordered by its identity (byte order, as DuckDB sorts)."""
        return self._dicts('SELECT * FROM ingest_ledger ORDER BY segment COLLATE "C"')

    def quarantine_reasons(self) -> dict[str, int]:
        """How many quarantined rows each reason holds."""
        rows = self._rows('SELECT reason, count(*) FROM quarantine GROUP BY reason ORDER BY reason COLLATE "C"')
        return {reason: int(count) for reason, count in rows}

    def stored_dims(self) -> dict[tuple[str, int, str], int]:
        """The feature dim stored for each feature space (model fingerprint, layer, capture recipe)."""
        return {(fingerprint, int(layer), recipe): int(dim)
                for fingerprint, layer, recipe, dim in self._rows("SELECT * FROM feature_spaces")}

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
        """Requests with arrival_time in [since, until), as `store.duckdb.LogStore.training_frame` selects them."""
        where, params = selection("format", since=since, until=until, domains=domains,
                                  model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
        rest = " FROM requests r JOIN features f USING (request_id)" + where + \
            ' ORDER BY r.arrival_time, r.request_id COLLATE "C"'
        scalars = ("r.request_id, f.dim, r.output_tokens, r.finish_reason, r.domain, r.arrival_time, r.max_tokens, "
                   f"{RECIPE_SQL} AS recipe")
        with self.connect() as con:
            con.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")  # one snapshot, two reads
            with con.cursor() as cursor:
                table = _read_csv(_copy_out(cursor, f"COPY (SELECT {scalars}{rest}) TO STDOUT (FORMAT csv)", params))
                dims = pc.unique(table.column("dim")).to_pylist()
                recipes = pc.unique(table.column("recipe")).to_pylist()
                if len(dims) > 1 or len(recipes) > 1:  # `_frame_from_arrow` says which; the features are not read
                    blobs = pa.nulls(table.num_rows, pa.large_binary())
                else:
                    data = _copy_out(cursor, f"COPY (SELECT f.feature{rest}) TO STDOUT (FORMAT binary)", params)
                    blobs = _feature_blobs(data, table.num_rows, dims[0] if dims else 0)
            con.rollback()
        return _frame_from_arrow(table.append_column("feature", blobs))

    # ------------------------------------------------------------------ what the pipeline's tasks ask

    def latest_feature_space(self, model_fingerprint: str | None = None, layer: int | None = None,
                             recipe: str | None = None) -> tuple[str | None, str, int, str] | None:
        """(model id, fingerprint, layer, recipe) of the most recent feedback, optionally narrowed."""
        where, params = selection("format", model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
        rows = self._rows(
            f"SELECT min(r.model_id), f.model_fingerprint, f.layer, {RECIPE_SQL} AS recipe "
            "FROM requests r JOIN features f USING (request_id)"
            + where + " GROUP BY 2, 3, 4 ORDER BY max(r.arrival_time) DESC LIMIT 1", params)
        if not rows:
            return None
        model_id, fingerprint, found_layer, found_recipe = rows[0]
        return model_id, fingerprint, int(found_layer), found_recipe

    def largest_max_tokens(self, model_fingerprint: str, layer: int, recipe: str) -> int | None:
        """The largest output budget among the stored requests of one feature space."""
        [(value,)] = self._rows(
            "SELECT max(r.max_tokens) FROM requests r JOIN features f USING (request_id) "
            f"WHERE f.model_fingerprint = %s AND f.layer = %s AND {RECIPE_SQL} = %s",
            [model_fingerprint, int(layer), recipe])
        return None if value is None else int(value)

    def recorded_lengths(self, request_ids: Sequence[str],
                         model_fingerprint: str | None = None) -> dict[str, tuple[int, float]]:
        """(output_tokens, arrival_time) of those request ids finished by a training-label reason."""
        query = ("SELECT request_id, output_tokens, arrival_time FROM requests "
                 "WHERE request_id = ANY(%s) AND finish_reason = ANY(%s)")
        params: list[Any] = [list(request_ids), list(TRAINING_FINISH_REASONS)]
        if model_fingerprint:
            query += " AND model_fingerprint = %s"
            params.append(model_fingerprint)
        return {rid: (int(tokens), float(arrival)) for rid, tokens, arrival in self._rows(query, params)}

    def recorded_gate(self, name: str, challenger: str, champion: str | None) -> dict | None:
        """The latest gate recorded for this challenger against this champion, or None."""
        rows = self._rows(
            "SELECT gate_key, verdict::text, mlflow_run_id FROM gates WHERE name = %s AND challenger = %s "
            "AND champion IS NOT DISTINCT FROM %s ORDER BY time DESC LIMIT 1",
            [name, str(challenger), None if champion is None else str(champion)])
        if not rows:
            return None
        import json

        return {"gate_key": rows[0][0], "verdict": json.loads(rows[0][1]), "gate_run_id": rows[0][2]}

    def gate_run(self, gate_key: str) -> tuple[bool, str | None]:
        """(whether a gate with this key is recorded, its MLflow run id)."""
        rows = self._rows("SELECT mlflow_run_id FROM gates WHERE gate_key = %s", [gate_key])
        return (True, rows[0][0]) if rows else (False, None)

    def record_gate(self, gate_key: str, time: datetime, name: str, challenger: str, champion: str | None,
                    passed: bool, verdict_json: str, results_json: str, run_id: str | None) -> None:
        """Record a gate once (a second record of the same key is ignored)."""
        with self.connect() as con:
            con.execute("INSERT INTO gates VALUES (%s, %s, %s, %s, %s, %s, %s::json, %s::json, %s) "
                        "ON CONFLICT (gate_key) DO NOTHING",
                        [gate_key, time, name, challenger, champion, passed, verdict_json, results_json, run_id])
            con.commit()

    # ------------------------------------------------------------------ ingest

    @contextmanager
    def segment_writer(self) -> Iterator[PostgresWriter]:
        """The writer `store.ingest` writes segments through, on a connection of its own."""
        with self.connect() as con:
            for ddl in _INCOMING_DDL:
                con.execute(ddl)
            con.commit()
            yield PostgresWriter(con)


@contextmanager
def scratch_database(url: str) -> Iterator[str]:
    """A new, empty database on the server of `url` for the block (dropped after); yields its URL.

    For benches and checks that need a store of their own on a shared server; needs the right to
    create databases.
    """
    import uuid

    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    server = make_url(_check_url(url))
    name = f"leap_scratch_{uuid.uuid4().hex[:12]}"
    params = {"host": server.host, "port": server.port, "user": server.username, "password": server.password,
              "dbname": server.database or "postgres"}
    with psycopg.connect(**{key: value for key, value in params.items() if value is not None},
                         autocommit=True) as con:
        con.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield server.set(database=name).render_as_string(hide_password=False)
        finally:
            con.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _copy_out(cursor: Any, statement: str, params: Sequence[Any]) -> bytes:
    chunks = []
    with cursor.copy(statement, list(params) or None) as copy:
        for chunk in copy:
            chunks.append(bytes(chunk))
    return b"".join(chunks)


_FRAME_TYPES = {"request_id": pa.string(), "dim": pa.int32(), "output_tokens": pa.int32(),
                "finish_reason": pa.string(), "domain": pa.string(), "arrival_time": pa.float64(),
                "max_tokens": pa.int32(), "recipe": pa.string()}


def _read_csv(data: bytes) -> pa.Table:
    """PostgreSQL's CSV of the frame's scalars (NULL unquoted empty, an empty string quoted)."""
    names = list(_FRAME_TYPES)
    if not data:
        return pa.table({name: pa.array([], kind) for name, kind in _FRAME_TYPES.items()})
    return pacsv.read_csv(
        io.BytesIO(data),
        read_options=pacsv.ReadOptions(column_names=names, use_threads=False),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types=_FRAME_TYPES, strings_can_be_null=True,
                                             quoted_strings_can_be_null=False),
    )


SpaceKey = tuple[str, int, str]


class PostgresWriter:
    """`store.ingest`'s writes on one PostgreSQL connection (see the module docstring for why they are
    safe with other writers at once). psycopg opens a transaction at the first statement, so `begin`
    has nothing to do."""

    concurrent = True
    """Other writers may write the store meanwhile: each segment re-reads its ledger row under a lock."""

    def __init__(self, con: Any) -> None:
        self.con = con
        self._reserved: list[SpaceKey] = []

    def snapshot(self) -> tuple[dict[str, tuple[str, str]], set[tuple[str, str]], dict[SpaceKey, int]]:
        ledger = {segment: (checksum, status) for segment, checksum, status
                  in self.con.execute("SELECT segment, checksum, status FROM ingest_ledger").fetchall()}
        changed = {(segment, checksum) for segment, checksum
                   in self.con.execute("SELECT segment, checksum FROM changed_segments").fetchall()}
        dims = {(fingerprint, int(layer), recipe): int(dim) for fingerprint, layer, recipe, dim
                in self.con.execute("SELECT * FROM feature_spaces").fetchall()}
        self.con.commit()
        return ledger, changed, dims

    def begin(self) -> None:
        self._reserved = []

    def commit(self) -> None:
        self.con.commit()

    def rollback(self) -> None:
        import psycopg

        try:
            self.con.rollback()
        except psycopg.Error:  # the connection broke: nothing of the transaction stays either way
            pass

    def claim(self, segment: str, checksum: str) -> tuple[tuple[str, str] | None, bool]:
        """Lock the segment until the transaction ends; its ledger row and whether this content is
        already quarantined as changed, as they are now that no other writer holds it."""
        self.con.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [segment])
        row = self.con.execute("SELECT checksum, status FROM ingest_ledger WHERE segment = %s", [segment]).fetchone()
        changed = self.con.execute("SELECT 1 FROM changed_segments WHERE segment = %s AND checksum = %s",
                                   [segment, checksum]).fetchone()
        return (None if row is None else (row[0], row[1])), changed is not None

    def clear_segment_quarantine(self, segment: str) -> None:
        self.con.execute("DELETE FROM quarantine WHERE segment = %s AND row_index = -1", [segment])

    def store_dims(self, spaces: Sequence[SpaceKey], dim: int | None,
                   known: Mapping[SpaceKey, int]) -> Mapping[SpaceKey, int]:
        """Reserve `spaces` at `dim` where no dim is stored yet (sorted, so writers lock in one order),
        then the dims stored for them: another writer's reservation is waited for, and wins if first."""
        spaces = sorted(set(spaces))
        if not spaces or dim is None:
            return known
        columns = ([space[0] for space in spaces], [space[1] for space in spaces], [space[2] for space in spaces])
        reserved = self.con.execute(
            "INSERT INTO feature_spaces SELECT s.*, %s FROM unnest(%s::text[], %s::int[], %s::text[]) "
            "AS s(model_fingerprint, layer, recipe) ORDER BY 1, 2, 3 ON CONFLICT DO NOTHING "
            "RETURNING model_fingerprint, layer, recipe", [int(dim), *columns]).fetchall()
        self._reserved = [(fingerprint, int(layer), recipe) for fingerprint, layer, recipe in reserved]
        rows = self.con.execute(
            "SELECT model_fingerprint, layer, recipe, dim FROM feature_spaces "
            "WHERE (model_fingerprint, layer, recipe) IN (SELECT * FROM unnest(%s::text[], %s::int[], %s::text[]))",
            list(columns)).fetchall()
        return {**known, **{(fingerprint, int(layer), recipe): int(value) for fingerprint, layer, recipe, value in rows}}

    def release_spaces(self, stored: Mapping[SpaceKey, int]) -> None:
        """Give back the reservations of spaces this segment stored no row of (all its rows of them
        were duplicates), so the store's dims stay those of stored rows."""
        unused = [space for space in self._reserved if space not in stored]
        for fingerprint, layer, recipe in unused:
            self.con.execute("DELETE FROM feature_spaces WHERE model_fingerprint = %s AND layer = %s AND recipe = %s",
                             [fingerprint, layer, recipe])
        self._reserved = []

    def insert_requests(self, rows: pa.Table, segment: str, now: datetime, replica_id: str | None) -> np.ndarray:
        """Insert the rows' requests unless their id is stored; which of `rows` were inserted."""
        n = rows.num_rows
        if not n:
            return np.zeros(0, dtype=bool)
        staged = rows.select(list(SCALAR_COLUMNS))
        columns = ", ".join(SCALAR_COLUMNS)
        with self.con.cursor() as cursor:
            with cursor.copy(f"COPY _incoming ({columns}) FROM STDIN (FORMAT csv)") as copy:
                copy.write(_csv(staged))
            cursor.execute(
                f"INSERT INTO requests ({columns}, segment, ingested_at, replica_id) "
                f"SELECT {columns}, %s, %s, %s FROM _incoming ORDER BY request_id "
                "ON CONFLICT (request_id) DO NOTHING RETURNING request_id",
                [segment, now, replica_id])
            inserted = pa.array([row[0] for row in cursor.fetchall()], pa.string())
        if len(inserted) == n:
            return np.ones(n, dtype=bool)
        return pc.fill_null(pc.is_in(rows.column("request_id"), value_set=inserted), False).to_numpy(
            zero_copy_only=False).astype(bool)

    def prepare_features(self, rows: pa.Table, dim: int, segment: str, checksum: str) -> None:
        pass  # the features go in with the rows, by `insert_features`

    def insert_features(self, rows: pa.Table, inserted: np.ndarray, dim: int, recipe: str | None) -> None:
        """COPY the features of the rows `insert_requests` inserted straight into `features`: this
        transaction holds their request ids, so no other writer can store a feature for them."""
        if not inserted.any():
            return
        fresh = rows if inserted.all() else rows.filter(pa.array(inserted))
        n = fresh.num_rows
        fields = [
            fresh.column("request_id").combine_chunks(),
            int4_field(np.full(n, int(dim))),
            int4_field(fresh.column("layer").to_numpy()),
            fresh.column("model_fingerprint").combine_chunks(),
            feature_bytes(fresh.column("feature"), dim),  # a view of the segment's float32 buffer
            pa.nulls(n, pa.string()) if recipe is None else pa.repeat(pa.scalar(recipe), n),
        ]
        with self.con.cursor() as cursor:
            with cursor.copy("COPY features (request_id, dim, layer, model_fingerprint, feature, recipe) "
                             "FROM STDIN (FORMAT binary)") as copy:
                copy.write(binary_copy(fields))

    def insert_quarantine(self, table: pa.Table, now: datetime) -> None:
        staged = table.select(["segment", "row_index", "request_id", "reason", "raw"]).append_column(
            "quarantined_at", pa.array([now] * table.num_rows, pa.timestamp("us")))
        with self.con.cursor() as cursor:
            with cursor.copy("COPY quarantine (segment, row_index, request_id, reason, raw, quarantined_at) "
                             "FROM STDIN (FORMAT csv)") as copy:
                copy.write(_csv(staged))

    def quarantine_segment(self, segment: str, reason: str, detail_json: str, now: datetime) -> None:
        self.con.execute("INSERT INTO quarantine VALUES (%s, -1, NULL, %s, %s::json, %s)",
                         [segment, reason, detail_json, now])

    def write_ledger(self, segment: str, checksum: str, counts: Sequence[int], status: str, now: datetime) -> None:
        read, accepted, quarantined, duplicates = (int(count) for count in counts)
        self.con.execute(
            "INSERT INTO ingest_ledger VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (segment) DO UPDATE SET "
            "checksum = excluded.checksum, rows_read = excluded.rows_read, rows_accepted = excluded.rows_accepted, "
            "rows_quarantined = excluded.rows_quarantined, rows_duplicate = excluded.rows_duplicate, "
            "ingested_at = excluded.ingested_at, status = excluded.status",
            [segment, checksum, read, accepted, quarantined, duplicates, now, status])

    def record_changed(self, segment: str, checksum: str, ingested_checksum: str, size_bytes: int,
                       now: datetime) -> None:
        self.con.execute("INSERT INTO changed_segments VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                         [segment, checksum, ingested_checksum, int(size_bytes), now])
