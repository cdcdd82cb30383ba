"""What ingest records of a segment: its status, its report, and the rows of a segment quarantined whole.

Every segment a run reaches ends with one `IngestReport` and one ledger row. `ok` segments have their
rows judged one by one (`store.validation`); `unreadable`, `failed` and `checksum_changed` segments are
quarantined whole (one quarantine row with row_index -1, a ledger row with zero counts) so later runs
skip them, while a repaired file at a path recorded `unreadable` or `failed` is ingested. `totals` sums
the reports of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from leap_io.feedback_schema import NOT_TRAINING_FINISH_REASONS
from store.protocol import StoreWriter
from store.validation import JudgedSegment, quarantine_json

STATUS_OK = "ok"
STATUS_UNREADABLE = "unreadable"
STATUS_FAILED = "failed"
STATUS_CHECKSUM_CHANGED = "checksum_changed"
STATUS_VANISHED = "vanished"  # listed, then gone before it was read: nothing to record

REASON_UNREADABLE = "unreadable_segment"
REASON_SEGMENT_ERROR = "segment_error"
REASON_CHECKSUM_CHANGED = "checksum_changed"


@dataclass
class ReadSegment:
    """A segment read from disk and judged on its own, ready for the writing connection."""

    segment: str
    checksum: str
    replica_id: str | None = None
    skip_status: str | None = None  # set when nothing is to be written: seen before, or vanished
    replaces: bool = False  # the ledger holds an earlier content that left nothing stored
    changed_from: str | None = None  # set when the ledger holds an ingested earlier content
    size_bytes: int = 0
    stamp: str | None = None  # the source's stamp when it was read, recorded with the outcome
    rows: int = 0
    judged: JudgedSegment | None = None
    error: Exception | None = None  # unreadable
    failure: Exception | None = None  # parsed, but judging it raised


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


class Crash(BaseException):
    """An exception of the test hook: it stands for the process dying, so no isolation may catch it."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


StageHook = Callable[[str], None]
"""Called inside the transaction after each write ("requests", "features", "quarantine", "ledger")."""


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def run_hook(hook: StageHook | None, name: str) -> None:
    if hook is not None:
        try:
            hook(name)
        except Exception as error:
            raise Crash(error) from error


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def write_ledger(writer: StoreWriter, report: IngestReport, now: datetime) -> None:
    writer.write_ledger(report.segment, report.checksum,
                        (report.rows_read, report.accepted, report.quarantined, report.duplicates), report.status, now)


def quarantine_whole(writer: StoreWriter, read: ReadSegment, status: str, reason: str, error: BaseException,
                      detail: Mapping[str, Any], hook: StageHook | None) -> IngestReport:
    """Record a segment none of whose rows is stored: one quarantine row (row_index -1) standing for it,
    and a ledger row with zero counts, so later runs skip it."""
    now = utc_now()
    if read.replaces:  # a repaired file replaces what its earlier version left in quarantine
        writer.clear_segment_quarantine(read.segment)
    writer.quarantine_segment(read.segment, reason, quarantine_json(dict(detail)), now)
    run_hook(hook, "quarantine")
    report = IngestReport(read.segment, read.checksum, 0, 0, 0, 0, status=status, reason=reason,
                          error=error_text(error), replica_id=read.replica_id)
    write_ledger(writer, report, now)
    run_hook(hook, "ledger")
    return report


def record_unreadable(writer: StoreWriter, read: ReadSegment, hook: StageHook | None) -> IngestReport:
    """Record a segment nothing can be read from: no row is known, so none is counted."""
    return quarantine_whole(writer, read, STATUS_UNREADABLE, REASON_UNREADABLE, read.error,
                             {"error": error_text(read.error)}, hook)


def record_failed(writer: StoreWriter, read: ReadSegment, error: BaseException, stage: str) -> IngestReport:
    """Record a segment whose processing raised: nothing of it is stored, later runs skip it."""
    rows = read.judged.n if read.judged is not None else read.rows
    return quarantine_whole(writer, read, STATUS_FAILED, REASON_SEGMENT_ERROR, error,
                             {"error": error_text(error), "stage": stage, "rows": rows, "replica_id": read.replica_id},
                             None)


def record_changed(writer: StoreWriter, read: ReadSegment) -> IngestReport:
    """Quarantine new content at the path of a segment already ingested, without ingesting any of it."""
    now = utc_now()
    detail = {"checksum": read.checksum, "ingested_checksum": read.changed_from, "size_bytes": read.size_bytes,
              "replica_id": read.replica_id}
    writer.quarantine_segment(read.segment, REASON_CHECKSUM_CHANGED, quarantine_json(detail), now)
    writer.record_changed(read.segment, read.checksum, read.changed_from, read.size_bytes, now)
    return IngestReport(read.segment, read.checksum, 0, 0, 0, 0, status=STATUS_CHECKSUM_CHANGED,
                        reason=REASON_CHECKSUM_CHANGED,
                        error=f"the segment was ingested with checksum {read.changed_from}; its content changed since",
                        replica_id=read.replica_id)


def not_trainable_counts(rows: pa.Table) -> dict[str, int]:
    """Accepted rows of each finish reason that is not a training label."""
    if not rows.num_rows:
        return {}
    counts = pc.value_counts(rows.column("finish_reason")).to_pylist()
    return {item["values"]: int(item["counts"]) for item in counts if item["values"] in NOT_TRAINING_FINISH_REASONS}


def skipped(read: ReadSegment) -> IngestReport:
    return IngestReport(read.segment, read.checksum, 0, 0, 0, 0, skipped=True, status=read.skip_status,
                        replica_id=read.replica_id)


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
