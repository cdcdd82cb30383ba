"""The replay machinery the simulated studies share: workloads, policies, per-run figures, paired intervals.

Every simulated study (`simulated_load`, `simulated_refresh`, `simulated_tail`) replays requests drawn from a pool of
real ones (prompt and true output lengths, plus each predictor's predicted totals) through
`leap_core.simulator` under arrivals quoted as fractions of the sustained FCFS capacity (`fcfs_capacity`,
steady state). Within one repeat (seed) every policy sees the same requests and the same arrival times,
so differences between policies are paired, not sampling noise of the workload, and the intervals here
resample those paired seeds (`leap_core.intervals`). "fcfs" and "oracle" (countdown on the true lengths)
are always added; stock vLLM ("stock", `SimConfig.stock`) and LEAP's countdown with adaptive decode slots
("leap-adaptive", `leap_core.decode_slots.DecodeSlotRule`) are run by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from leap_core.decode_slots import DecodeSlotRule
from leap_core.intervals import bootstrap_ci, hierarchical_bootstrap_ci, mean_ci, mean_last_axis, ratio_of_means
from leap_core.simulator import SimConfig, SimResult, StepTimeModel, poisson_arrivals, simulate

_REFERENCES = ("fcfs", "oracle")


STOCK = "stock"  # stock vLLM at its CPU defaults (`SimConfig.stock`), on the study's step model


ADAPTIVE = "leap-adaptive"  # LEAP's countdown with adaptive decode slots, at most the study's K


# The adaptive arm's rule (its max_slots becomes the study's K). Chosen on the training rows with cross-fitted
# LEAP predictions (K 64, R 512, 0.5 / 0.8 / 0.95 of stock's capacity, the fitted and an 18 + 7.5 ms/request
# step curve): no margin x drain (0.25-4 x 5-240 s) beat fixed K; this one held requests out and stayed within
# 0.2% of fixed K's mean PTL, where the module's defaults (0.25, 60 s) cost 2-18%.
ADAPTIVE_SLOT_RULE = DecodeSlotRule(margin=1.0, drain_s=15.0)


_NOT_CONFIGURABLE = {"policy", "step_model", "refresh_at", "refresh_cost_s", "distribution", "chunked_prefill",
                     "slot_rule"}


HEADLINE_LOAD = 0.9


LONG_QUANTILE = 0.9  # long requests: the pool's top decile of true length


TAIL_GOAL = 1.2  # long-request P95 latency at most this multiple of FCFS's (the tail guard's goal) ...


TAIL_MEAN_GOAL = 0.5  # ... while mean PTL stays at most this multiple of FCFS's


def _pool(prompt_tokens: ArrayLike, lengths: ArrayLike,
          predictions: dict[str, ArrayLike]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    prompt = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
    out = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if prompt.shape != out.shape or out.size < 2:
        raise ValueError("prompt_tokens and lengths must be 1-D of one length, at least two requests")
    if out.min() < 1:
        raise ValueError("every request needs a true length >= 1")
    preds = {}
    for name, values in predictions.items():
        if name in _REFERENCES:
            raise ValueError(f"{name!r} is added by the study; choose another predictor name")
        preds[name] = np.asarray(values, dtype=np.float64).reshape(-1)
        if preds[name].shape != out.shape:
            raise ValueError(f"predictions[{name!r}] has {preds[name].size} values for {out.size} requests")
    return prompt, out, preds


def _base_config(step_model: StepTimeModel, config: dict) -> SimConfig:
    clash = _NOT_CONFIGURABLE & config.keys()
    if clash:
        raise ValueError(f"the study sets {sorted(clash)} itself")
    return SimConfig(step_model=step_model, **config)


def bursty_arrivals(gaps: np.ndarray, n: int, rate: float, seed: int = 0) -> np.ndarray:
    """`n` arrival times whose gaps are `n` consecutive gaps of a real trace (a seeded window), rescaled so
    that their mean rate is `rate`: the trace's bursts and lulls at the study's load."""
    gaps = np.asarray(gaps, dtype=np.float64)
    if rate <= 0 or n < 1 or gaps.size < n:
        raise ValueError(f"need a positive rate and at least {n} trace gaps (have {gaps.size})")
    start = int(np.random.default_rng(seed).integers(0, gaps.size - n + 1))
    window = gaps[start:start + n]
    if window.sum() <= 0:
        window = np.ones(n)
    return np.cumsum(window / (window.mean() * rate))


def _arrivals(n: int, rate: float, seed: int, gaps: np.ndarray | None) -> np.ndarray:
    """Poisson arrivals at `rate`, or a real trace's bursts at that mean rate when `gaps` is given."""
    return poisson_arrivals(n, rate, seed=seed) if gaps is None else bursty_arrivals(gaps, n, rate, seed)


