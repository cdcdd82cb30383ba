"""Live figures of canary replicas against the rest of the fleet over the same time window.

Canaries serve the challenger and the rest the champion on traffic routed alike, so the two groups are
independent samples of one stream. Spearman, MAE and mean per-token latency are compared as differences
or a ratio with bootstrap intervals (`leap_core.intervals`); the canaries are worse only when an interval
says so. The canary flow (`flows.canary`) rolls worse canaries back and promotes otherwise.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from leap_core.intervals import percentile_interval, resample_rows
from leap_core.metrics import mae_batch, spearman_batch


def _group(true: ArrayLike, pred: ArrayLike, ptl: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, p, latency = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (true, pred, ptl))
    if not t.size == p.size == latency.size:
        raise ValueError(f"true, pred and ptl differ in length: {t.size}, {p.size}, {latency.size}")
    keep = np.isfinite(t) & np.isfinite(p) & np.isfinite(latency)
    return t[keep], p[keep], latency[keep]


def canary_figures(canary: tuple[ArrayLike, ArrayLike, ArrayLike], rest: tuple[ArrayLike, ArrayLike, ArrayLike],
                   ptl_bound: float = 0.05, level: float = 0.95, n_boot: int = 1000, seed: int = 0) -> dict:
    """The canaries' figures against the rest's; each group is (true lengths, predictions, PTLs).
    Rows with a value that is not finite are left out. See the module docstring for "worse"."""
    groups = {"canary": _group(*canary), "rest": _group(*rest)}
    sizes = {name: int(g[0].size) for name, g in groups.items()}
    figures: dict = {"n_canary": sizes["canary"], "n_rest": sizes["rest"], "level": level, "ptl_bound": ptl_bound}
    if min(sizes.values()) < 2:
        raise ValueError(f"each group needs at least 2 finished requests, got {sizes}")
    rng = np.random.default_rng(seed)
    draws = {name: resample_rows(sizes[name], n_boot, rng) for name in groups}
    point, boot = {}, {}
    for name, (t, p, latency) in groups.items():
        index = draws[name]
        point[name] = {"spearman": float(spearman_batch(t[None, :], p[None, :])[0]),
                       "mae": float(mae_batch(t[None, :], p[None, :])[0]), "mean_ptl": float(latency.mean())}
        boot[name] = {"spearman": spearman_batch(t[index], p[index]), "mae": mae_batch(t[index], p[index]),
                      "mean_ptl": latency[index].mean(axis=1)}
    for figure in ("spearman", "mae"):
        figures[figure] = {"canary": point["canary"][figure], "rest": point["rest"][figure],
                           "difference": percentile_interval(point["canary"][figure] - point["rest"][figure],
                                                             boot["canary"][figure] - boot["rest"][figure], level)}
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = boot["canary"]["mean_ptl"] / boot["rest"]["mean_ptl"]
    figures["mean_ptl"] = {"canary": point["canary"]["mean_ptl"], "rest": point["rest"]["mean_ptl"],
                           "ratio": percentile_interval(point["canary"]["mean_ptl"] / point["rest"]["mean_ptl"], ratios,
                                                        level)}
    worse = []
    if figures["spearman"]["difference"]["ci_high"] < 0.0:
        worse.append("spearman")
    if figures["mae"]["difference"]["ci_low"] > 0.0:
        worse.append("mae")
    if figures["mean_ptl"]["ratio"]["ci_low"] > 1.0 + ptl_bound:
        worse.append("mean_ptl")
    figures["worse_on"] = worse
    figures["canary_worse"] = bool(worse)
    return figures
