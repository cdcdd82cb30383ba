"""Which resident requests decode each step: LEAP's side of vLLM's `schedule()`.

When there are more decode candidates than `decode_slots`, the `leap_core.policy.DecodePolicy` picks which
decode and the others are held out of this one step (they keep their KV blocks). The engine thread waits
on the predictor in one bounded place only (`ready_wait_ms`). The Gittins order is rebuilt whenever
another readout serves and falls back to countdown, reported, for a readout without a length
distribution; `adaptive_slots` chooses the slot count each step (`leap_core.decode_slots`). After the
step, what the engine scheduled is counted and per-request state is pruned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from leap_core.decode_slots import DecodeSlotRule, DemandRate, StepTimeEstimator
from leap_core.policy import DecodePolicy, make_policy
from serving import vllm_compat
from serving.config import LeapConfig
from serving.fcfs_fallback import FcfsFallback
from serving.readout.service import ReadoutService
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker, Tracked

logger = logging.getLogger(__name__)

EXPIRE_EVERY_S = 1.0
LONGEST_STEP_S = 1.0  # a longer gap between two steps is an idle engine, not a step


@dataclass
class Counters:
    """The scheduler-side counts `stats()` reports (reset by `configure` between replays)."""

    ready: int = 0
    missed: int = 0
    waited_s: float = 0.0
    max_held_out: int = 0
    steps: int = 0
    schedule_s: float = 0.0
    held_steps: int = 0  # steps that held at least one decode candidate out
    held: int = 0  # hold-outs over all steps


class DecodeSteps:
    """Chooses each step's decodes by the policy of `config` and counts what the engine ran."""

    def __init__(self, config: LeapConfig, tracker: RequestTracker, telemetry: Telemetry,
                 readouts: ReadoutService, fallback: FcfsFallback | None = None) -> None:
        self.config = config
        self._tracker = tracker
        self._telemetry = telemetry
        self._readouts = readouts
        self._fallback = fallback
        self.order_fallbacks = 0  # policies built to count down in place of the gittins order, a readout serving
        self.policy: DecodePolicy = self._make_policy()
        self.counters = Counters()
        self.last_held: set[str] = set()
        # the last step's (decoded requests, prefill tokens, tokens of context the decoded requests attend
        # to, attending pairs of the prefill chunks): what the step-time model prices
        self.last_step_shape: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._next_expiry = 0.0
        self.step_times = StepTimeEstimator()
        self.demand = DemandRate()
        self.slot_rule = self._make_slot_rule()
        self.slots = config.decode_slots
        self._last_step_start: float | None = None
        self._remaining: dict[str, float] = {}  # replaced whole each step: scrapes read it from another thread
        telemetry.outstanding.set_function(self.outstanding_tokens)

    def _make_policy(self) -> DecodePolicy:
        c = self.config
        self._fcfs = make_policy("fcfs", k=c.decode_slots, waiting_cap=c.waiting_cap, aging=c.aging)
        order = c.decode_order
        self._gittins = order == "gittins"
        self._generation = self._readouts.generation
        self._distribution = self._readouts.length_distribution if self._gittins else None
        fallback = self._order_fallback()
        if fallback is not None:
            order = "countdown"
            if self._readouts.readout is not None:  # with no readout there is nothing to rank by anyway
                self.order_fallbacks += 1
                logger.warning("LEAP: the gittins order counts down instead: %s", fallback)
        self._telemetry.order_fallback.set(0 if fallback is None else 1)
        return make_policy(order, k=c.decode_slots, waiting_cap=c.waiting_cap, aging=c.aging,
                           distribution=self._distribution, wait_aging=c.wait_aging)

    def _make_slot_rule(self) -> DecodeSlotRule:
        c = self.config
        return DecodeSlotRule(max_slots=c.decode_slots, min_slots=min(4, c.decode_slots), margin=c.slot_margin)

    def _order_fallback(self) -> str | None:
        """Why the configured order cannot rank the serving readout's requests (None when it can); the
        policy follows from the next step."""
        if self.config.decode_order != "gittins" or self._readouts.length_distribution is not None:
            return None
        if self._readouts.readout is None:
            return "no readout serves"
        return f"the serving readout {self._readouts.version!r} carries no length distribution"

    def describe_order(self) -> dict:
        """The decode order configured and the one serving (from the next step at the latest), why they
        differ, and how many times a serving readout without a length distribution made the gittins order
        count down."""
        configured = self.config.decode_order
        reason = self._order_fallback()
        return {"configured": configured, "serving": configured if reason is None else "countdown",
                "fallback": reason, "fallbacks": self.order_fallbacks}

    def reset(self) -> None:
        """Take the policy and decode shape of the settings as they are now, and count afresh."""
        self.policy = self._make_policy()
        self.counters = Counters()
        self._telemetry.max_held.set(0)
        self.slot_rule = self._make_slot_rule()
        self.slots = self.config.decode_slots

    # -- before the step -------------------------------------------------------------------------
    def _predicted_total(self, request: Any, entry: Tracked, source: str) -> float:
        """The total length a request is ordered by: the oracle's, the client's or LEAP's prediction."""
        if source == "oracle":
            value = entry.oracle
        elif source == "client" and entry.client_prediction is not None:
            value = entry.client_prediction
        else:
            value = self._tracker.predictions.get(request.request_id)
        return value if value is not None else float(request.max_tokens)

    def choose(self, running: list, current_step: int) -> None:
        """Hold out all but the chosen decode candidates for the coming `schedule()` call."""
        start = time.perf_counter()
        if self.config.adaptive_slots:
            self._time_last_step(start)
        now = time.time()
        track, predictions = self._tracker.track, self._tracker.predictions
        candidates, entries, missing, new = [], [], [], []
        source = self.config.length_source
        readouts = self._readouts
        if self._gittins and (readouts.generation != self._generation
                              or readouts.length_distribution is not self._distribution):
            self.policy = self._make_policy()  # another readout serves: rank by its distribution
        fcfs = self._fallback is not None and self._fallback.on  # the kill switch: FCFS from this step
        policy = self._fcfs if fcfs else self.policy
        needs_prediction = not fcfs and self._readouts.readout is not None and source in ("predicted", "client")
        for request in running:
            entry = track(request)
            if not vllm_compat.past_prefill(request):
                continue  # still in prefill: never held
            if not entry.decode_seen:
                entry.decode_seen = True
                entry.first_token_time = now
                new.append((request, entry))
                if needs_prediction:
                    if request.request_id in predictions:
                        self.counters.ready += 1
                        self._telemetry.ready.inc()
                    else:
                        missing.append(request.request_id)
            candidates.append(request)
            entries.append(entry)
        if missing:
            self._wait_for_predictions(missing)
        adaptive = self.config.adaptive_slots and not fcfs and self.config.decode_order != "fcfs"
        if adaptive:
            for request, entry in new:
                self.demand.add(now, self._predicted_total(request, entry, source))
        n = len(candidates)
        self._telemetry.resident.set(len(running))
        self._telemetry.decoding.set(n)
        self.last_held = set()
        k = self.config.decode_slots
        if n > (self.slot_rule.min_slots if adaptive else k):
            predicted = np.fromiter((self._predicted_total(r, e, source) for r, e in zip(candidates, entries)),
                                    dtype=np.float64, count=n)
            generated = np.fromiter((r.num_output_tokens for r in candidates), dtype=np.float64, count=n)
            if adaptive:
                k = self._adaptive_slots(candidates, predicted, generated, now)
        self.slots = policy.k = k
        self._telemetry.slots.set(k)
        if n > k:
            held_out = np.fromiter((e.held_out for e in entries), dtype=np.int64, count=n)
            arrival = np.fromiter((e.arrival for e in entries), dtype=np.float64, count=n)
            waited = np.fromiter((e.waited for e in entries), dtype=np.int64, count=n)
            chosen = np.zeros(n, dtype=bool)
            chosen[policy.select(predicted, generated, held_out, arrival, waited)] = True
            for request, keep in zip(candidates, chosen):
                if not keep:
                    vllm_compat.hold_out_next_step(request, current_step)
                    self.last_held.add(request.request_id)
        self._telemetry.held.set(len(self.last_held))
        if self.last_held:
            self.counters.held_steps += 1
            self.counters.held += len(self.last_held)
            self._telemetry.reordered_steps.inc()
            self._telemetry.held_total.inc(len(self.last_held))
        self._remaining = self.remaining_tokens(running)
        self.counters.schedule_s += time.perf_counter() - start

    def remaining_tokens(self, running: list) -> dict[str, float]:
        """{request id: predicted remaining output tokens} of every resident request, prefilling ones
        included (the prediction the order uses, else max_tokens, less what it generated)."""
        source, track = self.config.length_source, self._tracker.track
        return {r.request_id: max(self._predicted_total(r, track(r), source) - r.num_output_tokens, 0.0)
                for r in running}

    def outstanding_tokens(self) -> float:
        """The decode work this replica still holds, as a gateway may weigh it: the last step's remaining
        tokens of the requests still resident now, read at every scrape (`leap:predicted_outstanding_tokens`),
        so a request that finished after the last step no longer counts."""
        tracked = self._tracker.tracked
        return float(sum(v for rid, v in self._remaining.items() if rid in tracked))

    def describe_slots(self) -> dict:
        """K now, whether it is chosen each step, and the step time it is chosen from."""
        fixed, per_decode, per_prefill, per_context = (float(v) for v in self.step_times.coefficients())
        return {"adaptive": self.config.adaptive_slots, "slots": self.slots, "max_slots": self.config.decode_slots,
                "step_model": {"fixed_s": fixed, "per_decode_s": per_decode, "per_prefill_token_s": per_prefill,
                               "per_context_token_s": per_context, "steps": self.step_times.steps_},
                "demand_tok_s": self.demand.rate(time.time())}

    def _time_last_step(self, start: float) -> None:
        """The seconds since the last step began, as the duration of that step (whose shape `count` kept),
        unless the engine sat idle in between."""
        last, self._last_step_start = self._last_step_start, start
        if last is not None and start - last < LONGEST_STEP_S:
            decodes, prefill, context, _ = self.last_step_shape
            self.step_times.observe(decodes, prefill, context, start - last)

    def _adaptive_slots(self, candidates: list, predicted: np.ndarray, generated: np.ndarray, now: float) -> int:
        """K for this step from the measured step time, the arriving demand and the resident backlog."""
        if not self.step_times.fitted:
            return self.config.decode_slots
        context = sum(vllm_compat.context_tokens(r) for r in candidates) / len(candidates)
        fixed, per_request = self.step_times.decode_step(context)
        backlog = float(np.maximum(predicted - generated, 0.0).sum())
        demand = self.slot_rule.demand(self.demand.rate(now), backlog)
        return self.slot_rule.slots(fixed, per_request, demand, len(candidates))

    def _wait_for_predictions(self, missing: list[str]) -> None:
        """One bounded wait for all of this step's new decode candidates that have no prediction yet."""
        self.counters.missed += len(missing)
        self._telemetry.missed.inc(len(missing))
        timeout = self.config.ready_wait_ms / 1000.0
        if timeout <= 0 or not self._readouts.predictor.running:
            return
        start = time.perf_counter()
        self._tracker.wait_for(missing, timeout)
        waited = time.perf_counter() - start
        self.counters.waited_s += waited
        self._telemetry.wait_seconds.inc(waited)

    # -- after the step --------------------------------------------------------------------------
    def count(self, running: list, num_scheduled_tokens: dict[str, int]) -> None:
        """Count hold-outs from what the engine actually scheduled, and the step's shape."""
        decodes = sum(1 for tokens in num_scheduled_tokens.values() if tokens == 1)
        context = pairs = 0
        worst = self.counters.max_held_out
        tracked = self._tracker.tracked
        for request in running:  # one pass: the step's shape, then the hold-outs
            tokens = num_scheduled_tokens.get(request.request_id, 0)
            if tokens == 1:
                context += vllm_compat.context_tokens(request)
            elif tokens > 1:
                pairs += vllm_compat.prefill_pairs(request, tokens)
            entry = tracked.get(request.request_id)
            if entry is None or not entry.decode_seen:
                continue
            if tokens:
                entry.held_out = 0
            else:
                entry.held_out += 1
                entry.waited += 1
                worst = max(worst, entry.held_out)
        self.last_step_shape = (decodes, sum(num_scheduled_tokens.values()) - decodes, context, pairs)
        if worst != self.counters.max_held_out:
            self.counters.max_held_out = worst
            self._telemetry.max_held.set(worst)
        self.counters.steps += 1

    def tidy(self) -> None:
        """The predictor's backlog gauge, and once a second the per-request state pruned and measured."""
        self._telemetry.pending.set(self._readouts.predictor.pending())
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRE_EVERY_S
            self._tracker.expire()
            for kind, size in self._tracker.sizes().items():
                self._telemetry.tracked.labels(kind=kind).set(size)
