"""How ingest writes the PostgreSQL store (`store.postgres.PostgresStore.segment_writer`), with other
workers writing it at the same time.

Accepted rows go by COPY to a temporary table and then into `requests`, their features by binary COPY
into `features` (`store.postgres_copy`). Each segment is its own transaction under an advisory lock on its
identity, so a segment ingested twice at once ends up once, and duplicate request ids are stored once
whichever commits first; how deadlocks and conflicting dims are avoided: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa

from store.feature_encoding import feature_bytes
from store.postgres_copy import binary_copy, copy_in, csv_rows, int4_field
from store.protocol import Ledger, SpaceKey
from store.row_masks import rows_in, rows_where
from store.sql import POSTGRES, SCALAR_COLUMNS, SqlWriter, scalar_columns_sql, space_dims

INCOMING_DDL = ("CREATE TEMPORARY TABLE IF NOT EXISTS _incoming ("
                + ", ".join(scalar_columns_sql(POSTGRES, constrained=False)) + ") ON COMMIT DELETE ROWS")
"""The per-connection staging table the requests are COPYed into (and inserted from, skipping ids
already stored); it empties itself at every commit and rollback."""


class PostgresWriter(SqlWriter):
    """`store.ingest`'s writes on one PostgreSQL connection (see the module docstring for why they are
    safe with other writers at once). psycopg opens a transaction at the first statement, so `begin`
    has nothing to do."""

    dialect = POSTGRES
    concurrent = True
    """Other writers may write the store meanwhile: each segment re-reads its ledger row under a lock."""

    def __init__(self, con: Any) -> None:
        import psycopg  # installed wherever a PostgreSQL store is open: `con` is its connection

        super().__init__(con)
        self.environment_errors = (psycopg.OperationalError, psycopg.InterfaceError)
        """A lost connection, a full disk, a deadlock (retried with the run), an unusable connection."""
        self._broken = psycopg.Error
        self._reserved: list[SpaceKey] = []

    def snapshot(self) -> tuple[Ledger, set[tuple[str, str]], dict[SpaceKey, int]]:
        ledger, changed = self._ledger_and_changed()
        dims = space_dims(self.con.execute("SELECT * FROM feature_spaces").fetchall())
        self.con.commit()
        return ledger, changed, dims

    def begin(self) -> None:
        self._reserved = []

    def commit(self) -> None:
        self.con.commit()

    def rollback(self) -> None:
        try:
            self.con.rollback()
        except self._broken:  # the connection broke: nothing of the transaction stays either way
            pass

    def claim(self, segment: str, checksum: str) -> tuple[tuple[str, str] | None, bool]:
        """Lock the segment until the transaction ends; its ledger row and whether this content is
        already quarantined as changed, as they are now that no other writer holds it."""
        self.con.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [segment])
        row = self.con.execute("SELECT checksum, status FROM ingest_ledger WHERE segment = %s", [segment]).fetchone()
        changed = self.con.execute("SELECT 1 FROM changed_segments WHERE segment = %s AND checksum = %s",
                                   [segment, checksum]).fetchone()
        return (None if row is None else (row[0], row[1])), changed is not None

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
        return {**known, **space_dims(rows)}

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
        columns = ", ".join(SCALAR_COLUMNS)
        with self.con.cursor() as cursor:
            copy_in(cursor, f"COPY _incoming ({columns}) FROM STDIN (FORMAT csv)",
                    csv_rows(rows.select(list(SCALAR_COLUMNS))))
            cursor.execute(
                f"INSERT INTO requests ({columns}, segment, ingested_at, replica_id) "
                f"SELECT {columns}, %s, %s, %s FROM _incoming ORDER BY request_id "
                "ON CONFLICT (request_id) DO NOTHING RETURNING request_id",
                [segment, now, replica_id])
            inserted = pa.array([row[0] for row in cursor.fetchall()], pa.string())
        if len(inserted) == n:
            return np.ones(n, dtype=bool)
        return rows_in(rows.column("request_id"), inserted)

    def prepare_features(self, rows: pa.Table, dim: int, segment: str, checksum: str) -> None:
        pass  # the features go in with the rows, by `insert_features`

    def insert_features(self, rows: pa.Table, inserted: np.ndarray, dim: int, recipe: str | None) -> None:
        """COPY the features of the rows `insert_requests` inserted straight into `features`: this
        transaction holds their request ids, so no other writer can store a feature for them."""
        if not inserted.any():
            return
        fresh = rows_where(rows, inserted)
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
            copy_in(cursor, "COPY features (request_id, dim, layer, model_fingerprint, feature, recipe) "
                            "FROM STDIN (FORMAT binary)", binary_copy(fields))

    def insert_quarantine(self, table: pa.Table, now: datetime) -> None:
        staged = table.select(["segment", "row_index", "request_id", "reason", "raw"]).append_column(
            "quarantined_at", pa.array([now] * table.num_rows, pa.timestamp("us")))
        with self.con.cursor() as cursor:
            copy_in(cursor, "COPY quarantine (segment, row_index, request_id, reason, raw, quarantined_at) "
                            "FROM STDIN (FORMAT csv)", csv_rows(staged))
