"""Online correction: an RLS thread that learns from finished requests and publishes new readouts.

Finished requests arrive as (feature, true output length). Every `every` of them the thread applies one
batch RLS update, builds a readout with the new weights, and calls `publish` (which swaps the predictor's
readout and rescores the live requests from their cached features). The scheduler never waits for it.
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

logger = logging.getLogger(__name__)


class OnlineLearner:
    """Owns one RLS state; thread-safe `observe`, `reanchor` and `stats`."""

    def __init__(self, rls: RLS | None, base_version: str, publish: Callable[[LinearReadout], None],
                 every: int = 8) -> None:
        self._rls = rls
        self._base_version = base_version
        self._publish = publish
        self._every = every
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.updates = 0
        self.submitted = 0
        self.observed = 0
        self._generation = 0  # bumped by reanchor: rows buffered before it are dropped, not learned
        self.published_version = base_version
        self._thread = threading.Thread(target=self._run, name="leap-rls", daemon=True)
        self._thread.start()

    def observe(self, feature: np.ndarray, output_tokens: int) -> None:
        self.submitted += 1
        self._queue.put((feature, output_tokens, self._generation))

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Until every observed row is processed (replays and tests read the learner's state after it)."""
        deadline = time.monotonic() + timeout
        while self.observed < self.submitted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def reanchor(self, rls: RLS | None, base_version: str) -> None:
        """Start again from a pushed readout's anchor (None pauses learning until one arrives)."""
        with self._lock:
            self._rls = rls
            self._base_version = base_version
            self.published_version = base_version
            self.updates = 0
            self._generation += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def stats(self) -> dict:
        with self._lock:
            rls = self._rls
            stats = {"active": rls is not None, "updates": self.updates, "observed": self.observed,
                     "base_version": self._base_version, "published_version": self.published_version}
            if rls is not None:
                stats.update(rls.stats())
        return stats

    def _run(self) -> None:
        features: list[np.ndarray] = []
        lengths: list[int] = []
        buffered_generation = self._generation
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                feature, output_tokens, generation = item
                if generation != buffered_generation:  # rows kept from before a reanchor are not learned
                    features, lengths = [], []
                    buffered_generation = generation
                if generation != self._generation:
                    continue
                features.append(feature)
                lengths.append(output_tokens)
                if len(features) >= self._every:
                    X, y = np.stack(features), np.asarray(lengths, dtype=np.float64)
                    features, lengths = [], []
                    self._learn(X, y)
            finally:
                self.observed += 1

    def _learn(self, X: np.ndarray, y: np.ndarray) -> None:
        with self._lock:
            rls = self._rls
            if rls is None:
                return
            try:
                rls.partial_fit(X, y)
            except Exception:
                logger.exception("RLS update failed; keeping the published readout")
                return
            self.updates += 1
            readout = rls.readout()
            version = f"{self._base_version}+rls{self.updates}"
            readout.metadata["version"] = version
            self.published_version = version
        self._publish(readout)
