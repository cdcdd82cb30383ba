"""The CPU predictor service: batches whatever features have arrived and predicts with the published readout.

It runs in its own thread beside the engine. `submit` only appends to a bounded deque, so it never blocks
the engine loop (overflow is dropped and counted). Each batch is one matrix product with the readout
published at that moment; `publish` is one reference assignment, so a batch is always predicted by one
version. A failing batch is retried row by row so one bad vector costs one prediction, and the thread
runs under `SupervisedThread`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, Self

import numpy as np

from serving.supervise import RateLimitedLog, SupervisedThread

logger = logging.getLogger(__name__)


class Readout(Protocol):
    metadata: dict

    def predict(self, X: np.ndarray) -> np.ndarray: ...


PredictionCallback = Callable[[Sequence[str], np.ndarray, str, np.ndarray], None]
"""callback(request_ids, predicted_lengths, readout_version, enqueue_times)."""

DropCallback = Callable[[str, int], None]
"""on_drop(reason, count): items that left the service without a prediction."""


class PredictorService:
    """A thread that turns (request id, feature vector) items into predicted output lengths.

    Counters: `predicted` (items handed to the callback), `batches`, `errors` (batches that failed as a
    whole, callbacks that raised, loop restarts), `row_errors` (items no prediction could be made for)
    and `dropped` (items refused because the queue was full or no readout was published).
    """

    def __init__(self, readout: Readout | None, callback: PredictionCallback, max_batch: int = 1024,
                 name: str = "leap-predictor", max_pending: int = 1 << 20,
                 on_drop: DropCallback | None = None) -> None:
        self._readout = readout
        self._callback = callback
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._on_drop = on_drop
        self._items: deque[tuple[str, np.ndarray, float]] = deque()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._warn = RateLimitedLog(logger)
        self._thread = SupervisedThread(name, self._run, on_error=self._count_loop_error)
        self.predicted = 0
        self.batches = 0
        self.errors = 0
        self.row_errors = 0
        self.dropped = 0

    # -- producer side -------------------------------------------------------------------------
    def submit(self, request_id: str, feature: np.ndarray) -> bool:
        """Queue one feature vector; returns at once. False when it was dropped (queue full)."""
        if len(self._items) >= self._max_pending:
            self._drop("queue_full", 1)
            return False
        self._items.append((request_id, feature, time.perf_counter()))
        self._wake.set()
        return True

    def publish(self, readout: Readout | None) -> None:
        """Make `readout` the one used for every batch taken from now on (None: drop what arrives)."""
        self._readout = readout

    @property
    def readout(self) -> Readout | None:
        return self._readout

    @property
    def version(self) -> str:
        readout = self._readout
        return "" if readout is None else str(readout.metadata.get("version", ""))

    def pending(self) -> int:
        return len(self._items) + self._in_flight

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until everything submitted so far has been predicted; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._items or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.set()
                self._idle.wait(min(remaining, 0.01))
        return True

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> Self:
        if not self._thread.started:
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.alive

    def stop(self, timeout: float = 5.0) -> None:
        self._thread.stopping.set()
        self._wake.set()
        self._thread.stop(timeout)

    def stats(self) -> dict:
        return {**self._thread.stats(), "predicted": self.predicted, "batches": self.batches,
                "batch_errors": self.errors, "row_errors": self.row_errors, "dropped": self.dropped,
                "pending": self.pending()}

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- worker side ---------------------------------------------------------------------------
    def _drop(self, reason: str, count: int) -> None:
        self.dropped += count
        if self._on_drop is not None:
            self._on_drop(reason, count)

    def _count_loop_error(self, exc: BaseException) -> None:
        self.errors += 1
        with self._idle:
            self._in_flight = 0
            self._idle.notify_all()

    def _take_batch(self) -> list[tuple[str, np.ndarray, float]]:
        batch = []
        items = self._items
        while items and len(batch) < self._max_batch:
            batch.append(items.popleft())
        self._in_flight = len(batch)
        return batch

    def _predict(self, readout: Readout, batch: list[tuple[str, np.ndarray, float]]) -> tuple[np.ndarray, np.ndarray]:
        """(values, predicted) for the batch: one product, or after a failure one row at a time.

        `predicted[i]` is False for a row no prediction could be made for. Values are passed on as the
        readout gave them; whoever stores them decides what a non-finite one means.
        """
        try:
            values = np.asarray(readout.predict(np.stack([item[1] for item in batch])), dtype=np.float64)
            if values.shape != (len(batch),):
                raise ValueError(f"predictor returned shape {values.shape} for {len(batch)} rows")
            return values, np.ones(len(batch), dtype=bool)
        except Exception:
            self.errors += 1
            self._warn.warning("batch", "LEAP predictor: a batch of %d failed; predicting row by row", len(batch),
                               exc_info=True)
        values = np.full(len(batch), np.nan)
        predicted = np.zeros(len(batch), dtype=bool)
        for i, item in enumerate(batch):
            try:
                row = np.asarray(readout.predict(item[1][None, :]), dtype=np.float64).reshape(-1)
                if row.shape != (1,):
                    raise ValueError(f"predictor returned {row.shape[0]} values for one row")
                values[i], predicted[i] = row[0], True
            except Exception:
                self.row_errors += 1
                self._warn.warning("row", "LEAP predictor: no prediction for request %s", item[0], exc_info=True)
        return values, predicted

    def _run(self) -> None:
        stopping = self._thread.stopping
        while not stopping.is_set():
            if not self._items:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            batch = self._take_batch()
            try:
                readout = self._readout  # read after taking the batch: see the module docstring
                if readout is None:
                    self._drop("no_readout", len(batch))
                    continue
                values, predicted = self._predict(readout, batch)
                if not predicted.all():
                    self._drop("predict_error", int((~predicted).sum()))
                    keep = np.flatnonzero(predicted)
                    batch, values = [batch[i] for i in keep], values[keep]
                if not batch:
                    continue
                ids = [item[0] for item in batch]
                enqueued = np.fromiter((item[2] for item in batch), dtype=np.float64, count=len(batch))
                try:
                    self._callback(ids, values, str(readout.metadata.get("version", "")), enqueued)
                except Exception:
                    self.errors += 1
                    self._drop("callback_error", len(batch))
                    self._warn.warning("callback", "LEAP predictor: the prediction callback failed", exc_info=True)
                    continue
                self.predicted += len(batch)
                self.batches += 1
            finally:
                with self._idle:
                    self._in_flight = 0
                    if not self._items:
                        self._idle.notify_all()
