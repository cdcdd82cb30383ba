"""Online correction: an RLS thread that learns from finished requests and publishes new readouts.

Every `every` finished requests the thread applies one batch RLS update and calls
`publish(readout, generation)`; the scheduler never waits for it. Each anchor is a generation, and every
publish carries the one it was learned in, so an update computed just before a push cannot overwrite
it. The queue is bounded and the thread runs under `SupervisedThread`, so a row that breaks an update
costs that update, not online learning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from leap_core.readout import LinearReadout
from leap_core.rls import RLS
from serving.supervise import RateLimitedLog, SupervisedThread

logger = logging.getLogger(__name__)

Publish = Callable[[LinearReadout, int], None]
"""publish(readout, generation): serve an RLS-corrected readout learned under anchor `generation`."""


class OnlineLearner:
    """Owns one RLS state; thread-safe `observe`, `reanchor` and `stats`.

    Counters: `submitted`/`observed` (rows queued / processed), `updates` (since the last anchor),
    `dropped` (rows refused: queue full, wrong dimension, or a batch that failed), `errors` (updates or
    publishes that raised, loop restarts).
    """

    def __init__(self, rls: RLS | None, base_version: str, publish: Publish, every: int = 8,
                 max_queue: int = 65_536, on_drop: Callable[[str, int], None] | None = None,
                 on_error: Callable[[], None] | None = None) -> None:
        self._rls = rls
        self._base_version = base_version
        self._publish = publish
        self._every = every
        self._on_drop = on_drop
        self._on_error = on_error
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._warn = RateLimitedLog(logger)
        self.updates = 0
        self.submitted = 0
        self.observed = 0
        self.dropped = 0
        self.errors = 0
        self._generation = 0
        self._features: list[np.ndarray] = []
        self._lengths: list[int] = []
        self._buffered_generation = 0
        self._anchor_seen = rls.n_seen_ if rls is not None else 0
        self.published_version = base_version
        self._thread = SupervisedThread("leap-rls", self._run, on_error=lambda exc: self._error())
        self._thread.start()

    @property
    def generation(self) -> int:
        """The current anchor's generation; a publish tagged with another one is stale."""
        return self._generation

    @property
    def active(self) -> bool:
        """Whether rows are learned now (an anchor with RLS state is set)."""
        return self._rls is not None

    @property
    def alive(self) -> bool:
        return self._thread.alive

    def observe(self, feature: np.ndarray, output_tokens: int, generation: int | None = None) -> bool:
        """Queue one finished request; False when it was dropped because the queue is full.

        `generation` is the anchor the row was prepared for (its readout's columns); a row of another
        anchor than the current one is dropped, not learned. Default: the current one.
        """
        try:
            self._queue.put_nowait((feature, output_tokens, self._generation if generation is None else generation))
        except queue.Full:
            self._drop("queue_full", 1)
            return False
        self.submitted += 1
        return True

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Until every observed row is processed (replays and tests read the learner's state after it)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self.observed < self.submitted:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.alive:
                    return False
                self._idle.wait(min(remaining, 0.1))
        return True

    def reanchor(self, rls: RLS | None, base_version: str) -> int:
        """Start again from a pushed readout's anchor (None pauses learning); the new generation."""
        with self._lock:
            self._rls = rls
            self._base_version = base_version
            self._anchor_seen = rls.n_seen_ if rls is not None else 0
            self.published_version = base_version
            self.updates = 0
            self._generation += 1
            return self._generation

    def flush(self, timeout: float = 5.0) -> bool:
        """Learn every row observed so far, the partial batch included, before returning (the learner
        thread does it after the rows queued before this call); False when it did not happen within
        `timeout` (queue full, thread down)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def snapshot(self) -> dict | None:
        """The RLS state learned under the current anchor, taken between two updates (None while nothing
        learns): `state` (its state arrays), `readout` (the anchor readout the state extends),
        `base_version` (that readout's version), `rows` (rows folded since the anchor), `updates`,
        `generation`, and `buffered` (rows waiting for the next batch, not in the state yet).

        A fleet merges these states over their common anchor (`leap_core.fleet_rls`)."""
        with self._lock:
            rls = self._rls
            if rls is None:
                return None
            return {"state": rls.state_arrays(), "readout": rls.readout_, "base_version": self._base_version,
                    "rows": int(rls.n_seen_ - self._anchor_seen), "updates": self.updates,
                    "generation": self._generation, "buffered": len(self._features)}

    def close(self) -> None:
        self._thread.stopping.set()
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.stop(5)

    def stats(self) -> dict:
        with self._lock:
            rls = self._rls
            stats = {"active": rls is not None, "updates": self.updates, "observed": self.observed,
                     "base_version": self._base_version, "published_version": self.published_version,
                     "generation": self._generation, "dropped": self.dropped, "errors": self.errors}
            if rls is not None:
                stats.update(rls.stats())
        return stats

    def health(self) -> dict:
        return {**self._thread.stats(), "errors": self.errors, "dropped": self.dropped,
                "queue_depth": self._queue.qsize()}

    # -- the learner thread ----------------------------------------------------------------------
    def _drop(self, reason: str, count: int) -> None:
        self.dropped += count
        if self._on_drop is not None:
            self._on_drop(reason, count)

    def _error(self) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error()

    def _run(self) -> None:
        stopping = self._thread.stopping
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if stopping.is_set():
                    return
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):  # `flush`: learn the partial batch, then say so
                try:
                    self._learn_buffered()
                except Exception:
                    self._warn.warning("flush", "LEAP RLS: the waiting rows could not be learned", exc_info=True)
                finally:
                    item.set()
                continue
            try:
                self._take(*item)
            except Exception:
                self._error()
                self._warn.warning("row", "LEAP RLS: a finished request could not be learned", exc_info=True)
            finally:
                with self._idle:
                    self.observed += 1
                    self._idle.notify_all()

    def _learn_buffered(self) -> None:
        """Learn the rows waiting for a full batch now, as one smaller update (RLS is exact whatever the
        batch sizes), unless they belong to an earlier anchor."""
        if not self._features or self._buffered_generation != self._generation:
            return
        self._learn_batch(self._buffered_generation)

    def _learn_batch(self, generation: int) -> None:
        """Learn the buffered rows as one update and empty the buffer."""
        X, y = self._features, np.asarray(self._lengths, dtype=np.float64)
        self._features, self._lengths = [], []
        try:
            X = np.stack(X)
        except ValueError:
            self._drop("bad_batch", len(y))
            raise
        self._learn(X, y, generation)

    def _take(self, feature: np.ndarray, output_tokens: int, generation: int) -> None:
        if generation != self._generation:  # a row of an earlier anchor: never learned, never a reason
            self._drop("reanchored", 1)     # to drop the current anchor's rows
            return
        if generation != self._buffered_generation:  # rows kept from before a reanchor are not learned
            self._drop("reanchored", len(self._features))
            self._features, self._lengths = [], []
            self._buffered_generation = generation
        rls = self._rls
        feature = np.asarray(feature)
        if rls is not None and feature.shape != (rls.dim_,):
            self._drop("wrong_dim", 1)
            return
        self._features.append(feature)
        self._lengths.append(int(output_tokens))
        if len(self._features) >= self._every:
            self._learn_batch(generation)

    def _learn(self, X: np.ndarray, y: np.ndarray, generation: int) -> None:
        with self._lock:
            rls = self._rls
            if rls is None or generation != self._generation:
                return
            try:
                rls.partial_fit(X, y)
            except Exception:
                self._error()
                logger.exception("RLS update failed; keeping the published readout")
                return
            self.updates += 1
            readout = rls.readout()
            version = f"{self._base_version}+rls{self.updates}"
            readout.metadata["version"] = version
            self.published_version = version
        self._publish(readout, generation)
