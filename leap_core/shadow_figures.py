"""Paired, delayed-label figures of a readout held in shadow against the one that served the same requests.

Both readouts predicted each finished request from the same captured vector, so the comparison is
paired: Spearman, MAE and pairwise order accuracy for each readout and as a difference, with a paired
bootstrap interval (`leap_core.intervals.bootstrap_ci`). The shadow is worse only when an interval says
so; the gate (`leap_core.gate_verdict`) promotes only a challenger that is not worse in shadow.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from leap_core.intervals import bootstrap_ci
from leap_core.metrics import mae_batch, spearman_batch

PAIRWISE_ROWS = 1024
"""Rows the order accuracy's bootstrap draws on at most (each replicate compares every pair: n^2 cells);
the point value uses every row."""


def pairwise_order_accuracy(true: ArrayLike, pred: ArrayLike) -> float:
    """Of the pairs of requests whose lengths differ, the share `pred` orders as `true` (a tie in `pred`
    counts half); NaN without such a pair."""
    return float(_order_accuracy_batch(np.asarray(true, dtype=np.float64)[None, :],
                                       np.asarray(pred, dtype=np.float64)[None, :])[0])


def _order_accuracy_batch(true: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """`pairwise_order_accuracy` of each row of (k, n) arrays, in blocks that keep k * n * n small."""
    out = np.empty(true.shape[0])
    block = max(1, (1 << 22) // max(1, true.shape[1] ** 2))
    for start in range(0, true.shape[0], block):
        t, p = true[start:start + block], pred[start:start + block]
        dt = np.sign(t[:, :, None] - t[:, None, :])
        dp = np.sign(p[:, :, None] - p[:, None, :])
        pairs = np.count_nonzero(dt, axis=(1, 2))
        agree = np.sum(dt * dp, axis=(1, 2))  # concordant - discordant, ties in pred count 0
        with np.errstate(divide="ignore", invalid="ignore"):
            out[start:start + block] = np.where(pairs > 0, 0.5 * (1.0 + agree / np.where(pairs > 0, pairs, 1)),
                                                np.nan)
    return out


def _paired(figure: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    def difference(true: np.ndarray, served: np.ndarray, shadow: np.ndarray) -> np.ndarray:
        return figure(true, shadow) - figure(true, served)
    return difference


def shadow_figures(output_tokens: ArrayLike, served: ArrayLike, shadow: ArrayLike, level: float = 0.95,
                   n_boot: int = 1000, seed: int = 0) -> dict:
    """Each readout's Spearman, MAE and order accuracy on the same requests, the shadow's minus the
    served one's with a paired bootstrap interval, and whether the shadow is worse (module docstring).

    Rows whose values are not all finite are left out (and counted in `n_dropped`)."""
    true = np.asarray(output_tokens, dtype=np.float64).reshape(-1)
    a = np.asarray(served, dtype=np.float64).reshape(-1)
    b = np.asarray(shadow, dtype=np.float64).reshape(-1)
    if not true.size == a.size == b.size:
        raise ValueError(f"output_tokens, served and shadow differ in length: {true.size}, {a.size}, {b.size}")
    keep = np.isfinite(true) & np.isfinite(a) & np.isfinite(b)
    true, a, b = true[keep], a[keep], b[keep]
    figures: dict = {"n": int(true.size), "n_dropped": int((~keep).sum()), "level": level}
    statistics = {"spearman": spearman_batch, "mae": mae_batch, "order_accuracy": _order_accuracy_batch}
    for name, figure in statistics.items():
        figures[name] = {"served": float(figure(true[None, :], a[None, :])[0]) if true.size else float("nan"),
                         "shadow": float(figure(true[None, :], b[None, :])[0]) if true.size else float("nan")}
        rows = np.arange(true.size)
        if name == "order_accuracy" and true.size > PAIRWISE_ROWS:
            rows = np.random.default_rng(seed).choice(true.size, PAIRWISE_ROWS, replace=False)
        figures[name]["difference"] = bootstrap_ci(_paired(figure), true[rows], a[rows], b[rows], n_boot=n_boot,
                                                   seed=seed, level=level, vectorized=True)
    worse = [name for name in ("spearman", "order_accuracy") if figures[name]["difference"]["ci_high"] < 0.0]
    if figures["mae"]["difference"]["ci_low"] > 0.0:
        worse.append("mae")
    figures["worse_on"] = worse
    figures["shadow_worse"] = bool(worse)
    return figures
