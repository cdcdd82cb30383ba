"""Append-only feedback segments: one Parquet row per finished request, written exactly once.

Rows go to a writer thread so the scheduler never waits on the disk. Layout under the feedback folder:

  <folder>/feedback-<time>-<replica>-<id>.parquet     complete segments (what ingest reads)
  <folder>/<replica>/.writer.lock                     held (flock) while this replica's writer runs
  <folder>/<replica>/*.arrows.partial                 this replica's open segment, an Arrow IPC stream
  <folder>/<replica>/quarantine/*.jsonl               rows that could not be converted, with the reason

The open segment gets one record batch per flush, fsynced each time, so a crash leaves a readable prefix.
Rotation (by rows or age) and shutdown convert the stream to Parquet through a temporary name: the file
is fsynced before the atomic rename and the folder after it, so readers only see complete segments.
Partials live in a folder per replica, so a restarting replica recovers only its own crashed stream and
never another replica's open one; a dead replica's partials are adopted once they are stale and its lock
is free.

Nothing a caller passes can stop the writer: each row is converted on its own before it joins a batch,
and a row that does not fit the schema is quarantined with its reason and counted. The backlog (rows
accepted, not yet on disk) is bounded; rows beyond it are dropped and counted by reason. Rows that
cannot be written (a full disk) stay in the backlog and are retried; a segment whose conversion fails
stays on disk as a partial and is retried too. `flush()` raises unless everything accepted before it is
in a closed Parquet segment (or quarantined), and `stats()` / `healthy()` say how the writer is doing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import ipc

from leap_io.durable import fsync_dir, write_durably
from leap_io.feedback_schema import feedback_schema, parquet_options, segment_metadata, segment_table

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".arrows.partial"
QUARANTINE_DIR = "quarantine"
LOCK_NAME = ".writer.lock"
REPLICA_ENV = "LEAP_REPLICA_ID"

DEFAULT_MAX_QUEUE_ROWS = 100_000
DEFAULT_MAX_QUEUE_BYTES = 1 << 30  # the backlog's features, whatever the dim
DEFAULT_MAX_QUARANTINE_BYTES = 64 << 20
DEFAULT_ORPHAN_AGE_S = 3600.0
_MAX_BATCH_ROWS = 1024  # rows per record batch when a backlog is written out
_MAX_RETRY_S = 10.0

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


class _BadRow(ValueError):
    """A row that does not fit the feedback schema; the message is the quarantine reason."""


# ---------------------------------------------------------------------------------------- files

def _write_parquet(table: pa.Table, final: Path) -> None:
    """Write `table` to `final` durably (`leap_io.durable`)."""
    write_durably(final, lambda path: pq.write_table(segment_table(table), path, **parquet_options()))


def _read_stream(source: Any) -> tuple[list[pa.RecordBatch], pa.Schema | None, bool]:
    """(complete batches, schema, torn) of an IPC stream; a torn or unterminated tail is dropped."""
    batches: list[pa.RecordBatch] = []
    schema = None
    torn = False
    try:
        reader = ipc.open_stream(source)
        schema = reader.schema
        while True:
            try:
                batches.append(reader.read_next_batch())
            except StopIteration:
                break
    except (pa.ArrowInvalid, EOFError):
        torn = True
    except OSError as exc:
        if exc.errno is not None:  # a real I/O error: keep the file for a later try
            raise
        torn = True  # Arrow reports a message cut short as an OSError without errno
    return batches, schema, torn


def _final_name(partial: Path, dest: Path) -> Path:
    return dest / (partial.name[: -len(PARTIAL_SUFFIX)] + ".parquet")


def recover_partial(partial: Path, dest: Path | None = None) -> tuple[int, bool]:
    """Turn a crashed stream into a Parquet segment in `dest` (default: beside it).

    Returns (rows recovered, torn tail dropped). The partial is removed only once its rows are durable
    as Parquet; on any error it stays, so nothing is lost and a later try can finish the job.
    """
    partial = Path(partial)
    dest = partial.parent if dest is None else Path(dest)
    with pa.OSFile(str(partial), "rb") as source:
        batches, schema, torn = _read_stream(source)
    rows = sum(len(b) for b in batches)
    if schema is not None and rows:
        _write_parquet(pa.Table.from_batches(batches, schema=schema), _final_name(partial, dest))
    partial.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        fsync_dir(partial.parent)
    return rows, torn


# ------------------------------------------------------------------------------------- replicas

def _safe_id(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text.strip())[:64].lstrip(".")
    return cleaned or "replica"


def default_replica_id(port: int | None = None) -> str:
    """`LEAP_REPLICA_ID` if set, else the host name (and `port`, for several replicas on one host)."""
    given = os.environ.get(REPLICA_ENV, "").strip()
    if given:
        return _safe_id(given)
    host = socket.gethostname() or "host"
    return _safe_id(f"{host}-{port}" if port else host)


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path`, or None when another process (or fd) holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _is_disk_full(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc)


# ---------------------------------------------------------------------------------- conversion

def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value if not isinstance(value, str) else value[:1000]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    return repr(value)[:200]


def _summary(feature: Any) -> dict[str, Any]:
    """What the quarantine keeps of a feature: its kind and size, never its values."""
    summary: dict[str, Any] = {"type": type(feature).__name__}
    shape = getattr(feature, "shape", None)
    if shape is not None:
        summary["shape"] = [int(s) for s in shape] if isinstance(shape, tuple) else repr(shape)[:100]
        summary["dtype"] = str(getattr(feature, "dtype", ""))
    elif isinstance(feature, (list, tuple)):
        summary["length"] = len(feature)
    return summary


_FAST_TYPES = {pa.string(): str, pa.float64(): float, pa.float32(): float}
_INT32 = (-(1 << 31), (1 << 31) - 1)


class _Converter:
    """Checks one row against the schema and returns plain values that build a batch without error."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.dim = schema.field("feature").type.list_size
        self.scalars = [(f.name, f.type, f.nullable) for f in schema if f.name != "feature"]

    def convert(self, row: Any) -> tuple[list[Any], np.ndarray]:
        if not isinstance(row, Mapping):
            raise _BadRow(f"row is a {type(row).__name__}, not a mapping of column -> value")
        values = []
        for name, kind, nullable in self.scalars:
            value = row.get(name)
            if value is None:
                if not nullable:
                    raise _BadRow(f"{name} is missing or null")
                values.append(None)
                continue
            fast = _FAST_TYPES.get(kind)
            if fast is not None and type(value) is fast:
                values.append(value)
                continue
            if kind == pa.int32() and type(value) is int and _INT32[0] <= value <= _INT32[1]:
                values.append(value)
                continue
            try:
                values.append(pa.scalar(value, type=kind).as_py())
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise _BadRow(f"{name}: {type(value).__name__} {_json_safe(value)!r} does not convert to "
                              f"{kind}: {exc}") from None
        if "feature" not in row or row["feature"] is None:
            raise _BadRow("feature is missing or null")
        try:
            feature = np.asarray(row["feature"], dtype=np.float32)
        except Exception as exc:  # noqa: BLE001 - __array__ of a foreign object may raise anything
            raise _BadRow(f"feature does not convert to float32: {type(exc).__name__}: {exc}") from None
        if feature.size != self.dim:
            raise _BadRow(f"feature has {feature.size} values of shape {feature.shape}, expected dim {self.dim}")
        return values, feature.reshape(self.dim)

    def batch(self, rows: list[tuple[list[Any], np.ndarray]]) -> pa.RecordBatch:
        columns = list(zip(*(values for values, _ in rows)))
        arrays = [pa.array(list(column), type=kind) for column, (_, kind, _) in zip(columns, self.scalars)]
        flat = np.concatenate([feature for _, feature in rows])
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), self.dim))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


