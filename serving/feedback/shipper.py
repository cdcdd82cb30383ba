"""Ship this replica's closed feedback segments from the local folder to object storage.

With `feedback_url` set, the writer still spools segments to the local folder and this thread uploads
each complete one to `<prefix>/<replica id>/<segment name>`, where ingest lists them. The local file is
deleted only after the upload is verified (`leap_io.object_store`), so every row is always on disk, in
the bucket, or both: an S3 outage only grows the spool (with backoff), and a re-upload after a crash is
read once by ingest. Only this replica's own segments are shipped. Retry, bounds and shutdown:
docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from leap_io.durable import fsync_dir
from leap_io.object_store import ObjectAccessDenied, ObjectStore, ObjectStoreError
from leap_io.s3_locations import check_key_part, parse_s3_url
from serving.supervise import SupervisedThread

logger = logging.getLogger(__name__)

THREAD_NAME = "feedback_shipper"


def segment_name_pattern(replica_id: str) -> re.Pattern[str]:
    """The complete segments `serving.feedback.writer.FeedbackWriter` names for `replica_id`, and no other replica's.

    The fixed fields after the id (a six-digit sequence and a hex id) anchor it, so replica `r0` does not
    match `r0-1234`'s segments.
    """
    return re.compile(rf"^feedback-\d{{8}}T\d{{6}}-{re.escape(replica_id)}-\d{{6}}-[0-9a-f]+\.parquet$")


class FeedbackShipper:
    """Uploads one replica's complete segments from `folder` to `<url>/<replica_id>/` on a supervised thread."""

    def __init__(self, folder: str | Path, replica_id: str, url: str, *, endpoint_url: str | None = None,
                 store: ObjectStore | None = None, interval_s: float = 1.0, max_segments_per_pass: int = 64,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, create_bucket: bool = True,
                 on_error: Any = None) -> None:
        if interval_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s or max_segments_per_pass < 1:
            raise ValueError("interval_s and backoff_s must be > 0, max_backoff_s >= backoff_s, "
                             "max_segments_per_pass >= 1")
        self.folder = Path(folder)
        self.replica_id = check_key_part(replica_id, "replica id")
        self.location = parse_s3_url(url)
        self.destination = self.location.child(self.replica_id)
        self._store = store if store is not None else ObjectStore(endpoint_url)
        self._pattern = segment_name_pattern(self.replica_id)
        self.interval_s, self.max_segments_per_pass = interval_s, max_segments_per_pass
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._bucket_ready = not create_bucket

        self.segments_shipped = 0
        self.bytes_shipped = 0
        self.failures = 0  # uploads (or local reads) that failed, each retried later
        self.consecutive_failures = 0
        self.vanished = 0  # listed, then gone before it was read (removed by someone else)
        self.last_error: str | None = None
        self.last_shipped_at: float | None = None
        self._retry_at = 0.0
        self._closed = False
        self._ship_lock = threading.Lock()  # one pass at a time: the thread's, a flush's or close's
        self._wake = threading.Event()
        self._thread = SupervisedThread("leap-feedback-shipper", self._loop, on_error=on_error)

    def start(self) -> FeedbackShipper:
        """Start the thread; its first pass ships what an earlier run of this replica left behind."""
        self._thread.start()
        return self

    # -- what waits ------------------------------------------------------------------------------
    def pending(self) -> list[Path]:
        """This replica's complete segments still on the local disk, oldest name first."""
        try:
            names = sorted(entry.name for entry in os.scandir(self.folder) if entry.is_file())
        except FileNotFoundError:
            return []
        return [self.folder / name for name in names if self._pattern.match(name)]

    # -- shipping --------------------------------------------------------------------------------
    def ship(self, deadline_s: float | None = None) -> dict[str, Any]:
        """Ship every pending segment now (ignoring the backoff), up to `deadline_s` seconds; returns stats()."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        while True:
            shipped, failed = self._pass(limit=None, deadline=deadline)
            if failed or not shipped or not self.pending():
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self.stats()

    def _pass(self, limit: int | None, deadline: float | None = None) -> tuple[int, bool]:
        """Upload up to `limit` pending segments; (shipped, failed). A pass ends at its first S3 error."""
        with self._ship_lock:
            pending = self.pending()
            if limit is not None:
                pending = pending[:limit]
            if not pending:
                return 0, False
            if not self._bucket_ready:
                try:
                    self._store.ensure_bucket(self.location.bucket)
                    self._bucket_ready = True
                except ObjectAccessDenied:  # a replica's least-privilege key may neither check nor create it
                    self._bucket_ready = True
                    logger.info("feedback shipper: this key may not check bucket %s; shipping without",
                                self.location.bucket)
                except ObjectStoreError as error:  # the upload below says whether it matters
                    logger.warning("feedback shipper: could not check bucket %s: %s", self.location.bucket, error)
            shipped = 0
            for path in pending:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                try:
                    data = path.read_bytes()
                except FileNotFoundError:
                    self.vanished += 1
                    logger.error("feedback shipper: %s disappeared before it was shipped", path.name)
                    continue
                except OSError as error:
                    self._failed(f"reading {path}: {error}")
                    return shipped, True
                key = self.destination.key(path.name)
                try:
                    self._store.put(self.location.bucket, key, data)
                except (ObjectStoreError, OSError) as error:
                    self._failed(str(error))
                    return shipped, True
                self._bucket_ready = True
                self._recovered()
                try:
                    path.unlink()
                    fsync_dir(self.folder)
                except FileNotFoundError:
                    pass
                except OSError as error:  # shipped, so nothing is lost; the next pass uploads it again
                    logger.error("feedback shipper: shipped %s but could not delete it: %s", path.name, error)
                shipped += 1
                self.segments_shipped += 1
                self.bytes_shipped += len(data)
                self.last_shipped_at = time.time()
            self._recovered()
            return shipped, False

    def _recovered(self) -> None:
        """An upload went through: the bucket no longer counts as failing (as of this upload, so that
        `stats()` never shows a shipped backlog still failing)."""
        if self.consecutive_failures:
            logger.warning("feedback shipper: shipping to %s works again after %d failures",
                           self.destination, self.consecutive_failures)
        self.consecutive_failures, self._retry_at = 0, 0.0

    def _failed(self, error: str) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = error
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** min(self.consecutive_failures - 1, 16))
        self._retry_at = time.monotonic() + delay
        logger.error("feedback shipper: %s; segments stay on local disk, next try in %.1fs", error, delay)

    def _loop(self) -> None:
        stopping = self._thread.stopping
        while not stopping.is_set():
            now = time.monotonic()
            if now >= self._retry_at:
                shipped, failed = self._pass(self.max_segments_per_pass)
                more = shipped == self.max_segments_per_pass and not failed
                if more:
                    continue  # a backlog: the next bounded pass at once
            # failing: sleep out the backoff (a wake() only ends the sleep early); else the interval
            wait = max(0.01, self._retry_at - time.monotonic()) if self.consecutive_failures else self.interval_s
            self._wake.wait(wait)
            self._wake.clear()

    def wake(self) -> None:
        """Ship soon (e.g. after the writer closed a segment) instead of at the next interval."""
        self._wake.set()

    # -- reporting and shutdown ------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.alive

    def healthy(self) -> bool:
        """The thread runs (an unreachable bucket shows as `failing` in stats(), not here)."""
        return self._thread.alive and not self._closed

    def stats(self) -> dict[str, Any]:
        """Counters for the runtime's health report and /metrics (keys are stable)."""
        pending = self.pending()
        pending_bytes = 0
        for path in pending:
            with contextlib.suppress(OSError):
                pending_bytes += path.stat().st_size
        return {"enabled": True, "alive": self._thread.alive, "healthy": self.healthy(),
                "destination": self.destination.url(), "replica_id": self.replica_id,
                "segments_shipped": self.segments_shipped, "bytes_shipped": self.bytes_shipped,
                "failures": self.failures, "consecutive_failures": self.consecutive_failures,
                "failing": self.consecutive_failures > 0, "vanished": self.vanished,
                "pending_segments": len(pending), "pending_bytes": pending_bytes,
                "last_error": self.last_error, "last_shipped_at": self.last_shipped_at,
                "thread": self._thread.stats()}

    def close(self, deadline_s: float = 10.0) -> bool:
        """Stop the thread, then ship what is left until `deadline_s`; True when nothing is left."""
        start = time.monotonic()
        self._thread.stopping.set()
        self._wake.set()
        self._thread.stop(timeout=deadline_s)
        remaining = max(0.0, deadline_s - (time.monotonic() - start))
        self.ship(deadline_s=remaining)
        self._closed = True
        left = self.pending()
        if left:
            logger.error("feedback shipper: %d segments of %s are still on local disk at shutdown (%s); the "
                         "next start ships them", len(left), self.replica_id, self.last_error)
        return not left


