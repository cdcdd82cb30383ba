"""Idempotent ingest of feedback segments into the log store.

A segment is read once, checked as a whole with Arrow / numpy kernels, and written in one
transaction: accepted rows go to `requests` and `features`, failing rows to `quarantine` with the
first reason they fail, and the ledger records the segment's checksum and counts. Every row read is
accounted for exactly once: rows_read == accepted + quarantined + duplicates. Rerunning is safe: a
segment whose (path, checksum) is in the ledger is skipped, and a request id already stored is a
duplicate, never a second row.

Segments are isolated from each other: bad input in one segment never aborts the run or blocks the
next one. What cannot be parsed is recorded `unreadable`; a segment whose processing raises (an
Arrow or DuckDB error, a value no check foresaw) is rolled back alone and recorded `failed` with
reason `segment_error` and the error, while the other segments of the run (and of its transaction
group) are ingested. Both get one quarantine row (row_index -1) and a ledger row with zero counts, so
later runs skip them; `retry_failed` tries `failed` ones again (after a fix). Errors of the
environment rather than of the segment (the store locked, disk or memory exhausted, a DuckDB fatal
error) still end the run: quarantining every segment of a full disk would be wrong.

A segment's content never changes once renamed. When it does:
- the path was recorded `unreadable` or `failed` (nothing of it was ingested): the new content is
  ingested and replaces the ledger row (a repaired file);
- the path was ingested (`ok`): the new content is NOT ingested, since its rows would be counted
  against a ledger row that describes other rows; it is quarantined with reason
  `checksum_changed` (one quarantine row, and a `changed_segments` row keyed by path and checksum,
  so later runs skip it). The rows ingested from the first content stay, as do their ledger counts.

Capture recipes (see `store.duckdb`): a segment's metadata may record the recipe its features were
captured with (`leap.recipe`, `leap_io.feedback_schema.META_RECIPE`); each accepted row stores it,
canonicalized by `leap_core.recipes.Recipe.parse`, and a segment that records none stores NULL, which
means `last@<layer>`. A recipe that does not parse quarantines every row of its segment
(`unparsable_recipe`), and so does one that the segment's dim cannot be a capture of
(`recipe_does_not_fit_dim`: no hidden size gives that dim). The dim check is per feature space
(fingerprint, layer, recipe), so two recipes of one layer never conflict.

Finish reasons (see `store.duckdb`): `stop` and `length` rows are training labels; `abort`, `error` and
`repetition` rows are stored but never trained on, and each report counts them by reason
(`not_trainable`); any other reason is quarantined as `unknown_finish_reason`.

Feedback folders: segments are read from the folder itself and from its sub-folders one level down,
`<feedback>/<replica id>/*.parquet`. Each row's `replica_id` is the sub-folder's name; for a
top-level segment it is the segment metadata's `leap.replica_id` when present, else the replica in a
writer's segment name (`feedback-<time>-<replica>-<sequence>-<id>.parquet`), else NULL. Hidden
names, the writer's open streams (`*.arrows.partial`), temporary names, deeper folders and
`quarantine/` are never read. A feedback location `s3://bucket/prefix` is read the same way from the
objects `<prefix>/*.parquet` and `<prefix>/<replica id>/*.parquet` (the replicas' shippers upload there,
serving/shipper.py); each segment's ledger identity is then its `s3://bucket/key`.

While one segment is written, a helper thread already reads, checksums, parses and judges the next
(all of which release the GIL), so reading and writing overlap. The checks that depend on the store
(dims already stored, ids already stored) run on the writing connection, inside the transaction.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store.duckdb import (
    FINISH_REASONS,
    NOT_TRAINING_FINISH_REASONS,
    REQUIRED_COLUMNS,
    SCALAR_COLUMNS,
    LogStore,
    StoreBusyError,
    stored_dims,
)
from store.feature_encoding import feature_bytes
from store.feature_files import file_name, write_feature_file
from leap_core.recipes import Recipe, RecipeError
from leap_io.jsonable import dumps
from leap_io.object_store import is_object_url
from leap_io.feedback_schema import (
    META_DIM,
    META_LAYER,
    META_MODEL_FINGERPRINT,
    META_MODEL_ID,
    META_RECIPE,
    META_REPLICA_ID,
    feature_lists,
    feedback_schema,
)

SpaceKey = tuple[str, int, str]
"""A feature space: (model fingerprint, layer, capture recipe), as `store.duckdb.stored_dims` keys it."""

STATUS_OK = "ok"
STATUS_UNREADABLE = "unreadable"
STATUS_FAILED = "failed"
STATUS_CHECKSUM_CHANGED = "checksum_changed"
STATUS_VANISHED = "vanished"  # listed, then gone before it was read: nothing to record

REASON_UNREADABLE = "unreadable_segment"
REASON_SEGMENT_ERROR = "segment_error"
REASON_CHECKSUM_CHANGED = "checksum_changed"
REASON_MISSING_ID = "missing_request_id"
REASON_MISSING_SEGMENT_DIM = "missing_segment_dim"
REASON_FEATURE_WRONG_DIM = "feature_wrong_dim"
REASON_FEATURE_DIM_CONFLICT = "feature_dim_conflicts_store"
REASON_FEATURE_NOT_FINITE = "feature_not_finite"
REASON_INVALID_PROMPT_TOKENS = "invalid_prompt_tokens"
REASON_INVALID_OUTPUT_TOKENS = "invalid_output_tokens"
REASON_ZERO_OUTPUT_TOKENS = "zero_output_tokens"
REASON_NON_FINITE_TIME = "non_finite_time"
REASON_FINISH_BEFORE_ARRIVAL = "finish_before_arrival"
REASON_UNKNOWN_FINISH_REASON = "unknown_finish_reason"
REASON_UNPARSABLE_RECIPE = "unparsable_recipe"
REASON_RECIPE_WRONG_DIM = "recipe_does_not_fit_dim"
REASON_NUL_IN_TEXT = "nul_in_text"


def null_field_reason(column: str) -> str:
    return f"null_field:{column}"


def missing_column_reason(column: str) -> str:
    return f"missing_column:{column}"


def bad_column_type_reason(column: str) -> str:
    return f"bad_column_type:{column}"


def bad_metadata_reason(column: str) -> str:
    """A row needed the segment metadata's value for `column`, and that value does not fit the column."""
    return f"bad_metadata:{column}"


