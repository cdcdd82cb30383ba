"""The promotion gate's verdict: challenger against bar on paired replays, with an interval and three outcomes.

The replays (`harness.gate_replay`) give each arm's per-request PTL over the same (request, repeat) pairs;
the verdict is the ratio of mean PTLs, challenger over bar (the champion, or FCFS), with a bootstrap
interval over requests: better, worse (including a guard on the longest quartile's P95, since
shortest-predicted-first can starve long requests) or no difference. `passed` turns that into the rule,
with `on_no_difference` deciding the middle case; a challenger found worse in shadow
(`leap_core.shadow_figures`) never passes, and anything that makes the comparison meaningless fails
closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from leap_core.intervals import bootstrap_ci, ratio_over_requests

LONG_QUANTILE = 0.75
MARGIN = 0.02  # better needs the ratio at least this far below 1
# The long-request guard's bound: the tolerance the product states for long requests (their P95 at most 1.2x
# FCFS's). At 1.10 the guard refused 11 of 100 simulated first promotions whose mean PTL gain was x0.78 at
# the median (`leap bench gate`'s quick size), their longest quartile's P95 being 10-20% later, which is what
# shortest-predicted-first does to long requests by design.
P95_BOUND = 1.20
BETTER, NO_DIFFERENCE, WORSE = "better", "no-difference", "worse"
ON_NO_DIFFERENCE = ("keep", "noninferior")


def _figures(summary: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, int]:
    ptl = np.asarray(summary["ptl"], dtype=np.float64).reshape(-1)
    tokens = np.asarray(summary["output_tokens"], dtype=np.float64).reshape(-1)
    return ptl, tokens, int(summary.get("repeats", 1))


def _failed(reason: str, bar: str, margin: float, p95_bound: float) -> dict[str, Any]:
    return {"passed": False, "outcome": None, "reason": reason, "bar": bar, "margin": margin,
            "p95_bound": p95_bound}


def _long_p95_interval(bar_ptl: np.ndarray, ch_ptl: np.ndarray, long: np.ndarray, repeats: int, n_boot: int,
                       seed: int, level: float) -> dict[str, float]:
    """The longest quartile's P95 PTL, challenger over bar, with a bootstrap interval that resamples the long
    requests, each with all its repeats (one request's repeats are not independent samples)."""
    bar_long = bar_ptl.reshape(repeats, -1)[:, long]  # (repeats, long requests)
    ch_long = ch_ptl.reshape(repeats, -1)[:, long]

    def ratio(rows: np.ndarray) -> np.ndarray:
        def p95(arm: np.ndarray) -> np.ndarray:  # rows (..., n) -> the P95 over those requests' repeats
            return np.percentile(np.moveaxis(arm[:, rows], 0, -2).reshape(*rows.shape[:-1], -1), 95, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return p95(ch_long) / p95(bar_long)

    return bootstrap_ci(ratio, np.arange(bar_long.shape[1]), n_boot=n_boot, seed=seed, level=level, vectorized=True)


def gate_verdict(results: Mapping[str, Mapping[str, Any] | None], margin: float = MARGIN,
                 p95_bound: float = P95_BOUND, on_no_difference: str = "keep", noninferiority: float = 0.02,
                 level: float = 0.95, n_boot: int = 2000, seed: int = 0,
                 shadow: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The outcome (better, no difference, worse) of the challenger against the bar, its paired ratio
    with a bootstrap interval, and whether the rule passes it (module docstring).

    `results` maps "fcfs", "champion" (None or absent when there is none) and "challenger" to replay
    summaries with per-request `ptl` and `output_tokens`, in one order, and `repeats` (default 1): the
    figures are the repeats one after another, so entry i is request i % (size / repeats). Missing or
    non-finite figures, or replays of different requests, fail the gate rather than raise.
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if not p95_bound > 0.0:
        raise ValueError(f"p95_bound must be > 0, got {p95_bound}")
    if on_no_difference not in ON_NO_DIFFERENCE:
        raise ValueError(f"on_no_difference is one of {ON_NO_DIFFERENCE}, not {on_no_difference!r}")
    bar = "champion" if results.get("champion") is not None else "fcfs"
    if results.get("challenger") is None:
        return _failed("no challenger replay", bar, margin, p95_bound)
    if results.get(bar) is None:
        return _failed(f"no {bar} replay to compare with", bar, margin, p95_bound)

    bar_ptl, bar_tokens, repeats = _figures(results[bar])
    ch_ptl, ch_tokens, ch_repeats = _figures(results["challenger"])
    if (bar_ptl.size == 0 or bar_ptl.shape != ch_ptl.shape or not np.array_equal(bar_tokens, ch_tokens)
            or repeats != ch_repeats or repeats < 1 or bar_ptl.size % repeats):
        return _failed(f"the {bar} and challenger replays are not the same requests with the same lengths",
                       bar, margin, p95_bound)
    if not np.isfinite(np.concatenate([bar_ptl, ch_ptl])).all() or bar_ptl.sum() <= 0:
        return _failed("a replay has missing or non-finite latencies", bar, margin, p95_bound)

    n_requests = bar_ptl.size // repeats
    ratio = ratio_over_requests(ch_ptl, bar_ptl, repeats, n_boot=n_boot, seed=seed, level=level)
    long = bar_tokens >= np.quantile(bar_tokens, LONG_QUANTILE)
    bar_long_p95 = float(np.percentile(bar_ptl[long], 95))
    ch_long_p95 = float(np.percentile(ch_ptl[long], 95))
    long_ratio = ch_long_p95 / bar_long_p95 if bar_long_p95 > 0 else float("inf")
    long_interval = _long_p95_interval(bar_ptl, ch_ptl, long[:n_requests], repeats, n_boot, seed, level)
    # worse only on evidence; an interval that cannot be formed (no finite resample) fails closed
    long_ok = bool(np.isfinite(long_interval["ci_low"])) and long_interval["ci_low"] <= p95_bound
    if ratio["ci_low"] > 1.0 or not long_ok:
        outcome = WORSE
    elif ratio["ci_high"] < 1.0 and ratio["value"] <= 1.0 - margin:
        outcome = BETTER
    else:
        outcome = NO_DIFFERENCE
    passed = outcome == BETTER or (outcome == NO_DIFFERENCE and on_no_difference == "noninferior"
                                   and ratio["ci_high"] <= 1.0 + noninferiority)
    shadow_worse = shadow is not None and bool(shadow.get("shadow_worse"))
    interval = f"{level:.0%} interval x{ratio['ci_low']:.3f}..x{ratio['ci_high']:.3f}"
    reason = (f"{outcome}: mean PTL x{ratio['value']:.3f} of {bar}'s ({interval}; better needs the interval "
              f"below x1 and at most x{1 - margin:.3f}); longest-quartile P95 PTL x{long_ratio:.3f} of {bar}'s "
              f"(x{long_interval['ci_low']:.3f}..x{long_interval['ci_high']:.3f}; worse when the interval lies "
              f"above x{p95_bound:.3f}); rule on no difference: {on_no_difference}")
    if shadow is not None:
        reason += (f"; in shadow on {shadow.get('n')} live requests: "
                   + (f"worse on {', '.join(shadow.get('worse_on', []))}" if shadow_worse else "not worse"))
    passed = passed and not shadow_worse
    verdict: dict[str, Any] = {
        "passed": bool(passed),
        "outcome": outcome,
        "reason": ("passed, " if passed else "failed, ") + reason,
        "bar": bar,
        "margin": margin,
        "p95_bound": p95_bound,
        "on_no_difference": on_no_difference,
        "noninferiority": noninferiority,
        "mean_ptl_ratio": ratio["value"],
        "ci_low": ratio["ci_low"],
        "ci_high": ratio["ci_high"],
        "level": level,
        "long_p95_ratio": float(long_ratio),
        "long_p95_ci_low": long_interval["ci_low"],
        "long_p95_ci_high": long_interval["ci_high"],
        "challenger_mean_ptl": float(ch_ptl.mean()),
        "bar_mean_ptl": float(bar_ptl.mean()),
        "challenger_long_p95_ptl": ch_long_p95,
        "bar_long_p95_ptl": bar_long_p95,
        "n_requests": int(n_requests),
        "repeats": int(repeats),
        "n_long": int(long[:n_requests].sum()),
        "shadow": None if shadow is None else dict(shadow),
    }
    fcfs = results.get("fcfs")
    if bar != "fcfs" and fcfs is not None:
        fcfs_ptl = np.asarray(fcfs["ptl"], dtype=np.float64)
        if fcfs_ptl.size and fcfs_ptl.mean() > 0:
            verdict["fcfs_mean_ptl_ratio"] = float(ch_ptl.mean() / fcfs_ptl.mean())
    return verdict
