"""Idempotent ingest of feedback segments into the log store.

A segment is read once, checked as a whole (`store.validation`) and written in one transaction: accepted
rows to `requests` and `features`, failing rows to `quarantine` with their first reason, and a ledger
row with the checksum and counts, so every row read is accounted for exactly once and a rerun never
stores a row twice. A run costs what is new: a segment whose stamp is unchanged since it was checked is
skipped unread. Segments are isolated: a bad one is quarantined whole (`store.ingest_outcomes`), while
errors of the environment (a full disk, a lost connection) end the run. Which files and objects are
read, and how reading overlaps writing: docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from leap_io.feedback_schema import META_REPLICA_ID
from leap_io.s3_locations import is_object_url
from store.ingest_outcomes import (
    REASON_CHECKSUM_CHANGED,
    REASON_SEGMENT_ERROR,
    REASON_UNREADABLE,
    STATUS_CHECKSUM_CHANGED,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_UNREADABLE,
    STATUS_VANISHED,
    Crash,
    IngestReport,
    ReadSegment,
    StageHook,
    not_trainable_counts,
    record_changed,
    record_failed,
    record_unreadable,
    run_hook,
    skipped,
    totals,
    utc_now,
    write_ledger,
)
from store.protocol import Ledger, SpaceKey, Stamps, Store, StoreWriter
from store.row_masks import rows_where
from store.validation import JudgedSegment

__all__ = [  # the outcomes' names too: callers take the whole ingest API from here
    "REASON_CHECKSUM_CHANGED",
    "REASON_SEGMENT_ERROR",
    "REASON_UNREADABLE",
    "STATUS_CHECKSUM_CHANGED",
    "STATUS_FAILED",
    "STATUS_OK",
    "STATUS_UNREADABLE",
    "IngestReport",
    "SegmentFile",
    "SegmentSource",
    "complete_segments",
    "deal_segments",
    "ingest_folder",
    "ingest_segment",
    "ingest_segments",
    "totals",
]

_WRITER_NAME = re.compile(r"^feedback-\d{8}T\d{6}-(?P<replica>.+)-\d{6}-[0-9a-f]+\.parquet$")
"""A segment name as serving.feedback.writer.FeedbackWriter makes it; the replica id sits between fixed fields."""

QUARANTINE_DIR = "quarantine"
"""A sub-folder of the feedback folder that ingest never reads (the writer sets bad files aside there)."""


def _checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ingest_table(writer: StoreWriter, read: ReadSegment, known_dims: Mapping[SpaceKey, int],
                  hook: StageHook | None) -> tuple[IngestReport, dict[SpaceKey, int]]:
    """Write one judged segment; also returns the dims it stored for each feature space."""
    segment, judged = read.segment, read.judged
    now = utc_now()
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
    run_hook(hook, "requests")
    writer.insert_features(rows, inserted, judged.dim or 0, judged.recipe)
    run_hook(hook, "features")
    quarantine = judged.quarantine_rows(segment)
    if quarantine.num_rows:
        writer.insert_quarantine(quarantine, now)
    run_hook(hook, "quarantine")

    accepted = np.zeros(judged.n, dtype=bool)
    accepted[np.flatnonzero(firsts)[inserted]] = True
    dims = judged.dims_by_space(accepted)
    writer.release_spaces(dims)
    n_accepted = int(accepted.sum())
    n_quarantined = quarantine.num_rows
    stored = rows_where(rows, inserted)
    report = IngestReport(segment, read.checksum, judged.n, n_accepted, n_quarantined,
                          judged.n - n_accepted - n_quarantined, not_trainable=not_trainable_counts(stored),
                          replica_id=read.replica_id)
    write_ledger(writer, report, now)
    run_hook(hook, "ledger")
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

    def remove(self) -> None:
        """Delete the segment (`store.retention`, once all its rows are stored)."""
        ...


def stamp_of(source: SegmentSource) -> str | None:
    """What the source says of its content without reading it (`stamp`); None when it cannot say."""
    try:
        stamp = getattr(source, "stamp", None)
    except OSError:  # gone since it was listed: reading it says so
        return None
    return stamp if isinstance(stamp, str) and stamp else None


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

    @property
    def stamp(self) -> str:
        """Size, modification time and inode: a rewrite or a replacing rename changes it."""
        info = self.path.stat()
        return f"file:{info.st_size}:{info.st_mtime_ns}:{info.st_ino}"

    def remove(self) -> None:
        self.path.unlink()


def _read_segment(source: SegmentSource, ledger: Ledger, changed: set[tuple[str, str]], retry_failed: bool,
                  run_errors: tuple[type[BaseException], ...], stamps: Stamps | None = None) -> ReadSegment:
    """Read, checksum, parse and judge one segment; runs on the read-ahead thread (no store access).

    `ledger` maps each segment already ingested to (checksum, status), `changed` holds the
    (segment, checksum) contents already quarantined as changed, and `stamps` each checked segment's
    stamp, as they were when the writing connection opened: only that connection writes, and each
    path comes once per run. A segment whose stamp is unchanged is not read. `run_errors` end the run
    instead of marking the segment unreadable or failed (`_run_errors`).
    """
    replica = source.replica_id
    segment = source.segment
    stamp = stamp_of(source)
    known = (stamps or {}).get(segment) if stamp is not None else None
    if known is not None and known[0] == stamp and not (retry_failed and known[2] == STATUS_FAILED):
        return ReadSegment(segment, known[1], replica, skip_status=known[2])  # stamp already recorded
    try:
        data = source.read_bytes()
    except FileNotFoundError:
        return ReadSegment(segment, "", replica, skip_status=STATUS_VANISHED)
    checksum = _checksum(data)
    seen = ledger.get(segment)
    if seen is not None and seen[0] == checksum and not (retry_failed and seen[1] == STATUS_FAILED):
        return ReadSegment(segment, checksum, replica, skip_status=seen[1], stamp=stamp)
    if (segment, checksum) in changed:
        return ReadSegment(segment, checksum, replica, skip_status=STATUS_CHECKSUM_CHANGED, stamp=stamp)
    read = ReadSegment(segment, checksum, replica, size_bytes=len(data), replaces=seen is not None, stamp=stamp)
    if seen is not None and seen[1] == STATUS_OK:
        read.replaces, read.changed_from = False, seen[0]
        return read
    try:
        # One thread: the feature column is nearly all the bytes and decodes on one thread anyway,
        # while Arrow's pool would take cores from the writing thread and DuckDB. `ParquetFile`, not
        # `read_table`: one file needs no dataset layer, whose first use costs a process 0.3 s.
        raw = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False)
    except run_errors:
        raise
    except Exception as error:
        read.error = error
        return read
    read.rows = raw.num_rows
    if read.replica_id is None:
        read.replica_id = _replica_of(source.name, raw.schema.metadata or {})
    try:
        read.judged = JudgedSegment(raw)
    except run_errors:
        raise
    except Exception as error:
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


def _as_claimed(read: ReadSegment, seen: tuple[str, str] | None, changed: bool, retry_failed: bool) -> ReadSegment:
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


def _write_segment(writer: StoreWriter, read: ReadSegment, known_dims: Mapping[SpaceKey, int],
                   hook: StageHook | None, retry_failed: bool = False) -> tuple[IngestReport, dict[SpaceKey, int]]:
    """Write one read segment inside the open transaction (raises if writing it fails), and its stamp."""
    report, dims = _write_outcome(writer, read, known_dims, hook, retry_failed)
    if read.stamp is not None:
        writer.write_stamp(read.segment, read.stamp, read.checksum, report.status)
    return report, dims


def _write_outcome(writer: StoreWriter, read: ReadSegment, known_dims: Mapping[SpaceKey, int],
                   hook: StageHook | None, retry_failed: bool) -> tuple[IngestReport, dict[SpaceKey, int]]:
    if writer.concurrent:
        read = _as_claimed(read, *writer.claim(read.segment, read.checksum), retry_failed)
        if read.skip_status is not None:
            return skipped(read), {}
    if read.changed_from is not None:
        return record_changed(writer, read), {}
    if read.failure is not None:
        return record_failed(writer, read, read.failure, "judge"), {}
    if read.judged is None:
        return record_unreadable(writer, read, hook), {}
    return _ingest_table(writer, read, known_dims, hook)


def _run_errors(writer: StoreWriter) -> tuple[type[BaseException], ...]:
    """Errors of the environment, not of a segment: they end the run instead of quarantining the segment."""
    return (MemoryError, *writer.environment_errors)


def _write_alone(writer: StoreWriter, read: ReadSegment, known_dims: dict[SpaceKey, int],
                 hook: StageHook | None, retry_failed: bool = False) -> IngestReport:
    """Write one segment in a transaction of its own; if writing it raises, record it failed instead."""
    writer.begin()
    try:
        report, dims = _write_segment(writer, read, known_dims, hook, retry_failed)
        writer.commit()
    except (Crash, *_run_errors(writer)):
        writer.rollback()
        raise
    except Exception as error:
        writer.rollback()
        writer.begin()
        try:
            if writer.concurrent:  # hold the segment while recording it, as a write would
                read = _as_claimed(read, *writer.claim(read.segment, read.checksum), retry_failed)
            if read.skip_status is not None:
                report, dims = skipped(read), {}
            else:
                report, dims = record_failed(writer, read, error, "write"), {}
            if read.stamp is not None:
                writer.write_stamp(read.segment, read.stamp, read.checksum, report.status)
            writer.commit()
        except BaseException:
            writer.rollback()
            raise
    known_dims.update(dims)
    return report


def _record_stamps(writer: StoreWriter, reads: Sequence[ReadSegment]) -> None:
    """Record the stamps of segments skipped by their checksum, in one short transaction (in segment
    order, so concurrent runs never deadlock). Losing them costs one more read of each next run."""
    if not reads:
        return
    writer.begin()
    try:
        for read in sorted(reads, key=lambda item: item.segment):
            writer.write_stamp(read.segment, str(read.stamp), read.checksum, str(read.skip_status))
        writer.commit()
    except BaseException:
        writer.rollback()
        raise


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
    stamps = writer.stamps()
    unstamped: list[ReadSegment] = []  # skipped by their checksum: their stamps are recorded at the end
    run_errors = _run_errors(writer)
    pending_dims: dict[SpaceKey, int] = {}  # written by the open transaction
    reports: list[IngestReport] = []
    group: list[tuple[ReadSegment, int]] = []  # segments written in the open transaction, with their report's index
    rows_in_transaction = 0

    def read_ahead(index: int) -> Future | None:
        if index >= len(sources):
            return None
        return reader.submit(_read_segment, sources[index], ledger, changed, retry_failed, run_errors, stamps)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="leap-ingest-read") as reader:
        ahead = read_ahead(0)
        try:
            for index in range(len(sources)):
                read = ahead.result()
                ahead = read_ahead(index + 1)
                if read.skip_status is not None:
                    if read.skip_status != STATUS_VANISHED:
                        reports.append(skipped(read))
                    if read.stamp is not None and read.skip_status != STATUS_VANISHED:
                        unstamped.append(read)
                    continue
                if not group:
                    writer.begin()
                group.append((read, len(reports)))
                try:
                    report, dims = _write_segment(writer, read, {**known_dims, **pending_dims}, hook, retry_failed)
                except (Crash, *run_errors):
                    raise
                except Exception:
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
            _record_stamps(writer, unstamped)
        except BaseException as error:
            if group:
                writer.rollback()
            if ahead is not None:
                ahead.cancel()
            if isinstance(error, Crash):
                raise error.error from None
            raise
    return reports


def ingest_segment(store: Store, path: str | Path, *, replica_id: str | None = None,
                   _after_stage: StageHook | None = None) -> IngestReport:
    """Ingest one complete segment in one transaction; a crash part-way leaves nothing of it."""
    return ingest_segments(store, [SegmentFile(Path(path), replica_id)], _after_stage=_after_stage)[0]


def ingest_segments(store: Store, sources: Sequence[SegmentSource], *, transaction_rows: int = 0,
                    retry_failed: bool = False, _after_stage: StageHook | None = None) -> list[IngestReport]:
    """Ingest listed segments (`complete_segments`) into `store`, a `LogStore` or a `PostgresStore`,
    in order; `ingest_folder` explains `transaction_rows` and `retry_failed`. Several calls may run at
    once on a PostgreSQL store, over the same segments or not: see `store.postgres_writer`."""
    with store.segment_writer() as writer:
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


def ingest_folder(store: Store, folder: str | Path | None = None, *, transaction_rows: int = 0,
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


