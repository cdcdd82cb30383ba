"""Simulated scheduling studies: the load sweep, refreshed predictions versus countdown, and the long tail.

Every study replays requests drawn from a pool of real ones (prompt and true output lengths, plus each
predictor's predicted totals) through `leap_core.simulator` under Poisson arrivals quoted as fractions
of the sustained FCFS capacity (`fcfs_capacity`, steady state). Within one repeat (seed) every policy sees
the same requests and the same arrival times (the arrival gaps are one exponential draw scaled by the
rate), so differences between policies are paired, not sampling noise of the workload. "fcfs" and "oracle" (countdown on the true
lengths) are always added.
"""

from __future__ import annotations

import pathlib
from dataclasses import replace

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import brentq

from leap_core.metrics import bootstrap_ci, spearman
from leap_core.simulator import SimConfig, SimResult, StepTimeModel, fcfs_capacity, poisson_arrivals, simulate

__all__ = ["run_load", "plot_load", "section_load", "run_refresh", "plot_refresh", "section_refresh",
           "run_tail", "plot_tail", "section_tail", "refresh_sigma"]

_REFERENCES = ("fcfs", "oracle")
_NOT_CONFIGURABLE = {"policy", "step_model", "refresh_every", "refresh_cost_s", "refresh_sigma", "refresh_seed"}


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


def _workloads(n_pool: int, n_requests: int, repeats: int, seed: int):
    """Per repeat: the drawn pool indices and an arrival seed (drawn with replacement only if needed)."""
    if n_requests < 1 or repeats < 1:
        raise ValueError("n_requests and repeats must be >= 1")
    for repeat in range(repeats):
        rng = np.random.default_rng((seed, repeat))
        yield rng.choice(n_pool, n_requests, replace=n_requests > n_pool), 1000 * seed + repeat


def _run_policy(name: str, arrival: np.ndarray, prompt: np.ndarray, out: np.ndarray,
                predicted: dict[str, np.ndarray], config: SimConfig) -> SimResult:
    """fcfs, oracle (countdown on the truth) or countdown on the named predictor, for drawn requests."""
    if name == "fcfs":
        return simulate(arrival, prompt, out, out, replace(config, policy="fcfs"))
    if name == "oracle":
        return simulate(arrival, prompt, out, out, replace(config, policy="countdown"))
    return simulate(arrival, prompt, out, predicted[name], replace(config, policy="countdown"))


def _figures(result: SimResult) -> dict[str, float]:
    ptl, latency = result.ptl, result.latency
    return {"mean_latency_s": float(latency.mean()), "p95_latency_s": float(np.percentile(latency, 95)),
            "mean_ptl": float(ptl.mean()), "p95_ptl": float(np.percentile(ptl, 95))}


def _mean_over_repeats(figures: list[dict[str, float]]) -> dict[str, float]:
    """Each figure averaged over repeats, plus the spread of mean PTL across them (sample std)."""
    merged = {key: float(np.mean([f[key] for f in figures])) for key in figures[0]}
    merged["mean_ptl_std"] = float(np.std([f["mean_ptl"] for f in figures], ddof=1)) if len(figures) > 1 else 0.0
    return merged


# ------------------------------------------------------------------------------------------ load sweep

LOADS = (0.7, 0.8, 0.9, 0.95)  # fractions of the sustained FCFS capacity
HEADLINE_LOAD = 0.9
OVERLOADS = (1.2,)  # above capacity queues grow without bound: figures depend on the horizon, stated with it
RATIO_GOALS = {"leap_over_fcfs": 0.55, "leap_over_best_baseline": 0.85, "leap_over_oracle": 1.10}


