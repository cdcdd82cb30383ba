"""Simulated scheduling studies: the load sweep, refreshed predictions versus countdown, and the long tail.

Every study replays requests drawn from a pool of real ones (prompt and true output lengths, plus each
predictor's predicted totals) through `leap_core.simulator` under Poisson arrivals quoted as fractions
of the sustained FCFS capacity (`fcfs_capacity`, steady state). Within one repeat (seed) every policy sees
the same requests and the same arrival times (the arrival gaps are one exponential draw scaled by the
rate), so differences between policies are paired, not sampling noise of the workload. "fcfs" and "oracle" (countdown on the true
lengths) are always added; the load study adds stock vLLM ("stock", `SimConfig.stock`: FCFS, every running
request decoded up to its CPU default of 128, its chunked-prefill token budget) and, beside LEAP's countdown,
the same countdown with adaptive decode slots ("leap-adaptive", `leap_core.decode_slots.DecodeSlotRule`).
"""

from __future__ import annotations

import pathlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from leap_core.decode_slots import DecodeSlotRule
from leap_core.metrics import (bootstrap_ci, difference_of_means, hierarchical_bootstrap_ci, mean_last_axis,
                               ratio_of_means, spearman)
from leap_core.simulator import SimConfig, SimResult, StepTimeModel, fcfs_capacity, poisson_arrivals, simulate

__all__ = ["run_load", "run_load_over_splits", "Split", "choose_baseline", "plot_load", "section_load", "run_refresh",
           "plot_refresh", "section_refresh", "run_tail", "plot_tail", "section_tail", "life_error"]

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


# ----------------------------------------------------------------------------------------------- inputs


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


# ------------------------------------------------------------------------------------------ load sweep

LOADS = (0.5, 0.7, 0.8, 0.9, 0.95)  # fractions of the sustained FCFS capacity
HEADLINE_LOAD = 0.9
# `leap eval load --quick`: the wall-clock study's loads (`leap eval versus-stock`) and the headline
QUICK_LOADS = (0.5, 0.8, HEADLINE_LOAD, 0.95)
LONG_QUANTILE = 0.9  # long requests: the pool's top decile of true length
OVERLOADS = (1.2,)  # above capacity queues grow without bound: figures depend on the horizon, stated with it
RATIO_GOALS = {"leap_over_fcfs": 0.55, "leap_over_best_baseline": 0.85, "leap_over_oracle": 1.10}
N_REQUESTS = 2000  # requests a run draws from the pool


@dataclass(frozen=True)
class Split:
    """One train/test split of the load study: the simulated pool (prompt and true output lengths of its
    requests) with every predictor's predicted totals for it, fitted for this split, and the baseline LEAP
    is compared against, chosen on this split's validation rows (`choose_baseline`; None: the least mean
    PTL on this split's own test seeds, which flatters it)."""

    prompt_tokens: ArrayLike
    lengths: ArrayLike
    predictions: dict[str, ArrayLike]
    best_baseline: str | None = None


def run_load(prompt_tokens: ArrayLike, lengths: ArrayLike, predictions: dict[str, ArrayLike],
             step_model: StepTimeModel, best_baseline: str | None = None, **options: Any) -> dict:
    """`run_load_over_splits` on one split: this pool, these predictions, this baseline."""
    return run_load_over_splits([Split(prompt_tokens, lengths, predictions, best_baseline)], step_model, **options)


