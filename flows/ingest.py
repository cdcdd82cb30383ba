"""Idempotent ingest of feedback segments into the log store.

A segment is read once, checked as a whole with Arrow / numpy kernels, and written in one
transaction: accepted rows go to `requests` and `features`, failing rows to `quarantine` with the
first reason they fail, and the ledger records the segment's checksum and counts. Every row read is
accounted for exactly once: rows_read == accepted + quarantined + duplicates. Rerunning is safe: a
segment whose (path, checksum) is in the ledger is skipped, and a request id already stored is a
duplicate, never a second row. Segments are immutable once renamed; a segment whose checksum changed
(say, an unreadable file that was repaired) is ingested again and its ledger row replaced.

While one segment is written, a helper thread already reads, checksums, parses and judges the next
(all of which release the GIL), so reading and writing overlap. The checks that depend on the store
(dims already stored, ids already stored) run on the writing connection, inside the transaction.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flows.store import FINISH_REASONS, REQUIRED_COLUMNS, SCALAR_COLUMNS, LogStore, stored_dims
from leap_io.feedback_schema import (
    META_DIM,
    META_LAYER,
    META_MODEL_FINGERPRINT,
    META_MODEL_ID,
    feedback_schema,
)

STATUS_OK = "ok"
STATUS_UNREADABLE = "unreadable"

REASON_UNREADABLE = "unreadable_segment"
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


def null_field_reason(column: str) -> str:
    return f"null_field:{column}"


def missing_column_reason(column: str) -> str:
    return f"missing_column:{column}"


def bad_column_type_reason(column: str) -> str:
    return f"bad_column_type:{column}"


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
    """What one segment contributed; for a skipped segment every count is zero."""

    segment: str
    checksum: str
    rows_read: int
    accepted: int
    quarantined: int
    duplicates: int
    skipped: bool = False
    status: str = STATUS_OK


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
    """

    def __init__(self, raw: pa.Table) -> None:
        self.raw = raw
        self.n = raw.num_rows
        metadata = raw.schema.metadata or {}
        self.dim = _metadata_value(metadata, META_DIM, int)
        self.verdicts = _Verdicts(self.n)
        self.columns: dict[str, pa.Array] = {}
        column_problems: list[str] = []
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
            column = pc.fill_null(column, pa.scalar(fallback, target))
        return column

    def _conform_feature(self, problems: list[str]) -> pa.Array:
        list_type = pa.list_(pa.float32())
        if "feature" not in self.raw.column_names:
            problems.append(missing_column_reason("feature"))
            return pa.nulls(self.n, list_type)
        feature = self.raw.column("feature").combine_chunks()
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

    def _judge_features(self) -> None:
        flag = self.verdicts.flag
        if self.dim is None:
            flag(True, REASON_MISSING_SEGMENT_DIM)
            return
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

    def feature_spaces(self) -> tuple[np.ndarray, list[tuple[str | None, int | None]]]:
        """Each row's feature space as a code into the list of distinct (fingerprint, layer) pairs."""
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
        return codes.reshape(-1), named

    def judge_against_store(self, stored_dims: Mapping[tuple[str, int], int]) -> None:
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
                "request_id": pc.if_else(pc.equal(ids, ""), pa.scalar(None, pa.string()), ids),
                "reason": pa.array(self.verdicts.reason_of(rows), pa.string()),
                # Only failing rows get here, kept whole (features too) for whoever looks into them.
                "raw": pa.array([_to_json(row) for row in self.raw.take(rows).to_pylist()], pa.string()),
            }
        )

    def accepted_rows(self, accepted: np.ndarray) -> pa.Table:
        table = pa.table({**self.columns, "feature": self.feature})
        return table if accepted.all() else table.filter(pa.array(accepted))

    def dims_by_space(self, accepted: np.ndarray) -> dict[tuple[str, int], int]:
        """The dim this segment stores for each feature space among the accepted rows."""
        if not accepted.any():
            return {}
        codes, pairs = self.feature_spaces()
        return {pairs[code]: int(self.dim) for code in np.unique(codes[accepted])}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": strict JSON has no spelling for them
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _to_json(row: dict[str, Any]) -> str:
    return json.dumps(_json_safe(row), allow_nan=False, default=str)


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stage(hook: StageHook | None, name: str) -> None:
    if hook is not None:
        hook(name)


def _insert_arrow(con: duckdb.DuckDBPyConnection, view: str, table: pa.Table, sql: str, params: list) -> None:
    con.register(view, table)
    try:
        con.execute(sql, params)
    finally:
        con.unregister(view)


def _write_ledger(con: duckdb.DuckDBPyConnection, report: IngestReport, now: datetime) -> None:
    con.execute(
        "INSERT OR REPLACE INTO ingest_ledger VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [report.segment, report.checksum, report.rows_read, report.accepted, report.quarantined,
         report.duplicates, now, report.status],
    )


