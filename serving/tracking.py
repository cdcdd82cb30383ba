"""Per-request state: what LEAP knows about each resident request, its captured feature and its prediction.

Three threads write here (the engine thread, the capture receiver, the predictor and readout publisher),
so the per-request dicts are mutated and iterated under one lock, while the engine thread's hot reads are
single dict operations. Nothing here may grow with the number of requests served, only with the number
resident: late and orphaned arrivals are dropped and counted (docs/architecture.md). Client `leap_*`
extras are validated once, when a request becomes resident (`serving.request_extras`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving import vllm_compat
from serving.request_extras import LeapExtras, parse_leap_extras
from serving.supervise import RateLimitedLog
from serving.telemetry import Telemetry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    """What LEAP remembers about one resident request."""

    arrival: float
    extras: LeapExtras
    held_out: int = 0  # consecutive steps held out; 0 after each decode
    waited: int = 0  # every step held out since its first decode (the tail guard's wait)
    first_token_time: float | None = None
    decode_seen: bool = False
    predicted_at_admission: float | None = None

    @property
    def oracle(self) -> float | None:
        return self.extras.leap_oracle_length

    @property
    def client_prediction(self) -> float | None:
        return self.extras.leap_predicted_length


class RequestTracker:
    """The per-request dicts of one runtime, with their locking, pruning and counting.

    Parameters
    ----------
    telemetry : where drops and bad extras are counted.
    finished_memory : how many recently finished ids are remembered to recognise late arrivals.
    orphan_ttl_s : how long a feature or prediction may wait for its request to become resident.
    max_awaiting : how many finished requests may wait for a feature that is still on its way.
    clock : monotonic seconds (a parameter so expiry can be exercised without sleeping).
    """

    def __init__(self, telemetry: Telemetry, finished_memory: int = 65_536, orphan_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, max_awaiting: int = 4096) -> None:
        self.telemetry = telemetry
        self.tracked: dict[str, Tracked] = {}
        self.features: dict[str, np.ndarray] = {}
        self.predictions: dict[str, float] = {}
        self.versions: dict[str, str] = {}
        self._finished_memory = finished_memory
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._orphans: dict[str, float] = {}  # id -> when its first untracked feature/prediction arrived
        self._orphan_ttl_s = orphan_ttl_s
        # finished before their feature arrived (a worker in another process sends it over ZeroMQ):
        # id -> deadline; their features, once they come, wait in _late_features
        self._awaiting: OrderedDict[str, float] = OrderedDict()
        self._late_features: dict[str, np.ndarray] = {}
        self._max_awaiting = max_awaiting
        self._clock = clock
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._warn = RateLimitedLog(logger)

    # -- the engine thread -------------------------------------------------------------------------
    def track(self, request: Any) -> Tracked:
        """The entry of a resident request, created (and its extras validated) the first time."""
        entry = self.tracked.get(request.request_id)
        if entry is None:
            extras = self._extras(request)
            entry = Tracked(arrival=float(request.arrival_time), extras=extras)
            rid = request.request_id
            with self._lock:
                self.tracked[rid] = entry
                self._orphans.pop(rid, None)
                self._finished.pop(rid, None)  # an id reused after it finished is a new request
                prediction = self.predictions.get(rid)
            if prediction is not None:
                entry.predicted_at_admission = prediction
        return entry

    def _extras(self, request: Any) -> LeapExtras:
        extras, errors = parse_leap_extras(vllm_compat.request_extra_args(request))
        if errors:
            for key in errors:
                self.telemetry.bad_extra(key)
            listed = "; ".join(f"{key[:64]}: {reason}" for key, reason in sorted(errors.items())[:8])
            more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
            self._warn.warning("extras", "LEAP ignored invalid extras of request %s: %s%s", request.request_id,
                               listed, more)
        return extras

    def entry_of_unseen(self, request: Any) -> Tracked:
        """An entry (not stored) for a request that finished before any step began with it resident:
        one whose first token ended it (EOS at once, or max_tokens=1) in the step that prefilled it."""
        now = time.time()
        return Tracked(arrival=float(request.arrival_time), extras=self._extras(request), first_token_time=now)

    def finish(self, request_id: str, await_feature_s: float | None = None
               ) -> tuple[Tracked | None, np.ndarray | None, float | None, str, bool]:
        """Forget a finished request: (entry, feature, latest prediction, its readout version, awaiting).

        With `await_feature_s`, a request without its feature yet waits for it that long (`settle`), unless
        too many already wait; `awaiting` says whether it does. Decided under the lock that `add_feature`
        takes, so a feature landing at this moment is never lost between the two.
        """
        with self._lock:
            entry = self.tracked.pop(request_id, None)
            feature = self.features.pop(request_id, None)
            awaiting = (feature is None and await_feature_s is not None
                        and len(self._awaiting) < self._max_awaiting)
            if awaiting:
                self._awaiting[request_id] = self._clock() + await_feature_s
            predicted = self.predictions.pop(request_id, None)
            version = self.versions.pop(request_id, "")
            self._orphans.pop(request_id, None)
            self._finished[request_id] = None
            if len(self._finished) > self._finished_memory:
                self._finished.popitem(last=False)
        return entry, feature, predicted, version, awaiting

    def settle(self, final: bool = False) -> list[tuple[str, np.ndarray | None]]:
        """(id, feature) of finished requests whose feature arrived; (id, None) for those whose wait is
        over (every one when `final`)."""
        if not self._awaiting:  # the engine thread calls this every step: no lock when nothing waits
            return []
        now = self._clock()
        settled = []
        with self._lock:
            for rid, deadline in list(self._awaiting.items()):
                feature = self._late_features.pop(rid, None)
                if feature is not None or final or now >= deadline:
                    del self._awaiting[rid]
                    settled.append((rid, feature))
        return settled

    def wait_for(self, request_ids: Sequence[str], timeout: float) -> list[str]:
        """Wait until every id has a prediction or `timeout` passes; the ids still without one.

        One deadline for all of them: the engine thread waits at most `timeout` per step however many
        requests reach decode without a prediction. It sleeps on a condition that every stored
        prediction signals, so it wakes as soon as the last one arrives.
        """
        deadline = time.monotonic() + timeout
        predictions = self.predictions
        with self._arrived:
            missing = [rid for rid in request_ids if rid not in predictions]
            while missing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.wait(remaining)
                missing = [rid for rid in missing if rid not in predictions]
        return missing

    def expire(self) -> int:
        """Drop features and predictions whose request has not become resident within the TTL."""
        now = self._clock()
        with self._lock:
            stale = [rid for rid, since in self._orphans.items()
                     if now - since > self._orphan_ttl_s and rid not in self.tracked]
            features = predictions = 0
            for rid in stale:
                del self._orphans[rid]
                features += self.features.pop(rid, None) is not None
                predictions += self.predictions.pop(rid, None) is not None
                self.versions.pop(rid, None)
        self.telemetry.drop("feature", "expired", features)
        self.telemetry.drop("prediction", "expired", predictions)
        return len(stale)

    # -- the receiver and predictor threads --------------------------------------------------------
    def add_feature(self, request_id: str, feature: np.ndarray) -> bool:
        """Keep a captured feature; False (and counted) when its request already finished."""
        with self._lock:
            if request_id in self._awaiting:  # its request finished first: the row waits for it
                self._late_features[request_id] = feature
                return False
            if request_id in self._finished:
                accepted = False
            else:
                accepted = True
                self.features[request_id] = feature
                if request_id not in self.tracked:
                    self._orphans.setdefault(request_id, self._clock())
        if not accepted:
            self.telemetry.drop("feature", "finished")
        return accepted

    def add_predictions(self, request_ids: Iterable[str], values: np.ndarray, version: str) -> int:
        """Store predictions; non-finite ones and those of finished requests are dropped and counted.

        A NaN stored as a prediction would sort after every number and hold its request out until the
        waiting cap forces it in; without a prediction it goes by its max_tokens instead.
        """
        stored = non_finite = finished = 0
        admitted: list[tuple[Tracked, float]] = []
        with self._arrived:
            tracked, predictions, versions, done = self.tracked, self.predictions, self.versions, self._finished
            for rid, value in zip(request_ids, values):
                value = float(value)
                if not math.isfinite(value):
                    non_finite += 1
                    continue
                if rid in done:
                    finished += 1
                    continue
                predictions[rid] = value
                versions[rid] = version
                stored += 1
                entry = tracked.get(rid)
                if entry is None:
                    self._orphans.setdefault(rid, self._clock())
                elif entry.predicted_at_admission is None:
                    admitted.append((entry, value))
            if stored:
                self._arrived.notify_all()
        for entry, value in admitted:
            entry.predicted_at_admission = value
        self.telemetry.predictions.inc(stored)
        self.telemetry.drop("prediction", "non_finite", non_finite)
        self.telemetry.drop("prediction", "finished", finished)
        if non_finite:
            self._warn.warning("non_finite", "LEAP: %d non-finite predictions (readout %s) treated as missing",
                               non_finite, version)
        return stored

    def live_features(self) -> tuple[list[str], list[np.ndarray]]:
        """A consistent snapshot of (ids, features) of every request not yet finished."""
        with self._lock:
            return list(self.features), list(self.features.values())

    def sizes(self) -> dict[str, int]:
        return {"tracked": len(self.tracked), "features": len(self.features),
                "predictions": len(self.predictions), "orphans": len(self._orphans),
                "awaiting_feature": len(self._awaiting),
                "finished_memory": len(self._finished)}