def run_load_over_splits(splits: Sequence[Split], step_model: StepTimeModel, loads=LOADS,
                         headline: float = HEADLINE_LOAD, overloads=OVERLOADS, n_requests: int = N_REQUESTS,
                         seeds: int = 30, seed: int = 0, orders: dict[str, Order] | None = None,
                         engine: EngineCapacity = EngineCapacity(), gaps: np.ndarray | None = None,
                         slot_rule: DecodeSlotRule = ADAPTIVE_SLOT_RULE, **config) -> dict:
    """Latency and PTL of every policy at Poisson loads quoted as fractions of the sustained capacity, on
    every train/test split.

    On each split, each of `seeds` workloads draws `n_requests` from that split's pool and one arrival
    sequence per load (seeds `seed + split`), at the load's fraction of that pool's own capacity; every
    policy replays the same draw, so policies are compared paired by seed. The ratios (LEAP's mean PTL
    over FCFS's, the split's best baseline's and the oracle's) carry 95% intervals that resample the splits
    and then the seeds within each (`leap_core.metrics.hierarchical_bootstrap_ci`; with one split, the
    seeds alone), at every load (`ratios_by_load`) and at `headline` (`ratios`, which the goals read); the
    table's mean PTL carries the same interval. `tail` holds each policy's latency and PTL quantiles,
    longest waits and long-request tail at every load, averaged over every split's seeds, with the same
    two-level intervals (`_with_split_intervals`). `config` holds SimConfig knobs (max_resident, decode_slots, waiting_cap, ...), the same
    the step model was calibrated at. Overloads are run over the same horizon (`n_requests` arrivals) and
    reported with it: their figures grow with the horizon. `orders` (policy name -> `Order`) runs other
    decode orders on the same draws, each with its paired ratio to its predictor's countdown.

    Stock vLLM ("stock") replays every draw too, at its own engine shape (`SimConfig.stock`: R = K = 128,
    2,048 batched tokens, chunked prefill) on the same step model, and with a "leap" predictor LEAP's countdown
    with adaptive decode slots ("leap-adaptive", `slot_rule` at most the study's K): every load's ratios
    start with LEAP's and the adaptive arm's mean PTL and mean latency over stock's (`leap_over_stock`,
    `leap_adaptive_over_stock`, `..._latency`). The loads stay fractions of the study's FCFS capacity;
    `stock_capacity_rps` is stock's own sustained capacity on the pools (their mean), to read them by.

    `best_baseline` is the baseline chosen on most splits (the first split's on a tie), `best_baseline_by_split`
    each split's, and `best_baseline_chosen_on` "validation" when every split was given its choice ("test"
    otherwise). `engine`: the engine-measured capacity the loads are fractions of (`EngineCapacity`);
    `capacity_rps` reports it for the pools (their mean) with its interval. `gaps`: a real trace's
    inter-arrival gaps; each workload then arrives in a window of the trace's bursts rescaled to the load
    (`bursty_arrivals`) instead of a Poisson process.
    """
    if not splits:
        raise ValueError("run_load_over_splits needs at least one split")
    pools = [_pool(split.prompt_tokens, split.lengths, split.predictions) for split in splits]
    names = list(pools[0][2])
    if any(list(preds) != names for _, _, preds in pools):
        raise ValueError(f"every split must predict with the same predictors, {names}")
    base = _base_config(engine.rescale(step_model), config)
    capacities = [fcfs_capacity(prompt, out, base) for prompt, out, _ in pools]
    capacity_rps = engine.of(float(np.mean(capacities)))
    stock_capacity = float(np.mean([fcfs_capacity(prompt, out, SimConfig.stock(base.step_model))
                                    for prompt, out, _ in pools]))
    orders = dict(orders or {})
    added = [*_REFERENCES, STOCK, ADAPTIVE]
    for name in names:
        if name in added:
            raise ValueError(f"{name!r} is added by the study; choose another predictor name")
    for name, order in orders.items():
        if name in names or name in added or order.predictor not in names:
            raise ValueError(f"order {name!r}: a new policy name on one of the predictors {sorted(names)}")
    baselines = [p for p in names if not p.startswith("leap")]
    for split in splits:
        if split.best_baseline is not None and split.best_baseline not in baselines:
            raise ValueError(f"best_baseline {split.best_baseline!r} is not one of the baselines {baselines}")
    policies = [*names, *([ADAPTIVE] if "leap" in names else []), *orders, *_REFERENCES, STOCK]
    every_load = sorted({float(m) for m in (*loads, headline, *overloads)})
    # runs[load][policy][split]: the figures of each of the split's seeds
    runs: dict[float, dict[str, list[list]]] = {m: {p: [[] for _ in pools] for p in policies} for m in every_load}
    long_thresholds = [float(np.quantile(out, LONG_QUANTILE)) for _, out, _ in pools]
    for k, ((prompt, out, preds), capacity) in enumerate(zip(pools, capacities)):
        for idx, arrival_seed in _workloads(out.size, n_requests, seeds, seed + k):
            for m in every_load:
                arrival = _arrivals(n_requests, m * capacity, arrival_seed, gaps)
                for policy, figures in _replays(policies, arrival, idx, prompt, out, preds, base, orders,
                                                out[idx] >= long_thresholds[k], slot_rule).items():
                    runs[m][policy][k].append(figures)
    table = {str(m): {p: _over_seeds(runs[m][p]) for p in policies} for m in every_load}
    ptl = {m: {p: _per_seed(runs[m][p], "mean_ptl") for p in policies} for m in every_load}
    latency = {m: {p: _per_seed(runs[m][p], "mean_latency_s") for p in policies} for m in every_load}
    head = float(headline)
    best_by_split = [split.best_baseline if split.best_baseline is not None
                     else min(baselines, key=lambda p: ptl[head][p][k].mean()) if baselines else None
                     for k, split in enumerate(splits)]
    best = Counter(best_by_split).most_common(1)[0][0]
    ratios_by_load = {str(m): _load_ratios(ptl[m], best_by_split, orders, latency[m]) for m in every_load}
    ratios = ratios_by_load[str(head)]
    long_p95 = {p: _per_seed(runs[head][p], "long_p95_latency_s") for p in policies}
    return {
        "capacity_rps": capacity_rps,
        "stock_capacity_rps": stock_capacity,
        "stock": {"max_num_seqs": SimConfig.stock().max_resident,
                  "max_num_batched_tokens": SimConfig.stock().max_prefill_tokens_per_step,
                  "how": "FCFS, every running request decoded each step, decode tokens first from the batched "
                         "tokens and prompts chunked into the rest (vLLM's CPU defaults for its OpenAI server)"},
        **({"adaptive_slots": {**asdict(adaptive_config(base, slot_rule).slot_rule), "demand_tau_s": base.demand_tau_s}}
           if ADAPTIVE in policies else {}),
        "arrivals": "poisson" if gaps is None else "bursty: windows of a real trace's gaps at the load's mean rate",
        "long_requests": {"quantile": LONG_QUANTILE, "min_tokens": float(np.mean(long_thresholds))},
        "capacity_measure": "FCFS steady state: completions between the 25th and 75th percentile of a "
                            "saturated run of 4,000 pool requests in the simulator, its step model on the engine's "
                            "time base (divided by `capacity_rps.scale`, the engine's rate over the simulator's on "
                            "the requests the engine ran)",
        "n_requests": int(n_requests),
        "seeds": int(seeds),
        "splits": len(pools),
        "interval_over": ["splits", "seeds"] if len(pools) > 1 else ["seeds"],
        "n_pool": int(pools[0][1].size),
        "by_split": [{"n_pool": int(out.size), "capacity_rps": capacity, "long_min_tokens": threshold,
                      "best_baseline": chosen}
                     for (_, out, _), capacity, threshold, chosen in zip(pools, capacities, long_thresholds,
                                                                         best_by_split)],
        "loads": [float(m) for m in sorted(loads)],
        "overloads": [{"load": float(m), "horizon_requests": int(n_requests),
                       "horizon_s": float(n_requests / (m * capacity_rps["value"]))} for m in sorted(overloads)],
        "headline_load": head,
        "spearman": {name: float(np.mean([spearman(out, preds[name]) for _, out, preds in pools]))
                     for name in names},
        "table": table,
        "tail": {p: {str(m): _with_split_intervals(runs[m][p], TAIL_FIGURES) for m in every_load} for p in policies},
        "best_baseline": best,
        "best_baseline_by_split": best_by_split,
        "best_baseline_chosen_on": None if best is None else (
            "validation" if all(split.best_baseline is not None for split in splits) else "test"),
        "ratios": ratios,
        "ratios_by_load": ratios_by_load,
        "long_p95_over_fcfs": {p: paired_ratio(long_p95[p], long_p95["fcfs"]) for p in policies if p != "fcfs"},
        "tail_goal": _tail_goals(long_p95, ptl[head], [p for p in policies if p != "fcfs"]),
        "goals": ratio_goals(ratios),
        "sweep": {
            "multipliers": every_load,
            **{key: {p: [table[str(m)][p][key] for m in every_load] for p in policies}
               for key in ("mean_ptl", "mean_ptl_ci_low", "mean_ptl_ci_high", "mean_latency_s")},
        },
    }


