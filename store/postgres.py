"""The log store on PostgreSQL: the same tables and API as the DuckDB store, written by several workers.

A DuckDB file takes one writing process at a time, which stays the default on one machine
(`store.duckdb.LogStore`); a fleet's ingest workers need a store they can all write at once, and
docs/infra.md ("Why PostgreSQL for the shared store") says why it is PostgreSQL, reached through
SQLAlchemy and psycopg 3. Bulk rows and features travel by COPY (`store.postgres_copy`), features as
one `bytea` of float32 per row. Shared reads are `store.sql`'s, concurrent ingest writes
`store.postgres_writer`'s; schema versions are migrated once under an advisory lock (`UPGRADES`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from store.frame import TrainingFrame, frame_from_arrow
from store.postgres_copy import copy_out, feature_blobs, read_csv
from store.postgres_writer import INCOMING_DDL, PostgresWriter
from store.sql import (
    FRAME_COLUMNS,
    POSTGRES,
    SCHEMA_VERSION_QUERY,
    SqlStore,
    frame_query,
    requests_ddl,
    schema_version_sql,
    space_dims,
    table_ddl,
)

POSTGRES_SCHEMA_VERSION = 5
"""Version of the PostgreSQL store's tables (its own line of versions: the DuckDB file's differ)."""

_SCHEMA_LOCK = 0x4C454150_53544F52  # "LEAPSTOR": the advisory lock key of schema changes

SCHEMA_DDL = (
    requests_ddl(POSTGRES),
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
    table_ddl(POSTGRES, "quarantine"),
    "CREATE INDEX IF NOT EXISTS quarantine_segment ON quarantine (segment)",
    table_ddl(POSTGRES, "ingest_ledger"),
    table_ddl(POSTGRES, "changed_segments"),
    table_ddl(POSTGRES, "segment_stamps"),
    table_ddl(POSTGRES, "gates"),
    table_ddl(POSTGRES, "store_meta"),
)

UPGRADES = {3: ("ALTER TABLE requests ADD COLUMN IF NOT EXISTS client_request_id TEXT",
                "UPDATE requests SET client_request_id = request_id WHERE client_request_id IS NULL"),
            4: ("ALTER TABLE requests ADD COLUMN IF NOT EXISTS shadow_predicted REAL",
                "ALTER TABLE requests ADD COLUMN IF NOT EXISTS shadow_version TEXT"),
            5: ("ALTER TABLE requests ADD COLUMN IF NOT EXISTS client_arrival_time DOUBLE PRECISION",)}
"""What brings the tables from the version before each key to it (a new store's tables are created at
the latest): version 3 keeps the client's id as data beside the serving process's key, and older rows'
key was the client's id; version 4 keeps a shadow readout's prediction (`serving.readout.shadow`); version 5
keeps a client's planned arrival beside the server's time."""

_FRAME_TYPES = {"request_id": pa.string(), "dim": pa.int32(), "output_tokens": pa.int32(),
                "finish_reason": pa.string(), "domain": pa.string(), "arrival_time": pa.float64(),
                "max_tokens": pa.int32(), "recipe": pa.string(), "policy": pa.string(), "decoding": pa.string()}
"""The types of `store.sql.FRAME_COLUMNS`, in their order."""


def check_url(url: str) -> str:
    """`url` as the store reads it: `postgresql://` becomes psycopg's; ValueError for another database."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername != "postgresql+psycopg":
        raise ValueError(f"the PostgreSQL log store needs a postgresql+psycopg:// URL, not {parsed.drivername}://")
    return parsed.render_as_string(hide_password=False)


def _version(con: Any) -> int:
    [(exists,)] = con.execute("SELECT to_regclass('store_meta') IS NOT NULL").fetchall()
    if not exists:
        return 0
    row = con.execute(SCHEMA_VERSION_QUERY).fetchone()
    return int(row[0]) if row else 0


class PostgresStore(SqlStore):
    """The log store in a PostgreSQL database; every method uses its own connection and transaction.

    Parameters
    ----------
    url:
        A `postgresql+psycopg://user@host:port/database` URL (`postgresql://` is read as psycopg).
    """

    dialect = POSTGRES

    def __init__(self, url: str) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        self.url = check_url(url)
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
            if _version(con) != POSTGRES_SCHEMA_VERSION:
                con.execute("SELECT pg_advisory_xact_lock(%s)", [_SCHEMA_LOCK])
                version = _version(con)  # another worker may have migrated while this one waited
                [(had_requests,)] = con.execute("SELECT to_regclass('requests') IS NOT NULL").fetchall()
                for ddl in SCHEMA_DDL:
                    con.execute(ddl)
                for target in sorted(UPGRADES):
                    if had_requests and version < target:
                        for statement in UPGRADES[target]:
                            con.execute(statement)
                con.execute(schema_version_sql(POSTGRES), [str(POSTGRES_SCHEMA_VERSION)])
            con.commit()
        self._schema_ready = True

    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self.connect() as con:
            rows = con.execute(query, list(params)).fetchall()
            con.rollback()
        return rows

    def _dicts(self, query: str) -> list[dict]:
        with self.connect() as con:
            cursor = con.execute(query)
            names = [column.name for column in cursor.description]
            rows = [dict(zip(names, row)) for row in cursor.fetchall()]
            con.rollback()
        return rows

    def _execute(self, statement: str, params: Sequence[Any]) -> None:
        with self.connect() as con:
            con.execute(statement, list(params))
            con.commit()

    def schema_version(self) -> int:
        with self.connect() as con:
            return _version(con)

    def stored_dims(self) -> dict[tuple[str, int, str], int]:
        """The feature dim stored for each feature space (model fingerprint, layer, capture recipe)."""
        return space_dims(self._rows("SELECT * FROM feature_spaces"))

    def _frame(self, where: str, params: list) -> TrainingFrame:
        """The rows' scalars as CSV, then (unless the scalars already mix dims or recipes) their vectors
        as binary COPY, both from one snapshot."""
        with self.connect() as con:
            con.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")  # one snapshot, two reads
            with con.cursor() as cursor:
                scalars = frame_query(POSTGRES, FRAME_COLUMNS, where)
                table = read_csv(copy_out(cursor, f"COPY ({scalars}) TO STDOUT (FORMAT csv)", params), _FRAME_TYPES)
                dims = pc.unique(table.column("dim")).to_pylist()
                recipes = pc.unique(table.column("recipe")).to_pylist()
                if len(dims) > 1 or len(recipes) > 1:  # `frame_from_arrow` says which; the features are not read
                    blobs = pa.nulls(table.num_rows, pa.large_binary())
                else:
                    features = frame_query(POSTGRES, "f.feature", where)
                    data = copy_out(cursor, f"COPY ({features}) TO STDOUT (FORMAT binary)", params)
                    blobs = feature_blobs(data, table.num_rows, dims[0] if dims else 0)
            con.rollback()
        return frame_from_arrow(table.append_column("feature", blobs))

    @contextmanager
    def segment_writer(self) -> Iterator[PostgresWriter]:
        """The writer `store.ingest` writes segments through, on a connection of its own."""
        with self.connect() as con:
            con.execute(INCOMING_DDL)
            con.commit()
            yield PostgresWriter(con)