def _ingest_unreadable(con: duckdb.DuckDBPyConnection, segment: str, checksum: str, error: Exception,
                       hook: StageHook | None) -> IngestReport:
    """Record a segment nothing can be read from: no row is known, so none is counted."""
    now = _now()
    con.execute(
        "INSERT INTO quarantine VALUES (?, -1, NULL, ?, ?::JSON, ?)",
        [segment, REASON_UNREADABLE, _to_json({"error": f"{type(error).__name__}: {error}"}), now],
    )
    _stage(hook, "quarantine")
    report = IngestReport(segment, checksum, 0, 0, 0, 0, status=STATUS_UNREADABLE)
    _write_ledger(con, report, now)
    _stage(hook, "ledger")
    return report


def _stored_ids(con: duckdb.DuckDBPyConnection, ids: pa.Array) -> pa.Array:
    """Those of `ids` already in the store (an index lookup per id, in one query)."""
    con.register("_incoming_ids", pa.table({"request_id": ids}))
    try:
        stored = con.sql(
            "SELECT request_id FROM _incoming_ids SEMI JOIN requests USING (request_id)"
        ).to_arrow_table().column("request_id")
    finally:
        con.unregister("_incoming_ids")
    return stored.combine_chunks()


def _ingest_table(con: duckdb.DuckDBPyConnection, segment: str, checksum: str, judged: _Segment,
                  known_dims: Mapping[tuple[str, int], int],
                  hook: StageHook | None) -> tuple[IngestReport, dict[tuple[str, int], int]]:
    """Write one judged segment; also returns the dims it stored for each feature space."""
    now = _now()
    judged.judge_against_store(known_dims)
    firsts = judged.first_occurrences()
    ids = judged.columns["request_id"]
    stored = _stored_ids(con, ids.filter(pa.array(firsts)))
    accepted = firsts & ~_mask(pc.is_in(ids, value_set=stored)) if len(stored) else firsts

    rows = judged.accepted_rows(accepted)
    columns = ", ".join(SCALAR_COLUMNS)
    _insert_arrow(con, "_incoming_requests", rows.select(list(SCALAR_COLUMNS)),
                  f"INSERT INTO requests ({columns}, segment, ingested_at) "
                  f"SELECT {columns}, ?, ? FROM _incoming_requests", [segment, now])
    _stage(hook, "requests")
    _insert_arrow(con, "_incoming_features", rows.select(["request_id", "layer", "model_fingerprint", "feature"]),
                  "INSERT INTO features (request_id, dim, layer, model_fingerprint, feature) "
                  "SELECT request_id, ?, layer, model_fingerprint, feature FROM _incoming_features",
                  [judged.dim])
    _stage(hook, "features")
    quarantine = judged.quarantine_rows(segment)
    if quarantine.num_rows:
        _insert_arrow(con, "_incoming_quarantine", quarantine,
                      "INSERT INTO quarantine SELECT segment, row_index, request_id, reason, raw::JSON, ? "
                      "FROM _incoming_quarantine", [now])
    _stage(hook, "quarantine")

    n_accepted = int(accepted.sum())
    n_quarantined = quarantine.num_rows
    report = IngestReport(segment, checksum, judged.n, n_accepted, n_quarantined,
                          judged.n - n_accepted - n_quarantined)
    _write_ledger(con, report, now)
    _stage(hook, "ledger")
    return report, judged.dims_by_space(accepted)


@dataclass
class _ReadSegment:
    """A segment read from disk and judged on its own, ready for the writing connection."""

    segment: str
    checksum: str
    seen_status: str | None = None  # set when the ledger already holds this exact file
    judged: _Segment | None = None
    error: Exception | None = None


def _read_segment(path: Path, ledger: Mapping[str, tuple[str, str]]) -> _ReadSegment:
    """Read, checksum, parse and judge one segment; runs on the read-ahead thread (no store access).

    `ledger` maps each segment already ingested to (checksum, status), as it was when the
    writing connection opened: only that connection writes, and each path comes once per run.
    """
    segment = str(path.resolve())
    data = path.read_bytes()
    checksum = _checksum(data)
    seen = ledger.get(segment)
    if seen is not None and seen[0] == checksum:
        return _ReadSegment(segment, checksum, seen_status=seen[1])
    try:
        # One thread: the feature column is nearly all the bytes and decodes on one thread anyway,
        # while Arrow's pool would take cores from the writing thread and DuckDB.
        raw = pq.read_table(pa.BufferReader(data), use_threads=False)
    except (pa.ArrowException, OSError, ValueError) as error:
        return _ReadSegment(segment, checksum, error=error)
    return _ReadSegment(segment, checksum, judged=_Segment(raw))