def _workloads(n_pool: int, n_requests: int, repeats: int, seed: int):
    """Per repeat: the drawn pool indices and an arrival seed (drawn with replacement only if needed)."""
    if n_requests < 1 or repeats < 1:
        raise ValueError("n_requests and repeats must be >= 1")
    for repeat in range(repeats):
        rng = np.random.default_rng((seed, repeat))
        yield rng.choice(n_pool, n_requests, replace=n_requests > n_pool), 1000 * seed + repeat


@dataclass(frozen=True)
class Order:
    """A decode order a study runs beside its predictors' countdown: `policy` on `predictor`'s predictions
    with SimConfig `overrides` (e.g. the Gittins policy's `distribution`, a `waiting_cap`), reported as a
    ratio of mean PTL to that predictor's countdown under `ratio` (paired by seed)."""

    predictor: str
    ratio: str
    policy: str = "gittins"
    overrides: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCapacity:
    """What the engine sustains on the wall clock over what the simulator, with a given step model, says for
    the same requests (the fidelity study measures both, `leap eval fidelity`).

    The simulator then runs on the engine's time base: every step cost divided by `scale`
    (`rescale`), so a pool's simulated capacity is what the engine would sustain on it, a load of 0.9 is
    0.9 of that, and the seconds are the engine's. (Arrivals at a fraction of the engine's capacity priced
    by a slower or faster step model would put the simulated queue at another load than the engine's.)
    The ratios between policies at a load do not depend on `scale`; the capacity and the seconds do, and
    carry the engine measurement's interval. Without one, `scale` 1 and no interval: the simulator's own
    capacity."""

    scale: float = 1.0
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    source: str = "simulator: no engine measurement given"

    def rescale(self, step_model: StepTimeModel) -> StepTimeModel:
        """`step_model` on the engine's time base."""
        costs = asdict(step_model)
        table = tuple(seconds / self.scale for seconds in costs.pop("decode_base_s"))
        return StepTimeModel(**{cost: seconds / self.scale for cost, seconds in costs.items()}, decode_base_s=table)

    def of(self, capacity_rps: float) -> dict[str, Any]:
        """A pool's capacity simulated on the rescaled step model, as {value, ci_low, ci_high} (requests/s)
        with the interval of the engine measurement, the factor and its source."""
        measured = np.isfinite(self.ci_low) and np.isfinite(self.ci_high)
        return {"value": capacity_rps,
                "ci_low": capacity_rps * self.ci_low / self.scale if measured else None,
                "ci_high": capacity_rps * self.ci_high / self.scale if measured else None,
                "scale": self.scale, "source": self.source}


def adaptive_config(config: SimConfig, rule: DecodeSlotRule = ADAPTIVE_SLOT_RULE) -> SimConfig:
    """`config`'s countdown with decode slots chosen each step by `rule`, at most `config.decode_slots`."""
    most = config.decode_slots
    return replace(config, policy="countdown",
                   slot_rule=replace(rule, max_slots=most, min_slots=min(rule.min_slots, most)))


