"""A discrete-event simulator of the engine's step loop, to compare decode policies on whole traces.

Each step admits waiting requests in arrival order, then decodes up to `decode_slots` resident requests
chosen by the policy; a step's duration comes from a calibrated `leap_core.step_time.StepTimeModel`.
Stretches of steps in which the selection cannot change are taken in one move, so whole traces simulate
quickly. `SimConfig.stock` runs vLLM's own budget (every running request decodes, chunked prefill) as the
baseline; `slot_rule` lets the decode slots follow the load (`leap_core.decode_slots`); `refresh_at`
replaces a resident request's estimate mid-decode, to study refreshing against the one-shot countdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from leap_core.decode_slots import DecodeSlotRule, DemandRate
from leap_core.policy import UNBOUNDED_STEPS, DecodePolicy, advance_held_out, make_policy
from leap_core.step_time import StepTimeModel

__all__ = ["StepTimeModel",  # SimConfig.step_model's type, so simulator callers need one import
           "SimConfig", "SimResult", "simulate", "fcfs_capacity", "poisson_arrivals",
           "VLLM_CPU_MAX_NUM_SEQS", "VLLM_CPU_MAX_NUM_BATCHED_TOKENS"]


# vLLM's defaults for its OpenAI server on the CPU platform at world size 1 (EngineArgs.get_batch_defaults in
# vllm/engine/arg_utils.py: 128 x world size sequences, 2,048 x world size batched tokens; chunked prefill on)
VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SimConfig:
    """Engine shape and policy. `predicted` passed to `simulate` orders countdown; the true lengths make the oracle.

    Refresh (off when `refresh_at` is empty): after a step in which a request's generated count reaches
    `refresh_at[c]`, its predicted total becomes generated + `refreshed[request, c]` (the remaining length
    estimated at that point; NaN keeps the countdown), and the step takes `refresh_cost_s` longer per
    refreshed request. The prefill prediction is never refreshed at admission.

    Token budget: by default a step admits waiting prompts whole while they fit `max_prefill_tokens_per_step`
    (a longer first prompt goes alone), beside its decodes. With `chunked_prefill` the budget is vLLM's
    `max_num_batched_tokens`: the step's decodes take a token each first, the waiting prompts in arrival
    order take what is left, and the one that does not fit takes the rest of the budget, continuing first in
    the next steps (vLLM's scheduler, `schedule()` in vllm/v1/core/sched/scheduler.py, with its default
    `long_prefill_token_threshold` 0; a prompt in progress holds one of the `max_resident` seats).

    Adaptive decode slots (off when `slot_rule` is None): at each decision point, K =
    `slot_rule.slots(fixed, per_request, demand, resident)`, at most `decode_slots`: a decode-only step of k
    requests costs `fixed + per_request * k` with fixed = `step_model.base_s` and per_request =
    `per_decode_s + per_context_token_s x` the residents' mean context (the model's linear fields, which price
    every count past a `decode_base_s` table and are fitted on the same steps as it), and demand is what a
    `DemandRate(demand_tau_s)` fed each arrival's predicted length at its arrival time says, plus the
    residents' predicted remaining tokens over `slot_rule.drain_s`. K is recomputed where the simulator
    decides (an admission, a finish, an arrival while a seat is free, a policy change), not inside a stretch
    of identical steps taken in one move: between those the demand only decays (time constant
    `demand_tau_s`) and the backlog shrinks, so K is held a stretch longer than a step-by-step engine would.
    """

    max_resident: int = 512
    decode_slots: int = 64
    waiting_cap: int = 128
    aging: float = 0.0
    wait_aging: float = 0.0
    policy: str = "countdown"
    max_prefill_tokens_per_step: int = 2048
    step_model: StepTimeModel = field(default_factory=StepTimeModel)
    refresh_at: tuple[int, ...] = ()
    refresh_cost_s: float = 0.0
    # policy "gittins": the predictor's length distribution (leap_core.gittins.LengthGivenPrediction)
    distribution: Any = field(default=None, compare=False)
    chunked_prefill: bool = False
    slot_rule: DecodeSlotRule | None = None
    demand_tau_s: float = 30.0

    @classmethod
    def stock(cls, step_model: StepTimeModel | None = None, max_num_seqs: int = VLLM_CPU_MAX_NUM_SEQS,
              max_num_batched_tokens: int = VLLM_CPU_MAX_NUM_BATCHED_TOKENS) -> SimConfig:
        """Stock vLLM at its CPU defaults: FCFS admission, every running request decoded each step (up to
        `max_num_seqs`, which is also the most resident), vLLM's chunked-prefill token budget. KV-cache
        preemption is not modelled (the engine's cache holds `max_num_seqs` requests of the pool's lengths)."""
        return cls(max_resident=max_num_seqs, decode_slots=max_num_seqs, policy="fcfs",
                   max_prefill_tokens_per_step=max_num_batched_tokens, chunked_prefill=True,
                   step_model=step_model if step_model is not None else StepTimeModel())


@dataclass
class SimResult:
    """Per-request outcomes, in the order the requests were given. Times are in seconds."""

    arrival: np.ndarray
    output_tokens: np.ndarray
    first_token: np.ndarray  # absolute time of the first token
    finish: np.ndarray  # absolute time of the last token
    max_held_out: np.ndarray  # most consecutive steps the request was resident but not decoded
    steps: int  # engine steps taken
    tokens: int  # tokens generated over all steps (first tokens included), counted step by step

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def latency(self) -> np.ndarray:
        return self.finish - self.arrival

    @property
    def ptl(self) -> np.ndarray:
        """Per-token latency as in the LEAP paper: end-to-end latency over output tokens (not inter-token)."""
        return self.latency / self.output_tokens

    def aggregates(self) -> dict[str, float]:
        """Summary figures: PTL and TTFT distribution, latency, throughput over the makespan."""
        ptl, ttft, latency = self.ptl, self.ttft, self.latency
        makespan = float(self.finish.max() - self.arrival.min()) if self.arrival.size else 0.0
        p50, p90, p95 = np.percentile(ptl, [50, 90, 95])
        return {
            "mean_ptl": float(ptl.mean()),
            "p50_ptl": float(p50),
            "p90_ptl": float(p90),
            "p95_ptl": float(p95),
            "mean_ttft": float(ttft.mean()),
            "p95_ttft": float(np.percentile(ttft, 95)),
            "mean_latency": float(latency.mean()),
            "p95_latency": float(np.percentile(latency, 95)),
            "throughput": float(self.output_tokens.sum() / makespan) if makespan > 0 else float("nan"),
            "n": int(self.arrival.size),
            "max_steps_held_out": int(self.max_held_out.max()),
        }


def simulate(arrival, prompt_tokens, output_tokens, predicted, config: SimConfig = SimConfig(),
             refreshed=None) -> SimResult:
    """Replay requests through the step loop and return when each got its first and last token.

    `predicted` is each request's predicted total output length; only countdown and adaptive slots read
    it (pass `output_tokens` for the oracle). Every request needs at least one output token. With
    `config.refresh_at`, `refreshed` (n, len(refresh_at)) holds each request's remaining-length estimate
    at each of those generated counts.
    """
    arrival, prompt_tokens, output_tokens, predicted = _checked_requests(arrival, prompt_tokens, output_tokens,
                                                                         predicted, config)
    refresh_at, refreshed = _checked_refresh(config, refreshed, arrival.shape[0])
    n = arrival.shape[0]
    order = np.argsort(arrival, kind="stable")  # admission is FCFS, so work in arrival order
    queue = _Queue(arrival[order], prompt_tokens[order], output_tokens[order], predicted[order],
                   refreshed[order] if refresh_at.size else None)
    first_token = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    max_held = np.zeros(n, dtype=np.int64)
    policy = make_policy(config.policy, k=config.decode_slots, waiting_cap=config.waiting_cap, aging=config.aging,
                         distribution=config.distribution, wait_aging=config.wait_aging)
    slots = _AdaptiveSlots(config, queue) if config.slot_rule is not None else None
    model = config.step_model
    resident = _Resident.empty()

    now = queue.arrival[0]
    finished = steps = tokens = 0
    while finished < n:
        if len(resident) == 0 and queue.waiting and queue.next_arrival > now:
            now = queue.next_arrival  # idle engine: jump to the next arrival
        if slots is not None:
            policy.k = slots(now, resident)
        decoding, stable_steps, num_decodes = resident.decoding(policy, policy.k)
        context = resident.context(decoding)
        room = config.max_resident - len(resident)
        prefill = (queue.chunked(now, room, config.max_prefill_tokens_per_step - num_decodes)
                   if config.chunked_prefill else queue.admissible(now, room, config.max_prefill_tokens_per_step))
        if prefill:
            jump = 1
            now = now + model.step_seconds(num_decodes, prefill.tokens, context, prefill.pairs)
        else:
            # the same step repeats while nothing changes the selection: until a decoding request finishes
            # or is due a refresh, or (when a slot is free) the first step at or after the next arrival;
            # each repeat is `growth` longer than the one before (every decoded context gains a token)
            dt = model.step_seconds(num_decodes, 0, context)
            growth = model.per_context_token_s * num_decodes
            jump = resident.steps_unchanged(decoding, stable_steps, refresh_at)
            if len(resident) < config.max_resident and queue.waiting:
                jump = max(min(jump, steps_to_cover(queue.next_arrival - now, dt, growth)), 1)
            now = now + repeated_seconds(jump, dt, growth)
        steps += jump
        tokens += jump * num_decodes + prefill.requests
        resident.advance(decoding, jump)
        if refresh_at.size:
            refreshed_now = resident.refresh(decoding, refresh_at, queue.refreshed)
            if refreshed_now:
                now = now + refreshed_now * config.refresh_cost_s  # the step's outputs arrive after the refresh
        if prefill:
            new = queue.admit(prefill.requests, prefill.progress)
            first_token[new] = now
            resident.admit(new, queue)
        done_ids, done_max_held = resident.remove_finished()
        if done_ids.size:
            finish[done_ids] = now
            max_held[done_ids] = done_max_held
            finished += done_ids.shape[0]

    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(n)
    return SimResult(arrival=arrival, output_tokens=output_tokens, first_token=first_token[inverse],
                     finish=finish[inverse], max_held_out=max_held[inverse], steps=steps, tokens=tokens)


def repeated_seconds(steps: int, first: float, growth: float) -> float:
    """Seconds of `steps` consecutive steps, the first taking `first` and each `growth` longer than the last."""
    return steps * first + growth * steps * (steps - 1) / 2


def steps_to_cover(gap: float, first: float, growth: float) -> int:
    """The fewest such steps (at least 0) that together take `gap` seconds or more."""
    if gap <= 0:
        return 0
    if growth <= 0:
        return int(np.ceil(gap / first))
    b = first - growth / 2
    steps = int(np.ceil((-b + np.sqrt(b * b + 2 * growth * gap)) / growth))
    while steps > 0 and repeated_seconds(steps - 1, first, growth) >= gap:  # float rounding, either way
        steps -= 1
    while repeated_seconds(steps, first, growth) < gap:
        steps += 1
    return steps


def _checked_requests(arrival, prompt_tokens, output_tokens, predicted, config: SimConfig):
    """The requests' columns as arrays, once they and the engine shape are known to make a trace."""
    arrival = np.asarray(arrival, dtype=np.float64)
    prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
    output_tokens = np.asarray(output_tokens, dtype=np.int64)
    predicted = np.asarray(predicted, dtype=np.float64)
    n = arrival.shape[0]
    if not (prompt_tokens.shape == output_tokens.shape == predicted.shape == (n,)):
        raise ValueError("arrival, prompt_tokens, output_tokens and predicted must be 1-D of equal length")
    if n == 0:
        raise ValueError("no requests to simulate")
    if output_tokens.min() < 1:
        raise ValueError("every request needs output_tokens >= 1")
    if config.max_resident < 1 or config.decode_slots < 1:
        raise ValueError("max_resident and decode_slots must be positive")
    if config.chunked_prefill and config.max_prefill_tokens_per_step <= min(config.decode_slots,
                                                                            config.max_resident - 1):
        # vLLM requires max_num_batched_tokens >= max_num_seqs: a prompt in progress always gets a token
        raise ValueError("chunked_prefill needs max_prefill_tokens_per_step > the decodes beside a prompt in "
                         "progress, min(decode_slots, max_resident - 1)")
    if config.demand_tau_s <= 0:
        raise ValueError("demand_tau_s must be > 0")
    return arrival, prompt_tokens, output_tokens, predicted


