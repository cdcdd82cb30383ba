"""A discrete-event simulator of the engine's step loop, to compare decode policies on whole traces.

Each step the engine admits waiting requests in arrival order (their prefill yields the first token and
the hidden state the length prediction needs, so admission cannot be length-aware), then decodes up
to `decode_slots` of the requests already resident, chosen by the policy. A step's duration comes from
a linear `StepTimeModel` that can be calibrated from measured engine steps. Within a step everything is
vectorised, and a stretch of steps in which the selection cannot change (no request finishes, joins or
is forced in by the waiting cap) is taken in one move, so a 20,000-request trace takes seconds.

Optionally the predictions can be refreshed during decoding (the alternative to LEAP's one-shot
countdown): when a resident request's generated count reaches one of `refresh_at`, its estimate of the
remaining length is replaced by a given one (measured: a readout applied to the decode state the engine
captured at that point), and the step pays `refresh_cost_s` per refreshed request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from leap_core.policy import UNBOUNDED_STEPS, advance_held_out, make_policy

__all__ = ["StepTimeModel", "SimConfig", "SimResult", "simulate", "fcfs_capacity", "poisson_arrivals"]


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one engine step takes: a fixed cost, plus a cost per decoded sequence and per prefill token.

    The defaults are plausible for SmolLM2-135M on two CPU cores (about 760 generated tokens/s with 64
    decodes a step, about 20,000 prefill tokens/s); calibrate with `fit` from measured steps.
    """

    base_s: float = 0.02
    per_decode_s: float = 0.001
    per_prefill_token_s: float = 0.00005

    def step_seconds(self, num_decodes, num_prefill_tokens):
        """Duration of a step (scalars or arrays)."""
        return self.base_s + self.per_decode_s * num_decodes + self.per_prefill_token_s * num_prefill_tokens

    @classmethod
    def fit(cls, num_decodes, num_prefill_tokens, step_seconds) -> "StepTimeModel":
        """Least-squares coefficients from measured steps, constrained non-negative (a cost cannot be < 0)."""
        decodes = np.asarray(num_decodes, dtype=np.float64)
        prefill = np.asarray(num_prefill_tokens, dtype=np.float64)
        seconds = np.asarray(step_seconds, dtype=np.float64)
        design = np.column_stack((np.ones_like(decodes), decodes, prefill))
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0  # a column never exercised gets coefficient 0
        coef, _ = nnls(design / scale, seconds)
        coef = coef / scale
        return cls(base_s=float(coef[0]), per_decode_s=float(coef[1]), per_prefill_token_s=float(coef[2]))


