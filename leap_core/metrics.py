"""Figures for predictors and schedules: rank agreement, errors by length bucket, latency per token.

A scheduler only needs the order of requests right, so rank correlations (Spearman, Kendall) are the
headline predictor figures; MAE by bucket shows where the errors are. Per-token latency (PTL) is the
serving figure that length-aware scheduling improves.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

# The paper's bucket edges for a 2048-token budget: short < 256 <= medium < 1024 <= long.
_REFERENCE_BUDGET = 2048
_REFERENCE_EDGES = (256, 1024)


def _pair(true: ArrayLike, pred: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    true = np.asarray(true, dtype=np.float64).reshape(-1)
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    if true.shape != pred.shape:
        raise ValueError(f"true and pred differ in length: {true.shape[0]} vs {pred.shape[0]}")
    return true, pred


def spearman(true: ArrayLike, pred: ArrayLike) -> float:
    """Spearman rank correlation (NaN when either side is constant or has < 2 values)."""
    true, pred = _pair(true, pred)
    if true.size < 2 or np.ptp(true) == 0 or np.ptp(pred) == 0:
        return float("nan")
    return float(stats.spearmanr(true, pred).statistic)


def kendall(true: ArrayLike, pred: ArrayLike) -> float:
    """Kendall's tau-b (NaN when either side is constant or has < 2 values)."""
    true, pred = _pair(true, pred)
    if true.size < 2 or np.ptp(true) == 0 or np.ptp(pred) == 0:
        return float("nan")
    return float(stats.kendalltau(true, pred).statistic)


def mae(true: ArrayLike, pred: ArrayLike) -> float:
    """Mean absolute error in tokens (NaN when empty)."""
    true, pred = _pair(true, pred)
    return float(np.mean(np.abs(true - pred))) if true.size else float("nan")


def bucket_edges(max_tokens: int) -> tuple[float, float]:
    """(short/medium, medium/long) edges: the paper's (256, 1024) scaled by max_tokens / 2048."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    factor = max_tokens / _REFERENCE_BUDGET
    return _REFERENCE_EDGES[0] * factor, _REFERENCE_EDGES[1] * factor


def mae_by_bucket(true: ArrayLike, pred: ArrayLike, max_tokens: int) -> dict[str, float]:
    """MAE within each bucket of the TRUE length, plus overall; NaN for an empty bucket."""
    true, pred = _pair(true, pred)
    low, high = bucket_edges(max_tokens)
    masks = {
        "short": true < low,
        "medium": (true >= low) & (true < high),
        "long": true >= high,
        "all": np.ones_like(true, dtype=bool),
    }
    return {name: mae(true[mask], pred[mask]) for name, mask in masks.items()}


def ptl(arrival: ArrayLike, finish: ArrayLike, output_tokens: ArrayLike) -> NDArray[np.float64]:
    """Per-token latency of each request: (finish - arrival) / output tokens, in seconds per token."""
    arrival = np.asarray(arrival, dtype=np.float64).reshape(-1)
    finish = np.asarray(finish, dtype=np.float64).reshape(-1)
    tokens = np.asarray(output_tokens, dtype=np.float64).reshape(-1)
    if not (arrival.shape == finish.shape == tokens.shape):
        raise ValueError("arrival, finish and output_tokens must have one length")
    if (tokens < 1).any():
        raise ValueError("every request must have at least one output token")
    return (finish - arrival) / tokens


def summary(values: ArrayLike) -> dict[str, float]:
    """Mean and the 50th, 90th and 95th percentiles (all NaN when there are no values)."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p95": float("nan")}
    p50, p90, p95 = np.percentile(values, [50, 90, 95])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p95": float(p95)}


def throughput(output_tokens: ArrayLike, start: float, end: float) -> float:
    """Output tokens per second over the wall-clock window [start, end]."""
    if not end > start:
        raise ValueError(f"end ({end}) must be after start ({start})")
    return float(np.sum(np.asarray(output_tokens, dtype=np.float64)) / (end - start))