def _tail_goals(long_p95: dict[str, np.ndarray], ptl: dict[str, np.ndarray], policies: list[str]) -> dict:
    """Each policy's long-request P95 latency and mean PTL over FCFS's, paired by (split, seed), and whether
    both meet the tail goal (TAIL_GOAL, TAIL_MEAN_GOAL; point values)."""
    return {p: _against_tail_goal(paired_ratio(long_p95[p], long_p95["fcfs"]), paired_ratio(ptl[p], ptl["fcfs"]))
            for p in policies}


def _against_tail_goal(long: dict, ptl: dict) -> dict:
    """Long-request P95 and mean PTL over FCFS's (paired ratios), and whether both meet the tail goal."""
    return {"long_p95_over_fcfs": long, "mean_ptl_over_fcfs": ptl,
            "meets_goal": bool(long["value"] <= TAIL_GOAL and ptl["value"] <= TAIL_MEAN_GOAL)}


def _per_seed(figures: list[list[dict[str, float]]], key: str) -> np.ndarray:
    """One figure of each paired seed of each split, (splits, seeds) in seed order (what the paired ratios
    resample)."""
    return np.array([[f[key] for f in seeds_of] for seeds_of in figures])


_OPPONENT = "best baseline of each split"  # the paired-ratio key of the baseline each split chose


def _load_ratios(ptl: dict[str, np.ndarray], best_by_split: list[str | None],
                 orders: dict[str, Order], latency: dict[str, np.ndarray] | None = None) -> dict[str, dict]:
    """At one load, from (splits, seeds) mean PTLs: LEAP's paired ratios (`paired_ratios`, against stock vLLM
    first, then each split's own best baseline), with `latency` (the same seeds' mean latencies) LEAP's and
    the adaptive arm's mean latency over stock's, the adaptive arm's mean PTL over fixed-K LEAP's, and each
    order's mean PTL over its predictor's countdown's and over the oracle's."""
    opponent = None if best_by_split[0] is None else np.stack([ptl[name][k] for k, name in enumerate(best_by_split)])
    ratios = paired_ratios(ptl if opponent is None else {**ptl, _OPPONENT: opponent},
                           None if opponent is None else _OPPONENT)
    stock = {key: ratios.pop(key) for key in ("leap_over_stock", "leap_adaptive_over_stock") if key in ratios}
    if latency is not None and STOCK in latency:
        stock.update({f"{name.replace('-', '_')}_over_stock_latency": paired_ratio(latency[name], latency[STOCK])
                      for name in ("leap", ADAPTIVE) if name in latency})
    ratios = {**stock, **ratios}  # stock vLLM's first: what LEAP replaces
    if ADAPTIVE in ptl and "leap" in ptl:
        ratios["leap_adaptive_over_leap"] = paired_ratio(ptl[ADAPTIVE], ptl["leap"])
    for name, order in orders.items():
        ratios[order.ratio] = paired_ratio(ptl[name], ptl[order.predictor])
        ratios[f"{name.replace('-', '_')}_over_oracle"] = paired_ratio(ptl[name], ptl["oracle"])
    return ratios


VALIDATION_SEEDS = 8
VALIDATION_SEED = 200  # arrival seeds from 200,000: apart from the test runs' (0) and the tail guard's (100)


def choose_baseline(prompt_tokens: ArrayLike, lengths: ArrayLike, predictions: dict[str, ArrayLike],
                    step_model: StepTimeModel, load: float = HEADLINE_LOAD, n_requests: int = N_REQUESTS,
                    seeds: int = VALIDATION_SEEDS, seed: int = VALIDATION_SEED,
                    engine: EngineCapacity = EngineCapacity(), **config) -> dict:
    """The baseline whose countdown gives the least mean PTL on a validation pool, to be LEAP's opponent
    in `run_load` (`best_baseline`), so the test pool's figures never choose it.

    Meant for rows no baseline was fitted on and the test pool does not hold (the load study: the target's
    feedback-stream half). Paired seeds as in `run_load`, at `load` of this pool's own sustained capacity;
    FCFS is replayed beside as the reference. `baselines` holds each one's mean PTL with its 95% bootstrap
    interval over the seeds and its Spearman on the pool."""
    prompt, out, preds = _pool(prompt_tokens, lengths, predictions)
    if not preds:
        raise ValueError("no baseline to choose from")
    base = _base_config(engine.rescale(step_model), config)
    capacity = fcfs_capacity(prompt, out, base)
    policies = [*preds, "fcfs"]
    runs: dict[str, list] = {p: [] for p in policies}
    for idx, arrival_seed in _workloads(out.size, n_requests, seeds, seed):
        arrival = poisson_arrivals(n_requests, load * capacity, seed=arrival_seed)
        for policy, figures in _replays(policies, arrival, idx, prompt, out, preds, base).items():
            runs[policy].append(figures)
    figures = {p: {key: value for key, value in _over_seeds([runs[p]]).items() if key.startswith("mean_ptl")}
               for p in policies}
    best = min(preds, key=lambda p: figures[p]["mean_ptl"])
    return {"best_baseline": best, "load": float(load), "capacity_rps": float(capacity), "n_pool": int(out.size),
            "n_requests": int(n_requests), "seeds": int(seeds), "seed": int(seed), "fcfs": figures["fcfs"],
            "baselines": {name: {**figures[name], "spearman": spearman(out, values)}
                          for name, values in preds.items()}}


TAIL_GOAL = 1.2  # long-request P95 latency at most this multiple of FCFS's (the tail guard's goal) ...
TAIL_MEAN_GOAL = 0.5  # ... while mean PTL stays at most this multiple of FCFS's
GUARD_CAPS = (32, 128)  # the tail guard's knobs: the waiting cap ...
GUARD_WAIT_AGINGS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)  # ... and the wait aging (`CountdownPolicy`)