def _run_policy(name: str, arrival: np.ndarray, prompt: np.ndarray, out: np.ndarray,
                predicted: dict[str, np.ndarray], config: SimConfig,
                orders: dict[str, Order] | None = None,
                slot_rule: DecodeSlotRule = ADAPTIVE_SLOT_RULE) -> SimResult:
    """fcfs, oracle (countdown on the truth), stock vLLM, LEAP with adaptive slots (`slot_rule`), one of
    `orders`, or countdown on the named predictor, for drawn requests."""
    if name == "fcfs":
        return simulate(arrival, prompt, out, out, replace(config, policy="fcfs"))
    if name == "oracle":
        return simulate(arrival, prompt, out, out, replace(config, policy="countdown"))
    if name == STOCK:
        return simulate(arrival, prompt, out, out, SimConfig.stock(config.step_model))
    if name == ADAPTIVE:
        return simulate(arrival, prompt, out, predicted["leap"], adaptive_config(config, slot_rule))
    if orders and name in orders:
        order = orders[name]
        return simulate(arrival, prompt, out, predicted[order.predictor],
                        replace(config, policy=order.policy, **order.overrides))
    return simulate(arrival, prompt, out, predicted[name], replace(config, policy="countdown"))


QUANTILES = (50, 95, 99)


# the per-run figures `_over_seeds` averages into a study's table (the rest of `_figures` is the tail block)
_TABLE_FIGURES = ("mean_latency_s", "p95_latency_s", "mean_ptl", "p95_ptl", "long_p95_latency_s")


TAIL_FIGURES = (*(f"p{q}_latency_s" for q in QUANTILES), *(f"p{q}_ptl" for q in QUANTILES), "max_wait_s",
                "max_held_out_steps", "long_p95_latency_s", "long_p99_latency_s")


def _figures(result: SimResult, long: np.ndarray | None = None) -> dict[str, float]:
    """One replay's figures: mean, P50, P95 and P99 of latency and PTL; the longest any request waited for
    admission (arrival to its first token, which its prefill yields when it is admitted); the most
    consecutive steps a resident request was held out of decoding (the wait a length-aware order adds
    after admission). With `long` (the requests of the pool's top length decile), also their P95 and P99
    latency, the tail a length-aware order makes long requests pay."""
    latency, ptl = result.latency, result.ptl
    figures = {"mean_latency_s": float(latency.mean()), "mean_ptl": float(ptl.mean()),
               **{f"p{q}_latency_s": float(v) for q, v in zip(QUANTILES, np.percentile(latency, QUANTILES))},
               **{f"p{q}_ptl": float(v) for q, v in zip(QUANTILES, np.percentile(ptl, QUANTILES))},
               "max_wait_s": float(result.ttft.max()), "max_held_out_steps": float(result.max_held_out.max())}
    if long is not None:
        long_tail = np.percentile(latency[long], (95, 99)) if long.any() else (np.nan, np.nan)
        figures["long_p95_latency_s"], figures["long_p99_latency_s"] = (float(v) for v in long_tail)
    return figures


def _replays(policies, arrival: np.ndarray, idx: np.ndarray, prompt: np.ndarray, out: np.ndarray,
             preds: dict[str, np.ndarray], config: SimConfig, orders: dict[str, Order] | None = None,
             long: np.ndarray | None = None,
             slot_rule: DecodeSlotRule = ADAPTIVE_SLOT_RULE) -> dict[str, dict[str, float]]:
    """Each policy's `_figures` for the pool requests `idx` arriving at `arrival` (one paired workload)."""
    drawn = {name: values[idx] for name, values in preds.items()}
    return {policy: _figures(_run_policy(policy, arrival, prompt[idx], out[idx], drawn, config, orders, slot_rule),
                             long)
            for policy in policies}


def _per_seed(figures: list[list[dict[str, float]]], key: str) -> np.ndarray:
    """One figure of each paired seed of each split, (splits, seeds) in seed order (what the paired ratios
    resample)."""
    return np.array([[f[key] for f in seeds_of] for seeds_of in figures])