def _write_segment(con: duckdb.DuckDBPyConnection, read: _ReadSegment, replaces: bool,
                   known_dims: Mapping[tuple[str, int], int],
                   hook: StageHook | None) -> tuple[IngestReport, dict[tuple[str, int], int]]:
    """Write one read segment inside the open transaction; `replaces` an earlier version of it."""
    if replaces:  # a changed segment replaces what an earlier version of it left in quarantine
        con.execute("DELETE FROM quarantine WHERE segment = ?", [read.segment])
    if read.judged is None:
        return _ingest_unreadable(con, read.segment, read.checksum, read.error, hook), {}
    return _ingest_table(con, read.segment, read.checksum, read.judged, known_dims, hook)


def _ingest_paths(con: duckdb.DuckDBPyConnection, paths: Sequence[Path], hook: StageHook | None,
                  transaction_rows: int = 0) -> list[IngestReport]:
    """Ingest `paths` in order, reading the next segment while writing this one.

    A transaction holds one segment, or consecutive segments until they hold `transaction_rows`
    rows. Either way a crash rolls back whole segments together with their ledger rows, so a rerun
    ingests exactly what is missing.
    """
    ledger = {segment: (checksum, status) for segment, checksum, status
              in con.execute("SELECT segment, checksum, status FROM ingest_ledger").fetchall()}
    known_dims = stored_dims(con)
    pending_dims: dict[tuple[str, int], int] = {}  # written by the open transaction
    reports: list[IngestReport] = []
    rows_in_transaction, in_transaction = 0, False
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="leap-ingest-read") as reader:
        ahead: Future | None = reader.submit(_read_segment, paths[0], ledger) if paths else None
        try:
            for index in range(len(paths)):
                read = ahead.result()
                ahead = reader.submit(_read_segment, paths[index + 1], ledger) if index + 1 < len(paths) else None
                if read.seen_status is not None:
                    reports.append(IngestReport(read.segment, read.checksum, 0, 0, 0, 0, skipped=True,
                                                status=read.seen_status))
                    continue
                if not in_transaction:
                    con.execute("BEGIN TRANSACTION")
                    in_transaction = True
                report, dims = _write_segment(con, read, read.segment in ledger, {**known_dims, **pending_dims},
                                              hook)
                reports.append(report)
                pending_dims.update(dims)
                rows_in_transaction += report.rows_read
                if rows_in_transaction >= transaction_rows:
                    con.execute("COMMIT")
                    in_transaction, rows_in_transaction = False, 0
                    known_dims.update(pending_dims)
                    pending_dims.clear()
            if in_transaction:
                con.execute("COMMIT")
        except BaseException:
            if in_transaction:
                with suppress(duckdb.Error):
                    con.execute("ROLLBACK")
            if ahead is not None:
                ahead.cancel()
            raise
    return reports


def ingest_segment(store: LogStore, path: str | Path, *, _after_stage: StageHook | None = None) -> IngestReport:
    """Ingest one complete segment in one transaction; a crash part-way leaves nothing of it."""
    with store.connect() as con:
        return _ingest_paths(con, [Path(path)], _after_stage)[0]


def complete_segments(folder: str | Path) -> list[Path]:
    """The renamed (complete) `*.parquet` segments of `folder`, by name; temporary names never match."""
    return sorted(
        (path for path in Path(folder).glob("*.parquet") if path.is_file() and not path.name.startswith(".")),
        key=lambda path: path.name,
    )


def ingest_folder(store: LogStore, folder: str | Path | None = None, *, transaction_rows: int = 0,
                  _after_stage: StageHook | None = None) -> list[IngestReport]:
    """Ingest every complete segment of `folder` (default: the feedback folder).

    Each segment gets its own transaction unless `transaction_rows` > 0, which groups consecutive
    segments into one until they hold that many rows. That saves a commit per segment, which counts
    for a backlog of segments smaller than a row group (DuckDB's inserts of 2000-row segments ran 3x
    faster in one transaction), at the price of a crash losing the whole group's progress (never
    its data: the group's ledger rows roll back with it, so a rerun ingests the group again).
    """
    if folder is None:
        from leap_io.paths import sub_dir

        folder = sub_dir("feedback")
    segments = complete_segments(folder)
    with store.connect() as con:
        return _ingest_paths(con, segments, _after_stage, transaction_rows)


def totals(reports: Iterable[IngestReport]) -> dict[str, int]:
    """Summed counts of several reports (they reconcile as each report does)."""
    reports = list(reports)
    return {
        "segments": len(reports),
        "skipped": sum(report.skipped for report in reports),
        "rows_read": sum(report.rows_read for report in reports),
        "accepted": sum(report.accepted for report in reports),
        "quarantined": sum(report.quarantined for report in reports),
        "duplicates": sum(report.duplicates for report in reports),
    }