_WRITER_NAME = re.compile(r"^feedback-\d{8}T\d{6}-(?P<replica>.+)-\d{6}-[0-9a-f]+\.parquet$")
"""A segment name as serving.feedback.FeedbackWriter makes it; the replica id sits between fixed fields."""

QUARANTINE_DIR = "quarantine"
"""A sub-folder of the feedback folder that ingest never reads (the writer sets bad files aside there)."""
PARTIAL_SUFFIX = ".arrows.partial"
"""The writer's open stream; it becomes a `*.parquet` segment by an atomic rename when complete."""

_RUN_ERRORS: tuple[type[BaseException], ...] = (
    StoreBusyError,
    MemoryError,
    duckdb.IOException,
    duckdb.OutOfMemoryException,
    duckdb.FatalException,
    duckdb.InternalException,
    duckdb.InterruptException,
)
"""Errors of the environment, not of a segment: they end the run instead of quarantining the segment."""
try:
    import psycopg
except ImportError:  # the PostgreSQL store is not installed: its errors cannot occur
    pass
else:  # a lost connection, a full disk, a deadlock (retried with the run), an unusable connection
    _RUN_ERRORS += (psycopg.OperationalError, psycopg.InterfaceError)


_TOKEN_COLUMNS = ("prompt_tokens", "output_tokens")
_TIME_COLUMNS = ("arrival_time", "first_token_time", "finish_time")
# Columns a row may leave null because the segment's metadata says the same thing for every row.
_METADATA_FALLBACK = {
    "model_id": (META_MODEL_ID, str),
    "model_fingerprint": (META_MODEL_FINGERPRINT, str),
    "layer": (META_LAYER, int),
}
_INT32_MAX = np.iinfo(np.int32).max
_SCHEMA = feedback_schema(1)


@dataclass(frozen=True)
class IngestReport:
    """What one segment contributed; for a skipped segment every count is zero.

    `status` is ok, unreadable, failed or checksum_changed (the last three with `reason` and
    `error`); `not_trainable` counts the accepted rows of each finish reason that is not a training
    label; `replica_id` is the sub-folder the segment came from (None at the top level).
    """

    segment: str
    checksum: str
    rows_read: int
    accepted: int
    quarantined: int
    duplicates: int
    skipped: bool = False
    status: str = STATUS_OK
    reason: str | None = None
    error: str | None = None
    not_trainable: Mapping[str, int] = field(default_factory=dict)
    replica_id: str | None = None


class _Crash(BaseException):
    """An exception of the test hook: it stands for the process dying, so no isolation may catch it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


StageHook = Callable[[str], None]
"""Called inside the transaction after each write ("requests", "features", "quarantine", "ledger")."""


class _Verdicts:
    """The first failing reason of each row, as a rank into `reasons` (0: passing).

    A row's reason is the earliest check, in the order the checks were made, that it fails. A check
    that needs the store runs later, on the writing thread, but keeps its place in that order
    through a rank reserved when it would have run.
    """

    def __init__(self, n: int) -> None:
        self.codes = np.zeros(n, dtype=np.int32)
        self.reasons: list[str | None] = [None]

    def reserve(self) -> int:
        self.reasons.append(None)
        return len(self.reasons) - 1

    def flag(self, failing: np.ndarray | bool, reason: str, rank: int | None = None) -> None:
        if rank is None:
            rank = self.reserve()
        self.reasons[rank] = reason
        codes = self.codes
        codes[((codes == 0) | (codes > rank)) & failing] = rank

    @property
    def passing(self) -> np.ndarray:
        return self.codes == 0

    def reason_of(self, rows: np.ndarray) -> list[str]:
        return np.array(self.reasons, dtype=object)[self.codes[rows]].tolist()


def _mask(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A boolean Arrow array as numpy, null counted as False."""
    return pc.fill_null(array, False).to_numpy(zero_copy_only=False).astype(bool)


def _segment_recipe(metadata: Mapping[bytes, bytes]) -> tuple[str | None, str | None]:
    """(canonical recipe, None), (None, None) when the segment records none, or (None, why) when the
    recorded one does not parse."""
    raw = metadata.get(META_RECIPE)
    if raw is None:
        return None, None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None, f"the recipe {raw[:200]!r} is not UTF-8"
    if not text.strip():
        return None, None  # an empty value says no more than a missing one
    try:
        return str(Recipe.parse(text)), None
    except ValueError as error:  # RecipeError
        return None, str(error)[:500]


def _fits_dim(recipe: str, dim: int) -> bool:
    """Whether some hidden size makes `recipe`'s vector `dim` floats long."""
    try:
        Recipe.parse(recipe).hidden_for(dim)
        return True
    except RecipeError:
        return False


