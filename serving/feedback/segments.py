"""The files of one replica's feedback: segments, their crash recovery, the quarantine, write failures.

Complete segments (`feedback-*.parquet`, what ingest reads) sit at the top of the feedback folder; each
replica's lock, open Arrow IPC stream and quarantine sit in a folder of its own, so a restarting replica
recovers only its own crashed stream (and adopts a dead replica's once stale). The open stream is fsynced
per append, so a crash leaves a readable prefix, and closing converts it to Parquet durably
(`leap_io.durable`), so readers only see complete segments. A failed write (a full disk) cuts the stream
back to its last durable batch and backs off; layout: docs/serving.md ("Feedback segments").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import ipc

from leap_io.durable import fsync_dir, write_durably
from leap_io.feedback_schema import parquet_options, segment_table

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".arrows.partial"
QUARANTINE_DIR = "quarantine"
LOCK_NAME = ".writer.lock"
REPLICA_ENV = "LEAP_REPLICA_ID"
_MAX_RETRY_S = 10.0


class SegmentError(Exception):
    """A segment could not be finished; `what` says which step failed, the cause is chained. Its rows
    stay on disk as a partial."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class QuarantineFull(Exception):
    """The quarantine folder is at its cap."""


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


def _safe_id(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text.strip())[:64].lstrip(".")
    return cleaned or "replica"


def default_replica_id(port: int | None = None) -> str:
    """`LEAP_REPLICA_ID` if set, else the host name (and `port`, for several replicas on one host)."""
    from leap_io.settings import read_settings

    given = (read_settings().replica_id or "").strip()
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


def is_disk_full(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc)


