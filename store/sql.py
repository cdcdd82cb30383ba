"""The SQL both stores run, written once: their shared tables, the selection of rows, the reads, the
gate records and the ledger writes.

DuckDB and PostgreSQL accept the same statements but for a few spellings, which a `Dialect` names; a
store supplies the primitives that run the text on its connections (`SqlStore`), a writer its open
connection (`SqlWriter`). Bulk paths and schema migrations stay per engine. The text is plain SQL since
SQLAlchemy Core would need a DuckDB dialect the project does not install. A feature space is (model
fingerprint, layer, recipe); a NULL recipe means `last@<layer>` (`RECIPE_SQL`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa

from leap_io.feedback_schema import TRAINING_FINISH_REASONS, feedback_schema
from store.frame import TrainingFrame
from store.protocol import Ledger, SpaceKey, Stamps

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


@dataclass(frozen=True)
class Dialect:
    """How one engine spells what the shared SQL leaves open."""

    mark: str
    """The parameter placeholder."""
    types: Mapping[pa.DataType, str]
    """The SQL type of each Arrow type a feedback column has."""
    in_list: str
    """`{}` (an expression) is one of the values of a list parameter."""
    byte_order: str
    """`{}` (a text expression) as an ORDER BY key that sorts by bytes."""

    @property
    def text(self) -> str:
        return self.types[pa.string()]

    def contains(self, expression: str) -> str:
        return self.in_list.format(expression)

    def bytewise(self, expression: str) -> str:
        return self.byte_order.format(expression)


DUCKDB = Dialect(
    mark="?",
    types={pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.float64(): "DOUBLE", pa.float32(): "FLOAT"},
    in_list="list_contains(?::VARCHAR[], {})",
    byte_order="{}",
)

POSTGRES = Dialect(
    mark="%s",
    types={pa.string(): "TEXT", pa.int32(): "INTEGER", pa.float64(): "DOUBLE PRECISION", pa.float32(): "REAL"},
    in_list="{} = ANY(%s)",
    byte_order='{} COLLATE "C"',
)


# ---------------------------------------------------------------------------- the tables


def scalar_columns_sql(dialect: Dialect, *, constrained: bool = True) -> list[str]:
    """The column definitions of a segment's scalar columns: `request_id` the primary key and the
    required columns NOT NULL, or (`constrained` False, a staging table) neither."""
    schema = feedback_schema(1)
    columns = []
    for name in SCALAR_COLUMNS:
        sql_type = dialect.types[schema.field(name).type]
        if name == "request_id":
            columns.append(f"request_id {sql_type}{' PRIMARY KEY' if constrained else ''}")
        else:
            columns.append(f"{name} {sql_type}{' NOT NULL' if constrained and name in REQUIRED_COLUMNS else ''}")
    return columns


def requests_ddl(dialect: Dialect) -> str:
    """The `requests` table: a segment's scalar columns, then where and when each row was ingested."""
    text = dialect.text
    # replica_id last: older DuckDB files get it by ALTER TABLE, which appends, so both orders agree
    columns = scalar_columns_sql(dialect) + [f"segment {text} NOT NULL", "ingested_at TIMESTAMP NOT NULL",
                                             f"replica_id {text}"]
    return "CREATE TABLE IF NOT EXISTS requests (\n  " + ",\n  ".join(columns) + "\n)"


