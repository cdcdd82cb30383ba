"""Idempotent ingest of feedback segments into the log store.

A segment is read once, checked as a whole with Arrow / numpy kernels, and written in one
transaction: accepted rows go to `requests` and `features`, failing rows to `quarantine` with the
first reason they fail, and the ledger records the segment's checksum and counts. Every row read is
accounted for exactly once: rows_read == accepted + quarantined + duplicates. Rerunning is safe: a
segment whose (path, checksum) is in the ledger is skipped, and a request id already stored is a
duplicate, never a second row. Segments are immutable once renamed; a segment whose checksum changed
(say, an unreadable file that was repaired) is ingested again and its ledger row replaced.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
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
from serving.feedback_schema import (
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
    """The first failing reason of each row, as a small integer code into `reasons`."""

    def __init__(self, n: int) -> None:
        self.codes = np.zeros(n, dtype=np.int32)
        self.reasons: list[str | None] = [None]

    def flag(self, failing: np.ndarray | bool, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)
        code = self.reasons.index(reason)
        self.codes[(self.codes == 0) & failing] = code

    @property
    def passing(self) -> np.ndarray:
        return self.codes == 0


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
    """One segment's rows conformed to the feedback schema and judged row by row, without row loops."""

    def __init__(self, raw: pa.Table, known_dims: dict[tuple[str, int], int]) -> None:
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
        self._judge(column_problems, known_dims)

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
                else:
                    column = pc.cast(column, target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                problems.append(bad_column_type_reason(name))
                column = pa.nulls(self.n, pa.float64() if name in _TOKEN_COLUMNS else target)
        if fallback is not None:
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
        try:
            return pc.cast(feature, target) if feature.type != target else feature
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            problems.append(bad_column_type_reason("feature"))
            return pa.nulls(self.n, list_type)

    def _judge(self, column_problems: list[str], known_dims: dict[tuple[str, int], int]) -> None:
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

        self._judge_features(known_dims)

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

    def _judge_features(self, known_dims: dict[tuple[str, int], int]) -> None:
        flag = self.verdicts.flag
        if self.dim is None:
            flag(True, REASON_MISSING_SEGMENT_DIM)
            return
        lengths = pc.fill_null(pc.list_value_length(self.feature), -1).to_numpy(zero_copy_only=False)
        flag(lengths != self.dim, REASON_FEATURE_WRONG_DIM)

        keys = pa.table({"fp": self.columns["model_fingerprint"], "layer": self.columns["layer"]})
        pairs = keys.group_by(["fp", "layer"]).aggregate([]).to_pylist()
        for pair in pairs:
            stored = known_dims.get((pair["fp"], pair["layer"]))
            if stored is not None and stored != self.dim:
                in_pair = _mask(pc.and_(pc.equal(keys["fp"], pair["fp"]), pc.equal(keys["layer"], pair["layer"])))
                flag(in_pair, REASON_FEATURE_DIM_CONFLICT)

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

    def first_occurrences(self) -> np.ndarray:
        """Passing rows that are the first passing row with their request id (first wins)."""
        passing = np.flatnonzero(self.verdicts.passing)
        ids = self.columns["request_id"].take(passing)
        firsts = pa.table({"id": ids, "row": passing}).group_by("id").aggregate([("row", "min")])
        mask = np.zeros(self.n, dtype=bool)
        mask[firsts.column("row_min").to_numpy()] = True
        return mask

    def quarantine_rows(self, segment: str) -> pa.Table:
        rows = np.flatnonzero(~self.verdicts.passing)
        raw_rows = self.raw.take(rows).to_pylist()
        reasons = np.array(self.verdicts.reasons, dtype=object)[self.verdicts.codes[rows]]
        ids = self.columns["request_id"].take(rows)
        return pa.table(
            {
                "segment": pa.array([segment] * len(rows), pa.string()),
                "row_index": pa.array(rows, pa.int64()),
                "request_id": pc.if_else(pc.equal(ids, ""), pa.scalar(None, pa.string()), ids),
                "reason": pa.array(reasons.tolist(), pa.string()),
                "raw": pa.array([_to_json(row) for row in raw_rows], pa.string()),
            }
        )

    def accepted_rows(self, accepted: np.ndarray) -> pa.Table:
        table = pa.table({**self.columns, "feature": self.feature})
        return table.filter(pa.array(accepted))


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


def _ingest_table(con: duckdb.DuckDBPyConnection, segment: str, checksum: str, raw: pa.Table,
                  hook: StageHook | None) -> IngestReport:
    now = _now()
    judged = _Segment(raw, stored_dims(con))
    firsts = judged.first_occurrences()
    ids = judged.columns["request_id"]
    con.register("_incoming_ids", pa.table({"request_id": ids.filter(pa.array(firsts))}))
    try:
        stored = con.sql(
            "SELECT request_id FROM _incoming_ids SEMI JOIN requests USING (request_id)"
        ).to_arrow_table().column("request_id")
    finally:
        con.unregister("_incoming_ids")
    accepted = firsts & ~_mask(pc.is_in(ids, value_set=stored.combine_chunks()))

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
    return report


def _ingest(con: duckdb.DuckDBPyConnection, path: Path, hook: StageHook | None) -> IngestReport:
    segment = str(path.resolve())
    data = path.read_bytes()
    checksum = _checksum(data)
    seen = con.execute("SELECT checksum, status FROM ingest_ledger WHERE segment = ?", [segment]).fetchone()
    if seen is not None and seen[0] == checksum:
        return IngestReport(segment, checksum, 0, 0, 0, 0, skipped=True, status=seen[1])
    try:
        raw: pa.Table | None = pq.read_table(pa.BufferReader(data))
        error = None
    except (pa.ArrowException, OSError, ValueError) as exc:
        raw, error = None, exc

    con.execute("BEGIN TRANSACTION")
    try:
        # A changed segment replaces what an earlier version of it left in quarantine.
        con.execute("DELETE FROM quarantine WHERE segment = ?", [segment])
        if raw is None:
            report = _ingest_unreadable(con, segment, checksum, error, hook)
        else:
            report = _ingest_table(con, segment, checksum, raw, hook)
        con.execute("COMMIT")
    except BaseException:
        with suppress(duckdb.Error):
            con.execute("ROLLBACK")
        raise
    return report


def ingest_segment(store: LogStore, path: str | Path, *, _after_stage: StageHook | None = None) -> IngestReport:
    """Ingest one complete segment in one transaction; a crash part-way leaves nothing of it."""
    with store.connect() as con:
        return _ingest(con, Path(path), _after_stage)


def complete_segments(folder: str | Path) -> list[Path]:
    """The renamed (complete) `*.parquet` segments of `folder`, by name; temporary names never match."""
    return sorted(
        (path for path in Path(folder).glob("*.parquet") if path.is_file() and not path.name.startswith(".")),
        key=lambda path: path.name,
    )


def ingest_folder(store: LogStore, folder: str | Path | None = None, *,
                  _after_stage: StageHook | None = None) -> list[IngestReport]:
    """Ingest every complete segment of `folder` (default: the feedback folder), one transaction each."""
    if folder is None:
        from serving.paths import sub_dir

        folder = sub_dir("feedback")
    segments = complete_segments(folder)
    with store.connect() as con:
        return [_ingest(con, path, _after_stage) for path in segments]


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