@dataclass(frozen=True)
class SimConfig:
    """Engine shape and policy. `predicted` passed to `simulate` orders countdown; the true lengths make the oracle.

    Refresh (off when `refresh_at` is empty): after a step in which a request's generated count reaches
    `refresh_at[c]`, its predicted total becomes generated + `refreshed[request, c]` (the remaining length
    estimated at that point; NaN keeps the countdown), and the step takes `refresh_cost_s` longer per
    refreshed request. The prefill prediction is never refreshed at admission.
    """

    max_resident: int = 512
    decode_slots: int = 64
    waiting_cap: int = 128
    aging: float = 0.0
    policy: str = "countdown"
    max_prefill_tokens_per_step: int = 2048
    step_model: StepTimeModel = field(default_factory=StepTimeModel)
    refresh_at: tuple[int, ...] = ()
    refresh_cost_s: float = 0.0


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

    `predicted` is each request's predicted total output length; only countdown reads it (pass
    `output_tokens` for the oracle). Every request needs at least one output token. With
    `config.refresh_at`, `refreshed` (n, len(refresh_at)) holds each request's remaining-length estimate
    at each of those generated counts.
    """
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
    refresh_at = np.asarray(config.refresh_at, dtype=np.int64).reshape(-1)
    if refresh_at.size and (refresh_at.min() < 1 or np.any(np.diff(refresh_at) <= 0)):
        raise ValueError("refresh_at must be increasing generated counts >= 1")
    if config.refresh_cost_s < 0:
        raise ValueError("refresh_cost_s must be >= 0")
    if refresh_at.size:
        refreshed = np.asarray(refreshed, dtype=np.float64) if refreshed is not None else None
        if refreshed is None or refreshed.shape != (n, refresh_at.size):
            raise ValueError(f"refresh_at needs refreshed estimates of shape ({n}, {refresh_at.size})")

    order = np.argsort(arrival, kind="stable")  # admission is FCFS, so work in arrival order
    arr, prompt, out, pred = arrival[order], prompt_tokens[order], output_tokens[order], predicted[order]
    fresh = refreshed[order] if refresh_at.size else None
    first_token = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    max_held = np.zeros(n, dtype=np.int64)

    policy = make_policy(config.policy, k=config.decode_slots, waiting_cap=config.waiting_cap, aging=config.aging)
    model = config.step_model
    k, cap_resident, budget = config.decode_slots, config.max_resident, config.max_prefill_tokens_per_step
    n_refresh = refresh_at.size

    # Resident requests as parallel arrays, kept in admission (= arrival) order.
    r_id = np.empty(0, dtype=np.int64)
    r_out = np.empty(0, dtype=np.int64)
    r_pred = np.empty(0, dtype=np.float64)
    r_arr = np.empty(0, dtype=np.float64)
    r_gen = np.empty(0, dtype=np.int64)
    r_held = np.empty(0, dtype=np.int64)
    r_max_held = np.empty(0, dtype=np.int64)

    now = arr[0]
    next_waiting = 0  # requests [next_waiting, n) have not been admitted yet
    finished = 0
    steps = 0
    tokens = 0
    while finished < n:
        n_res = r_id.shape[0]
        if n_res == 0 and next_waiting < n and arr[next_waiting] > now:
            now = arr[next_waiting]  # idle engine: jump to the next arrival

        # Admission: arrived requests in order, while slots and the prefill token budget allow.
        admit_end = next_waiting
        prefill_tokens = 0
        if n_res < cap_resident and next_waiting < n and arr[next_waiting] <= now:
            admit_end = min(int(np.searchsorted(arr, now, side="right")), next_waiting + cap_resident - n_res)
            cumulative = np.cumsum(prompt[next_waiting:admit_end])
            fits = max(int(np.searchsorted(cumulative, budget, side="right")), 1)  # a long prompt goes alone
            admit_end = next_waiting + fits
            prefill_tokens = int(cumulative[fits - 1])
        admitted = admit_end - next_waiting

        # Decode: the policy picks among the requests resident before this step.
        if n_res > k:
            chosen, stable_steps = policy.select_steps(r_pred, r_gen, r_held, r_arr)
            decoding = np.zeros(n_res, dtype=bool)
            decoding[chosen] = True
            num_decodes = chosen.shape[0]
        else:
            decoding = np.ones(n_res, dtype=bool)
            stable_steps = UNBOUNDED_STEPS
            num_decodes = n_res

        # Repeat the same step while nothing changes the selection: until a decoding request finishes,
        # or (when a slot is free) until the first step that starts at or after the next arrival.
        jump = 1
        if admitted == 0:
            dt = model.step_seconds(num_decodes, 0)
            jump = min(stable_steps, int((r_out - r_gen)[decoding].min()))
            if n_refresh:  # stop at the first step after which a decoding request is due a refresh
                upcoming = np.searchsorted(refresh_at, r_gen[decoding], side="right")
                due = upcoming < n_refresh
                if due.any():
                    jump = min(jump, int((refresh_at[upcoming[due]] - r_gen[decoding][due]).min()))
            if n_res < cap_resident and next_waiting < n:
                jump = max(min(jump, int(np.ceil((arr[next_waiting] - now) / dt))), 1)
            now = now + jump * dt
        else:
            now = now + model.step_seconds(num_decodes, prefill_tokens)
        steps += jump
        tokens += jump * num_decodes + admitted
        r_gen = r_gen + jump * decoding
        r_held = advance_held_out(r_held, decoding, jump)
        r_max_held = np.maximum(r_max_held, r_held)
        if n_refresh:
            point = np.minimum(np.searchsorted(refresh_at, r_gen), n_refresh - 1)
            hit = np.flatnonzero(decoding & (refresh_at[point] == r_gen) & (r_gen < r_out))
            estimate = fresh[r_id[hit], point[hit]] if hit.size else np.empty(0)
            hit, estimate = hit[np.isfinite(estimate)], estimate[np.isfinite(estimate)]
            if hit.size:
                r_pred[hit] = r_gen[hit] + estimate
                now = now + hit.size * config.refresh_cost_s  # the step's outputs arrive after the refresh

        if admitted:
            new = slice(next_waiting, admit_end)
            first_token[new] = now
            r_id = np.concatenate((r_id, np.arange(next_waiting, admit_end)))
            r_out = np.concatenate((r_out, out[new]))
            r_pred = np.concatenate((r_pred, pred[new]))
            r_arr = np.concatenate((r_arr, arr[new]))
            r_gen = np.concatenate((r_gen, np.ones(admitted, dtype=np.int64)))
            r_held = np.concatenate((r_held, np.zeros(admitted, dtype=np.int64)))
            r_max_held = np.concatenate((r_max_held, np.zeros(admitted, dtype=np.int64)))
            next_waiting = admit_end

        done = r_gen >= r_out
        if done.any():
            done_ids = r_id[done]
            finish[done_ids] = now
            max_held[done_ids] = r_max_held[done]
            finished += done_ids.shape[0]
            keep = ~done
            r_id, r_out, r_pred, r_arr = r_id[keep], r_out[keep], r_pred[keep], r_arr[keep]
            r_gen, r_held, r_max_held = r_gen[keep], r_held[keep], r_max_held[keep]

    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.arange(n)
    return SimResult(arrival=arrival, output_tokens=output_tokens, first_token=first_token[inverse],
                     finish=finish[inverse], max_held_out=max_held[inverse], steps=steps, tokens=tokens)


def fcfs_capacity(prompt_tokens, output_tokens, config: SimConfig = SimConfig(), n: int = 4000,
                  seed: int = 0) -> float:
    """Requests per second the engine sustains under FCFS in steady state.

    At least `n` requests wait at t = 0: the pool repeated, each copy in its own seeded order, so the
    queue holds the pool's length mix exactly (a draw with replacement from a heavy-tailed pool moves
    the rate by several percent). The rate is counted between the 25th and the 75th percentile of
    completions, so neither the ramp-up (slots filling) nor the drain tail (fewer requests than slots
    at the end) enters it. Loads are quoted as fractions of this figure; releasing one pool at once and
    dividing by its makespan would include the tail and understate what the engine sustains.
    """
    prompt_tokens = np.asarray(prompt_tokens)
    output_tokens = np.asarray(output_tokens)
    if prompt_tokens.shape != output_tokens.shape or prompt_tokens.size == 0:
        raise ValueError("prompt_tokens and output_tokens must be 1-D of one non-zero length")
    rng = np.random.default_rng(seed)
    copies = -(-n // prompt_tokens.size)
    idx = np.concatenate([rng.permutation(prompt_tokens.size) for _ in range(copies)])
    n = idx.size
    fcfs = SimConfig(max_resident=config.max_resident, decode_slots=config.decode_slots,
                     waiting_cap=config.waiting_cap, policy="fcfs",
                     max_prefill_tokens_per_step=config.max_prefill_tokens_per_step, step_model=config.step_model)
    finish = np.sort(simulate(np.zeros(n), prompt_tokens[idx], output_tokens[idx], output_tokens[idx], fcfs).finish)
    low, high = n // 4, (3 * n) // 4
    span = float(finish[high] - finish[low])
    return (high - low) / span if span > 0 else float(n / finish[-1])


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of a Poisson process with `rate` requests/s, the first one after one gap."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