class SegmentFiles:
    """One replica's segment files under a feedback folder, used by one writer thread.

    Claims the replica's folder (a name held by a live writer falls back to `<name>-<pid>`), recovers
    its own crashed stream and adopts stale orphans of dead replicas, then keeps one open segment
    at a time and the quarantine file. `retry_base_s` is the first backoff after a failed write.
    """

    def __init__(self, folder: str | Path, replica_id: str, *, lock_wait_s: float, orphan_age_s: float,
                 max_quarantine_bytes: int, retry_base_s: float) -> None:
        self.root = Path(folder)
        self.root.mkdir(parents=True, exist_ok=True)
        self.replica_id, self._lock_fd = self._claim(_safe_id(replica_id), lock_wait_s)
        self.replica_dir = self.root / self.replica_id
        self.quarantine_dir = self.replica_dir / QUARANTINE_DIR
        self.max_quarantine_bytes = max_quarantine_bytes
        self.retry_base_s = retry_base_s

        # counters: written by the writer thread, read anywhere (ints are atomic enough to read)
        self.segments_closed = 0
        self.errors = 0
        self.recovered_rows, self.torn_segments, self.adopted_rows = 0, 0, 0
        self.last_error: str | None = None
        self.disk_errno: int | None = None  # set while writes fail, cleared by the next success
        self.retry_at = 0.0
        self._failures = 0

        self.stranded: list[Path] = []  # closed streams whose Parquet conversion is still to do
        self._recover_own()
        self._adopt_orphans(orphan_age_s)
        self.quarantine_bytes = sum(p.stat().st_size for p in self.quarantine_dir.glob("*.jsonl")
                                    if p.is_file()) if self.quarantine_dir.is_dir() else 0
        self._quarantine_file: Path | None = None

        self._handle: io.BufferedRandom | None = None
        self._stream: ipc.RecordBatchStreamWriter | None = None
        self._partial: Path | None = None
        self._stream_bytes = 0  # size of the open stream after its last durable batch
        self.segment_rows = 0
        self._segment_started = 0.0
        self._sequence = 0

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

    def release(self) -> None:
        """Free the replica's folder for the next writer."""
        if self._lock_fd is not None:
            _unlock(self._lock_fd)
            self._lock_fd = None

    def _recover_into_root(self, partial: Path, whose: str) -> int:
        try:
            rows, torn = recover_partial(partial, self.root)
        except FileNotFoundError:
            return 0
        except Exception as exc:
            self.errors += 1
            self.last_error = f"recovering {partial}: {exc}"
            logger.exception("feedback: could not recover %s yet; it stays for a later try", partial)
            if partial.parent == self.replica_dir:
                self.stranded.append(partial)
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

    # -- write failures --------------------------------------------------------------------------
    def failed(self, exc: BaseException, what: str, waiting: int) -> None:
        """A write failed: remember why and back off (exponentially, up to 10 s) before the next try."""
        self.errors += 1
        self._failures += 1
        self.disk_errno = errno.ENOSPC if is_disk_full(exc) else getattr(exc, "errno", None) or -1
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        delay = min(_MAX_RETRY_S, max(self.retry_base_s, 0.05) * 2 ** min(self._failures - 1, 8))
        self.retry_at = time.monotonic() + delay
        logger.error("feedback: %s failed (%s); %d rows kept for a retry in %.1fs", what, exc, waiting, delay)

    def succeeded(self) -> None:
        """Rows reached the disk: the write error (and its backoff) is over."""
        if self.disk_errno is not None:
            logger.warning("feedback: writing works again after %d failures", self._failures)
        self.disk_errno, self._failures, self.retry_at = None, 0, 0.0

    # -- the open segment ------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._stream is not None

    def age_s(self) -> float:
        """Seconds since the open segment was opened."""
        return time.monotonic() - self._segment_started

    def open(self, schema: pa.Schema) -> None:
        """Start a new segment: an empty stream of `schema`, durable before any row goes in."""
        self._sequence += 1  # orders this replica's segments opened within the same second
        name = (f"feedback-{time.strftime('%Y%m%dT%H%M%S')}-{self.replica_id}-{self._sequence:06d}-"
                f"{uuid.uuid4().hex[:6]}")
        partial = self.replica_dir / (name + PARTIAL_SUFFIX)
        handle = open(partial, "w+b")
        try:
            stream = ipc.new_stream(handle, schema)
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
        self.segment_rows = 0
        self._segment_started = time.monotonic()

    def append(self, batch: pa.RecordBatch) -> None:
        """Write one batch durably to the open segment; on failure the segment is abandoned and it raises."""
        try:
            self._stream.write_batch(batch)
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except BaseException:
            self.abandon()
            raise
        self._stream_bytes = os.fstat(self._handle.fileno()).st_size
        self.segment_rows += batch.num_rows

    def abandon(self) -> None:
        """Drop the open stream after a failed write: cut it back to its last durable batch and keep it
        as a partial for a later conversion (or remove it when it holds no rows)."""
        handle, partial, size, rows = self._handle, self._partial, self._stream_bytes, self.segment_rows
        self._handle = self._stream = self._partial = None
        self.segment_rows = 0
        if handle is None:
            return
        with contextlib.suppress(Exception):
            handle.close()  # may fail to flush what the disk refused; that part is cut off below
        if partial is None:
            return
        try:
            if rows:
                os.truncate(partial, size)
                self.stranded.append(partial)
            else:
                partial.unlink(missing_ok=True)
        except OSError as exc:
            self.errors += 1
            logger.error("feedback: could not trim the failed segment %s: %s", partial, exc)
            if rows:
                self.stranded.append(partial)

    def close_segment(self) -> None:
        """Finish the open stream and convert it to Parquet from our own handle (a file removed under
        us is still readable through it). SegmentError when that fails: the partial keeps every batch."""
        if self._stream is None:
            return
        if self.segment_rows == 0:
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
        except Exception as exc:
            self.abandon()
            raise SegmentError("closing the feedback segment") from exc
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
        except Exception as exc:
            self.abandon()
            raise SegmentError("converting the feedback segment to Parquet") from exc
        self._handle = self._stream = self._partial = None
        with contextlib.suppress(Exception):
            handle.close()
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            fsync_dir(self.replica_dir)
        self.segments_closed += 1

    def finish_stranded(self) -> None:
        """Convert the partials earlier failures left; SegmentError at the first that still fails."""
        while self.stranded:
            partial = self.stranded[0]
            try:
                recover_partial(partial, self.root)
            except FileNotFoundError:
                logger.error("feedback: stranded segment %s disappeared before its conversion", partial)
                self.errors += 1
            except Exception as exc:
                raise SegmentError(f"converting the stranded segment {partial.name}") from exc
            self.stranded.pop(0)
            self.segments_closed += 1

    def undone(self) -> list[str]:
        """What is not in a closed Parquet segment yet, in words."""
        parts = []
        if self.stranded:
            parts.append(f"{len(self.stranded)} segments are not converted to Parquet yet "
                         f"({', '.join(p.name for p in self.stranded)})")
        if self._stream is not None:
            parts.append("the open segment could not be closed")
        return parts

    # -- quarantine ------------------------------------------------------------------------------
    def quarantine(self, data: bytes) -> None:
        """Append quarantine lines durably; QuarantineFull at the cap, the write's error when it fails."""
        if self.quarantine_bytes + len(data) > self.max_quarantine_bytes:
            raise QuarantineFull(f"the quarantine of {self.replica_id} is full ({self.quarantine_bytes} bytes)")
        if self._quarantine_file is None:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            self._quarantine_file = self.quarantine_dir / (
                f"quarantine-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl")
        with open(self._quarantine_file, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self.quarantine_bytes += len(data)