def choose_tail_guard(prompt_tokens: ArrayLike, lengths: ArrayLike, predicted: ArrayLike,
                      step_model: StepTimeModel, order: Order, caps=GUARD_CAPS, wait_agings=GUARD_WAIT_AGINGS,
                      multiplier: float = HEADLINE_LOAD, n_requests: int = 1000, seeds: int = 8, seed: int = 100,
                      engine: EngineCapacity = EngineCapacity(), **config) -> dict:
    """The tail guard of `order` (run on `predicted`): the waiting cap and wait aging that meet the tail goal
    (long-request P95 latency <= TAIL_GOAL x FCFS's and mean PTL <= TAIL_MEAN_GOAL x FCFS's, both paired
    by seed) at the least mean PTL. When none meets both, the one with the lowest long-request tail among
    those that keep the mean goal; when none keeps that either, the one with the least mean PTL.

    Meant for a validation pool (the training rows with cross-fitted predictions), so the test pool's
    figures never chose it. Paired seeds as in `run_load`; the table keeps every knob's figures."""
    prompt, out, preds = _pool(prompt_tokens, lengths, {order.predictor: predicted})
    base = _base_config(engine.rescale(step_model), config)
    capacity = fcfs_capacity(prompt, out, base)
    threshold = float(np.quantile(out, LONG_QUANTILE))
    knobs = [(int(c), float(w)) for c in caps for w in wait_agings]
    guarded = {knob: replace(order, overrides={**order.overrides, "waiting_cap": knob[0], "wait_aging": knob[1]})
               for knob in knobs}
    runs: dict[Any, list] = {"fcfs": [], **{knob: [] for knob in knobs}}
    for idx, arrival_seed in _workloads(out.size, n_requests, seeds, seed):
        arrival = poisson_arrivals(n_requests, multiplier * capacity, seed=arrival_seed)
        drawn = {order.predictor: preds[order.predictor][idx]}
        long = out[idx] >= threshold
        runs["fcfs"].append(_figures(_run_policy("fcfs", arrival, prompt[idx], out[idx], drawn, base), long))
        for knob, guard in guarded.items():
            runs[knob].append(_figures(_run_policy("guard", arrival, prompt[idx], out[idx], drawn, base,
                                                   {"guard": guard}), long))
    table = []
    for cap, wait_aging in knobs:
        figures = runs[(cap, wait_aging)]
        row = {"waiting_cap": cap, "wait_aging": wait_aging,
               "mean_ptl": float(np.mean([f["mean_ptl"] for f in figures])),
               "long_p95_latency_s": float(np.nanmean([f["long_p95_latency_s"] for f in figures]))}
        row.update(_tail_goal(figures, runs["fcfs"]))
        table.append(row)
    long_ratio = lambda row: row["long_p95_over_fcfs"]["value"]  # noqa: E731
    ptl_ratio = lambda row: row["mean_ptl_over_fcfs"]["value"]  # noqa: E731
    meeting = [row for row in table if row["meets_goal"]]
    keeping_mean = [row for row in table if ptl_ratio(row) <= TAIL_MEAN_GOAL]
    chosen = (min(meeting, key=ptl_ratio) if meeting else min(keeping_mean, key=long_ratio) if keeping_mean
              else min(table, key=ptl_ratio))
    return {"waiting_cap": chosen["waiting_cap"], "wait_aging": chosen["wait_aging"],
            "met_on_validation": bool(meeting),
            "goal": {"long_p95_over_fcfs": TAIL_GOAL, "mean_ptl_over_fcfs": TAIL_MEAN_GOAL},
            "validation": {"long_p95_over_fcfs": chosen["long_p95_over_fcfs"],
                           "mean_ptl_over_fcfs": chosen["mean_ptl_over_fcfs"]},
            "load": float(multiplier), "n_pool": int(out.size), "n_requests": int(n_requests), "seeds": int(seeds),
            "fcfs_long_p95_latency_s": float(np.nanmean([f["long_p95_latency_s"] for f in runs["fcfs"]])),
            "fcfs_mean_ptl": float(np.mean([f["mean_ptl"] for f in runs["fcfs"]])), "table": table}


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


def paired_ratios(ptl: dict[str, np.ndarray], best: str | None, leap: str = "leap") -> dict[str, dict]:
    """LEAP's mean PTL over each reference's, paired by workload: ratio of means with a 95% bootstrap
    interval that resamples the workloads jointly for both policies (`paired_ratio`). Stock vLLM first, and
    the adaptive-slot arm over it, when they ran."""
    pairs = {"leap_over_stock": STOCK, "leap_over_fcfs": "fcfs", "leap_over_best_baseline": best,
             "leap_over_oracle": "oracle"}
    ratios = {}
    for key, other in pairs.items():
        if other is not None and other in ptl and leap in ptl:
            ratios[key] = paired_ratio(ptl[leap], ptl[other])
        if key == "leap_over_stock" and ADAPTIVE in ptl and STOCK in ptl:
            ratios["leap_adaptive_over_stock"] = paired_ratio(ptl[ADAPTIVE], ptl[STOCK])
    if "leap-rls" in ptl and "fcfs" in ptl:
        ratios["leap_rls_over_fcfs"] = paired_ratio(ptl["leap-rls"], ptl["fcfs"])
    return ratios


def ratio_goals(ratios: dict[str, dict]) -> dict[str, dict]:
    """The evidence goals: each ratio at most its target, and LEAP over the best baseline with an
    interval entirely below 1."""
    goals = {}
    for key, limit in RATIO_GOALS.items():
        if key not in ratios:
            continue
        r = ratios[key]
        met = r["value"] <= limit and (key != "leap_over_best_baseline" or r["ci_high"] < 1.0)
        target = f"<= {limit}" + (", interval below 1.0" if key == "leap_over_best_baseline" else "")
        goals[key] = {"target": target, "measured": r["value"], "ci": [r["ci_low"], r["ci_high"]], "met": bool(met)}
    return goals


