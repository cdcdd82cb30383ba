"""Refreshing predictions against countdown (`leap eval refresh`), both arms measured in the simulator.

Countdown predicts once at prefill; refresh re-estimates the remaining length from decode states captured
during generation and pays for each estimate. The two are replayed on the same paired workloads
(`evaluation.simulation`), and the error of the estimate each holds is measured over a request's life.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numpy.typing import ArrayLike

from evaluation.simulation import (
    _REFERENCES,
    HEADLINE_LOAD,
    _base_config,
    _figures,
    _over_seeds,
    _pool,
    _run_policy,
    _workloads,
)
from leap_core.intervals import bootstrap_ci, difference_of_means, mean_ci, ratio_of_means
from leap_core.simulator import StepTimeModel, fcfs_capacity, poisson_arrivals, simulate


def run_refresh(prompt_tokens: ArrayLike, lengths: ArrayLike, predicted: ArrayLike, refreshed: ArrayLike,
                refresh_at, step_model: StepTimeModel, refresh_cost_s: float, load: float = HEADLINE_LOAD,
                n_requests: int = 2000, seeds: int = 30, seed: int = 0, **config) -> dict:
    """Countdown (one prediction at prefill) against refreshing it during decoding, both arms measured.

    `predicted` is each request's predicted total at prefill (what countdown schedules by, counting it
    down as tokens are generated); `refreshed[i, c]` is the remaining length a readout estimated from
    the decode state captured at generated = `refresh_at[c]` (NaN where the request ended before it).
    Each of `seeds` workloads replays the same draw and arrivals under FCFS, the oracle, countdown and
    refresh (which pays `refresh_cost_s` per refreshed request in its step); the latency and PTL ratios
    refresh / countdown carry 95% bootstrap intervals over the paired seeds. The error of the estimate
    the scheduler holds is measured at every captured point of each request's life (`life_error`).
    """
    prompt, out, preds = _pool(prompt_tokens, lengths, {"countdown": predicted})
    points = np.asarray(refresh_at, dtype=np.int64).reshape(-1)
    fresh = np.asarray(refreshed, dtype=np.float64)
    if fresh.shape != (out.size, points.size):
        raise ValueError(f"refreshed must be (requests, refresh points) = ({out.size}, {points.size})")
    if refresh_cost_s < 0:
        raise ValueError("refresh_cost_s must be >= 0")
    base = _base_config(step_model, config)
    capacity = fcfs_capacity(prompt, out, base)
    refreshing = replace(base, policy="countdown", refresh_at=tuple(int(p) for p in points),
                         refresh_cost_s=float(refresh_cost_s))
    arms = ("countdown", "refresh", *_REFERENCES)
    runs: dict[str, list] = {arm: [] for arm in arms}
    for idx, arrival_seed in _workloads(out.size, n_requests, seeds, seed):
        arrival = poisson_arrivals(n_requests, load * capacity, seed=arrival_seed)
        drawn = {"countdown": preds["countdown"][idx]}
        for policy in ("countdown", *_REFERENCES):
            runs[policy].append(_figures(_run_policy(policy, arrival, prompt[idx], out[idx], drawn, base)))
        runs["refresh"].append(_figures(simulate(arrival, prompt[idx], out[idx], drawn["countdown"], refreshing,
                                                 refreshed=fresh[idx])))
    table = {arm: _over_seeds([runs[arm]]) for arm in arms}
    ratio = {key: bootstrap_ci(ratio_of_means, np.array([f[key] for f in runs["refresh"]]),
                               np.array([f[key] for f in runs["countdown"]]), vectorized=True)
             for key in ("mean_ptl", "mean_latency_s")}
    life = life_error(out, preds["countdown"], fresh, points)
    return {
        "load": float(load),
        "capacity_rps": float(capacity),
        "n_requests": int(n_requests),
        "seeds": int(seeds),
        "n_pool": int(out.size),
        "refresh_at": points.tolist(),
        "refresh_cost_s": float(refresh_cost_s),
        "table": table,
        "ratios": {"refresh_over_countdown": ratio["mean_ptl"],
                   "refresh_over_countdown_latency": ratio["mean_latency_s"]},
        "refresh_wins": bool(ratio["mean_ptl"]["ci_high"] < 1.0),
        "life_error": life,
    }


def life_error(lengths: np.ndarray, predicted: np.ndarray, refreshed: np.ndarray, points: np.ndarray) -> dict:
    """Absolute error of the remaining-length estimate each arm holds at generated = 0 and at each refresh
    point a request reaches (g < its length).

    Countdown holds max(predicted - g, 1); refresh holds the estimate made at g (the prefill prediction
    at g = 0). Per point: both arms' MAE with 95% bootstrap intervals over requests; over life: each
    request's errors averaged over its points first (every request weighs once), then over requests.
    """
    out = np.asarray(lengths, dtype=np.float64)
    per_point, life = [], {"countdown": np.zeros(out.size), "refresh": np.zeros(out.size)}
    counts = np.zeros(out.size)
    for g, column in zip((0, *points.tolist()), (None, *refreshed.T)):
        reached = out > g
        if column is not None:
            reached &= np.isfinite(column)
        if not reached.any():
            continue
        remaining = out[reached] - g
        countdown = np.abs(np.maximum(predicted[reached] - g, 1.0) - remaining)
        refresh = countdown if column is None else np.abs(np.maximum(column[reached], 1.0) - remaining)
        life["countdown"][reached] += countdown
        life["refresh"][reached] += refresh
        counts[reached] += 1
        per_point.append({"generated": int(g), "n": int(reached.sum()),
                          "countdown_mae": mean_ci(countdown),
                          "refresh_mae": mean_ci(refresh)})
    averaged = {arm: values[counts > 0] / counts[counts > 0] for arm, values in life.items()}
    return {"per_point": per_point,
            "over_life": {arm: mean_ci(values)
                          for arm, values in averaged.items()},
            "over_life_difference": bootstrap_ci(difference_of_means, averaged["refresh"], averaged["countdown"],
                                                 vectorized=True)}