def _over_seeds(figures: list[list[dict[str, float]]]) -> dict[str, float]:
    """The table's figures averaged over every split's seeds, mean PTL with its 95% interval over splits and
    seeds (`hierarchical_bootstrap_ci`; over the seeds alone for one split)."""
    pooled = [f for seeds_of in figures for f in seeds_of]
    merged = {key: float(np.mean([f[key] for f in pooled])) for key in _TABLE_FIGURES if key in pooled[0]}
    ci = hierarchical_bootstrap_ci(mean_last_axis, _per_seed(figures, "mean_ptl"))
    merged["mean_ptl_ci_low"], merged["mean_ptl_ci_high"] = ci["ci_low"], ci["ci_high"]
    return merged


def paired_ratio(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Mean of `a` over mean of `b` with its 95% bootstrap interval, the paired workloads resampled jointly
    for both: 1-D arrays (seeds, or requests of one replay) row by row; (splits, seeds) arrays the splits
    first, then the seeds within each (`hierarchical_bootstrap_ci`)."""
    if np.ndim(a) == 2:
        return hierarchical_bootstrap_ci(ratio_of_means, a, b)
    return bootstrap_ci(ratio_of_means, a, b, vectorized=True)


def _with_intervals(figures: list[dict[str, float]], names=None) -> dict:
    """Each figure's mean over seeds (its finite values), and beside it `<figure>_ci`: its 95% bootstrap
    interval; `names`: only these figures (default all)."""
    merged: dict = {}
    for name in names or figures[0]:
        values = np.array([f[name] for f in figures], dtype=np.float64)
        values = values[np.isfinite(values)]
        merged[name] = float(values.mean()) if values.size else float("nan")
        ci = (mean_ci(values) if values.size > 1
              else {"ci_low": merged[name], "ci_high": merged[name]})
        merged[f"{name}_ci"] = [ci["ci_low"], ci["ci_high"]]
    return merged


def _with_split_intervals(figures: list[list[dict[str, float]]], names: Sequence[str]) -> dict:
    """`_with_intervals` for the figures of every split's seeds ((splits, seeds) nested lists): each mean
    over all of them, its interval over the splits, then the seeds within each
    (`hierarchical_bootstrap_ci`), as the table's mean PTL; a figure some workload lacks (no long request
    in its draw) falls back to the workloads that have it, pooled."""
    if len(figures) < 2:
        return _with_intervals([f for seeds_of in figures for f in seeds_of], names)
    merged: dict = {}
    for name in names:
        values = _per_seed(figures, name).astype(np.float64)
        if not np.isfinite(values).all():
            merged.update(_with_intervals([f for seeds_of in figures for f in seeds_of], [name]))
            continue
        merged[name] = float(values.mean())
        ci = hierarchical_bootstrap_ci(mean_last_axis, values)
        merged[f"{name}_ci"] = [ci["ci_low"], ci["ci_high"]]
    return merged


def _against_tail_goal(long: dict, ptl: dict) -> dict:
    """Long-request P95 and mean PTL over FCFS's (paired ratios), and whether both meet the tail goal."""
    return {"long_p95_over_fcfs": long, "mean_ptl_over_fcfs": ptl,
            "meets_goal": bool(long["value"] <= TAIL_GOAL and ptl["value"] <= TAIL_MEAN_GOAL)}


def _tail_goal(figures: list[dict[str, float]], fcfs: list[dict[str, float]]) -> dict:
    """One tail row's long-request P95 and mean PTL over FCFS's, paired by seed (seeds whose draw has a
    long request), and whether both meet the tail goal."""
    def over_fcfs(name: str) -> dict[str, float]:
        a, b = (np.array([f[name] for f in rows], dtype=np.float64) for rows in (figures, fcfs))
        keep = np.isfinite(a) & np.isfinite(b)
        return paired_ratio(a[keep], b[keep])

    return _against_tail_goal(over_fcfs("long_p95_latency_s"), over_fcfs("mean_ptl"))