_TABLES = {
    "quarantine": """CREATE TABLE IF NOT EXISTS quarantine (
  segment {text} NOT NULL,
  row_index BIGINT NOT NULL,
  request_id {text},
  reason {text} NOT NULL,
  raw JSON,
  quarantined_at TIMESTAMP NOT NULL
)""",
    "ingest_ledger": """CREATE TABLE IF NOT EXISTS ingest_ledger (
  segment {text} PRIMARY KEY,
  checksum {text} NOT NULL,
  rows_read BIGINT NOT NULL,
  rows_accepted BIGINT NOT NULL,
  rows_quarantined BIGINT NOT NULL,
  rows_duplicate BIGINT NOT NULL,
  ingested_at TIMESTAMP NOT NULL,
  status {text} NOT NULL,
  CHECK (rows_read = rows_accepted + rows_quarantined + rows_duplicate)
)""",
    # New content found at the path of a segment already ingested: never ingested (its rows would
    # mix with the first content's), kept here so later runs skip it, and quarantined with a reason.
    "changed_segments": """CREATE TABLE IF NOT EXISTS changed_segments (
  segment {text} NOT NULL,
  checksum {text} NOT NULL,
  ingested_checksum {text} NOT NULL,
  size_bytes BIGINT NOT NULL,
  seen_at TIMESTAMP NOT NULL,
  PRIMARY KEY (segment, checksum)
)""",
    # What each ledgered segment looked like from outside when its content was last checked (size and
    # modification time of a file, size and ETag of an object): a segment whose stamp is unchanged is
    # skipped without being read again (`store.ingest`).
    "segment_stamps": """CREATE TABLE IF NOT EXISTS segment_stamps (
  segment {text} PRIMARY KEY,
  stamp {text} NOT NULL,
  checksum {text} NOT NULL,
  status {text} NOT NULL
)""",
    # The gate verdicts the pipeline records (`flows.tasks.record_gate`).
    "gates": """CREATE TABLE IF NOT EXISTS gates (
  gate_key {text} PRIMARY KEY,
  time TIMESTAMP NOT NULL,
  name {text} NOT NULL,
  challenger {text} NOT NULL,
  champion {text},
  passed BOOLEAN NOT NULL,
  verdict JSON NOT NULL,
  results JSON NOT NULL,
  mlflow_run_id {text}
)""",
    "store_meta": """CREATE TABLE IF NOT EXISTS store_meta (
  key {text} PRIMARY KEY,
  value {text} NOT NULL
)""",
}


def table_ddl(dialect: Dialect, table: str) -> str:
    """The CREATE TABLE of one of the tables both stores hold alike: quarantine, ingest_ledger,
    changed_segments, segment_stamps, gates or store_meta."""
    return _TABLES[table].format(text=dialect.text)


def schema_version_sql(dialect: Dialect) -> str:
    """The statement that records the schema version (its one parameter) in `store_meta`."""
    return (f"INSERT INTO store_meta VALUES ('schema_version', {dialect.mark}) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value")


STAMPS_QUERY = "SELECT segment, stamp, checksum, status FROM segment_stamps"
"""Each checked segment's (segment, stamp, checksum, status): `stamps_of` makes them `Stamps`."""


def stamps_of(rows: Sequence[Sequence[str]]) -> Stamps:
    return {segment: (stamp, checksum, status) for segment, stamp, checksum, status in rows}


SCHEMA_VERSION_QUERY = "SELECT value FROM store_meta WHERE key = 'schema_version'"
"""The query of the schema version recorded in `store_meta`."""


# ---------------------------------------------------------------------------- selecting rows


def recipe_sql(alias: str = "f") -> str:
    """The capture recipe of a `features` row in SQL: its `recipe`, else `last@<layer>`."""
    return f"coalesce({alias}.recipe, 'last@' || CAST({alias}.layer AS VARCHAR))"


RECIPE_SQL = recipe_sql()
"""`recipe_sql()` for the `features` table under the alias `f`."""


def canonical_recipe(name: str) -> str:
    """A recipe's canonical name (`leap_core.recipes.Recipe.parse`); RecipeError if it does not parse."""
    from leap_core.recipes import Recipe

    return str(Recipe.parse(name))


def selection(dialect: Dialect, *, since: float | None = None, until: float | None = None,
              domains: Sequence[str] | None = None, model_fingerprint: str | None = None, layer: int | None = None,
              recipe: str | None = None) -> tuple[str, list]:
    """(" WHERE ..." or "", parameters) selecting rows of `requests r JOIN features f`: arrival_time in
    [since, until), some domains, one feature space (`recipe` by its canonical name)."""
    mark = dialect.mark
    clauses = ((f"r.arrival_time >= {mark}", since, float), (f"r.arrival_time < {mark}", until, float),
               (dialect.contains("r.domain"), domains, list), (f"f.model_fingerprint = {mark}", model_fingerprint, str),
               (f"f.layer = {mark}", layer, int), (f"{RECIPE_SQL} = {mark}", recipe, canonical_recipe))
    where, params = [], []
    for clause, value, convert in clauses:
        if value is not None:
            where.append(clause)
            params.append(convert(value))
    return (" WHERE " + " AND ".join(where) if where else ""), params


FRAME_COLUMNS = ("r.request_id, f.dim, r.output_tokens, r.finish_reason, r.domain, r.arrival_time, r.max_tokens, "
                 f"{RECIPE_SQL} AS recipe, r.policy, r.decoding")
"""The scalar columns of a training frame (`store.frame.frame_from_arrow`), in this order."""


