"""The runtime's Prometheus metrics, and the drop and error counts its health report repeats.

One registry per runtime (served at `/metrics` by the admin API, and appended to vLLM's `/metrics` on
the serving port by `serving.api_middleware`), so two engines in one process do not share counts. Names
follow vLLM's: a `leap:` prefix, lengths in tokens, times in seconds, labels from small fixed sets.
Everything LEAP throws away is counted with what it was and why (`leap:dropped_total{what, reason}`),
every `leap_*` request extra a client got wrong by key (`leap:bad_request_extras_total{key}`), and every
error a background thread survived (`leap:thread_errors_total{thread}`); `snapshot()` returns the same
numbers as plain dicts for `/leap/health`, without parsing Prometheus text.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from serving.request_extras import KNOWN_KEYS

UNKNOWN_EXTRA = "unknown"
"""The label of every `leap_*` extra key LEAP does not know (`leap:bad_request_extras_total`)."""
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
"""Output-length buckets in tokens, vLLM's 1-2-5 series (`vllm:request_generation_tokens`)."""

class Telemetry:
    """Every metric of one LEAP runtime; the counting methods are safe from any thread."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.predictions = Counter("leap:predictions", "Length predictions stored", registry=r)
        self.ready = Counter("leap:prediction_ready", "Requests whose prediction was ready at their first decode",
                             registry=r)
        self.missed = Counter("leap:prediction_missed", "Requests that reached decode before their prediction",
                              registry=r)
        self.wait_seconds = Counter("leap:prediction_wait_seconds",
                                    "Engine-thread time spent waiting for missing predictions", registry=r)
        self.finished = Counter("leap:finished_requests", "Finished requests seen", registry=r)
        self.predicted_tokens = Histogram("leap:predicted_generation_tokens",
                                          "Predicted output length at admission of each finished request that had "
                                          "one, in tokens", buckets=TOKEN_BUCKETS, registry=r)
        self.actual_tokens = Histogram("leap:actual_generation_tokens", "True output length of the same finished "
                                       "requests, in tokens", buckets=TOKEN_BUCKETS, registry=r)
        self.reordered_steps = Counter("leap:reordered_steps", "Steps in which LEAP held at least one decode "
                                       "candidate out (its order differed from vLLM's)", registry=r)
        self.held_total = Counter("leap:held_out_request_steps", "Decode candidates held out, summed over steps",
                                  registry=r)
        self.outstanding = Gauge("leap:predicted_outstanding_tokens", "Predicted remaining output tokens of the "
                                 "resident requests (the prediction, else max_tokens, less what each generated)",
                                 registry=r)
        self.rls_updates = Gauge("leap:rls_updates", "RLS batch updates since the last anchor", registry=r)
        self.resident = Gauge("leap:num_requests_resident", "Resident (running) requests", registry=r)
        self.decoding = Gauge("leap:num_decode_candidates", "Resident requests past prefill", registry=r)
        self.held = Gauge("leap:num_requests_held_out", "Requests held out this step", registry=r)
        self.slots = Gauge("leap:decode_slots", "Decode slots of this step (K; chosen each step when adaptive)",
                           registry=r)
        self.max_held = Gauge("leap:max_steps_held_out", "Longest hold-out seen", registry=r)
        self.fcfs_fallback = Gauge("leap:kill_switch", "1 while decodes are ordered FCFS by the kill switch "
                                   "or the live-ranking fallback (serving/fcfs_fallback.py)", registry=r)
        self.order_fallback = Gauge("leap:order_fallback", "1 while the gittins order is configured but decodes "
                                    "count down: the serving readout carries no length distribution "
                                    "(serving/decode_steps.py)", registry=r)
        self.shadow_active = Gauge("leap:shadow_active", "1 while a challenger is held in shadow", registry=r)
        self.shadow_rows = Gauge("leap:shadow_rows", "Finished requests paired in the shadow's live figures "
                                 "(serving/readout/shadow.py)", registry=r)
        self.shadow_figure = Gauge("leap:shadow_figure", "Rolling figure of the served and the shadow readout on "
                                   "the same finished requests", ["readout", "figure"], registry=r)
        self.pending = Gauge("leap:predictor_queue", "Features waiting for a prediction", registry=r)
        self.tracked = Gauge("leap:tracked_state", "Per-request entries held, by kind", ["kind"], registry=r)
        self.readout = Info("leap:readout", "The readout serving now and where it came from", registry=r)
        self._dropped = Counter("leap:dropped", "Items LEAP dropped, by what they were and why",
                                ["what", "reason"], registry=r)
        self._bad_extras = Counter("leap:bad_request_extras",
                                   "Requests whose leap_* extra was ignored as invalid, by key", ["key"], registry=r)
        self._thread_errors = Counter("leap:thread_errors", "Errors a LEAP background thread survived",
                                      ["thread"], registry=r)
        self._thread_alive = Gauge("leap:thread_alive", "1 while a LEAP background thread runs", ["thread"],
                                   registry=r)
        self._lock = threading.Lock()
        self._dropped_tally: Tally[tuple[str, str]] = Tally()
        self._bad_extras_tally: Tally[str] = Tally()
        self._errors_tally: Tally[str] = Tally()

    def finished_lengths(self, predicted: float, actual: int) -> None:
        """One finished request's predicted (at admission) and true output length."""
        self.predicted_tokens.observe(max(float(predicted), 0.0))
        self.actual_tokens.observe(actual)

    def drop(self, what: str, reason: str, count: int = 1) -> None:
        """Count `count` dropped `what`s (capture, feature, prediction, rls_row, ...) for `reason`."""
        if count <= 0:
            return
        self._dropped.labels(what=what, reason=reason).inc(count)
        with self._lock:
            self._dropped_tally[(what, reason)] += count

    def bad_extra(self, key: str) -> None:
        """Count one ignored extra by its key; every key LEAP does not know counts as "unknown", so a
        client sending new names cannot grow the metrics without bound."""
        key = key if key in KNOWN_KEYS or key == "vllm_xargs" else UNKNOWN_EXTRA
        self._bad_extras.labels(key=key).inc()
        with self._lock:
            self._bad_extras_tally[key] += 1

    def thread_error(self, thread: str, count: int = 1) -> None:
        self._thread_errors.labels(thread=thread).inc(count)
        with self._lock:
            self._errors_tally[thread] += count

    def watch_thread(self, thread: str, alive: Callable[[], bool]) -> None:
        """Export `alive()` as `leap:thread_alive{thread}`, read at every scrape."""
        self._thread_alive.labels(thread=thread).set_function(lambda: float(bool(alive())))

    def set_readout(self, version: str, source: str) -> None:
        self.readout.info({"version": version, "source": source})

    def dropped(self, what: str, reason: str) -> int:
        with self._lock:
            return self._dropped_tally[(what, reason)]

    def snapshot(self) -> dict:
        """The drop, bad-extra and thread-error counts as plain dicts (for `/leap/health`)."""
        with self._lock:
            return {"dropped": {f"{what}/{reason}": n for (what, reason), n in sorted(self._dropped_tally.items())},
                    "bad_request_extras": dict(sorted(self._bad_extras_tally.items())),
                    "thread_errors": dict(sorted(self._errors_tally.items()))}