class ShipperCollector:
    """Prometheus collector of a shipper's stats(); register it on the runtime's metrics registry."""

    def __init__(self, shipper: FeedbackShipper) -> None:
        self.shipper = shipper

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.shipper.stats()
        yield CounterMetricFamily("leap:feedback_segments_shipped", "Feedback segments uploaded and verified",
                                  value=stats["segments_shipped"])
        yield CounterMetricFamily("leap:feedback_bytes_shipped", "Bytes of feedback segments uploaded",
                                  value=stats["bytes_shipped"])
        yield CounterMetricFamily("leap:feedback_ship_failures", "Segment uploads that failed (retried later)",
                                  value=stats["failures"])
        yield GaugeMetricFamily("leap:feedback_ship_pending_segments", "Closed segments not yet shipped",
                                value=stats["pending_segments"])
        yield GaugeMetricFamily("leap:feedback_ship_pending_bytes", "Bytes of closed segments not yet shipped",
                                value=stats["pending_bytes"])
        yield GaugeMetricFamily("leap:feedback_ship_failing", "1 while uploads to the bucket fail",
                                value=int(stats["failing"]))


def start_shipper(config: Any, writer: Any, telemetry: Any) -> FeedbackShipper | None:
    """The shipper of a serving runtime's writer when `config.feedback_url` is set (else None), started,
    with its metrics on the runtime's registry and its thread's errors counted."""
    if not getattr(config, "feedback_url", None):
        return None
    shipper = FeedbackShipper(writer.root, writer.replica_id, config.feedback_url,
                              endpoint_url=config.s3_endpoint_url,
                              on_error=lambda _exc: telemetry.thread_error(THREAD_NAME))
    telemetry.registry.register(ShipperCollector(shipper))
    telemetry.watch_thread(THREAD_NAME, lambda: shipper.alive)
    logger.info("LEAP ships feedback of replica %s to %s", shipper.replica_id, shipper.destination)
    return shipper.start()