def frame_query(dialect: Dialect, columns: str, where: str) -> str:
    """The rows of a training frame that `where` (`selection`) selects, in the frame's order."""
    return (f"SELECT {columns} FROM requests r JOIN features f USING (request_id){where} "
            f"ORDER BY r.arrival_time, {dialect.bytewise('r.request_id')}")


# ---------------------------------------------------------------------------- the reads


class SqlStore(ABC):
    """The reads and gate records both stores answer with the same SQL.

    A store supplies its `dialect` and primitives on connections of its own: `_rows` and `_dicts`
    read, `_execute` writes one statement in a transaction of its own, and `_frame` reads a training
    frame its own bulk way.
    """

    dialect: Dialect

    @abstractmethod
    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple]:
        """The rows of one query."""

    @abstractmethod
    def _dicts(self, query: str) -> list[dict]:
        """The rows of one query, each a dict by column name."""

    @abstractmethod
    def _execute(self, statement: str, params: Sequence[Any]) -> None:
        """Run one statement and commit it."""

    @abstractmethod
    def _frame(self, where: str, params: list) -> TrainingFrame:
        """The training frame of the rows `where` (`selection`) selects, in `frame_query`'s order."""

    def _ensure_gates(self) -> None:  # noqa: B027  (a hook: a no-op where the schema holds the table)
        """Create the gates table where the store's schema does not hold it from the start."""

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

    def recorded_lengths(self, request_ids: Sequence[str],
                         model_fingerprint: str | None = None) -> dict[str, tuple[int, float]]:
        """(output_tokens, arrival_time) recorded for each of those client request ids, finished by a
        training-label reason; where a client sent an id more than once, its latest row's."""
        m, contains = self.dialect.mark, self.dialect.contains
        query = (f"SELECT client_request_id, output_tokens, arrival_time FROM requests "
                 f"WHERE {contains('client_request_id')} AND {contains('finish_reason')}")
        params: list[Any] = [list(request_ids), list(TRAINING_FINISH_REASONS)]
        if model_fingerprint:
            query += f" AND model_fingerprint = {m}"
            params.append(model_fingerprint)
        rows = self._rows(query + " ORDER BY arrival_time, finish_time", params)
        return {rid: (int(tokens), float(arrival)) for rid, tokens, arrival in rows}

    def shadow_rows(self, shadow_version: str, since: float | None = None) -> dict[str, np.ndarray]:
        """The stored rows a readout held in shadow predicted (`serving.readout.shadow`), oldest first, as arrays:
        `output_tokens`, `served` (the serving readout's prediction at admission), `shadow`,
        `finish_reason`, `max_tokens`, `policy`, `decoding`, `readout_version`; only rows finished after
        `since` (unix seconds) when given. Which lengths are labels is the caller's rule
        (`leap_io.labels.label_problems`)."""
        m = self.dialect.mark
        query = (f"SELECT output_tokens, predicted_at_admission, shadow_predicted, finish_reason, max_tokens, "
                 f"policy, decoding, readout_version FROM requests WHERE shadow_version = {m} "
                 f"AND shadow_predicted IS NOT NULL AND predicted_at_admission IS NOT NULL")
        params: list[Any] = [shadow_version]
        if since is not None:
            query += f" AND finish_time > {m}"
            params.append(float(since))
        rows = self._rows(query + f" ORDER BY arrival_time, {self.dialect.bytewise('request_id')}", params)
        names = ("output_tokens", "served", "shadow", "finish_reason", "max_tokens", "policy", "decoding",
                 "readout_version")
        kinds = (np.int64, np.float64, np.float64, object, np.float64, object, object, object)
        columns = list(zip(*rows)) if rows else [()] * len(names)
        return {name: np.asarray(column, dtype=kind) for name, column, kind in zip(names, columns, kinds)}

    def served_rows(self, readout_versions: Sequence[str], since: float) -> dict[str, np.ndarray]:
        """The stored rows that finished after `since` (unix seconds) while one of `readout_versions` served,
        oldest first, as arrays: `readout_version`, `output_tokens`, `predicted` (at admission),
        `arrival_time`, `finish_time`, `finish_reason`, `max_tokens`, `policy`, `decoding`. The canary
        flow compares the versions' live figures over one window (`flows.canary`)."""
        m = self.dialect.mark
        versions = list(readout_versions)
        if not versions:
            raise ValueError("name at least one readout version")
        query = (f"SELECT readout_version, output_tokens, predicted_at_admission, arrival_time, finish_time, "
                 f"finish_reason, max_tokens, policy, decoding FROM requests WHERE finish_time > {m} "
                 f"AND readout_version IN ({', '.join([m] * len(versions))})")
        rows = self._rows(query + f" ORDER BY arrival_time, {self.dialect.bytewise('request_id')}",
                          [float(since), *versions])
        names = ("readout_version", "output_tokens", "predicted", "arrival_time", "finish_time", "finish_reason",
                 "max_tokens", "policy", "decoding")
        kinds = (object, np.int64, np.float64, np.float64, np.float64, object, np.float64, object, object)
        columns = list(zip(*rows)) if rows else [()] * len(names)
        return {name: np.asarray(column, dtype=kind) for name, column, kind in zip(names, columns, kinds)}

    def _count_by(self, table: str, column: str) -> dict[str, int]:
        rows = self._rows(f"SELECT {column}, count(*) FROM {table} GROUP BY {column} "
                          f"ORDER BY {self.dialect.bytewise(column)}")
        return {value: int(count) for value, count in rows}

    def finish_reasons(self) -> dict[str, int]:
        """How many stored requests finished with each reason (only `TRAINING_FINISH_REASONS` train)."""
        return self._count_by("requests", "finish_reason")

    def quarantine_reasons(self) -> dict[str, int]:
        """How many quarantined rows each reason holds."""
        return self._count_by("quarantine", "reason")

    def changed_segments(self) -> list[dict]:
        """Contents found at an already-ingested segment's path and left out (see `store.ingest`)."""
        return self._dicts(f"SELECT * FROM changed_segments ORDER BY {self.dialect.bytewise('segment')}, seen_at")

    def stamps(self) -> Stamps:
        """The stamp each checked segment had, with that content's (checksum, status) (`store.ingest`)."""
        return stamps_of(self._rows(STAMPS_QUERY))

    def ledger(self) -> list[dict]:
        """One dict per ingested segment, ordered by its identity (byte order)."""
        return self._dicts(f"SELECT * FROM ingest_ledger ORDER BY {self.dialect.bytewise('segment')}")

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
        return self._frame(*selection(self.dialect, since=since, until=until, domains=domains,
                                      model_fingerprint=model_fingerprint, layer=layer, recipe=recipe))

    def newest_since(self, rows: int, *, since: float | None = None, until: float | None = None,
                     domains: Sequence[str] | None = None, model_fingerprint: str | None = None,
                     layer: int | None = None, recipe: str | None = None) -> float | None:
        """The arrival time of the `rows`-th newest row `training_frame` would select with these filters
        (the `since` that keeps about the newest `rows`), or None when it selects fewer."""
        where, params = selection(self.dialect, since=since, until=until, domains=domains,
                                  model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
        found = self._rows(f"SELECT r.arrival_time FROM requests r JOIN features f USING (request_id){where} "
                           f"ORDER BY r.arrival_time DESC LIMIT 1 OFFSET {int(rows) - 1}", params)
        return float(found[0][0]) if found else None

    # ------------------------------------------------------------------ what the pipeline's tasks ask

    def latest_feature_space(self, model_fingerprint: str | None = None, layer: int | None = None,
                             recipe: str | None = None) -> tuple[str | None, str, int, str] | None:
        """(model id, fingerprint, layer, recipe) of the most recent feedback, optionally narrowed."""
        where, params = selection(self.dialect, model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
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
        mark = self.dialect.mark
        [(value,)] = self._rows(
            "SELECT max(r.max_tokens) FROM requests r JOIN features f USING (request_id) "
            f"WHERE f.model_fingerprint = {mark} AND f.layer = {mark} AND {RECIPE_SQL} = {mark}",
            [model_fingerprint, int(layer), recipe])
        return None if value is None else int(value)

    def recorded_gate(self, name: str, challenger: str, champion: str | None) -> dict | None:
        """The latest gate recorded for this challenger against this champion, or None."""
        self._ensure_gates()
        mark = self.dialect.mark
        rows = self._rows(
            f"SELECT gate_key, verdict::text, mlflow_run_id FROM gates WHERE name = {mark} AND challenger = {mark} "
            f"AND champion IS NOT DISTINCT FROM {mark} ORDER BY time DESC LIMIT 1",
            [name, str(challenger), None if champion is None else str(champion)])
        if not rows:
            return None
        gate_key, verdict, run_id = rows[0]
        return {"gate_key": gate_key, "verdict": json.loads(verdict), "gate_run_id": run_id}

    def gate_run(self, gate_key: str) -> tuple[bool, str | None]:
        """(whether a gate with this key is recorded, its MLflow run id)."""
        self._ensure_gates()
        rows = self._rows(f"SELECT mlflow_run_id FROM gates WHERE gate_key = {self.dialect.mark}", [gate_key])
        return (True, rows[0][0]) if rows else (False, None)

    def record_gate(self, gate_key: str, time: datetime, name: str, challenger: str, champion: str | None,
                    passed: bool, verdict_json: str, results_json: str, run_id: str | None) -> None:
        """Record a gate once (a second record of the same key is ignored)."""
        self._ensure_gates()
        m = self.dialect.mark
        self._execute(f"INSERT INTO gates VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}::JSON, {m}::JSON, {m}) "
                      "ON CONFLICT (gate_key) DO NOTHING",
                      [gate_key, time, name, challenger, champion, passed, verdict_json, results_json, run_id])


# ---------------------------------------------------------------------------- the ledger writes


class SqlWriter:
    """The writes of `store.protocol.StoreWriter` that both stores make with the same SQL, on `con`,
    the writer's open connection (a DuckDB or a psycopg connection: both `execute(query, params)`)."""

    dialect: Dialect

    def __init__(self, con: Any) -> None:
        self.con = con

    def _ledger_and_changed(self) -> tuple[Ledger, set[tuple[str, str]]]:
        """The ledger's (checksum, status) of each segment, and the contents quarantined as changed."""
        ledger = {segment: (checksum, status) for segment, checksum, status
                  in self.con.execute("SELECT segment, checksum, status FROM ingest_ledger").fetchall()}
        changed = {(segment, checksum) for segment, checksum
                   in self.con.execute("SELECT segment, checksum FROM changed_segments").fetchall()}
        return ledger, changed

    def stamps(self) -> Stamps:
        """The stamp each segment had when its content was last checked, with that content's (checksum,
        status): the status a run that finds the same stamp reports without reading the segment."""
        return stamps_of(self.con.execute(STAMPS_QUERY).fetchall())

    def write_stamp(self, segment: str, stamp: str, checksum: str, status: str) -> None:
        m = self.dialect.mark
        self.con.execute(
            f"INSERT INTO segment_stamps VALUES ({m}, {m}, {m}, {m}) ON CONFLICT (segment) "
            "DO UPDATE SET stamp = excluded.stamp, checksum = excluded.checksum, status = excluded.status",
            [segment, stamp, checksum, status])

    def clear_segment_quarantine(self, segment: str) -> None:
        self.con.execute(f"DELETE FROM quarantine WHERE segment = {self.dialect.mark} AND row_index = -1", [segment])

    def quarantine_segment(self, segment: str, reason: str, detail_json: str, now: datetime) -> None:
        m = self.dialect.mark
        self.con.execute(f"INSERT INTO quarantine VALUES ({m}, -1, NULL, {m}, {m}::JSON, {m})",
                         [segment, reason, detail_json, now])

    def write_ledger(self, segment: str, checksum: str, counts: Sequence[int], status: str, now: datetime) -> None:
        m = self.dialect.mark
        self.con.execute(
            f"INSERT INTO ingest_ledger VALUES ({m}, {m}, {m}, {m}, {m}, {m}, {m}, {m}) ON CONFLICT (segment) "
            "DO UPDATE SET checksum = excluded.checksum, rows_read = excluded.rows_read, "
            "rows_accepted = excluded.rows_accepted, rows_quarantined = excluded.rows_quarantined, "
            "rows_duplicate = excluded.rows_duplicate, ingested_at = excluded.ingested_at, status = excluded.status",
            [segment, checksum, *(int(count) for count in counts), now, status])

    def record_changed(self, segment: str, checksum: str, ingested_checksum: str, size_bytes: int,
                       now: datetime) -> None:
        m = self.dialect.mark
        self.con.execute(f"INSERT INTO changed_segments VALUES ({m}, {m}, {m}, {m}, {m}) ON CONFLICT DO NOTHING",
                         [segment, checksum, ingested_checksum, int(size_bytes), now])


def space_dims(rows: Sequence[tuple[str, int, str, int]]) -> dict[SpaceKey, int]:
    """(fingerprint, layer, recipe, dim) rows as the dim of each feature space."""
    return {(fingerprint, int(layer), recipe): int(dim) for fingerprint, layer, recipe, dim in rows}