def _checked_refresh(config: SimConfig, refreshed, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(generated counts at which predictions are refreshed, the estimates there); no counts: no refresh."""
    refresh_at = np.asarray(config.refresh_at, dtype=np.int64).reshape(-1)
    if refresh_at.size and (refresh_at.min() < 1 or np.any(np.diff(refresh_at) <= 0)):
        raise ValueError("refresh_at must be increasing generated counts >= 1")
    if config.refresh_cost_s < 0:
        raise ValueError("refresh_cost_s must be >= 0")
    if not refresh_at.size:
        return refresh_at, None
    refreshed = np.asarray(refreshed, dtype=np.float64) if refreshed is not None else None
    if refreshed is None or refreshed.shape != (n, refresh_at.size):
        raise ValueError(f"refresh_at needs refreshed estimates of shape ({n}, {refresh_at.size})")
    return refresh_at, refreshed


@dataclass(frozen=True)
class _Prefill:
    """What a step prefills: `requests` whose prompts complete in it (they join with their first token),
    `tokens` prompt tokens computed, their attending `pairs`, and `progress`, the tokens of the next waiting
    prompt computed so far when a chunk of it ran (0 otherwise). False when the step prefills nothing."""

    requests: int = 0
    tokens: int = 0
    pairs: int = 0
    progress: int = 0

    def __bool__(self) -> bool:
        return self.requests > 0 or self.tokens > 0


class _Queue:
    """The requests in arrival order, and how far admission has come: requests [admitted, n) wait, the first
    of them with `progress` of its prompt tokens already computed (chunked prefill)."""

    def __init__(self, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, predicted: np.ndarray,
                 refreshed: np.ndarray | None) -> None:
        self.arrival, self.prompt, self.output, self.predicted = arrival, prompt, output, predicted
        self.refreshed = refreshed
        self.admitted = 0
        self.progress = 0

    @property
    def waiting(self) -> bool:
        return self.admitted < self.arrival.shape[0]

    @property
    def next_arrival(self) -> float:
        return self.arrival[self.admitted]

    def _arrived(self, now: float, room: int) -> int:
        """How many waiting requests, in order, have arrived by `now`, at most `room`."""
        if room <= 0 or not self.waiting or self.arrival[self.admitted] > now:
            return 0
        return min(int(np.searchsorted(self.arrival, now, side="right")), self.admitted + room) - self.admitted

    def admissible(self, now: float, room: int, prefill_budget: int) -> _Prefill:
        """The requests this step admits whole: those arrived by `now`, in order, at most `room` of them,
        while their prompts fit `prefill_budget` (a longer first prompt goes alone)."""
        arrived = self._arrived(now, room)
        if not arrived:
            return _Prefill()
        prompts = self.prompt[self.admitted:self.admitted + arrived]
        cumulative = np.cumsum(prompts)
        fits = max(int(np.searchsorted(cumulative, prefill_budget, side="right")), 1)
        return _Prefill(fits, int(cumulative[fits - 1]), int((prompts[:fits] * (prompts[:fits] + 1) // 2).sum()))

    def chunked(self, now: float, room: int, budget: int) -> _Prefill:
        """vLLM's chunked prefill: the prompt in progress, then those arrived by `now`, in order, at most
        `room` requests counting the one in progress, each computing what is left of its prompt while
        `budget` tokens remain; the first that does not fit computes a chunk of the rest and stops the step.
        A chunk of n tokens from token c attends n (c + (n + 1) / 2) pairs."""
        arrived = self._arrived(now, room)
        if not arrived or budget <= 0:
            return _Prefill()
        start = np.zeros(arrived, dtype=np.int64)
        start[0] = self.progress
        left = self.prompt[self.admitted:self.admitted + arrived] - start
        cumulative = np.cumsum(left)
        complete = int(np.searchsorted(cumulative, budget, side="right"))
        tokens = int(cumulative[complete - 1]) if complete else 0
        chunk = min(budget - tokens, int(left[complete])) if complete < arrived else 0
        touched = min(complete + 1, arrived)
        computed = left[:touched].copy()
        if complete < arrived:
            computed[complete] = chunk
        pairs = int((computed * start[:touched] + computed * (computed + 1) // 2).sum())
        progress = (int(start[complete]) + chunk) if chunk else 0
        return _Prefill(complete, tokens + chunk, pairs, progress)

    def admit(self, count: int, progress: int = 0) -> slice:
        """Take the next `count` waiting requests, the one after them computed `progress` tokens into its
        prompt; their positions in arrival order."""
        taken = slice(self.admitted, self.admitted + count)
        self.admitted += count
        self.progress = progress
        return taken


class _Resident:
    """The resident requests as parallel arrays, in admission (= arrival) order: position in arrival
    order, true and predicted total length, arrival, tokens generated, consecutive steps held out,
    the most of those so far, prompt tokens, and every step held out since joining."""

    def __init__(self, ids: np.ndarray, output: np.ndarray, predicted: np.ndarray, arrival: np.ndarray,
                 generated: np.ndarray, held: np.ndarray, max_held: np.ndarray, prompt: np.ndarray,
                 waited: np.ndarray) -> None:
        self.ids, self.output, self.predicted, self.arrival = ids, output, predicted, arrival
        self.generated, self.held, self.max_held, self.prompt = generated, held, max_held, prompt
        self.waited = waited

    @classmethod
    def empty(cls) -> _Resident:
        counts = [np.empty(0, dtype=np.int64) for _ in range(5)]
        return cls(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64),
                   np.empty(0, dtype=np.float64), *counts)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def decoding(self, policy: DecodePolicy, slots: int) -> tuple[np.ndarray, int, int]:
        """(mask of the requests decoded this step, steps the policy's choice holds, how many decode): the
        policy picks when more requests are resident than there are decode slots."""
        if len(self) <= slots:
            return np.ones(len(self), dtype=bool), UNBOUNDED_STEPS, len(self)
        chosen, stable_steps = policy.select_steps(self.predicted, self.generated, self.held, self.arrival,
                                                   self.waited)
        decoding = np.zeros(len(self), dtype=bool)
        decoding[chosen] = True
        return decoding, stable_steps, chosen.shape[0]

    def context(self, decoding: np.ndarray) -> int:
        """Tokens of context the decoded requests attend to: each one's prompt and what it generated."""
        return int((self.prompt[decoding] + self.generated[decoding]).sum())

    def steps_unchanged(self, decoding: np.ndarray, stable_steps: int, refresh_at: np.ndarray) -> int:
        """Steps the selection holds: until the policy would choose again, a decoding request finishes, or
        one reaches its next refresh point (the step after which it is due)."""
        steps = min(stable_steps, int((self.output - self.generated)[decoding].min()))
        if refresh_at.size:
            upcoming = np.searchsorted(refresh_at, self.generated[decoding], side="right")
            due = upcoming < refresh_at.size
            if due.any():
                steps = min(steps, int((refresh_at[upcoming[due]] - self.generated[decoding][due]).min()))
        return steps

    def advance(self, decoding: np.ndarray, steps: int) -> None:
        """`steps` steps decoding the requests of `decoding` (a token each) and holding out the others."""
        self.generated = self.generated + steps * decoding
        self.held = advance_held_out(self.held, decoding, steps)
        self.max_held = np.maximum(self.max_held, self.held)
        self.waited = self.waited + steps * ~decoding

    def refresh(self, decoding: np.ndarray, refresh_at: np.ndarray, refreshed: np.ndarray) -> int:
        """Replace the predicted total of each decoding request that just reached a refresh point and is not
        done by generated + its estimate there (a NaN estimate keeps the countdown); how many were."""
        point = np.minimum(np.searchsorted(refresh_at, self.generated), refresh_at.size - 1)
        hit = np.flatnonzero(decoding & (refresh_at[point] == self.generated) & (self.generated < self.output))
        estimate = refreshed[self.ids[hit], point[hit]] if hit.size else np.empty(0)
        hit, estimate = hit[np.isfinite(estimate)], estimate[np.isfinite(estimate)]
        if hit.size:
            self.predicted[hit] = self.generated[hit] + estimate
        return int(hit.size)

    def admit(self, new: slice, queue: _Queue) -> None:
        """The requests at positions `new` of the queue join with their first token generated."""
        count = new.stop - new.start
        self.ids = np.concatenate((self.ids, np.arange(new.start, new.stop)))
        self.output = np.concatenate((self.output, queue.output[new]))
        self.predicted = np.concatenate((self.predicted, queue.predicted[new]))
        self.arrival = np.concatenate((self.arrival, queue.arrival[new]))
        self.generated = np.concatenate((self.generated, np.ones(count, dtype=np.int64)))
        self.held = np.concatenate((self.held, np.zeros(count, dtype=np.int64)))
        self.max_held = np.concatenate((self.max_held, np.zeros(count, dtype=np.int64)))
        self.prompt = np.concatenate((self.prompt, queue.prompt[new]))
        self.waited = np.concatenate((self.waited, np.zeros(count, dtype=np.int64)))

    def remove_finished(self) -> tuple[np.ndarray, np.ndarray]:
        """Take out the requests that generated their whole output: (their positions, most steps held out)."""
        done = self.generated >= self.output
        if not done.any():
            return self.ids[:0], self.max_held[:0]
        finished = self.ids[done], self.max_held[done]
        keep = ~done
        self.ids, self.output, self.predicted, self.arrival = (self.ids[keep], self.output[keep],
                                                               self.predicted[keep], self.arrival[keep])
        self.generated, self.held, self.max_held = self.generated[keep], self.held[keep], self.max_held[keep]
        self.prompt, self.waited = self.prompt[keep], self.waited[keep]
        return finished


class _AdaptiveSlots:
    """The decode slots of `SimConfig.slot_rule` at a decision point: the arrivals up to now feed the demand
    estimate with their predicted lengths (what the serving process knows), the residents give the backlog
    (countdown's predicted remaining, at least 1 each) and the mean context a decode attends to."""

    def __init__(self, config: SimConfig, queue: _Queue) -> None:
        self.rule, self.model, self.most = config.slot_rule, config.step_model, config.decode_slots
        self.queue = queue
        self.demand = DemandRate(config.demand_tau_s)
        self.fed = 0  # arrivals the demand estimate has seen, in arrival order

    def __call__(self, now: float, resident: _Resident) -> int:
        arrival, predicted = self.queue.arrival, self.queue.predicted
        while self.fed < arrival.shape[0] and arrival[self.fed] <= now:
            self.demand.add(float(arrival[self.fed]), float(predicted[self.fed]))
            self.fed += 1
        if len(resident) == 0:
            return self.most
        backlog = float(np.maximum(resident.predicted - resident.generated, 1.0).sum())
        context = float((resident.prompt + resident.generated).mean())
        per_request = self.model.per_decode_s + self.model.per_context_token_s * context
        demand = self.rule.demand(self.demand.rate(now), backlog)
        return min(self.rule.slots(self.model.base_s, per_request, demand, len(resident)), self.most)


def fcfs_capacity(prompt_tokens, output_tokens, config: SimConfig = SimConfig(), n: int = 4000,
                  seed: int = 0) -> float:
    """Requests per second the engine sustains under FCFS in steady state.

    At least `n` requests wait at t = 0: the pool repeated, each copy in its own seeded order, so the
    queue holds the pool's length mix exactly (a draw with replacement from a heavy-tailed pool moves
    the rate by several percent). The rate is counted between the 25th and the 75th percentile of
    completions, so neither the ramp-up (slots filling) nor the drain tail (fewer requests than slots
    at the end) enters it. Loads are quoted as fractions of this figure; releasing one pool at once and
    dividing by its makespan would include the tail and understate what the engine sustains. The engine
    keeps `config`'s shape and token budget (`SimConfig.stock()` gives stock vLLM's) at a fixed K.
    """
    prompt_tokens = np.asarray(prompt_tokens)
    output_tokens = np.asarray(output_tokens)
    if prompt_tokens.shape != output_tokens.shape or prompt_tokens.size == 0:
        raise ValueError("prompt_tokens and output_tokens must be 1-D of one non-zero length")
    rng = np.random.default_rng(seed)
    copies = -(-n // prompt_tokens.size)
    idx = np.concatenate([rng.permutation(prompt_tokens.size) for _ in range(copies)])
    n = idx.size
    fcfs = replace(config, policy="fcfs", aging=0.0, wait_aging=0.0, refresh_at=(), refresh_cost_s=0.0,
                   distribution=None, slot_rule=None)  # the engine shape and its token budget, FCFS at K
    finish = np.sort(simulate(np.zeros(n), prompt_tokens[idx], output_tokens[idx], output_tokens[idx], fcfs).finish)
    low, high = n // 4, (3 * n) // 4
    span = float(finish[high] - finish[low])
    return (high - low) / span if span > 0 else float(n / finish[-1])


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of a Poisson process with `rate` requests/s, the first one after one gap."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