def plot_load(result: dict, path: pathlib.Path) -> None:
    """Mean PTL against load (fraction of sustained capacity), one line per policy, 95% intervals over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for policy, values in sweep["mean_ptl"].items():
        values = np.asarray(values)
        error = np.vstack((values - np.asarray(sweep["mean_ptl_ci_low"][policy]),
                           np.asarray(sweep["mean_ptl_ci_high"][policy]) - values))
        ax.errorbar(sweep["multipliers"], values, yerr=error, marker="o", capsize=3,
                    label=policy, linestyle="--" if policy in (*_REFERENCES, STOCK) else "-")
    ax.set_xlabel("load (fraction of sustained FCFS capacity)")
    ax.set_ylabel("mean per-token latency (s/token)")
    ax.set_title(f"Simulated mean PTL vs load ({_workloads_in_words(result)})")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _interval(r: dict) -> str:
    return f"{_g(r['value'])} [{_g(r['ci_low'])}, {_g(r['ci_high'])}]"


def _workloads_in_words(result: dict) -> str:
    """"30 paired seeds", or "5 train/test splits x 6 paired seeds" (results saved before splits: one)."""
    seeds = f"{result['seeds']} paired seeds"
    splits = result.get("splits", 1)
    return seeds if splits == 1 else (f"{splits} train/test splits (each partitions the target anew and refits "
                                      f"every predictor) x {seeds} each")


def _interval_basis(result: dict) -> str:
    """What the intervals resample, in words."""
    return "seeds" if result.get("splits", 1) == 1 else "splits, then seeds within each"


def section_load(result: dict, image: str) -> str:
    """docs/results.md section: latency and PTL per policy at each load, and LEAP's paired ratios."""
    rows = []
    for load, policies in result["table"].items():
        for policy, f in policies.items():
            rows.append([f"{float(load):g}", policy, _g(f["mean_latency_s"]), _g(f["p95_latency_s"]),
                         f"{_g(f['mean_ptl'])} [{_g(f['mean_ptl_ci_low'])}, {_g(f['mean_ptl_ci_high'])}]",
                         _g(f["p95_ptl"]), _g(f["long_p95_latency_s"]) if "long_p95_latency_s" in f else "n/a"])
    rho = ", ".join(f"{name} {_g(value)}" for name, value in result.get("spearman", {}).items())
    ratio_rows = [[key, _interval(r)] for key, r in result["ratios"].items()]
    overloads = "; ".join(f"{o['load']:g} over {o['horizon_requests']} arrivals ({_g(o['horizon_s'])} s)"
                          for o in result.get("overloads", []))
    untouched = result.get("untouched")
    pool = (f"the untouched test slice ({result['n_pool']} rows: {untouched['rows']})" if untouched
            else f"a pool of {result['n_pool']} held-out prompts")
    from evaluation.selections import CHAT_TRAIN

    window = ("" if result.get("train", CHAT_TRAIN) == CHAT_TRAIN
              else f", trained on {result['train']} ({result.get('n_train', '?')} rows)")
    text = [
        ("## The final table: simulated scheduling on the untouched test slice" if untouched
         else "## Simulated scheduling under load") + window,
        "",
        f"End-to-end latency and per-token latency (PTL = latency / output tokens) of each decode policy in the "
        f"step-loop simulator at R = {result.get('max_resident', '?')}, K = {result.get('decode_slots', '?')}, with "
        f"the step-time model calibrated on the live engine at that R and K ({result.get('step_model_source', '')}"
        f"). {result['n_requests']} requests "
        f"per run drawn from {pool}, Poisson arrivals at fractions of the "
        f"sustained FCFS capacity ({_capacity(result['capacity_rps'])}; {result['capacity_measure']}); "
        f"{_workloads_in_words(result)} (every policy replays the same draw), mean PTL with its 95% bootstrap "
        f"interval over {_interval_basis(result)}. Overloads (queues grow without bound, so figures depend on the "
        f"horizon): "
        f"{overloads or 'none'}. The oracle is countdown on the true lengths"
        + (f"; predictor Spearman on the pool{'' if result.get('splits', 1) == 1 else 's (mean over splits)'}: "
           f"{rho}." if rho else "."),
        "",
        _table(["load", "policy", "mean latency (s)", "P95 latency (s)", "mean PTL (s/token) [95% CI]",
                "P95 PTL (s/token)", "long-request P95 latency (s)"], rows),
        "",
        f"LEAP's mean PTL over each reference at {result['headline_load']:g} of capacity, paired by seed "
        f"(best baseline: {result.get('best_baseline')}), with 95% bootstrap intervals over "
        f"{_interval_basis(result)}:",
        "",
        _table(["ratio", "value [95% CI]"], ratio_rows),
    ]
    text += (_stock_lines(result) + _best_baseline_lines(result) + _ratios_by_load_lines(result)
             + _tail_lines(result))
    if result.get("bursty"):
        bursty = {**result["bursty"], "headline_load": result["headline_load"], "splits": result.get("splits", 1)}
        text += ["", "With bursty arrivals (the Azure conversation trace's gaps, windows rescaled to the load), "
                     "LEAP's mean PTL over each reference:", "",
                 *[f"- {key}: {_interval(r)}" for key, r in bursty["ratios"].items()], *_tail_lines(bursty)]
    if result.get("long_p95_over_fcfs"):
        goals = result.get("tail_goal", {})
        rows = [[name, _interval(r), *((_interval(goals[name]["mean_ptl_over_fcfs"]),
                                        "yes" if goals[name]["meets_goal"] else "no") if name in goals else ())]
                for name, r in result["long_p95_over_fcfs"].items()]
        text += ["", f"Long requests (true length >= {_g(result['long_requests']['min_tokens'])} tokens, the pool's "
                     f"top decile): P95 latency over FCFS's at {result['headline_load']:g}, paired by seed (the tail "
                     f"goal: <= {TAIL_GOAL:g} while mean PTL <= {TAIL_MEAN_GOAL:g} x FCFS's):", "",
                 _table(["policy", "long-request P95 / FCFS [95% CI]",
                         *(("mean PTL / FCFS [95% CI]", "meets the tail goal") if goals else ())], rows)]
    text += _guard_lines(result)
    return _finish(text, result, "Mean PTL vs load", image)