def _metadata_value(metadata: dict[bytes, bytes], key: bytes, kind: type) -> Any:
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        return kind(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None


class _Segment:
    """One segment's rows conformed to the feedback schema and judged row by row, without row loops.

    Everything here depends on the segment alone; `judge_against_store` adds the one check that
    needs the store (a dim that conflicts with the dim already stored for the same feature space).
    `recipe` is the segment's capture recipe (None: it records none, i.e. `last@<layer>`).
    """

    def __init__(self, raw: pa.Table) -> None:
        self.raw = raw
        self.n = raw.num_rows
        metadata = raw.schema.metadata or {}
        self.dim = _metadata_value(metadata, META_DIM, int)
        self.recipe, self.recipe_error = _segment_recipe(metadata)
        self.verdicts = _Verdicts(self.n)
        self.columns: dict[str, pa.Array] = {}
        column_problems: list[str] = []
        self._row_problems: list[tuple[np.ndarray, str]] = []  # rows a column problem touches
        for name in SCALAR_COLUMNS:
            self.columns[name] = self._conform(name, metadata, column_problems)
        self.feature = self._conform_feature(column_problems)
        self._dim_conflict_rank: int | None = None
        self._judge(column_problems)

    def _conform(self, name: str, metadata: dict[bytes, bytes], problems: list[str]) -> pa.Array:
        target = _SCHEMA.field(name).type
        fallback = None
        if name in _METADATA_FALLBACK:
            key, kind = _METADATA_FALLBACK[name]
            fallback = _metadata_value(metadata, key, kind)
        if name not in self.raw.column_names:
            if name in REQUIRED_COLUMNS and fallback is None:
                problems.append(missing_column_reason(name))
            column = pa.nulls(self.n, target)
        else:
            column = self.raw.column(name).combine_chunks()
            try:
                if name in _TOKEN_COLUMNS:
                    # Checked as float64 first: a writer may have stored NaN or fractional counts.
                    column = pc.cast(column, pa.float64())
                elif column.type != target:
                    column = pc.cast(column, target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                problems.append(bad_column_type_reason(name))
                column = pa.nulls(self.n, pa.float64() if name in _TOKEN_COLUMNS else target)
        if fallback is not None and column.null_count:
            try:
                value = pa.scalar(fallback, column.type)
            except (pa.ArrowException, OverflowError, TypeError, ValueError):
                # e.g. a layer above int32: the rows that needed it fail, the others stand
                self._row_problems.append((_mask(column.is_null()), bad_metadata_reason(name)))
            else:
                column = pc.fill_null(column, value)
        return column

    def _conform_feature(self, problems: list[str]) -> pa.Array:
        list_type = pa.list_(pa.float32())
        if "feature" not in self.raw.column_names:
            problems.append(missing_column_reason("feature"))
            return pa.nulls(self.n, list_type)
        feature = self.raw.column("feature").combine_chunks()
        if pa.types.is_fixed_size_binary(feature.type):  # a version 2 file: the floats' bytes (`segment_table`)
            try:
                return feature_lists(feature)
            except ValueError:
                problems.append(bad_column_type_reason("feature"))
                return pa.nulls(self.n, list_type)
        if pa.types.is_fixed_size_list(feature.type):
            target = pa.list_(pa.float32(), feature.type.list_size)
        elif pa.types.is_list(feature.type) or pa.types.is_large_list(feature.type):
            target = list_type
        else:
            problems.append(bad_column_type_reason("feature"))
            return pa.nulls(self.n, list_type)
        if feature.type.value_type == pa.float32():
            return feature  # a Parquet round trip renames the list's child field; no copy for that
        try:
            return pc.cast(feature, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            problems.append(bad_column_type_reason("feature"))
            return pa.nulls(self.n, list_type)

    def _judge(self, column_problems: list[str]) -> None:
        flag, columns = self.verdicts.flag, self.columns
        for problem in column_problems:
            flag(True, problem)
        for rows, problem in self._row_problems:
            flag(rows, problem)
        flag(self.recipe_error is not None, REASON_UNPARSABLE_RECIPE)

        ids = columns["request_id"]
        flag(_mask(pc.or_kleene(ids.is_null(), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(ids)), 0))),
             REASON_MISSING_ID)
        for name in SCALAR_COLUMNS:
            if name in REQUIRED_COLUMNS and name != "request_id":
                flag(_mask(columns[name].is_null()), null_field_reason(name))
        flag(_mask(self.feature.is_null()), null_field_reason("feature"))

        self._judge_features()

        for name, reason in zip(_TOKEN_COLUMNS, (REASON_INVALID_PROMPT_TOKENS, REASON_INVALID_OUTPUT_TOKENS)):
            counts = columns[name].to_numpy(zero_copy_only=False)
            with np.errstate(invalid="ignore"):
                valid = np.isfinite(counts) & (counts >= 0) & (counts <= _INT32_MAX) & (counts == np.floor(counts))
            flag(~valid & ~_mask(columns[name].is_null()), reason)
            columns[name] = pa.array(np.where(valid, counts, 0).astype(np.int32), mask=~valid)
        flag(_mask(pc.equal(columns["output_tokens"], 0)), REASON_ZERO_OUTPUT_TOKENS)

        times = {name: columns[name].to_numpy(zero_copy_only=False) for name in _TIME_COLUMNS}
        for name in _TIME_COLUMNS:
            flag(~np.isfinite(times[name]) & ~_mask(columns[name].is_null()), REASON_NON_FINITE_TIME)
        flag(_mask(pc.less(columns["finish_time"], columns["arrival_time"])), REASON_FINISH_BEFORE_ARRIVAL)
        known = pc.is_in(columns["finish_reason"], value_set=pa.array(FINISH_REASONS))
        flag(~_mask(known), REASON_UNKNOWN_FINISH_REASON)
        # PostgreSQL text cannot hold NUL, which would fail the whole segment's COPY there: one store
        # rule for both, the row is quarantined with its reason
        for name in SCALAR_COLUMNS:
            if pa.types.is_string(columns[name].type):
                flag(_mask(pc.match_substring(columns[name], "\x00")), REASON_NUL_IN_TEXT)

    def _judge_features(self) -> None:
        flag = self.verdicts.flag
        if self.dim is None:
            flag(True, REASON_MISSING_SEGMENT_DIM)
            return
        flag(self.recipe is not None and not _fits_dim(self.recipe, self.dim), REASON_RECIPE_WRONG_DIM)
        feature = self.feature
        if pa.types.is_fixed_size_list(feature.type) and feature.type.list_size == self.dim:
            wrong_dim = _mask(feature.is_null())  # null rows already failed; every other row has dim floats
        else:
            wrong_dim = pc.fill_null(pc.list_value_length(feature), -1).to_numpy(zero_copy_only=False) != self.dim
        flag(wrong_dim, REASON_FEATURE_WRONG_DIM)
        self._dim_conflict_rank = self.verdicts.reserve()
        flag(self._rows_with_non_finite_values(), REASON_FEATURE_NOT_FINITE)

    def _rows_with_non_finite_values(self) -> np.ndarray:
        feature = self.feature
        if pa.types.is_fixed_size_list(feature.type):
            size = feature.type.list_size
            values = feature.values.slice(feature.offset * size, self.n * size)
            matrix = values.to_numpy(zero_copy_only=False).reshape(self.n, size)
            return ~np.isfinite(matrix).all(axis=1)
        flat = pc.list_flatten(feature).to_numpy(zero_copy_only=False)
        parents = pc.list_parent_indices(feature).to_numpy(zero_copy_only=False)
        bad = np.zeros(self.n, dtype=bool)
        bad[parents[~np.isfinite(flat)]] = True
        return bad

    def feature_spaces(self) -> tuple[np.ndarray, list[tuple[str | None, int | None, str | None]]]:
        """Each row's feature space as a code into the list of distinct (fingerprint, layer, recipe)
        triples; the recipe is the segment's, else `last@<layer>` as `store.duckdb.RECIPE_SQL` reads it."""
        fingerprints = pc.dictionary_encode(self.columns["model_fingerprint"])
        layers = pc.dictionary_encode(self.columns["layer"])
        # Codes shifted by one so that null (-1) is a code too, then one integer per pair.
        fp_codes = pc.fill_null(fingerprints.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        layer_codes = pc.fill_null(layers.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        width = len(layers.dictionary) + 1
        pairs, codes = np.unique(fp_codes * width + layer_codes, return_inverse=True)
        fp_values = [None, *fingerprints.dictionary.to_pylist()]
        layer_values = [None, *layers.dictionary.to_pylist()]
        named = [(fp_values[pair // width], layer_values[pair % width]) for pair in pairs.tolist()]
        return codes.reshape(-1), [(fingerprint, layer, self._space_recipe(layer)) for fingerprint, layer in named]

    def _space_recipe(self, layer: int | None) -> str | None:
        if self.recipe is not None:
            return self.recipe
        return None if layer is None else str(Recipe.last(int(layer)))

    def judge_against_store(self, stored_dims: Mapping[SpaceKey, int]) -> None:
        """Fail the rows whose feature space is already stored with another dim."""
        if self._dim_conflict_rank is None or not stored_dims:
            return
        codes, pairs = self.feature_spaces()
        clashing = [index for index, pair in enumerate(pairs)
                    if stored_dims.get(pair) not in (None, self.dim)]
        if clashing:
            self.verdicts.flag(np.isin(codes, clashing), REASON_FEATURE_DIM_CONFLICT, rank=self._dim_conflict_rank)

    def first_occurrences(self) -> np.ndarray:
        """Passing rows that are the first passing row with their request id (first wins)."""
        passing = np.flatnonzero(self.verdicts.passing)
        mask = np.zeros(self.n, dtype=bool)
        if passing.size == 0:
            return mask
        ids = pc.dictionary_encode(self.columns["request_id"].take(passing)).indices
        _, first = np.unique(ids.to_numpy(zero_copy_only=False), return_index=True)
        mask[passing[first]] = True
        return mask

    def quarantine_rows(self, segment: str) -> pa.Table:
        rows = np.flatnonzero(~self.verdicts.passing)
        ids = self.columns["request_id"].take(rows)
        return pa.table(
            {
                "segment": pa.array([segment] * len(rows), pa.string()),
                "row_index": pa.array(rows, pa.int64()),
                # an id with NUL cannot be text in PostgreSQL; `raw` keeps it, escaped
                "request_id": pc.replace_substring(
                    pc.if_else(pc.equal(ids, ""), pa.scalar(None, pa.string()), ids), "\x00", "\ufffd"),
                "reason": pa.array(self.verdicts.reason_of(rows), pa.string()),
                # Only failing rows get here, kept whole (features too) for whoever looks into them.
                "raw": pa.array([_to_json(row) for row in self.raw.take(rows).to_pylist()], pa.string()),
            }
        )

    def accepted_rows(self, accepted: np.ndarray) -> pa.Table:
        table = pa.table({**self.columns, "feature": self.feature})
        return table if accepted.all() else table.filter(pa.array(accepted))

    def dims_by_space(self, accepted: np.ndarray) -> dict[SpaceKey, int]:
        """The dim this segment stores for each feature space among the accepted rows."""
        if not accepted.any():
            return {}
        codes, pairs = self.feature_spaces()
        return {pairs[code]: int(self.dim) for code in np.unique(codes[accepted])}


def _to_json(row: dict[str, Any]) -> str:
    return dumps(row, nonfinite="string", default=str)  # "nan", "inf": strict JSON has no spelling for them


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stage(hook: StageHook | None, name: str) -> None:
    if hook is not None:
        try:
            hook(name)
        except Exception as error:
            raise _Crash(error) from error


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


class StoreWriter(Protocol):
    """What ingest writes through: the judging above is the same for every store, only these writes differ.

    The DuckDB file is written through `_DuckDBWriter`, on the one connection that holds the file;
    `store.postgres.PostgresStore.segment_writer` gives a writer whose store other workers may
    write at the same time (`concurrent`): there each segment first `claim`s its ledger row under a
    lock that lasts until the transaction ends, and `store_dims` reads the dims stored for the
    segment's feature spaces inside the transaction instead of the run's snapshot.
    `prepare_features` hands over a segment's accepted rows before `insert_requests`, so that a store
    that writes their features elsewhere (the DuckDB store's feature files) starts while the requests
    go in; `insert_requests` returns which rows it inserted: the others are duplicates of ids already
    stored, and `insert_features` stores the features of the inserted ones.
    """

    concurrent: bool

    def snapshot(self) -> tuple[dict[str, tuple[str, str]], set[tuple[str, str]], dict[SpaceKey, int]]:
        """(segment -> (checksum, status) of the ledger, (segment, checksum) already quarantined as
        changed, the dim stored for each feature space) as the run starts."""
        ...

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None:
        """Roll back the open transaction; never raises (it runs while another error propagates)."""
        ...

    def claim(self, segment: str, checksum: str) -> tuple[tuple[str, str] | None, bool]:
        """(the segment's ledger row, whether this content is quarantined as changed), now and held."""
        ...

    def clear_segment_quarantine(self, segment: str) -> None: ...

    def store_dims(self, spaces: Sequence[SpaceKey], dim: int | None,
                   known: Mapping[SpaceKey, int]) -> Mapping[SpaceKey, int]: ...

    def release_spaces(self, stored: Mapping[SpaceKey, int]) -> None: ...

    def insert_requests(self, rows: pa.Table, segment: str, now: datetime, replica_id: str | None) -> np.ndarray: ...

    def prepare_features(self, rows: pa.Table, dim: int, segment: str, checksum: str) -> None: ...

    def insert_features(self, rows: pa.Table, inserted: np.ndarray, dim: int, recipe: str | None) -> None: ...

    def insert_quarantine(self, table: pa.Table, now: datetime) -> None: ...

    def quarantine_segment(self, segment: str, reason: str, detail_json: str, now: datetime) -> None: ...

    def write_ledger(self, segment: str, checksum: str, counts: Sequence[int], status: str, now: datetime) -> None: ...

    def record_changed(self, segment: str, checksum: str, ingested_checksum: str, size_bytes: int,
                       now: datetime) -> None: ...


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


class _DuckDBWriter:
    """The DuckDB file's writes, on the connection that holds the file's lock for the whole run: no
    other writer can run meanwhile, so the run's snapshot stays true and nothing needs claiming.

    A segment's feature file (`store.feature_files`) is written by `files`, a thread of its own,
    while the segment's requests go into the database; `insert_features` waits for it, so the file
    is on disk before the transaction that references it commits.
    """

    concurrent = False

    def __init__(self, con: duckdb.DuckDBPyConnection, features_folder: Path, files: ThreadPoolExecutor) -> None:
        self.con = con
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

    def snapshot(self) -> tuple[dict[str, tuple[str, str]], set[tuple[str, str]], dict[SpaceKey, int]]:
        ledger = {segment: (checksum, status) for segment, checksum, status
                  in self.con.execute("SELECT segment, checksum, status FROM ingest_ledger").fetchall()}
        changed = {(segment, checksum) for segment, checksum
                   in self.con.execute("SELECT segment, checksum FROM changed_segments").fetchall()}
        return ledger, changed, stored_dims(self.con)

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

    def clear_segment_quarantine(self, segment: str) -> None:
        self.con.execute("DELETE FROM quarantine WHERE segment = ? AND row_index = -1", [segment])

    def store_dims(self, spaces: Sequence[SpaceKey], dim: int | None,
                   known: Mapping[SpaceKey, int]) -> Mapping[SpaceKey, int]:
        return known

    def release_spaces(self, stored: Mapping[SpaceKey, int]) -> None:
        pass

    def insert_requests(self, rows: pa.Table, segment: str, now: datetime, replica_id: str | None) -> np.ndarray:
        ids = rows.column("request_id")
        stored = _stored_ids(self.con, ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids)
        inserted = ~_mask(pc.is_in(ids, value_set=stored)) if len(stored) else np.ones(rows.num_rows, dtype=bool)
        fresh = rows if inserted.all() else rows.filter(pa.array(inserted))
        columns = ", ".join(SCALAR_COLUMNS)
        _insert_arrow(self.con, "_incoming_requests", fresh.select(list(SCALAR_COLUMNS)),
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
        fresh = rows if inserted.all() else rows.filter(pa.array(inserted))
        references = fresh.select(["request_id", "layer", "model_fingerprint"]).append_column(
            "file_row", pa.array(np.flatnonzero(inserted).astype(np.int32)))
        _insert_arrow(self.con, "_incoming_features", references,
                      "INSERT INTO features (request_id, dim, layer, model_fingerprint, file, file_row, recipe) "
                      "SELECT request_id, ?, layer, model_fingerprint, ?, file_row, ? FROM _incoming_features",
                      [dim, name, recipe])

    def insert_quarantine(self, table: pa.Table, now: datetime) -> None:
        _insert_arrow(self.con, "_incoming_quarantine", table,
                      "INSERT INTO quarantine SELECT segment, row_index, request_id, reason, raw::JSON, ? "
                      "FROM _incoming_quarantine", [now])

    def quarantine_segment(self, segment: str, reason: str, detail_json: str, now: datetime) -> None:
        self.con.execute("INSERT INTO quarantine VALUES (?, -1, NULL, ?, ?::JSON, ?)", [segment, reason, detail_json, now])

    def write_ledger(self, segment: str, checksum: str, counts: Sequence[int], status: str, now: datetime) -> None:
        self.con.execute("INSERT OR REPLACE INTO ingest_ledger VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         [segment, checksum, *(int(count) for count in counts), now, status])

    def record_changed(self, segment: str, checksum: str, ingested_checksum: str, size_bytes: int,
                       now: datetime) -> None:
        self.con.execute("INSERT OR IGNORE INTO changed_segments VALUES (?, ?, ?, ?, ?)",
                         [segment, checksum, ingested_checksum, size_bytes, now])


@contextmanager
def store_writer(store: Any) -> Iterator[StoreWriter]:
    """The writer of `store`: its own (`segment_writer`, e.g. PostgreSQL's) where it has one, else
    the DuckDB file's, on one connection for the whole run."""
    own = getattr(store, "segment_writer", None)
    if own is not None:
        with own() as writer:
            yield writer
        return
    with store.connect() as con, ThreadPoolExecutor(max_workers=1, thread_name_prefix="leap-ingest-files") as files:
        yield _DuckDBWriter(con, store.features_folder, files)


def _write_ledger(writer: StoreWriter, report: IngestReport, now: datetime) -> None:
    writer.write_ledger(report.segment, report.checksum,
                        (report.rows_read, report.accepted, report.quarantined, report.duplicates), report.status, now)


def _quarantine_segment(writer: StoreWriter, segment: str, reason: str, detail: Mapping[str, Any],
                        now: datetime) -> None:
    """One quarantine row (row_index -1) standing for a whole segment."""
    writer.quarantine_segment(segment, reason, _to_json(dict(detail)), now)


def _ingest_unreadable(writer: StoreWriter, read: _ReadSegment, hook: StageHook | None) -> IngestReport:
    """Record a segment nothing can be read from: no row is known, so none is counted."""
    now = _now()
    if read.replaces:
        writer.clear_segment_quarantine(read.segment)
    _quarantine_segment(writer, read.segment, REASON_UNREADABLE, {"error": _error_text(read.error)}, now)
    _stage(hook, "quarantine")
    report = IngestReport(read.segment, read.checksum, 0, 0, 0, 0, status=STATUS_UNREADABLE,
                          reason=REASON_UNREADABLE, error=_error_text(read.error), replica_id=read.replica_id)
    _write_ledger(writer, report, now)
    _stage(hook, "ledger")
    return report


def _record_failed(writer: StoreWriter, read: _ReadSegment, error: BaseException, stage: str) -> IngestReport:
    """Record a segment whose processing raised: nothing of it is stored, later runs skip it."""
    now = _now()
    if read.replaces:
        writer.clear_segment_quarantine(read.segment)
    rows = read.judged.n if read.judged is not None else read.rows
    _quarantine_segment(writer, read.segment, REASON_SEGMENT_ERROR,
                        {"error": _error_text(error), "stage": stage, "rows": rows, "replica_id": read.replica_id},
                        now)
    report = IngestReport(read.segment, read.checksum, 0, 0, 0, 0, status=STATUS_FAILED,
                          reason=REASON_SEGMENT_ERROR, error=_error_text(error), replica_id=read.replica_id)
    _write_ledger(writer, report, now)
    return report


def _record_changed(writer: StoreWriter, read: _ReadSegment) -> IngestReport:
    """Quarantine new content at the path of a segment already ingested, without ingesting any of it."""
    now = _now()
    _quarantine_segment(writer, read.segment, REASON_CHECKSUM_CHANGED,
                        {"checksum": read.checksum, "ingested_checksum": read.changed_from,
                         "size_bytes": read.size_bytes, "replica_id": read.replica_id}, now)
    writer.record_changed(read.segment, read.checksum, read.changed_from, read.size_bytes, now)
    return IngestReport(read.segment, read.checksum, 0, 0, 0, 0, status=STATUS_CHECKSUM_CHANGED,
                        reason=REASON_CHECKSUM_CHANGED,
                        error=f"the segment was ingested with checksum {read.changed_from}; its content changed since",
                        replica_id=read.replica_id)


def _not_trainable(rows: pa.Table) -> dict[str, int]:
    """Accepted rows of each finish reason that is not a training label."""
    if not rows.num_rows:
        return {}
    counts = pc.value_counts(rows.column("finish_reason")).to_pylist()
    return {item["values"]: int(item["counts"]) for item in counts if item["values"] in NOT_TRAINING_FINISH_REASONS}


def _ingest_table(writer: StoreWriter, read: _ReadSegment, known_dims: Mapping[SpaceKey, int],
                  hook: StageHook | None) -> tuple[IngestReport, dict[SpaceKey, int]]:
    """Write one judged segment; also returns the dims it stored for each feature space."""
    segment, judged = read.segment, read.judged
    now = _now()
    if read.replaces:  # a repaired file replaces what its earlier version left in quarantine
        writer.clear_segment_quarantine(segment)
    codes, spaces = judged.feature_spaces()
    candidates = [spaces[code] for code in np.unique(codes[judged.verdicts.passing])]
    judged.judge_against_store(writer.store_dims(
        [space for space in candidates if space[0] is not None and space[1] is not None], judged.dim, known_dims))
    firsts = judged.first_occurrences()
    rows = judged.accepted_rows(firsts)
    writer.prepare_features(rows, judged.dim or 0, segment, read.checksum)
    inserted = writer.insert_requests(rows, segment, now, read.replica_id)  # the others: ids already stored
    _stage(hook, "requests")
    writer.insert_features(rows, inserted, judged.dim or 0, judged.recipe)
    _stage(hook, "features")
    quarantine = judged.quarantine_rows(segment)
    if quarantine.num_rows:
        writer.insert_quarantine(quarantine, now)
    _stage(hook, "quarantine")

    accepted = np.zeros(judged.n, dtype=bool)
    accepted[np.flatnonzero(firsts)[inserted]] = True
    dims = judged.dims_by_space(accepted)
    writer.release_spaces(dims)
    n_accepted = int(accepted.sum())
    n_quarantined = quarantine.num_rows
    stored = rows if inserted.all() else rows.filter(pa.array(inserted))
    report = IngestReport(segment, read.checksum, judged.n, n_accepted, n_quarantined,
                          judged.n - n_accepted - n_quarantined, not_trainable=_not_trainable(stored),
                          replica_id=read.replica_id)
    _write_ledger(writer, report, now)
    _stage(hook, "ledger")
    return report, dims


class SegmentSource(Protocol):
    """Where one complete segment's bytes come from: a local file (`SegmentFile`) or an object in a bucket
    (`store.segment_sources.ObjectSegment`). `segment` is its identity in the ledger (the resolved path, or
    `s3://bucket/key`), `replica_id` the replica folder it was found in (None at the top level), `name`
    its file name (which may carry the writer's replica id), and `read_bytes()` raises
    FileNotFoundError when it vanished after it was listed."""

    @property
    def segment(self) -> str: ...

    @property
    def replica_id(self) -> str | None: ...

    @property
    def name(self) -> str: ...

    def read_bytes(self) -> bytes: ...


@dataclass(frozen=True)
class SegmentFile:
    """A complete segment found in the feedback folder, and the replica whose sub-folder holds it."""

    path: Path
    replica_id: str | None = None

    @property
    def segment(self) -> str:
        return str(self.path.resolve())

    @property
    def name(self) -> str:
        return self.path.name

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()


@dataclass
class _ReadSegment:
    """A segment read from disk and judged on its own, ready for the writing connection."""

    segment: str
    checksum: str
    replica_id: str | None = None
    skip_status: str | None = None  # set when nothing is to be written: seen before, or vanished
    replaces: bool = False  # the ledger holds an earlier content that left nothing stored
    changed_from: str | None = None  # set when the ledger holds an ingested earlier content
    size_bytes: int = 0
    rows: int = 0
    judged: _Segment | None = None
    error: Exception | None = None  # unreadable
    failure: Exception | None = None  # parsed, but judging it raised


def _read_segment(source: SegmentSource, ledger: Mapping[str, tuple[str, str]], changed: set[tuple[str, str]],
                  retry_failed: bool) -> _ReadSegment:
    """Read, checksum, parse and judge one segment; runs on the read-ahead thread (no store access).

    `ledger` maps each segment already ingested to (checksum, status) and `changed` holds the
    (segment, checksum) contents already quarantined as changed, as they were when the writing
    connection opened: only that connection writes, and each path comes once per run.
    """
    replica = source.replica_id
    segment = source.segment
    try:
        data = source.read_bytes()
    except FileNotFoundError:
        return _ReadSegment(segment, "", replica, skip_status=STATUS_VANISHED)
    checksum = _checksum(data)
    seen = ledger.get(segment)
    if seen is not None and seen[0] == checksum and not (retry_failed and seen[1] == STATUS_FAILED):
        return _ReadSegment(segment, checksum, replica, skip_status=seen[1])
    if (segment, checksum) in changed:
        return _ReadSegment(segment, checksum, replica, skip_status=STATUS_CHECKSUM_CHANGED)
    read = _ReadSegment(segment, checksum, replica, size_bytes=len(data), replaces=seen is not None)
    if seen is not None and seen[1] == STATUS_OK:
        read.replaces, read.changed_from = False, seen[0]
        return read
    try:
        # One thread: the feature column is nearly all the bytes and decodes on one thread anyway,
        # while Arrow's pool would take cores from the writing thread and DuckDB. `ParquetFile`, not
        # `read_table`: one file needs no dataset layer, whose first use costs a process 0.3 s.
        raw = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    except _RUN_ERRORS:
        raise
    except Exception as error:  # noqa: BLE001  (anything the reader raises means the bytes are not a segment)
        read.error = error
        return read
    read.rows = raw.num_rows
    if read.replica_id is None:
        read.replica_id = _replica_of(source.name, raw.schema.metadata or {})
    try:
        read.judged = _Segment(raw)
    except _RUN_ERRORS:
        raise
    except Exception as error:  # noqa: BLE001  (isolation: this segment fails, the run goes on)
        read.failure = error
    return read


def _replica_of(name: str, metadata: Mapping[bytes, bytes]) -> str | None:
    """The replica of a top-level segment: its metadata's, else the one in a writer's segment name."""
    given = metadata.get(META_REPLICA_ID)
    if given:
        with suppress(UnicodeDecodeError):
            return given.decode().strip() or None
    match = _WRITER_NAME.match(name)
    return match.group("replica") if match else None


def _skipped(read: _ReadSegment) -> IngestReport:
    return IngestReport(read.segment, read.checksum, 0, 0, 0, 0, skipped=True, status=read.skip_status,
                        replica_id=read.replica_id)


def _as_claimed(read: _ReadSegment, seen: tuple[str, str] | None, changed: bool, retry_failed: bool) -> _ReadSegment:
    """`read` decided again against its ledger row as it is now, under the segment's lock: another
    writer may have ingested it (or quarantined its content as changed) since this run's snapshot."""
    if changed:
        return replace(read, skip_status=STATUS_CHECKSUM_CHANGED)
    if seen is None:
        return read
    if seen[0] == read.checksum and not (retry_failed and seen[1] == STATUS_FAILED):
        return replace(read, skip_status=seen[1])
    if seen[1] == STATUS_OK:
        return replace(read, replaces=False, changed_from=seen[0])
    return replace(read, replaces=True)


def _write_segment(writer: StoreWriter, read: _ReadSegment, known_dims: Mapping[SpaceKey, int],
                   hook: StageHook | None, retry_failed: bool = False) -> tuple[IngestReport, dict[SpaceKey, int]]:
    """Write one read segment inside the open transaction (raises if writing it fails)."""
    if writer.concurrent:
        read = _as_claimed(read, *writer.claim(read.segment, read.checksum), retry_failed)
        if read.skip_status is not None:
            return _skipped(read), {}
    if read.changed_from is not None:
        return _record_changed(writer, read), {}
    if read.failure is not None:
        return _record_failed(writer, read, read.failure, "judge"), {}
    if read.judged is None:
        return _ingest_unreadable(writer, read, hook), {}
    return _ingest_table(writer, read, known_dims, hook)


def _write_alone(writer: StoreWriter, read: _ReadSegment, known_dims: dict[SpaceKey, int],
                 hook: StageHook | None, retry_failed: bool = False) -> IngestReport:
    """Write one segment in a transaction of its own; if writing it raises, record it failed instead."""
    writer.begin()
    try:
        report, dims = _write_segment(writer, read, known_dims, hook, retry_failed)
        writer.commit()
    except (_Crash, *_RUN_ERRORS):
        writer.rollback()
        raise
    except Exception as error:  # noqa: BLE001  (isolation: this segment fails, the run goes on)
        writer.rollback()
        writer.begin()
        try:
            if writer.concurrent:  # hold the segment while recording it, as a write would
                read = _as_claimed(read, *writer.claim(read.segment, read.checksum), retry_failed)
            if read.skip_status is not None:
                report, dims = _skipped(read), {}
            else:
                report, dims = _record_failed(writer, read, error, "write"), {}
            writer.commit()
        except BaseException:
            writer.rollback()
            raise
    known_dims.update(dims)
    return report


def _ingest_paths(writer: StoreWriter, sources: Sequence[SegmentSource], hook: StageHook | None,
                  transaction_rows: int = 0, retry_failed: bool = False) -> list[IngestReport]:
    """Ingest `sources` in order, reading the next segment while writing this one.

    A transaction holds one segment, or consecutive segments until they hold `transaction_rows`
    rows. Either way a crash rolls back whole segments together with their ledger rows, so a rerun
    ingests exactly what is missing. A segment whose writing raises is rolled back with its group;
    the group's other segments are then written again one by one and the failing one is recorded
    `failed`, so one bad segment costs the run nothing else.
    """
    ledger, changed, known_dims = writer.snapshot()
    pending_dims: dict[SpaceKey, int] = {}  # written by the open transaction
    reports: list[IngestReport] = []
    group: list[tuple[_ReadSegment, int]] = []  # segments written in the open transaction, with their report's index
    rows_in_transaction = 0

    def read_ahead(index: int) -> Future | None:
        if index >= len(sources):
            return None
        return reader.submit(_read_segment, sources[index], ledger, changed, retry_failed)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="leap-ingest-read") as reader:
        ahead = read_ahead(0)
        try:
            for index in range(len(sources)):
                read = ahead.result()
                ahead = read_ahead(index + 1)
                if read.skip_status is not None:
                    if read.skip_status != STATUS_VANISHED:
                        reports.append(_skipped(read))
                    continue
                if not group:
                    writer.begin()
                group.append((read, len(reports)))
                try:
                    report, dims = _write_segment(writer, read, {**known_dims, **pending_dims}, hook, retry_failed)
                except (_Crash, *_RUN_ERRORS):
                    raise
                except Exception:  # noqa: BLE001  (isolation: redo the group without this segment)
                    writer.rollback()
                    earlier, group = group[:-1], []
                    pending_dims.clear()
                    rows_in_transaction = 0
                    for segment, position in earlier:  # rolled back with the group: written again, alone
                        reports[position] = _write_alone(writer, segment, known_dims, hook, retry_failed)
                    reports.append(_write_alone(writer, read, known_dims, hook, retry_failed))  # fails again, or not
                    continue
                reports.append(report)
                pending_dims.update(dims)
                rows_in_transaction += report.rows_read
                if rows_in_transaction >= transaction_rows:
                    writer.commit()
                    group, rows_in_transaction = [], 0
                    known_dims.update(pending_dims)
                    pending_dims.clear()
            if group:
                writer.commit()
                group = []
        except BaseException as error:
            if group:
                writer.rollback()
            if ahead is not None:
                ahead.cancel()
            if isinstance(error, _Crash):
                raise error.error from None
            raise
    return reports


def ingest_segment(store: LogStore, path: str | Path, *, replica_id: str | None = None,
                   _after_stage: StageHook | None = None) -> IngestReport:
    """Ingest one complete segment in one transaction; a crash part-way leaves nothing of it."""
    return ingest_segments(store, [SegmentFile(Path(path), replica_id)], _after_stage=_after_stage)[0]


def ingest_segments(store: Any, sources: Sequence[SegmentSource], *, transaction_rows: int = 0,
                    retry_failed: bool = False, _after_stage: StageHook | None = None) -> list[IngestReport]:
    """Ingest listed segments (`complete_segments`) into `store`, a `LogStore` or a `PostgresStore`,
    in order; `ingest_folder` explains `transaction_rows` and `retry_failed`. Several calls may run at
    once on a PostgreSQL store, over the same segments or not: see `store.postgres`."""
    with store_writer(store) as writer:
        return _ingest_paths(writer, sources, _after_stage, transaction_rows, retry_failed)


def deal_segments(sources: Sequence[SegmentSource], workers: int) -> list[list[SegmentSource]]:
    """`sources` dealt round-robin into at most `workers` non-empty batches for `ingest_segments` calls
    at once: each batch holds segments of every replica folder, so the batches finish together."""
    workers = max(1, min(int(workers), len(sources)))
    return [list(sources[index::workers]) for index in range(workers)] if sources else []


def _is_segment(path: Path) -> bool:
    return path.suffix == ".parquet" and not path.name.startswith(".") and path.is_file()


def complete_segments(folder: str | Path, *, endpoint_url: str | None = None) -> list[SegmentSource]:
    """The renamed (complete) `*.parquet` segments of `folder` and of its replica sub-folders.

    Top-level segments come first, by name, then each sub-folder's by name, sub-folders by name.
    Temporary and hidden names, open streams (`*.arrows.partial`), deeper folders and the
    `quarantine/` folder never match. An `s3://bucket/prefix` location lists the objects under the
    prefix the same way (`store.segment_sources.object_segments`, at `endpoint_url`).
    """
    if is_object_url(folder):
        from store.segment_sources import object_segments

        return object_segments(str(folder), endpoint_url=endpoint_url)
    def entries(path: Path) -> list[Path]:
        try:
            return sorted(path.iterdir(), key=lambda entry: entry.name)
        except (FileNotFoundError, NotADirectoryError):  # no folder yet, or a replica folder just removed
            return []

    folder = Path(folder)
    top = entries(folder)
    found = [SegmentFile(path) for path in top if _is_segment(path)]
    for replica in top:
        if replica.is_dir() and not replica.name.startswith(".") and replica.name != QUARANTINE_DIR:
            found += [SegmentFile(path, replica.name) for path in entries(replica) if _is_segment(path)]
    return found


def ingest_folder(store: LogStore, folder: str | Path | None = None, *, transaction_rows: int = 0,
                  retry_failed: bool = False, endpoint_url: str | None = None,
                  _after_stage: StageHook | None = None) -> list[IngestReport]:
    """Ingest every complete segment of `folder` (default: the feedback folder) and its replica sub-folders.

    `folder` may be an `s3://bucket/prefix` URL (at `endpoint_url`, else `LEAP_S3_ENDPOINT_URL`): the
    objects `<prefix>/<replica id>/*.parquet` are read from the bucket, each identified in the ledger
    by its `s3://bucket/key`.

    Each segment gets its own transaction unless `transaction_rows` > 0, which groups consecutive
    segments into one until they hold that many rows. That saves a commit per segment, which counts
    for a backlog of segments smaller than a row group (DuckDB's inserts of 2000-row segments ran 3x
    faster in one transaction), at the price of a crash losing the whole group's progress (never
    its data: the group's ledger rows roll back with it, so a rerun ingests the group again).
    `retry_failed` tries segments recorded `failed` again, e.g. after a fix of the ingest.
    """
    if folder is None:
        from leap_io.paths import sub_dir

        folder = sub_dir("feedback")
    segments = complete_segments(folder, endpoint_url=endpoint_url)
    return ingest_segments(store, segments, transaction_rows=transaction_rows, retry_failed=retry_failed,
                           _after_stage=_after_stage)


def totals(reports: Iterable[IngestReport]) -> dict[str, Any]:
    """Summed counts of several reports (they reconcile as each report does).

    `failed`, `unreadable` and `checksum_changed` count the segments of this run quarantined
    whole (not those skipped because an earlier run did); `not_trainable` sums the accepted rows
    of each finish reason that is not a training label.
    """
    reports = list(reports)
    not_trainable: dict[str, int] = {}
    for report in reports:
        for reason, count in report.not_trainable.items():
            not_trainable[reason] = not_trainable.get(reason, 0) + int(count)
    fresh = [report for report in reports if not report.skipped]
    return {
        "segments": len(reports),
        "skipped": sum(report.skipped for report in reports),
        "rows_read": sum(report.rows_read for report in reports),
        "accepted": sum(report.accepted for report in reports),
        "quarantined": sum(report.quarantined for report in reports),
        "duplicates": sum(report.duplicates for report in reports),
        "failed": sum(report.status == STATUS_FAILED for report in fresh),
        "unreadable": sum(report.status == STATUS_UNREADABLE for report in fresh),
        "checksum_changed": sum(report.status == STATUS_CHECKSUM_CHANGED for report in fresh),
        "not_trainable": dict(sorted(not_trainable.items())),
    }