def run_load(prompt_tokens: ArrayLike, lengths: ArrayLike, predictions: dict[str, ArrayLike],
             step_model: StepTimeModel, loads=LOADS, headline: float = HEADLINE_LOAD, overloads=OVERLOADS,
             n_requests: int = 2000, seeds: int = 30, seed: int = 0, **config) -> dict:
    """Latency and PTL of every policy at Poisson loads quoted as fractions of the sustained capacity.

    Each of `seeds` workloads draws `n_requests` from the pool and one arrival sequence per load; every
    policy replays the same draw, so policies are compared paired by seed. The ratios at `headline`
    (LEAP's mean PTL over FCFS's, the best baseline's and the oracle's) carry 95% bootstrap intervals
    over the seeds. `config` holds SimConfig knobs (max_resident, decode_slots, waiting_cap, ...), the
    same the step model was calibrated at. Overloads are run over the same horizon (`n_requests`
    arrivals) and reported with it: their figures grow with the horizon.
    """
    prompt, out, preds = _pool(prompt_tokens, lengths, predictions)
    base = _base_config(step_model, config)
    capacity = fcfs_capacity(prompt, out, base)
    policies = [*preds, *_REFERENCES]
    every_load = sorted({float(m) for m in (*loads, headline, *overloads)})
    runs: dict[float, dict[str, list]] = {m: {p: [] for p in policies} for m in every_load}
    for idx, arrival_seed in _workloads(out.size, n_requests, seeds, seed):
        drawn = {name: values[idx] for name, values in preds.items()}
        for m in every_load:
            arrival = poisson_arrivals(n_requests, m * capacity, seed=arrival_seed)
            for policy in policies:
                runs[m][policy].append(_figures(_run_policy(policy, arrival, prompt[idx], out[idx], drawn, base)))
    table = {str(m): {p: _over_seeds(runs[m][p]) for p in policies} for m in every_load}
    ptl = {p: np.array([f["mean_ptl"] for f in runs[float(headline)][p]]) for p in policies}
    baselines = [p for p in preds if not p.startswith("leap")]
    best = min(baselines, key=lambda p: ptl[p].mean()) if baselines else None
    ratios = paired_ratios(ptl, best)
    return {
        "capacity_rps": float(capacity),
        "capacity_measure": "FCFS steady state: completions between the 25th and 75th percentile of a "
                            "saturated run of 4,000 pool requests",
        "n_requests": int(n_requests),
        "seeds": int(seeds),
        "n_pool": int(out.size),
        "loads": [float(m) for m in sorted(loads)],
        "overloads": [{"load": float(m), "horizon_requests": int(n_requests),
                       "horizon_s": float(n_requests / (m * capacity))} for m in sorted(overloads)],
        "headline_load": float(headline),
        "spearman": {name: spearman(out, values) for name, values in preds.items()},
        "table": table,
        "best_baseline": best,
        "ratios": ratios,
        "goals": ratio_goals(ratios),
        "sweep": {
            "multipliers": every_load,
            **{key: {p: [table[str(m)][p][key] for m in every_load] for p in policies}
               for key in ("mean_ptl", "mean_ptl_ci_low", "mean_ptl_ci_high", "mean_latency_s")},
        },
    }


def _over_seeds(figures: list[dict[str, float]]) -> dict[str, float]:
    """Each figure averaged over seeds, mean PTL with its 95% bootstrap interval over them."""
    merged = {key: float(np.mean([f[key] for f in figures])) for key in figures[0]}
    ci = bootstrap_ci(mean_last_axis, np.array([f["mean_ptl"] for f in figures]), vectorized=True)
    merged["mean_ptl_ci_low"], merged["mean_ptl_ci_high"] = ci["ci_low"], ci["ci_high"]
    return merged


def paired_ratios(ptl: dict[str, np.ndarray], best: str | None, leap: str = "leap") -> dict[str, dict]:
    """LEAP's mean PTL over each reference's, paired by workload: ratio of means with a 95% bootstrap
    interval that resamples the workloads (seeds, or requests of one replay) jointly for both policies."""
    pairs = {"leap_over_fcfs": "fcfs", "leap_over_best_baseline": best, "leap_over_oracle": "oracle"}
    ratios = {}
    for key, other in pairs.items():
        if other is not None and other in ptl and leap in ptl:
            ratios[key] = bootstrap_ci(ratio_of_means, ptl[leap], ptl[other], vectorized=True)
    if "leap-rls" in ptl and "fcfs" in ptl:
        ratios["leap_rls_over_fcfs"] = bootstrap_ci(ratio_of_means, ptl["leap-rls"], ptl["fcfs"], vectorized=True)
    return ratios


def mean_last_axis(a: np.ndarray) -> np.ndarray:
    return np.mean(a, axis=-1)


