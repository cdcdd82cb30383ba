"""Append-only feedback segments: one Parquet row per finished request, written exactly once.

Rows go to a writer thread so the scheduler never waits on the disk; the files it writes are
`serving.feedback.segments`'. Nothing a caller passes can stop the writer: each row is converted on its
own (`serving.feedback.rows`) and a misfit row is quarantined with its reason. The backlog is bounded
(overflow dropped and counted), rows that cannot be written are retried, and `flush()` raises unless
everything accepted before it is in a closed segment or quarantined.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from leap_io.feedback_schema import feedback_schema, segment_metadata
from serving.feedback.rows import BadRow, BatchBreaker, Converted, RowConverter, quarantine_line
from serving.feedback.segments import QuarantineFull, SegmentError, SegmentFiles, default_replica_id, is_disk_full
from serving.supervise import SupervisedThread

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_ROWS = 100_000
DEFAULT_MAX_QUEUE_BYTES = 1 << 30  # the backlog's features, whatever the dim
DEFAULT_MAX_QUARANTINE_BYTES = 64 << 20
DEFAULT_ORPHAN_AGE_S = 3600.0
_MAX_BATCH_ROWS = 1024  # rows per record batch when a backlog is written out

# Drop reasons (rows accepted by nobody; counted, never silent).
DROP_QUEUE_FULL = "queue_full"  # the writer is slower than the rows come
DROP_DISK_FULL = "disk_full"  # the backlog is full because the disk is (ENOSPC)
DROP_WRITE_FAILED = "write_failed"  # the backlog is full because writes fail for another reason
DROP_WRITER_DEAD = "writer_dead"  # the writer thread is gone
DROP_CLOSED = "closed"  # written after close()
DROP_QUARANTINE_FULL = "quarantine_full"  # a bad row, and the quarantine folder is at its cap
DROP_QUARANTINE_FAILED = "quarantine_write_failed"  # a bad row that could not be quarantined
DROP_UNWRITTEN_AT_CLOSE = "unwritten_at_close"  # still in the backlog when close() gave up


class FeedbackFlushError(RuntimeError):
    """flush() could not put every row accepted before it into a closed Parquet segment."""


class _Control:
    def __init__(self, kind: str) -> None:
        self.kind = kind  # "flush" or "close"
        self.done = threading.Event()
        self.error: str | None = None


class FeedbackWriter:
    """Writes finished-request rows to rotating segments from a supervised background thread."""

    def __init__(self, folder: str | Path, dim: int, layer: int, model_id: str, fingerprint: str,
                 max_rows: int = 5000, max_seconds: float = 300.0, flush_rows: int = 64,
                 flush_seconds: float = 0.05, *, replica_id: str | None = None,
                 max_queue_rows: int = DEFAULT_MAX_QUEUE_ROWS, max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 max_quarantine_bytes: int = DEFAULT_MAX_QUARANTINE_BYTES,
                 orphan_age_s: float = DEFAULT_ORPHAN_AGE_S, lock_wait_s: float = 5.0,
                 recipe: str | None = None) -> None:
        if max_queue_rows < 1 or max_rows < 1 or flush_rows < 1:
            raise ValueError("max_queue_rows, max_rows and flush_rows must be >= 1")
        self.files = SegmentFiles(folder, replica_id or default_replica_id(), lock_wait_s=lock_wait_s,
                                  orphan_age_s=max(orphan_age_s, 2 * max_seconds + 60.0),
                                  max_quarantine_bytes=max_quarantine_bytes, retry_base_s=flush_seconds)
        self.root, self.replica_id = self.files.root, self.files.replica_id
        self.replica_dir, self.quarantine_dir = self.files.replica_dir, self.files.quarantine_dir
        self.schema = feedback_schema(dim).with_metadata(
            segment_metadata(dim, layer, model_id, fingerprint, replica_id=self.replica_id, recipe=recipe))
        self._convert = RowConverter(self.schema)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        row_bytes = 4 * dim + 1024
        self.capacity = max(1, min(max_queue_rows, max_queue_bytes // row_bytes))
        self.max_quarantine_bytes = max_quarantine_bytes

        # counters: written by the writer thread, read anywhere (ints are atomic enough to read)
        self.rows_written = 0
        self.rows_quarantined = 0
        self._errors = 0
        self._drops: Counter[str] = Counter()

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._rows: deque[Any] = deque()
        self._controls: deque[_Control] = deque()
        self._current: list[_Control] = []  # the controls the thread is handling now
        self._backlog = 0  # accepted rows not yet written, quarantined or dropped
        self._closing = False
        self._pending: list[Converted] = []  # converted, waiting for the disk
        self._last_flush = time.monotonic()
        self._thread = SupervisedThread("leap-feedback", self._run).start()

    # -- counts of the files -----------------------------------------------------------------------
    @property
    def errors(self) -> int:
        """Errors the writer survived: of its own, and of its files."""
        return self._errors + self.files.errors

    @property
    def segments_closed(self) -> int:
        return self.files.segments_closed

    @property
    def recovered_rows(self) -> int:
        """Rows of this replica's crashed segment recovered at start."""
        return self.files.recovered_rows

    @property
    def adopted_rows(self) -> int:
        """Rows of dead replicas' stale segments adopted at start."""
        return self.files.adopted_rows

    @property
    def torn_segments(self) -> int:
        return self.files.torn_segments

    # -- the caller's side ---------------------------------------------------------------------
    def write(self, row: dict[str, Any]) -> bool:
        """Queue one finished request's row; never blocks, never raises. False when it was dropped."""
        with self._lock:
            if self._closing:
                self._drops[DROP_CLOSED] += 1
                return False
            if self._backlog >= self.capacity or not self._thread.alive:
                self._drops[self._overflow_reason()] += 1
                return False
            self._rows.append(row)
            self._backlog += 1
            self._wake.notify()
        return True

    def flush(self, timeout: float = 10.0) -> dict[str, Any]:
        """Close the open segment now so every row accepted so far is readable as Parquet.

        Returns stats() when that is done; raises FeedbackFlushError when it is not (rows still waiting
        for the disk, a segment not converted, the writer gone, or the timeout passed).
        """
        control = self._submit("flush")
        if control is None:
            raise FeedbackFlushError("the feedback writer is closed or its thread is dead; nothing was flushed")
        if not control.done.wait(timeout):
            raise FeedbackFlushError(f"flush did not finish within {timeout:.1f}s; {self._backlog} rows are "
                                     f"still waiting ({self._last_error or 'the writer is busy'})")
        if control.error:
            raise FeedbackFlushError(control.error)
        return self.stats()

    def close(self, timeout: float = 30.0) -> bool:
        """Flush everything, close the open segment as Parquet and stop the thread; False if rows are left."""
        control = self._submit("close")
        clean = False
        if control is not None:
            clean = control.done.wait(timeout) and not control.error
            if control.error:
                logger.error("feedback: close left work undone: %s", control.error)
        self._thread.join(timeout if control is None else 1.0)
        if self._thread.alive:
            logger.error("feedback: writer thread did not stop within %.1fs (%d rows unwritten)", timeout,
                         self._backlog)
        else:
            self.files.release()
        return clean

    def stats(self) -> dict[str, Any]:
        """Counters for the runtime and /metrics (keys are stable)."""
        with self._lock:
            drops = dict(self._drops)
            depth = self._backlog
        disk_errno = self.files.disk_errno
        return {"rows_written": self.rows_written, "rows_dropped": sum(drops.values()), "drop_reasons": drops,
                "rows_quarantined": self.rows_quarantined, "queue_depth": depth,
                "alive": self._thread.alive, "errors": self.errors,
                "disk_full": disk_errno == errno.ENOSPC, "writing_fails": disk_errno is not None,
                "last_error": self.files.last_error}

    def healthy(self) -> bool:
        """The writer thread runs and takes rows (a full disk is visible in stats(), not here)."""
        return self._thread.alive and not self._closing

    # -- the thread ------------------------------------------------------------------------------
    def _submit(self, kind: str) -> _Control | None:
        with self._lock:
            if self._closing or not self._thread.alive:
                return None
            control = _Control(kind)
            self._controls.append(control)
            if kind == "close":
                self._closing = True
            self._wake.notify()
            return control

    def _overflow_reason(self) -> str:
        if not self._thread.alive:
            return DROP_WRITER_DEAD
        if self.files.disk_errno == errno.ENOSPC:
            return DROP_DISK_FULL
        if self.files.disk_errno is not None:
            return DROP_WRITE_FAILED
        return DROP_QUEUE_FULL

    def _run(self) -> None:
        while True:
            try:
                if self._step():
                    return
            except Exception as exc:  # a bug, not a bad row or a disk error: count it and carry on
                self._errors += 1
                self.files.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("feedback: writer step failed; continuing")
                controls, self._current = self._current, []
                for control in controls:  # whoever waits learns at once that it did not happen
                    control.error = f"the feedback writer failed while handling it: {self.files.last_error}"
                    control.done.set()
                if any(control.kind == "close" for control in controls):
                    with contextlib.suppress(Exception):
                        self._abandon_at_close()
                    return
                time.sleep(min(self.flush_seconds, 1.0))

    def _step(self) -> bool:
        with self._lock:
            if not self._rows and not self._controls:
                self._wake.wait(self._wait_s())
            rows = list(self._rows)
            self._rows.clear()
            controls = list(self._controls)
            self._controls.clear()
        self._current = controls
        bad: list[tuple[Any, str]] = []
        for row in rows:
            try:
                self._pending.append(self._convert.convert(row))
            except BadRow as exc:
                bad.append((row, str(exc)))
            except Exception as exc:
                bad.append((row, f"row did not convert: {type(exc).__name__}: {exc}"))
        if bad:
            self._quarantine(bad)
        files, now = self.files, time.monotonic()
        due = (len(self._pending) >= self.flush_rows
               or (self._pending and now - self._last_flush >= self.flush_seconds))
        if controls or (due and now >= files.retry_at):
            self._write_pending()
            self._last_flush = now
        if files.is_open and (files.segment_rows >= self.max_rows or files.age_s() >= self.max_seconds):
            self._close_segment()
        if files.stranded and (controls or now >= files.retry_at):
            self._finish_stranded()
        for control in controls:
            if control.kind == "close" and files.disk_errno is not None:
                self._write_pending()  # one more try before giving up
            self._close_segment()
            self._finish_stranded()
            control.error = self._undone()
            if control.kind == "close":
                self._abandon_at_close()
                control.done.set()
                return True
            control.done.set()
        self._current = []
        return False

    def _wait_s(self) -> float:
        if self._pending or self.files.stranded:
            return max(0.01, min(self.flush_seconds, max(self.files.retry_at - time.monotonic(), 0.01)))
        return max(self.flush_seconds, 1.0)  # idle: wake only to check the segment's age

    def _undone(self) -> str | None:
        parts = [f"{len(self._pending)} rows are still waiting for the disk"] if self._pending else []
        parts += self.files.undone()
        if not parts:
            return None
        last_error = self.files.last_error
        return "; ".join(parts) + (f"; last error: {last_error}" if last_error else "")

    def _abandon_at_close(self) -> None:
        if self._pending:
            lost = len(self._pending)
            logger.error("feedback: %d rows could not be written before shutdown (%s)", lost, self.files.last_error)
            self._pending.clear()
            self._count_out(lost, drop=DROP_UNWRITTEN_AT_CLOSE)
        self.files.abandon()  # a segment we could not close: keep its durable batches as a partial

    def _count_out(self, n: int, drop: str | None = None) -> None:
        with self._lock:
            self._backlog -= n
            if drop is not None:
                self._drops[drop] += n

    # -- onto the disk -----------------------------------------------------------------------------
    def _write_pending(self) -> None:
        """Write the converted rows as record batches; on failure they stay pending for a retry."""
        while self._pending:
            try:
                if not self.files.is_open:
                    self.files.open(self.schema)
                room = self.max_rows - self.files.segment_rows
                chunk = self._pending[:max(1, min(room, _MAX_BATCH_ROWS))]
                try:
                    batch = self._convert.checked_batch(chunk)
                except BatchBreaker as breaker:  # the per-row check let a bad row through
                    logger.warning("feedback: a batch did not build (%s); quarantining the row that broke it",
                                   breaker.__cause__)
                    self._quarantine([(self._convert.as_row(self._pending.pop(breaker.index)), str(breaker))])
                    continue  # build again without it
                self.files.append(batch)
            except Exception as exc:
                self.files.failed(exc, "writing feedback rows", len(self._pending))
                return
            del self._pending[:len(chunk)]
            self.rows_written += len(chunk)
            self._count_out(len(chunk))
            self.files.succeeded()
            if self.files.segment_rows >= self.max_rows:
                self._close_segment()

    def _close_segment(self) -> None:
        try:
            self.files.close_segment()
        except SegmentError as exc:
            self.files.failed(exc.__cause__, exc.what, len(self._pending))

    def _finish_stranded(self) -> None:
        try:
            self.files.finish_stranded()
        except SegmentError as exc:
            self.files.failed(exc.__cause__, exc.what, len(self._pending))

    def _quarantine(self, bad: list[tuple[Any, str]]) -> None:
        data = "".join(quarantine_line(row, reason, self.replica_id) for row, reason in bad).encode()
        try:
            self.files.quarantine(data)
        except QuarantineFull:
            logger.error("feedback: quarantine of %s is full (%d bytes); %d bad rows dropped: %s",
                         self.replica_id, self.files.quarantine_bytes, len(bad), bad[0][1])
            self._count_out(len(bad), drop=DROP_QUARANTINE_FULL)
            return
        except Exception as exc:
            self._errors += 1
            logger.error("feedback: could not quarantine %d bad rows (%s): %s", len(bad), exc, bad[0][1])
            self._count_out(len(bad), drop=DROP_DISK_FULL if is_disk_full(exc) else DROP_QUARANTINE_FAILED)
            return
        self.rows_quarantined += len(bad)
        self._count_out(len(bad))
        for _, reason in bad[:5]:
            logger.warning("feedback: quarantined a row: %s", reason)