# -------------------------------------------------------------------------------------- writer

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
        self.root = Path(folder)
        self.root.mkdir(parents=True, exist_ok=True)
        self.replica_id, self._lock_fd = self._claim(_safe_id(replica_id or default_replica_id()), lock_wait_s)
        self.replica_dir = self.root / self.replica_id
        self.quarantine_dir = self.replica_dir / QUARANTINE_DIR
        self.schema = feedback_schema(dim).with_metadata(
            segment_metadata(dim, layer, model_id, fingerprint, replica_id=self.replica_id, recipe=recipe))
        self._convert = _Converter(self.schema)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        row_bytes = 4 * dim + 1024
        self.capacity = max(1, min(max_queue_rows, max_queue_bytes // row_bytes))
        self.max_quarantine_bytes = max_quarantine_bytes

        # counters: written by the writer thread, read anywhere (ints are atomic enough to read)
        self.rows_written = 0
        self.segments_closed = 0
        self.rows_quarantined = 0
        self.errors = 0
        self.recovered_rows, self.torn_segments, self.adopted_rows = 0, 0, 0
        self._drops: Counter[str] = Counter()
        self._last_error: str | None = None
        self._disk_errno: int | None = None  # set while writes fail, cleared by the next success

        self._stranded: list[Path] = []  # closed streams whose Parquet conversion is still to do
        self._recover_own()
        self._adopt_orphans(max(orphan_age_s, 2 * max_seconds + 60.0))
        self._quarantine_bytes = sum(p.stat().st_size for p in self.quarantine_dir.glob("*.jsonl")
                                     if p.is_file()) if self.quarantine_dir.is_dir() else 0
        self._quarantine_file: Path | None = None

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._rows: deque[Any] = deque()
        self._controls: deque[_Control] = deque()
        self._current: list[_Control] = []  # the controls the thread is handling now
        self._backlog = 0  # accepted rows not yet written, quarantined or dropped
        self._closing = False
        self._pending: list[tuple[list[Any], np.ndarray]] = []  # converted, waiting for the disk
        self._handle: io.BufferedRandom | None = None
        self._stream: ipc.RecordBatchStreamWriter | None = None
        self._partial: Path | None = None
        self._stream_bytes = 0  # size of the open stream after its last durable batch
        self._segment_rows = 0
        self._segment_started = 0.0
        self._sequence = 0
        self._last_flush = time.monotonic()
        self._retry_at = 0.0
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="leap-feedback", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------
    def write(self, row: dict[str, Any]) -> bool:
        """Queue one finished request's row; never blocks, never raises. False when it was dropped."""
        with self._lock:
            if self._closing:
                self._drops[DROP_CLOSED] += 1
                return False
            if self._backlog >= self.capacity or not self._thread.is_alive():
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
        if self._thread.is_alive():
            logger.error("feedback: writer thread did not stop within %.1fs (%d rows unwritten)", timeout,
                         self._backlog)
        elif self._lock_fd is not None:
            _unlock(self._lock_fd)
            self._lock_fd = None
        return clean

    def stats(self) -> dict[str, Any]:
        """Counters for the runtime and /metrics (keys are stable)."""
        with self._lock:
            drops = dict(self._drops)
            depth = self._backlog
        return {"rows_written": self.rows_written, "rows_dropped": sum(drops.values()), "drop_reasons": drops,
                "rows_quarantined": self.rows_quarantined, "queue_depth": depth,
                "alive": self._thread.is_alive(), "errors": self.errors,
                "disk_full": self._disk_errno == errno.ENOSPC, "writing_fails": self._disk_errno is not None,
                "last_error": self._last_error}

    def healthy(self) -> bool:
        """The writer thread runs and takes rows (a full disk is visible in stats(), not here)."""
        return self._thread.is_alive() and not self._closing

    # -- start-up ------------------------------------------------------------------------------
    def _claim(self, wanted: str, wait_s: float) -> tuple[str, int | None]:
        """Lock this replica's folder; a name held by a live writer falls back to `<name>-<pid>`."""
        deadline = time.monotonic() + max(wait_s, 0.0)
        for name in (wanted, f"{wanted}-{os.getpid()}", f"{wanted}-{os.getpid()}-{uuid.uuid4().hex[:6]}"):
            folder = self.root / name
            folder.mkdir(parents=True, exist_ok=True)
            while True:
                fd = _try_lock(folder / LOCK_NAME)
                if fd is not None:
                    if name != wanted:
                        logger.error("feedback: replica id %r is in use by another live writer; writing as %r "
                                     "(give each replica its own %s)", wanted, name, REPLICA_ENV)
                    return name, fd
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        raise RuntimeError(f"feedback: could not lock a replica folder under {self.root}")

    def _recover_into_root(self, partial: Path, whose: str) -> int:
        try:
            rows, torn = recover_partial(partial, self.root)
        except FileNotFoundError:
            return 0
        except Exception as exc:
            self.errors += 1
            self._last_error = f"recovering {partial}: {exc}"
            logger.exception("feedback: could not recover %s yet; it stays for a later try", partial)
            if partial.parent == self.replica_dir:
                self._stranded.append(partial)
            return 0
        self.torn_segments += int(torn)
        logger.warning("feedback: recovered %d rows from %s (%s)%s", rows, partial.name, whose,
                       "; a torn last batch was dropped" if torn else "")
        return rows

    def _recover_own(self) -> None:
        for partial in sorted(self.replica_dir.glob("*" + PARTIAL_SUFFIX)):
            self.recovered_rows += self._recover_into_root(partial, "this replica's crashed segment")

    def _adopt_orphans(self, age_s: float) -> None:
        """Convert partials of replicas that are gone: lock free and untouched for `age_s` seconds."""
        cutoff = time.time() - age_s

        def stale(path: Path) -> bool:
            with contextlib.suppress(OSError):
                return path.stat().st_mtime < cutoff
            return False

        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and p != self.replica_dir):
            lock = folder / LOCK_NAME
            if not lock.is_file():
                continue
            old = [p for p in sorted(folder.glob("*" + PARTIAL_SUFFIX)) if stale(p)]
            if not old:
                continue
            try:
                fd = _try_lock(lock)
            except OSError:
                continue
            if fd is None:
                continue  # that replica is alive: its partials are its own business
            try:
                for partial in old:
                    self.adopted_rows += self._recover_into_root(partial, f"orphan of replica {folder.name}")
            finally:
                _unlock(fd)
        # streams of the writer before per-replica folders: adopt them once nobody could be writing them
        for partial in sorted(self.root.glob("*" + PARTIAL_SUFFIX)):
            if stale(partial):
                self.adopted_rows += self._recover_into_root(partial, "orphan in the shared folder")

    # -- the thread ------------------------------------------------------------------------------
    def _submit(self, kind: str) -> _Control | None:
        with self._lock:
            if self._closing or not self._thread.is_alive():
                return None
            control = _Control(kind)
            self._controls.append(control)
            if kind == "close":
                self._closing = True
            self._wake.notify()
            return control

    def _overflow_reason(self) -> str:
        if not self._thread.is_alive():
            return DROP_WRITER_DEAD
        if self._disk_errno == errno.ENOSPC:
            return DROP_DISK_FULL
        if self._disk_errno is not None:
            return DROP_WRITE_FAILED
        return DROP_QUEUE_FULL

    def _run(self) -> None:
        while True:
            try:
                if self._step():
                    return
            except Exception as exc:  # a bug, not a bad row or a disk error: count it and carry on
                self.errors += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("feedback: writer step failed; continuing")
                controls, self._current = self._current, []
                for control in controls:  # whoever waits learns at once that it did not happen
                    control.error = f"the feedback writer failed while handling it: {self._last_error}"
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
            except _BadRow as exc:
                bad.append((row, str(exc)))
            except Exception as exc:  # noqa: BLE001 - a row whose values misbehave in ways not foreseen
                bad.append((row, f"row did not convert: {type(exc).__name__}: {exc}"))
        if bad:
            self._quarantine(bad)
        now = time.monotonic()
        due = (len(self._pending) >= self.flush_rows
               or (self._pending and now - self._last_flush >= self.flush_seconds))
        if controls or (due and now >= self._retry_at):
            self._write_pending()
            self._last_flush = now
        if self._stream is not None and (self._segment_rows >= self.max_rows
                                         or now - self._segment_started >= self.max_seconds):
            self._close_segment()
        if self._stranded and (controls or now >= self._retry_at):
            self._finish_stranded()
        for control in controls:
            if control.kind == "close" and self._disk_errno is not None:
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
        if self._pending or self._stranded:
            return max(0.01, min(self.flush_seconds, max(self._retry_at - time.monotonic(), 0.01)))
        return max(self.flush_seconds, 1.0)  # idle: wake only to check the segment's age

    def _undone(self) -> str | None:
        parts = []
        if self._pending:
            parts.append(f"{len(self._pending)} rows are still waiting for the disk")
        if self._stranded:
            parts.append(f"{len(self._stranded)} segments are not converted to Parquet yet "
                         f"({', '.join(p.name for p in self._stranded)})")
        if self._stream is not None:
            parts.append("the open segment could not be closed")
        if not parts:
            return None
        return "; ".join(parts) + (f"; last error: {self._last_error}" if self._last_error else "")

    def _abandon_at_close(self) -> None:
        if self._pending:
            lost = len(self._pending)
            logger.error("feedback: %d rows could not be written before shutdown (%s)", lost, self._last_error)
            self._pending.clear()
            self._count_out(lost, drop=DROP_UNWRITTEN_AT_CLOSE)
        if self._handle is not None:  # a segment we could not close: keep its durable batches as a partial
            self._abandon_stream()

    def _count_out(self, n: int, drop: str | None = None) -> None:
        with self._lock:
            self._backlog -= n
            if drop is not None:
                self._drops[drop] += n

    def _failed(self, exc: BaseException, what: str) -> None:
        self.errors += 1
        self._failures += 1
        self._disk_errno = errno.ENOSPC if _is_disk_full(exc) else getattr(exc, "errno", None) or -1
        self._last_error = f"{what}: {type(exc).__name__}: {exc}"
        delay = min(_MAX_RETRY_S, max(self.flush_seconds, 0.05) * 2 ** min(self._failures - 1, 8))
        self._retry_at = time.monotonic() + delay
        logger.error("feedback: %s failed (%s); %d rows kept for a retry in %.1fs", what, exc,
                     len(self._pending), delay)

    def _succeeded(self) -> None:
        """Rows reached the disk: the write error (and its backoff) is over."""
        if self._disk_errno is not None:
            logger.warning("feedback: writing works again after %d failures", self._failures)
        self._disk_errno, self._failures, self._retry_at = None, 0, 0.0

    # -- segments ------------------------------------------------------------------------------
    def _open(self) -> None:
        self._sequence += 1  # orders this replica's segments opened within the same second
        name = (f"feedback-{time.strftime('%Y%m%dT%H%M%S')}-{self.replica_id}-{self._sequence:06d}-"
                f"{uuid.uuid4().hex[:6]}")
        partial = self.replica_dir / (name + PARTIAL_SUFFIX)
        handle = open(partial, "w+b")  # noqa: SIM115 - stays open as the segment's stream
        try:
            stream = ipc.new_stream(handle, self.schema)
            handle.flush()
            os.fsync(handle.fileno())
            fsync_dir(self.replica_dir)
        except BaseException:
            with contextlib.suppress(Exception):
                handle.close()
            partial.unlink(missing_ok=True)
            raise
        self._handle, self._stream, self._partial = handle, stream, partial
        self._stream_bytes = os.fstat(handle.fileno()).st_size
        self._segment_rows = 0
        self._segment_started = time.monotonic()

    def _write_pending(self) -> None:
        """Write the converted rows as record batches; on failure they stay pending for a retry."""
        while self._pending:
            try:
                if self._stream is None:
                    self._open()
                room = self.max_rows - self._segment_rows
                chunk = self._pending[:max(1, min(room, _MAX_BATCH_ROWS))]
                batch = self._build(chunk)
                if batch is None:
                    continue  # a row broke the batch and was quarantined; build again without it
                try:
                    self._stream.write_batch(batch)
                    self._handle.flush()
                    os.fsync(self._handle.fileno())
                except BaseException:
                    self._abandon_stream()
                    raise
            except Exception as exc:  # noqa: BLE001 - any failure keeps the rows for a retry
                self._failed(exc, "writing feedback rows")
                return
            self._stream_bytes = os.fstat(self._handle.fileno()).st_size
            del self._pending[:len(chunk)]
            self._segment_rows += len(chunk)
            self.rows_written += len(chunk)
            self._count_out(len(chunk))
            self._succeeded()
            if self._segment_rows >= self.max_rows:
                self._close_segment()

    def _build(self, chunk: list[tuple[list[Any], np.ndarray]]) -> pa.RecordBatch | None:
        try:
            return self._convert.batch(chunk)
        except Exception as exc:  # noqa: BLE001 - the per-row check let a bad row through; find it
            logger.warning("feedback: a batch did not build (%s); checking its rows one by one", exc)
        for index, item in enumerate(chunk):
            try:
                self._convert.batch([item])
            except Exception as exc:  # noqa: BLE001 - this row is the culprit: quarantine it
                del self._pending[index]
                self._quarantine([(dict(zip([n for n, _, _ in self._convert.scalars], item[0]),
                                        feature=item[1]), f"row does not build a batch: {exc}")])
                return None
        raise RuntimeError("a batch of rows that each convert does not convert together")

    def _abandon_stream(self) -> None:
        """Drop the open stream after a failed write: cut it back to its last durable batch and keep it
        as a partial for a later conversion (or remove it when it holds no rows)."""
        handle, partial, size, rows = self._handle, self._partial, self._stream_bytes, self._segment_rows
        self._handle = self._stream = self._partial = None
        self._segment_rows = 0
        with contextlib.suppress(Exception):
            handle.close()  # may fail to flush what the disk refused; that part is cut off below
        if partial is None:
            return
        try:
            if rows:
                os.truncate(partial, size)
                self._stranded.append(partial)
            else:
                partial.unlink(missing_ok=True)
        except OSError as exc:
            self.errors += 1
            logger.error("feedback: could not trim the failed segment %s: %s", partial, exc)
            if rows:
                self._stranded.append(partial)

    def _close_segment(self) -> None:
        """Finish the open stream and convert it to Parquet from our own handle (a file removed under
        us is still readable through it)."""
        if self._stream is None:
            return
        if self._segment_rows == 0:
            handle, partial = self._handle, self._partial
            self._handle = self._stream = self._partial = None
            with contextlib.suppress(Exception):
                handle.close()
            if partial is not None:
                partial.unlink(missing_ok=True)
            return
        try:
            self._stream.close()
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except Exception as exc:  # noqa: BLE001 - the durable batches stay on disk as a partial
            self._abandon_stream()
            self._failed(exc, "closing the feedback segment")
            return
        handle, partial = self._handle, self._partial
        try:
            if os.fstat(handle.fileno()).st_nlink == 0:
                logger.error("feedback: segment %s was removed by someone else; converting it from the "
                             "open file", partial.name)
                self.errors += 1
            handle.seek(0)
            batches, schema, torn = _read_stream(pa.PythonFile(handle, mode="r"))
            if torn:
                raise OSError(f"segment {partial.name} does not read back whole")
            _write_parquet(pa.Table.from_batches(batches, schema=schema), _final_name(partial, self.root))
        except Exception as exc:  # noqa: BLE001 - the partial holds every batch; convert it later
            self._abandon_stream()
            self._failed(exc, "converting the feedback segment to Parquet")
            return
        self._handle = self._stream = self._partial = None
        with contextlib.suppress(Exception):
            handle.close()
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            fsync_dir(self.replica_dir)
        self.segments_closed += 1

    def _finish_stranded(self) -> None:
        while self._stranded:
            partial = self._stranded[0]
            try:
                recover_partial(partial, self.root)
            except FileNotFoundError:
                logger.error("feedback: stranded segment %s disappeared before its conversion", partial)
                self.errors += 1
            except Exception as exc:  # noqa: BLE001 - it stays on disk for the next try
                self._failed(exc, f"converting the stranded segment {partial.name}")
                return
            self._stranded.pop(0)
            self.segments_closed += 1

    # -- quarantine ----------------------------------------------------------------------------
    def _quarantine_line(self, row: Any, reason: str) -> str:
        record: dict[str, Any] = {"quarantined_at": time.time(), "replica_id": self.replica_id, "reason": reason}
        try:
            if isinstance(row, Mapping):
                record["row"] = {str(k)[:100]: _json_safe(v) for k, v in row.items() if k != "feature"}
                record["feature"] = _summary(row.get("feature"))
            else:
                record["row"] = _json_safe(row)
            return json.dumps(record, default=repr) + "\n"
        except Exception as exc:  # noqa: BLE001 - a row that cannot even be described is still accounted for
            record["row"] = f"<a {type(row).__name__} that cannot be described: {type(exc).__name__}>"
            record.pop("feature", None)
            return json.dumps(record, default=repr) + "\n"

    def _quarantine(self, bad: list[tuple[Any, str]]) -> None:
        lines = [self._quarantine_line(row, reason) for row, reason in bad]
        data = "".join(lines).encode()
        if self._quarantine_bytes + len(data) > self.max_quarantine_bytes:
            logger.error("feedback: quarantine of %s is full (%d bytes); %d bad rows dropped: %s",
                         self.replica_id, self._quarantine_bytes, len(bad), bad[0][1])
            self._count_out(len(bad), drop=DROP_QUARANTINE_FULL)
            return
        try:
            if self._quarantine_file is None:
                self.quarantine_dir.mkdir(parents=True, exist_ok=True)
                self._quarantine_file = self.quarantine_dir / (
                    f"quarantine-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl")
            with open(self._quarantine_file, "ab") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except Exception as exc:  # noqa: BLE001 - counted as dropped with the reason
            self.errors += 1
            logger.error("feedback: could not quarantine %d bad rows (%s): %s", len(bad), exc, bad[0][1])
            self._count_out(len(bad), drop=DROP_DISK_FULL if _is_disk_full(exc) else DROP_QUARANTINE_FAILED)
            return
        self._quarantine_bytes += len(data)
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
        yield CounterMetricFamily("leap_feedback_rows_written", "Feedback rows written to segments",
                                  value=stats["rows_written"])
        dropped = CounterMetricFamily("leap_feedback_rows_dropped", "Feedback rows dropped, by reason",
                                      labels=["reason"])
        for reason, count in sorted(stats["drop_reasons"].items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield CounterMetricFamily("leap_feedback_rows_quarantined", "Feedback rows quarantined as malformed",
                                  value=stats["rows_quarantined"])
        yield CounterMetricFamily("leap_feedback_writer_errors", "Errors the feedback writer survived",
                                  value=stats["errors"])
        yield GaugeMetricFamily("leap_feedback_queue_depth", "Feedback rows accepted, not yet on disk",
                                value=stats["queue_depth"])
        yield GaugeMetricFamily("leap_feedback_writer_alive", "1 while the feedback writer thread runs",
                                value=int(stats["alive"]))
        yield GaugeMetricFamily("leap_feedback_disk_full", "1 while segment writes fail with ENOSPC",
                                value=int(stats["disk_full"]))
