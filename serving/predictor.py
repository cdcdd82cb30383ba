"""The CPU predictor service: batches whatever features have arrived and predicts with the published readout.

It runs in its own thread beside the engine. Producers (the capture receiver) call `submit`, which only
appends to a deque and sets an event, so it never blocks the engine loop. The worker drains the deque,
stacks the features, does one matrix product with the readout that is published *at that moment*, and
hands the batch to the callback. `publish` swaps the readout with a single reference assignment, which
is atomic under the GIL, so a batch is always predicted entirely by one version.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np


class Readout(Protocol):
    metadata: dict

    def predict(self, X: np.ndarray) -> np.ndarray: ...


PredictionCallback = Callable[[Sequence[str], np.ndarray, str, np.ndarray], None]
"""callback(request_ids, predicted_lengths, readout_version, enqueue_times)."""


class PredictorService:
    """A thread that turns (request id, feature vector) items into predicted output lengths."""

    def __init__(self, readout: Readout, callback: PredictionCallback, max_batch: int = 1024,
                 name: str = "leap-predictor") -> None:
        self._readout = readout
        self._callback = callback
        self._max_batch = max_batch
        self._items: deque[tuple[str, np.ndarray, float]] = deque()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.predicted = 0
        self.batches = 0
        self.errors = 0

    # -- producer side -------------------------------------------------------------------------
    def submit(self, request_id: str, feature: np.ndarray) -> None:
        """Queue one feature vector; returns at once."""
        self._items.append((request_id, feature, time.perf_counter()))
        self._wake.set()

    def publish(self, readout: Readout) -> None:
        """Make `readout` the one used for every batch from now on."""
        self._readout = readout

    @property
    def readout(self) -> Readout:
        return self._readout

    @property
    def version(self) -> str:
        return str(self._readout.metadata.get("version", ""))

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
    def start(self) -> "PredictorService":
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> "PredictorService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- worker side ---------------------------------------------------------------------------
    def _take_batch(self) -> list[tuple[str, np.ndarray, float]]:
        batch = []
        items = self._items
        while items and len(batch) < self._max_batch:
            batch.append(items.popleft())
        self._in_flight = len(batch)
        return batch

    def _run(self) -> None:
        while not self._stop:
            if not self._items:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            batch = self._take_batch()
            readout = self._readout
            ids = [item[0] for item in batch]
            try:
                features = np.stack([item[1] for item in batch])
                predictions = readout.predict(features)
                enqueued = np.fromiter((item[2] for item in batch), dtype=np.float64, count=len(batch))
                self._callback(ids, predictions, str(readout.metadata.get("version", "")), enqueued)
                self.predicted += len(batch)
                self.batches += 1
            except Exception:  # a bad vector must not kill the thread that serves every request
                self.errors += 1
            finally:
                with self._idle:
                    self._in_flight = 0
                    if not self._items:
                        self._idle.notify_all()