class FeedbackCollector:
    """Prometheus collector of a writer's stats(); register it on the runtime's metrics registry."""

    def __init__(self, writer: FeedbackWriter) -> None:
        self.writer = writer

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.writer.stats()
        yield CounterMetricFamily("leap:feedback_rows_written", "Feedback rows written to segments",
                                  value=stats["rows_written"])
        dropped = CounterMetricFamily("leap:feedback_rows_dropped", "Feedback rows dropped, by reason",
                                      labels=["reason"])
        for reason, count in sorted(stats["drop_reasons"].items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield CounterMetricFamily("leap:feedback_rows_quarantined", "Feedback rows quarantined as malformed",
                                  value=stats["rows_quarantined"])
        yield CounterMetricFamily("leap:feedback_writer_errors", "Errors the feedback writer survived",
                                  value=stats["errors"])
        yield GaugeMetricFamily("leap:feedback_queue_depth", "Feedback rows accepted, not yet on disk",
                                value=stats["queue_depth"])
        yield GaugeMetricFamily("leap:feedback_writer_alive", "1 while the feedback writer thread runs",
                                value=int(stats["alive"]))
        yield GaugeMetricFamily("leap:feedback_disk_full", "1 while segment writes fail with ENOSPC",
                                value=int(stats["disk_full"]))