def _stock_lines(result: dict) -> list[str]:
    """What the stock vLLM and adaptive-slot arms are (results saved before them have neither)."""
    if "stock_capacity_rps" not in result:
        return []
    stock, capacity = result.get("stock", {}), result["capacity_rps"]
    capacity = capacity["value"] if isinstance(capacity, dict) else capacity
    lines = ["", f"`stock` is stock vLLM at its CPU defaults on the same step model: {stock.get('how', '')} "
                 f"(max_num_seqs {stock.get('max_num_seqs')}, max_num_batched_tokens "
                 f"{stock.get('max_num_batched_tokens')}); its own sustained capacity on the pool is "
                 f"{_g(result['stock_capacity_rps'])} requests/s against the {_g(capacity)} the loads are fractions "
                 f"of. `*_over_stock_latency` rows divide mean latency, the others mean PTL."]
    rule = result.get("adaptive_slots")
    if rule:
        lines[-1] += (f" `leap-adaptive` is LEAP's countdown decoding, each step, the fewest of at most "
                      f"{rule['max_slots']} (at least {rule['min_slots']}) requests whose service rate stays "
                      f"{_percent(rule['margin'])} ahead of the demand (arriving predicted tokens a second, "
                      f"{_g(rule['demand_tau_s'])} s kernel, plus the resident backlog over {_g(rule['drain_s'])} s) "
                      f"on the step model's curve, or all of them where no such number keeps up or holding out "
                      f"saves under {_percent(rule['flat_tolerance'])} of a step (`leap_core.decode_slots`).")
    return lines


def _guard_lines(result: dict) -> list[str]:
    """What the Gittins order ranks by and which tail guard each guarded order runs (chosen on training rows)."""
    gittins = result.get("gittins", {})
    guards = result.get("tail_guards") or ({"leap-gittins-guard": result["tail_guard"]} if result.get("tail_guard")
                                           else {})
    if not guards:
        return []
    lines = ["", f"`leap-gittins` ranks by the Gittins index of the remaining length under LEAP's error distribution "
                 f"({gittins.get('bins')} bins of predicted length from {gittins.get('validation_pairs')} "
                 f"{gittins.get('fitted_on')}), weight 1/length. A guarded order adds the tail guard chosen on the "
                 f"training rows (cross-fitted predictions): its waiting cap and its wait aging (priority x "
                 f"exp(-wait_aging x steps waited / predicted remaining), HRRN-style):", ""]
    for name, guard in guards.items():
        validation = guard.get("validation")
        seen = (f"; there long P95 {_g(validation['long_p95_over_fcfs']['value'])} x FCFS's at mean PTL "
                f"{_g(validation['mean_ptl_over_fcfs']['value'])} x" if validation else "")
        verdict = ("the cheapest knob meeting the goal there" if guard["met_on_validation"]
                   else "none met the goal there; the lowest tail that keeps the mean goal" if validation
                   else "none met the goal there; the cap with the lowest tail")  # chosen by the cap alone
        lines.append(f"- `{name}`: cap {guard['waiting_cap']}, wait aging {_g(guard.get('wait_aging', 0.0))} "
                     f"({guard['seeds']} seeds of {guard['n_requests']} requests at {guard['load']:g}; {verdict}"
                     f"{seen}).")
    return lines


def _best_baseline_lines(result: dict) -> list[str]:
    """Where the best baseline was chosen, and each baseline's validation figures when it was on validation."""
    chosen_on = result.get("best_baseline_chosen_on")
    if not chosen_on:
        return []
    if chosen_on != "validation":
        return ["", f"The best baseline ({result['best_baseline']}) was chosen on these test seeds "
                    f"(the least mean PTL at {result['headline_load']:g}), which flatters it."]
    setup = result.get("validation", {})
    by_split = [row["best_baseline"] for row in result.get("validation_by_split", [])]
    per_split = ([f"Each of the {len(by_split)} splits chose on its own stream rows: "
                  + ", ".join(f"{name} on {by_split.count(name)}" for name in dict.fromkeys(by_split))
                  + "; the table is the first split's."] if len(by_split) > 1 else [])
    rows = [[name, f"{_g(v['mean_ptl'])} [{_g(v['mean_ptl_ci_low'])}, {_g(v['mean_ptl_ci_high'])}]",
             _g(v["spearman"])] for name, v in result.get("baseline_validation", {}).items()]
    return ["", f"The best baseline ({result['best_baseline']}) was chosen on validation rows, never on the test "
                f"pool: the {result.get('n_validation', '?')} feedback-stream rows of the target (which no "
                f"baseline was fitted on and the pool does not hold), each baseline's countdown replayed at "
                f"{_g(setup.get('load'))} of their capacity, {setup.get('n_requests', '?')} requests x "
                f"{setup.get('seeds', '?')} seeds; the least mean PTL wins (FCFS there: "
                f"{_g(setup.get('fcfs', {}).get('mean_ptl'))} s/token):", "",
            _table(["baseline", "validation mean PTL (s/token) [95% CI]", "validation Spearman"], rows),
            *([""] + per_split if per_split else [])]


def _ratios_by_load_lines(result: dict) -> list[str]:
    """The paired ratios at every load, one column a load (nothing when the headline is the only load)."""
    by_load = result.get("ratios_by_load")
    if not by_load or len(by_load) < 2:
        return []
    loads = list(by_load)
    keys = list(dict.fromkeys(key for ratios in by_load.values() for key in ratios))
    rows = [[key, *(_interval(by_load[m][key]) if key in by_load[m] else "n/a" for m in loads)] for key in keys]
    return ["", f"The same ratios at every load (paired by seed, 95% intervals over {_interval_basis(result)}):", "",
            _table(["ratio", *(f"{float(m):g}" for m in loads)], rows)]


def _tail_lines(result: dict) -> list[str]:
    """Each policy's tail at the headline load: latency and PTL quantiles, longest waits, long requests."""
    tail = result.get("tail")
    if not tail:
        return []
    head = str(result["headline_load"])
    figures = ("p50_latency_s", "p95_latency_s", "p99_latency_s", "p95_ptl", "p99_ptl", "max_wait_s",
               "max_held_out_steps", "long_p95_latency_s", "long_p99_latency_s")

    def cell(row: dict, name: str) -> str:  # intervals on the P95 and P99 figures, to keep the table short
        return _with_ci(row, name) if "p95" in name or "p99" in name else _g(row[name])

    rows = [[policy, *(cell(by_load[head], f) for f in figures)] for policy, by_load in tail.items() if head in by_load]
    return ["", f"Tail at {result['headline_load']:g} of capacity ({result.get('arrivals', 'poisson')} arrivals), "
                f"mean over the seeds [95% CI over {_interval_basis(result)}]: latency (s) and "
                f"PTL (s/token) quantiles; the longest wait from arrival to admission (s); the most consecutive "
                f"steps a resident request was held out of decoding; long requests' P95 and P99 latency (s):", "",
            _table(["policy", "P50 lat", "P95 lat", "P99 lat", "P95 PTL", "P99 PTL", "max wait", "max held out",
                    "long P95 lat", "long P99 lat"], rows)]


