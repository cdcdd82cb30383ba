"""The long-request tail (`leap eval tail`): how the waiting cap, aging and wait aging trade the tail of long
requests against mean PTL under countdown, on paired workloads (`evaluation.simulation`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numpy.typing import ArrayLike

from evaluation.simulation import (
    HEADLINE_LOAD,
    LONG_QUANTILE,
    TAIL_GOAL,
    TAIL_MEAN_GOAL,
    _base_config,
    _pool,
    _run_policy,
    _tail_goal,
    _with_intervals,
    _workloads,
)
from leap_core.simulator import SimResult, StepTimeModel, fcfs_capacity, poisson_arrivals


def run_tail(prompt_tokens: ArrayLike, lengths: ArrayLike, predicted: ArrayLike, step_model: StepTimeModel,
             waiting_caps=(8, 16, 32, 64, 128, 256, 1024), agings=(0.0, 0.01, 0.1, 0.3, 1.0, 3.0),
             wait_agings=(0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 3.0), multiplier: float = HEADLINE_LOAD, long_quantile: float = LONG_QUANTILE, n_requests: int = 2000,
             seeds: int = 30, seed: int = 0, aging_waiting_cap: int = 128, **config) -> dict:
    """How the waiting cap, aging and wait aging trade long-request tail latency against mean PTL under
    countdown.

    Long requests are those whose true length is at least the pool's `long_quantile`. Cap rows use no
    aging; aging and wait-aging rows (`leap_core.policy.CountdownPolicy`) use `aging_waiting_cap`. `config` holds the other SimConfig knobs. Every figure is
    a mean over `seeds` paired workloads with its 95% bootstrap interval (`<figure>_ci`). Each row also
    has its long-request P95 and mean PTL over FCFS's, paired by seed, and whether it meets the tail goal
    (`meets_goal`: long-request P95 <= TAIL_GOAL x FCFS's and mean PTL <= TAIL_MEAN_GOAL x FCFS's, both
    point values); `met_by` lists the rows that do.
    """
    prompt, out, preds = _pool(prompt_tokens, lengths, {"countdown": predicted})
    base = _base_config(step_model, config)
    capacity = fcfs_capacity(prompt, out, base)
    threshold = float(np.quantile(out, long_quantile))
    settings = {("fcfs",): None, **{("cap", int(c)): replace(base, waiting_cap=int(c), aging=0.0)
                                    for c in waiting_caps},
                **{("aging", float(a)): replace(base, waiting_cap=int(aging_waiting_cap), aging=float(a))
                   for a in agings},
                **{("wait_aging", float(w)): replace(base, waiting_cap=int(aging_waiting_cap), aging=0.0,
                                                     wait_aging=float(w)) for w in wait_agings}}
    runs: dict[tuple, list] = {key: [] for key in settings}
    for idx, arrival_seed in _workloads(out.size, n_requests, seeds, seed):
        arrival = poisson_arrivals(n_requests, multiplier * capacity, seed=arrival_seed)
        drawn = {"countdown": preds["countdown"][idx]}
        long = out[idx] >= threshold
        for key, setting in settings.items():
            policy = "fcfs" if setting is None else "countdown"
            result = _run_policy(policy, arrival, prompt[idx], out[idx], drawn, setting or base)
            runs[key].append(_tail_figures(result, long))
    mean = {key: _with_intervals(values) for key, values in runs.items()}
    for key in settings:
        if key != ("fcfs",):
            mean[key].update(_tail_goal(runs[key], runs[("fcfs",)]))
    rows = {"cap": [{"waiting_cap": int(c), **mean[("cap", int(c))]} for c in waiting_caps],
            "aging": [{"aging": float(a), **mean[("aging", float(a))]} for a in agings],
            "wait_aging": [{"wait_aging": float(w), **mean[("wait_aging", float(w))]} for w in wait_agings]}
    return {
        "multiplier": float(multiplier),
        "capacity_rps": float(capacity),
        "n_requests": int(n_requests),
        "seeds": int(seeds),
        "long_quantile": float(long_quantile),
        "long_threshold_tokens": threshold,
        "aging_waiting_cap": int(aging_waiting_cap),
        "fcfs": mean[("fcfs",)],
        **rows,
        "goal": {"long_p95_over_fcfs": TAIL_GOAL, "mean_ptl_over_fcfs": TAIL_MEAN_GOAL},
        "met_by": [{knob: row[knob]} for key, knob in _TAIL_KNOBS for row in rows[key] if row["meets_goal"]],
    }


_TAIL_KNOBS = (("cap", "waiting_cap"), ("aging", "aging"), ("wait_aging", "wait_aging"))  # (rows, knob)


def _tail_figures(result: SimResult, long: np.ndarray) -> dict[str, float]:
    latency = result.latency
    return {"long_p95_latency_s": float(np.percentile(latency[long], 95)) if long.any() else float("nan"),
            "all_p95_latency_s": float(np.percentile(latency, 95)), "mean_ptl": float(result.ptl.mean())}