def ratio_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.mean(a, axis=-1) / np.mean(b, axis=-1)


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
                    label=policy, linestyle="--" if policy in _REFERENCES else "-")
    ax.set_xlabel("load (fraction of sustained FCFS capacity)")
    ax.set_ylabel("mean per-token latency (s/token)")
    ax.set_title(f"Simulated mean PTL vs load ({result['seeds']} paired seeds)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _interval(r: dict) -> str:
    return f"{_g(r['value'])} [{_g(r['ci_low'])}, {_g(r['ci_high'])}]"


def section_load(result: dict, image: str) -> str:
    """docs/results.md section: latency and PTL per policy at each load, and LEAP's paired ratios."""
    rows = []
    for load, policies in result["table"].items():
        for policy, f in policies.items():
            rows.append([f"{float(load):g}", policy, _g(f["mean_latency_s"]), _g(f["p95_latency_s"]),
                         f"{_g(f['mean_ptl'])} [{_g(f['mean_ptl_ci_low'])}, {_g(f['mean_ptl_ci_high'])}]",
                         _g(f["p95_ptl"])])
    rho = ", ".join(f"{name} {_g(value)}" for name, value in result.get("spearman", {}).items())
    ratio_rows = [[key, _interval(r)] for key, r in result["ratios"].items()]
    overloads = "; ".join(f"{o['load']:g} over {o['horizon_requests']} arrivals ({_g(o['horizon_s'])} s)"
                          for o in result.get("overloads", []))
    text = [
        "## Simulated scheduling under load",
        "",
        f"End-to-end latency and per-token latency (PTL = latency / output tokens) of each decode policy in the "
        f"step-loop simulator at R = {result.get('max_resident', '?')}, K = {result.get('decode_slots', '?')}, with "
        f"the step-time model calibrated on the live engine at that R and K ({result.get('step_model_source', '')}"
        f"). {result['n_requests']} requests "
        f"per run drawn from a pool of {result['n_pool']} held-out prompts, Poisson arrivals at fractions of the "
        f"sustained FCFS capacity ({_g(result['capacity_rps'])} requests/s, {result['capacity_measure']}); "
        f"{result['seeds']} paired seeds (every policy replays the same draw), mean PTL with its 95% bootstrap "
        f"interval over seeds. Overloads (queues grow without bound, so figures depend on the horizon): "
        f"{overloads or 'none'}. The oracle is countdown on the true lengths"
        + (f"; predictor Spearman on the pool: {rho}." if rho else "."),
        "",
        _table(["load", "policy", "mean latency (s)", "P95 latency (s)", "mean PTL (s/token) [95% CI]",
                "P95 PTL (s/token)"], rows),
        "",
        f"LEAP's mean PTL over each reference at {result['headline_load']:g} of capacity, paired by seed "
        f"(best baseline: {result.get('best_baseline')}), with 95% bootstrap intervals:",
        "",
        _table(["ratio", "value [95% CI]"], ratio_rows),
    ]
    return _finish(text, result, "Mean PTL vs load", image)


# ---------------------------------------------------------------------------------- refresh vs countdown


def refresh_sigma(lengths: ArrayLike, target_spearman: float, seed: int = 0) -> float:
    """The log-normal noise `sigma` for which `lengths * exp(sigma * z)` has the target Spearman with `lengths`.

    One seeded draw of z on this pool; brentq on sigma. This makes a refreshed estimate as good at
    ranking as the prefill predictor it replaces. Spearman 1 gives 0; a target <= 0 cannot be reached.
    """
    out = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if target_spearman >= 1.0:
        return 0.0
    if not target_spearman > 0.0:
        raise ValueError(f"target_spearman must be > 0 for multiplicative noise, got {target_spearman}")
    z = np.random.default_rng(seed).standard_normal(out.size)

    log_out = np.log(np.maximum(out, 1.0))

    def gap(sigma: float) -> float:  # ranks of out * exp(sigma z), without overflow
        return spearman(out, log_out + sigma * z) - target_spearman

    high = 1.0
    while gap(high) > 0:
        high *= 2.0
        if high > 1e3:
            raise ValueError(f"target_spearman {target_spearman} is below what noise reaches on this pool")
    return float(brentq(gap, 0.0, high, xtol=1e-4))


def _life_mae(out: np.ndarray, predicted: np.ndarray, every: int, sigma: float, grid: int, seed: int) -> float:
    """MAE of the remaining-length estimate the scheduler holds at generated = 0, grid, 2*grid, ... < length.

    Countdown (every = 0) holds max(predicted - generated, 1). Refresh holds the prefill prediction
    counted down until generated reaches a multiple of `every`, then a fresh (length - g) * exp(sigma z)
    counted down from there. Averaged over each request's points first, so every request weighs once,
    as at admission. Evaluated on the pool with its own seeded draws of z.
    """
    counts = -(-out // grid)  # grid points below each length
    request = np.repeat(np.arange(out.size), counts)
    generated = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * grid
    true_remaining = out[request] - generated
    estimate = predicted[request] - generated
    if every:
        last = generated // every * every
        key, inverse = np.unique(request * (out.max() + 1) + last, return_inverse=True)
        noise = np.exp(sigma * np.random.default_rng(seed).standard_normal(key.size))[inverse]
        fresh = (out[request] - last) * noise - (generated - last)
        estimate = np.where(last > 0, fresh, estimate)
    error = np.abs(np.maximum(estimate, 1.0) - true_remaining)
    return float(np.mean(np.bincount(request, weights=error, minlength=out.size) / counts))


def run_refresh(prompt_tokens: ArrayLike, lengths: ArrayLike, predictions: dict[str, ArrayLike],
                step_model: StepTimeModel, refresh_costs: dict[str, float], refresh_every=(16, 64),
                multiplier: float = HEADLINE_LOAD, n_requests: int = 2000, repeats: int = 3, seed: int = 0, **config) -> dict:
    """Countdown (one prediction at prefill) against refreshing the estimate during decoding (the paper's Table 2).

    Refresh model: every `refresh_every` generated tokens each resident request gets a fresh estimate
    of its true remaining length, remaining * exp(sigma * z), z ~ N(0, 1) seeded, where sigma is fitted
    once per predictor (`refresh_sigma`) so the estimate at generated = 0 ranks the pool's lengths with
    the predictor's own Spearman: the refresh is as good as the prefill predictor, no better. The step
    pays `refresh_costs[predictor]` seconds per refreshed request. `refresh_every` 0 is countdown.
    MAE over life is averaged on a grid of the smallest non-zero `refresh_every` tokens (see `_life_mae`).
    """
    prompt, out, preds = _pool(prompt_tokens, lengths, predictions)
    missing = set(preds) - set(refresh_costs)
    if missing:
        raise ValueError(f"no refresh cost for {sorted(missing)}")
    everies = [int(e) for e in refresh_every]
    if min(everies, default=0) < 0:
        raise ValueError("refresh_every must be >= 0")
    grid = min((e for e in everies if e > 0), default=16)
    base = _base_config(step_model, config)
    capacity = fcfs_capacity(prompt, out, base)
    rho = {name: spearman(out, values) for name, values in preds.items()}
    sigma = {name: refresh_sigma(out, rho[name], seed) for name in preds}

    runs: dict[tuple, list] = {}  # (policy,) for countdown and the references, (predictor, every) for refresh
    for idx, arrival_seed in _workloads(out.size, n_requests, repeats, seed):
        arrival = poisson_arrivals(n_requests, multiplier * capacity, seed=arrival_seed)
        drawn = {name: values[idx] for name, values in preds.items()}
        for policy in (*preds, *_REFERENCES):
            runs.setdefault((policy,), []).append(
                _figures(_run_policy(policy, arrival, prompt[idx], out[idx], drawn, base)))
        for name in preds:
            for every in everies:
                refreshing = replace(base, refresh_every=every, refresh_cost_s=float(refresh_costs[name]),
                                     refresh_sigma=sigma[name], refresh_seed=arrival_seed)
                runs.setdefault((name, every), []).append(
                    _figures(_run_policy(name, arrival, prompt[idx], out[idx], drawn, refreshing)))

    rows, change = [], {}
    for name, values in preds.items():
        admission = float(np.mean(np.abs(values - out)))
        countdown = _mean_over_repeats(runs[(name,)])
        rows.append({"predictor": name, "mode": "countdown", "refresh_every": 0, "cost_s_per_refresh": 0.0,
                     **_row_figures(countdown), "mae_at_admission": admission,
                     "mae_mean_over_life": _life_mae(out, values, 0, 0.0, grid, seed)})
        change[name] = {}
        for every in everies:
            refreshed = _mean_over_repeats(runs[(name, every)])
            rows.append({"predictor": name, "mode": "refresh", "refresh_every": every,
                         "cost_s_per_refresh": float(refresh_costs[name]), **_row_figures(refreshed),
                         "mae_at_admission": admission,
                         "mae_mean_over_life": _life_mae(out, values, every, sigma[name], grid, seed)})
            change[name][str(every)] = refreshed["mean_latency_s"] / countdown["mean_latency_s"] - 1.0
    return {
        "multiplier": float(multiplier),
        "capacity_rps": float(capacity),
        "n_requests": int(n_requests),
        "repeats": int(repeats),
        "life_grid_tokens": int(grid),
        "predictors": {name: {"spearman": rho[name], "refresh_sigma": sigma[name]} for name in preds},
        "reference": {policy: _row_figures(_mean_over_repeats(runs[(policy,)])) for policy in _REFERENCES},
        "rows": rows,
        "change_vs_countdown": change,
    }


def _row_figures(figures: dict[str, float]) -> dict[str, float]:
    return {key: figures[key] for key in ("mean_latency_s", "p95_latency_s", "mean_ptl")}


def plot_refresh(result: dict, path: pathlib.Path) -> None:
    """Grouped bars: mean latency of each predictor under countdown and each refresh interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predictors = list(dict.fromkeys(row["predictor"] for row in result["rows"]))
    modes = list(dict.fromkeys(_mode_label(row) for row in result["rows"]))
    latency = {(row["predictor"], _mode_label(row)): row["mean_latency_s"] for row in result["rows"]}
    width = 0.8 / len(modes)
    x = np.arange(len(predictors))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for i, mode in enumerate(modes):
        ax.bar(x + (i - (len(modes) - 1) / 2) * width, [latency.get((p, mode), np.nan) for p in predictors],
               width, label=mode)
    for policy, style in zip(_REFERENCES, (":", "--")):
        ax.axhline(result["reference"][policy]["mean_latency_s"], color="grey", linestyle=style, label=policy)
    ax.set_xticks(x, predictors)
    ax.set_xlabel("predictor")
    ax.set_ylabel("mean latency (s)")
    ax.set_title(f"Countdown vs refreshed predictions at {result['multiplier']:g}x load")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _mode_label(row: dict) -> str:
    return "countdown" if row["mode"] == "countdown" else f"refresh every {row['refresh_every']}"


def section_refresh(result: dict, image: str) -> str:
    """docs/results.md section: countdown against refreshed estimates, with their cost and error."""
    rows = []
    for row in result["rows"]:
        change = ("" if row["mode"] == "countdown"
                  else _percent(result["change_vs_countdown"][row["predictor"]][str(row["refresh_every"])]))
        rows.append([row["predictor"], _mode_label(row), _g(1e3 * row["cost_s_per_refresh"]),
                     _g(row["mean_latency_s"]), _g(row["p95_latency_s"]), _g(row["mean_ptl"]),
                     _g(row["mae_at_admission"]), _g(row["mae_mean_over_life"]), change])
    for policy in _REFERENCES:
        f = result["reference"][policy]
        rows.append([policy, "reference", "", _g(f["mean_latency_s"]), _g(f["p95_latency_s"]), _g(f["mean_ptl"]),
                     "", "", ""])
    quality = ", ".join(f"{name} (Spearman {_g(p['spearman'])}, sigma {_g(p['refresh_sigma'])})"
                        for name, p in result["predictors"].items())
    text = [
        "## Refreshing predictions vs countdown",
        "",
        f"Countdown predicts once at prefill and schedules by predicted minus generated; refresh re-estimates "
        f"each resident request's remaining length every N generated tokens and pays the stated cost per "
        f"refreshed request in that step. Simulated at {result['multiplier']:g} of the sustained FCFS capacity, "
        f"{result['n_requests']} requests, mean over {result['repeats']} repeats.",
        "",
        f"Refresh model (an assumption, not a measured predictor): the refreshed estimate is the true remaining "
        f"length times exp(sigma z), z ~ N(0, 1), with sigma fitted so that at generated = 0 it ranks the pool "
        f"with the predictor's own Spearman: {quality}. MAE over life is the error of the estimate the scheduler "
        f"holds, sampled every {result['life_grid_tokens']} generated tokens over each request's life, averaged per "
        f"request and then over requests (on the pool, with its own draws of z).",
        "",
        _table(["predictor", "mode", "cost / refresh (ms)", "mean latency (s)", "P95 latency (s)",
                "mean PTL (s/token)", "MAE at admission (tokens)", "MAE over life (tokens)",
                "latency vs countdown"], rows),
    ]
    return _finish(text, result, "Countdown vs refresh", image)


# ------------------------------------------------------------------------------------------------- tail


def run_tail(prompt_tokens: ArrayLike, lengths: ArrayLike, predicted: ArrayLike, step_model: StepTimeModel,
             waiting_caps=(16, 32, 64, 128, 256, 1024), agings=(0.0, 0.001, 0.01, 0.1), multiplier: float = HEADLINE_LOAD,
             long_quantile: float = 0.9, n_requests: int = 2000, repeats: int = 3, seed: int = 0,
             aging_waiting_cap: int = 128, **config) -> dict:
    """How the waiting cap and aging trade long-request tail latency against mean PTL under countdown.

    Long requests are those whose true length is at least the pool's `long_quantile`. Cap rows use no
    aging; aging rows use `aging_waiting_cap`. `config` holds the other SimConfig knobs.
    """
    prompt, out, preds = _pool(prompt_tokens, lengths, {"countdown": predicted})
    base = _base_config(step_model, config)
    capacity = fcfs_capacity(prompt, out, base)
    threshold = float(np.quantile(out, long_quantile))
    settings = {("fcfs",): None, **{("cap", int(c)): replace(base, waiting_cap=int(c), aging=0.0)
                                    for c in waiting_caps},
                **{("aging", float(a)): replace(base, waiting_cap=int(aging_waiting_cap), aging=float(a))
                   for a in agings}}
    runs: dict[tuple, list] = {key: [] for key in settings}
    for idx, arrival_seed in _workloads(out.size, n_requests, repeats, seed):
        arrival = poisson_arrivals(n_requests, multiplier * capacity, seed=arrival_seed)
        drawn = {"countdown": preds["countdown"][idx]}
        long = out[idx] >= threshold
        for key, setting in settings.items():
            policy = "fcfs" if setting is None else "countdown"
            result = _run_policy(policy, arrival, prompt[idx], out[idx], drawn, setting or base)
            runs[key].append(_tail_figures(result, long))
    mean = {key: {name: float(np.mean([r[name] for r in values])) for name in values[0]}
            for key, values in runs.items()}
    return {
        "multiplier": float(multiplier),
        "capacity_rps": float(capacity),
        "n_requests": int(n_requests),
        "repeats": int(repeats),
        "long_quantile": float(long_quantile),
        "long_threshold_tokens": threshold,
        "aging_waiting_cap": int(aging_waiting_cap),
        "fcfs": mean[("fcfs",)],
        "cap": [{"waiting_cap": int(c), **mean[("cap", int(c))]} for c in waiting_caps],
        "aging": [{"aging": float(a), **mean[("aging", float(a))]} for a in agings],
    }


def _tail_figures(result: SimResult, long: np.ndarray) -> dict[str, float]:
    latency = result.latency
    return {"long_p95_latency_s": float(np.percentile(latency[long], 95)) if long.any() else float("nan"),
            "all_p95_latency_s": float(np.percentile(latency, 95)), "mean_ptl": float(result.ptl.mean())}


def plot_tail(result: dict, path: pathlib.Path) -> None:
    """Two columns (waiting cap, aging): long-request P95 latency above, mean PTL below, FCFS's as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(8, 5.5), dpi=120, sharex="col")
    columns = (("cap", "waiting_cap", "waiting cap (steps held out)"),
               ("aging", "aging", f"aging rate (waiting cap {result['aging_waiting_cap']})"))
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

    def rows(key: str, knob: str) -> list[list[str]]:
        return [[f"{r[knob]:g}", _g(r["long_p95_latency_s"]), _g(r["all_p95_latency_s"]), _g(r["mean_ptl"])]
                for r in result[key]] + [["FCFS", _g(fcfs["long_p95_latency_s"]), _g(fcfs["all_p95_latency_s"]),
                                          _g(fcfs["mean_ptl"])]]

    columns = ["long P95 latency (s)", "all P95 latency (s)", "mean PTL (s/token)"]
    text = [
        "## Long-request tail: waiting cap and aging",
        "",
        f"P95 latency of long requests (true length >= the pool's {result['long_quantile']:g} quantile, "
        f"{result['long_threshold_tokens']:g} tokens) and of all requests, with mean PTL, under countdown at "
        f"{result['multiplier']:g} of the sustained FCFS capacity, {result['n_requests']} requests, mean over "
        f"{result['repeats']} repeats. The waiting cap forces a resident request into the decode batch once it "
        f"has been held out that many consecutive steps. Aging (as in leap_core/policy.py, after TIE) orders by "
        f"predicted remaining x exp(-aging x held_out), where held_out counts the consecutive steps the request "
        f"was not decoded and restarts at 0 when it is; aging rows use cap {result['aging_waiting_cap']}.",
        "",
        _table(["waiting cap", *columns], rows("cap", "waiting_cap")),
        "",
        _table(["aging", *columns], rows("aging", "aging")),
    ]
    return _finish(text, result, "Long-request tail", image)


# ------------------------------------------------------------------------------------------- markdown


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