# ---------------------------------------------------------------------------------- refresh vs countdown


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
                          "countdown_mae": bootstrap_ci(mean_last_axis, countdown, vectorized=True),
                          "refresh_mae": bootstrap_ci(mean_last_axis, refresh, vectorized=True)})
    averaged = {arm: values[counts > 0] / counts[counts > 0] for arm, values in life.items()}
    return {"per_point": per_point,
            "over_life": {arm: bootstrap_ci(mean_last_axis, values, vectorized=True)
                          for arm, values in averaged.items()},
            "over_life_difference": bootstrap_ci(difference_of_means, averaged["refresh"], averaged["countdown"],
                                                 vectorized=True)}


def plot_refresh(result: dict, path: pathlib.Path) -> None:
    """MAE of the held remaining-length estimate at each captured point, countdown against refresh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["life_error"]["per_point"]
    x = np.array([max(p["generated"], 1) for p in points], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for arm, marker in (("countdown", "o"), ("refresh", "s")):
        values = np.array([p[f"{arm}_mae"]["value"] for p in points])
        error = np.vstack((values - [p[f"{arm}_mae"]["ci_low"] for p in points],
                           np.array([p[f"{arm}_mae"]["ci_high"] for p in points]) - values))
        ax.errorbar(x, values, yerr=error, marker=marker, capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generated tokens (0 plotted at 1)")
    ax.set_ylabel("MAE of the remaining-length estimate (tokens)")
    ax.set_title("Estimate held by the scheduler over each request's life (95% CI)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _agreement(result: dict) -> str:
    agreement = result.get("length_agreement") or {}
    if not agreement.get("n"):
        return ""
    return (f" The decode-state pass regenerated each output: {100 * agreement['equal_share']:.0f}% of "
            f"{agreement['n']} have the corpus' exact length (greedy both times; batching moves bf16 numerics), "
            f"median relative difference {100 * agreement['median_relative_difference']:.1f}%.")


def section_refresh(result: dict, image: str) -> str:
    """docs/results.md section: the measured refresh against countdown, latency and error, with intervals."""
    rows = [[arm, _g(f["mean_latency_s"]), _g(f["p95_latency_s"]),
             f"{_g(f['mean_ptl'])} [{_g(f['mean_ptl_ci_low'])}, {_g(f['mean_ptl_ci_high'])}]"]
            for arm, f in result["table"].items()]
    life = result["life_error"]
    error_rows = [[str(p["generated"]), str(p["n"]), _interval(p["countdown_mae"]), _interval(p["refresh_mae"])]
                  for p in life["per_point"]]
    error_rows.append(["over life", str(result.get("n_pool", "")), _interval(life["over_life"]["countdown"]),
                       _interval(life["over_life"]["refresh"])])
    readout = result.get("refresh_readout", {})
    verdict = ("refresh wins: the interval of its PTL ratio lies below 1, so serving offers it"
               if result["refresh_wins"] else
               "refresh does not win: the interval of its PTL ratio does not lie below 1, so serving keeps "
               "countdown")
    text = [
        "## Refreshing predictions vs countdown (measured)",
        "",
        f"Countdown predicts once at prefill and schedules by predicted minus generated. Refresh re-estimates "
        f"the remaining length at generated = {', '.join(str(p) for p in result['refresh_at'])} with a readout "
        f"of the layer-{readout.get('layer', '?')} state the engine computed at that point "
        f"({readout.get('how', '')}), and pays {_g(1e3 * result['refresh_cost_s'])} ms per refreshed request "
        f"(the readout's measured cost). Both arms are measured: {result['n_pool']} held-out ShareGPT prompts, "
        f"the refresh readout cross-fitted by prompt ({readout.get('folds', '?')} folds, "
        f"{readout.get('train_rows', '?')} training rows a fold). Simulated at {result['load']:g} of the sustained "
        f"FCFS capacity, R = {result.get('max_resident', '?')}, K = {result.get('decode_slots', '?')}, "
        f"{result['n_requests']} requests, {result['seeds']} paired seeds." + _agreement(result),
        "",
        _table(["arm", "mean latency (s)", "P95 latency (s)", "mean PTL (s/token) [95% CI]"], rows),
        "",
        f"Refresh / countdown, paired by seed: mean PTL {_interval(result['ratios']['refresh_over_countdown'])}, "
        f"mean latency {_interval(result['ratios']['refresh_over_countdown_latency'])}; {verdict}.",
        "",
        "MAE (tokens) of the remaining-length estimate each arm holds, at each point a request reaches, with "
        "95% bootstrap intervals over requests:",
        "",
        _table(["generated", "requests", "countdown MAE", "refresh MAE"], error_rows),
    ]
    return _finish(text, result, "Countdown vs refresh", image)


# ------------------------------------------------------------------------------------------------- tail


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


def _tail_goal(figures: list[dict[str, float]], fcfs: list[dict[str, float]]) -> dict:
    """One tail row's long-request P95 and mean PTL over FCFS's, paired by seed (seeds whose draw has a
    long request), and whether both meet the tail goal."""
    def over_fcfs(name: str) -> dict[str, float]:
        a, b = (np.array([f[name] for f in rows], dtype=np.float64) for rows in (figures, fcfs))
        keep = np.isfinite(a) & np.isfinite(b)
        return paired_ratio(a[keep], b[keep])

    return _against_tail_goal(over_fcfs("long_p95_latency_s"), over_fcfs("mean_ptl"))


def _with_intervals(figures: list[dict[str, float]], names=None) -> dict:
    """Each figure's mean over seeds (its finite values), and beside it `<figure>_ci`: its 95% bootstrap
    interval; `names`: only these figures (default all)."""
    merged: dict = {}
    for name in names or figures[0]:
        values = np.array([f[name] for f in figures], dtype=np.float64)
        values = values[np.isfinite(values)]
        merged[name] = float(values.mean()) if values.size else float("nan")
        ci = (bootstrap_ci(mean_last_axis, values, vectorized=True) if values.size > 1
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


def _tail_figures(result: SimResult, long: np.ndarray) -> dict[str, float]:
    latency = result.latency
    return {"long_p95_latency_s": float(np.percentile(latency[long], 95)) if long.any() else float("nan"),
            "all_p95_latency_s": float(np.percentile(latency, 95)), "mean_ptl": float(result.ptl.mean())}


def plot_tail(result: dict, path: pathlib.Path) -> None:
    """A column per knob (waiting cap, aging, wait aging): long-request P95 latency above, mean PTL below, FCFS's
    as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(key, knob, label) for key, knob, label in (
        ("cap", "waiting_cap", "waiting cap (steps held out)"),
        ("aging", "aging", f"aging rate (waiting cap {result['aging_waiting_cap']})"),
        ("wait_aging", "wait_aging", f"wait aging (waiting cap {result['aging_waiting_cap']})")) if result.get(key)]
    fig, axes = plt.subplots(2, len(columns), figsize=(4 * len(columns), 5.5), dpi=120, sharex="col", squeeze=False)
    for (key, knob, label), (top, bottom) in zip(columns, axes.T):
        rows = result[key]
        x = np.arange(len(rows))  # categorical axis: caps and agings span decades and include 0
        for ax, figure, unit in ((top, "long_p95_latency_s", "long-request P95 latency (s)"),
                                 (bottom, "mean_ptl", "mean PTL (s/token)")):
            ax.plot(x, [r[figure] for r in rows], "o-", label="countdown")
            ax.axhline(result["fcfs"][figure], color="grey", linestyle="--", label="FCFS")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
        bottom.set_xticks(x, [f"{r[knob]:g}" for r in rows])
        bottom.set_xlabel(label)
    axes[0, 0].legend(fontsize="small")
    fig.suptitle(f"Long requests (>= {result['long_threshold_tokens']:g} tokens) at {result['multiplier']:g}x load")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_tail(result: dict, image: str) -> str:
    """docs/results.md section: the waiting cap and aging against long-request tail latency and mean PTL."""
    fcfs = result["fcfs"]

    goal = result.get("goal")  # results saved before the goal columns have none

    def rows(key: str, knob: str) -> list[list[str]]:
        figures = ("long_p95_latency_s", "all_p95_latency_s", "mean_ptl")
        ratios = (lambda r: [_interval(r["long_p95_over_fcfs"]), _interval(r["mean_ptl_over_fcfs"]),
                             "yes" if r["meets_goal"] else "no"]) if goal else (lambda r: [])
        return [[f"{r[knob]:g}", *(_with_ci(r, f) for f in figures), *ratios(r)] for r in result[key]] + \
            [["FCFS", *(_with_ci(fcfs, f) for f in figures), *(["1", "1", "no"] if goal else [])]]

    columns = ["long P95 latency (s) [95% CI]", "all P95 latency (s) [95% CI]", "mean PTL (s/token) [95% CI]",
               *(["long P95 / FCFS [95% CI]", "mean PTL / FCFS [95% CI]", "meets the goal"] if goal else [])]
    text = [
        "## Long-request tail: waiting cap, aging and wait aging",
        "",
        f"P95 latency of long requests (true length >= the pool's {result['long_quantile']:g} quantile, "
        f"{result['long_threshold_tokens']:g} tokens) and of all requests, with mean PTL, under countdown at "
        f"{result['multiplier']:g} of the sustained FCFS capacity, {result['n_requests']} requests, mean over "
        f"{result['seeds']} paired seeds with 95% bootstrap intervals. The waiting cap forces a resident request into the decode batch once it "
        f"has been held out that many consecutive steps. Aging (as in leap_core/policy.py, after TIE) orders by "
        f"predicted remaining x exp(-aging x held_out), where held_out counts the consecutive steps the request "
        f"was not decoded and restarts at 0 when it is. Wait aging (the tail guard, HRRN-style) orders by "
        f"predicted remaining x exp(-w x waited / predicted remaining), where waited counts every step the "
        f"request was resident and not decoded, never reset; aging and wait-aging rows use cap "
        f"{result['aging_waiting_cap']}.",
        "",
        _table(["waiting cap", *columns], rows("cap", "waiting_cap")),
        "",
        _table(["aging", *columns], rows("aging", "aging")),
        *(["", _table(["wait aging", *columns], rows("wait_aging", "wait_aging"))] if result.get("wait_aging")
          else []),
    ]
    if goal:
        met = ", ".join(", ".join(f"{knob} {value:g}" for knob, value in row.items()) for row in result["met_by"])
        text += ["", f"The goal: long-request P95 latency <= {goal['long_p95_over_fcfs']:g} x FCFS's while mean PTL "
                     f"stays <= {goal['mean_ptl_over_fcfs']:g} x FCFS's (point values, paired by seed): "
                     + (f"met by {met}." if met else "no cap, aging or wait aging rate meets it.")]
    return _finish(text, result, "Long-request tail", image)


# ------------------------------------------------------------------------------------------- markdown


def _with_ci(row: dict, name: str) -> str:
    low, high = row.get(f"{name}_ci", (None, None))
    return _g(row[name]) + (f" [{_g(low)}, {_g(high)}]" if low is not None else "")


def _capacity(capacity: float | dict) -> str:
    """A capacity figure: a bare number (results saved before the engine measurement) or {value, ci_low,
    ci_high, source}."""
    if not isinstance(capacity, dict):
        return f"{_g(capacity)} requests/s"
    interval = (f" [{_g(capacity['ci_low'])}, {_g(capacity['ci_high'])}]" if capacity.get("ci_low") is not None
                else " (no interval)")
    return f"{_g(capacity['value'])}{interval} requests/s, {capacity['source']}"


def _g(value: float) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.3g}"


def _percent(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _finish(text: list[str], result: dict, title: str, image: str) -> str:
    """Goals (when given), the figure and the regenerate line."""
    goals = result.get("goals", {})
    if goals:
        text += ["", "Goals:"]
        text += [f"- {name}: target {g['target']}, measured {_g(g['measured'])}"
                 + (f" [{_g(g['ci'][0])}, {_g(g['ci'][1])}]" if g.get("ci") else "")
                 + f": {'met' if g['met'] else 'not met'}." for name, g in goals.items()]
    text += ["", f"![{title}]({image})"]
    if "command" in result:
        text += ["", f"Regenerate: `{result['command']}`"]
    return "\n".join(text) + "\n"
