"""Figures for predictors and schedules: rank agreement, errors by length bucket, latency per token.

A scheduler only needs the order of requests right, so rank correlations (Spearman, Kendall) are the
headline predictor figures; MAE by bucket shows where the errors are. Per-token latency (PTL) is the
serving figure that length-aware scheduling improves.

Test sets of a few hundred rows give figures that move by several hundredths between splits, so the
studies quote them with a percentile bootstrap interval (`leap_core.intervals`), per prompt set and
pooled (`per_set_metrics`); the row-wise forms here (`spearman_batch`, `mae_batch`) are what it
resamples. Outputs that reached the budget M are censored: their true length is only known to be >= M,
so they tie at M for ranking and are left out of the MAE.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats

from leap_core.intervals import bootstrap_ci

# The paper's bucket edges for a 2048-token budget: short < 256 <= medium < 1024 <= long.
_REFERENCE_BUDGET = 2048
_REFERENCE_EDGES = (256, 1024)


def _pair(true: ArrayLike, pred: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    true = np.asarray(true, dtype=np.float64).reshape(-1)
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    if true.shape != pred.shape:
        raise ValueError(f"true and pred differ in length: {true.shape[0]} vs {pred.shape[0]}")
    return true, pred


def _rank_correlation(test: Callable[..., Any], true: ArrayLike, pred: ArrayLike) -> float:
    true, pred = _pair(true, pred)
    if true.size < 2 or np.ptp(true) == 0 or np.ptp(pred) == 0:
        return float("nan")
    return float(test(true, pred).statistic)


def spearman(true: ArrayLike, pred: ArrayLike) -> float:
    """Spearman rank correlation (NaN when either side is constant or has < 2 values)."""
    return _rank_correlation(stats.spearmanr, true, pred)


def kendall(true: ArrayLike, pred: ArrayLike) -> float:
    """Kendall's tau-b (NaN when either side is constant or has < 2 values)."""
    return _rank_correlation(stats.kendalltau, true, pred)


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


# ------------------------------------------------------------------ censoring


def censor(true: ArrayLike, max_tokens: int, censored: ArrayLike | None = None
           ) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    """(true lengths with every censored row set to M, the censored mask).

    A row is censored when `censored` says so (finish_reason == "length") or its true length is >= M:
    the request was stopped by the budget, so its length is only known to be >= M. Setting all of
    them to M makes them tie among themselves, ranked above every uncensored row.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    true = np.asarray(true, dtype=np.float64).reshape(-1)
    mask = true >= max_tokens
    if censored is not None:
        given = np.asarray(censored, dtype=bool).reshape(-1)
        if given.shape != true.shape:
            raise ValueError(f"censored has {given.size} rows, true has {true.size}")
        mask |= given
    return np.where(mask, float(max_tokens), true), mask


def censored_spearman(true: ArrayLike, pred: ArrayLike, max_tokens: int, censored: ArrayLike | None = None) -> float:
    """Spearman with censored rows tied at rank >= M (see `censor`)."""
    values, _ = censor(true, max_tokens, censored)
    return spearman(values, pred)


def uncensored_mae(true: ArrayLike, pred: ArrayLike, max_tokens: int, censored: ArrayLike | None = None) -> float:
    """MAE over the uncensored rows only: a censored row's error is unknown (NaN when none is left)."""
    true, pred = _pair(true, pred)
    _, mask = censor(true, max_tokens, censored)
    return mae(true[~mask], pred[~mask])


def censored_share(true: ArrayLike, max_tokens: int, censored: ArrayLike | None = None) -> float:
    """The share of rows that reached the budget (NaN when empty)."""
    _, mask = censor(true, max_tokens, censored)
    return float(mask.mean()) if mask.size else float("nan")


# ------------------------------------------------------------------ vectorised, for the bootstrap


def spearman_batch(true: np.ndarray, pred: np.ndarray) -> NDArray[np.float64]:
    """Spearman of each row of (..., n) arrays: Pearson of the average ranks; NaN for a constant row.

    The vectorised form of `spearman` that `intervals.bootstrap_ci(..., vectorized=True)` wants.
    """
    rank_true = stats.rankdata(true, axis=-1)
    rank_pred = stats.rankdata(pred, axis=-1)
    rank_true -= rank_true.mean(axis=-1, keepdims=True)
    rank_pred -= rank_pred.mean(axis=-1, keepdims=True)
    numerator = np.sum(rank_true * rank_pred, axis=-1)
    denominator = np.sqrt(np.sum(rank_true ** 2, axis=-1) * np.sum(rank_pred ** 2, axis=-1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), np.nan)


def mae_batch(true: np.ndarray, pred: np.ndarray, weight: np.ndarray | None = None) -> NDArray[np.float64]:
    """MAE of each row of (..., n) arrays, over the columns of weight 1 when given (the uncensored ones);
    NaN where none is left."""
    if weight is None:
        return np.mean(np.abs(true - pred), axis=-1) if true.shape[-1] else np.full(true.shape[:-1], np.nan)
    count = weight.sum(axis=-1)
    total = np.sum(np.abs(true - pred) * weight, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(count > 0, total / np.where(count > 0, count, 1.0), np.nan)


def spearman_difference(true: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Paired rows: Spearman of prediction a minus Spearman of prediction b against the same truth."""
    return spearman_batch(true, a) - spearman_batch(true, b)


# ------------------------------------------------------------------ per set and pooled

MIN_SET_ROWS = 10
"""Fewest rows of a set for its Spearman to count in the within-set mean."""


def _within_set_statistic(groups: Sequence[np.ndarray]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """n-weighted mean of per-group Spearmans, for (..., n) arrays whose columns are grouped by `groups`.

    A group whose Spearman is NaN in a replicate (a constant truth) drops out of that replicate's mean.
    """
    sizes = np.asarray([g.size for g in groups], dtype=np.float64)

    def statistic(true: np.ndarray, pred: np.ndarray) -> np.ndarray:
        per_group = np.stack([spearman_batch(true[..., g], pred[..., g]) for g in groups], axis=-1)
        weight = np.where(np.isfinite(per_group), sizes, 0.0)
        total = np.sum(np.where(np.isfinite(per_group), per_group, 0.0) * weight, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(weight.sum(axis=-1) > 0, total / weight.sum(axis=-1), np.nan)

    return statistic


def within_set_spearman(sets: ArrayLike, true: ArrayLike, pred: ArrayLike, max_tokens: int,
                        censored: ArrayLike | None = None, *, min_set_rows: int = MIN_SET_ROWS,
                        n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """The n-weighted mean of per-set (censored) Spearmans, with a stratified bootstrap interval.

    When prompt length identifies the set and sets differ in length, a Spearman pooled across sets
    mostly measures whether the predictor tells the sets apart; within a set it measures the ranking
    a scheduler serving that set needs. Sets of fewer than `min_set_rows` rows are left out (listed
    in "sets" are the ones that count). Rows are resampled within their set.
    """
    true, pred = _pair(true, pred)
    labels = np.asarray(sets, dtype=object).reshape(-1)
    if labels.size != true.size:
        raise ValueError(f"sets has {labels.size} rows, true has {true.size}")
    values, _ = censor(true, max_tokens, censored)
    names = [str(name) for name in sorted({str(s) for s in labels.tolist()})]
    as_text = labels.astype(str)
    kept = [name for name in names if int((as_text == name).sum()) >= min_set_rows]
    if not kept:
        nan = float("nan")
        return {"value": nan, "ci_low": nan, "ci_high": nan, "sets": []}
    rows = np.isin(as_text, kept)
    sub_sets = as_text[rows]
    groups = [np.flatnonzero(sub_sets == name) for name in kept]
    figure = bootstrap_ci(_within_set_statistic(groups), values[rows], pred[rows], n_boot=n_boot, seed=seed,
                          level=level, strata=sub_sets, vectorized=True)
    return {**figure, "sets": kept}


def _set_figures(values: np.ndarray, pred: np.ndarray, true: np.ndarray, mask: np.ndarray, *, n_boot: int,
                 seed: int, level: float) -> dict[str, Any]:
    options = dict(n_boot=n_boot, seed=seed, level=level, vectorized=True)
    uncensored = (~mask).astype(np.float64)
    return {
        "n": int(values.size),
        "censored_share": float(mask.mean()) if mask.size else float("nan"),
        "spearman": bootstrap_ci(spearman_batch, values, pred, **options),
        "mae": bootstrap_ci(mae_batch, true, pred, uncensored, **options),
    }


def per_set_metrics(sets: ArrayLike | None, true: ArrayLike, pred: ArrayLike, censored: ArrayLike | None,
                    max_tokens: int, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                    min_set_rows: int = MIN_SET_ROWS) -> dict[str, Any]:
    """Predictor figures per prompt set and pooled, each with its bootstrap interval.

    Returns {"per_set": {set: figures}, "pooled": figures, "within_set_spearman": {...} or None}, where
    figures = {"n", "censored_share", "spearman": {value, ci_low, ci_high}, "mae": {value, ci_low, ci_high}}:
    Spearman with censored rows tied at M (`censored_spearman`), MAE in tokens over the uncensored rows
    only (`uncensored_mae`). `sets` None (or one set) gives no per-set entries and no within-set figure.
    censored: finish_reason == "length" per row, or None to infer it from true >= max_tokens.
    Every set is listed; a set smaller than `min_set_rows` still gets figures, but wide ones.
    """
    true, pred = _pair(true, pred)
    values, mask = censor(true, max_tokens, censored)
    options = dict(n_boot=n_boot, seed=seed, level=level)
    result: dict[str, Any] = {"per_set": {}, "pooled": _set_figures(values, pred, true, mask, **options),
                              "within_set_spearman": None}
    if sets is None:
        return result
    labels = np.asarray(sets, dtype=object).reshape(-1).astype(str)
    if labels.size != true.size:
        raise ValueError(f"sets has {labels.size} rows, true has {true.size}")
    names = sorted(set(labels.tolist()))
    for name in names:
        rows = labels == name
        result["per_set"][name] = _set_figures(values[rows], pred[rows], true[rows], mask[rows], **options)
    if len(names) > 1:
        result["within_set_spearman"] = within_set_spearman(labels, true, pred, max_tokens, mask,
                                                            min_set_rows=min_set_rows, **options)
    return result


def gap_closed(true: ArrayLike, base: ArrayLike, step: ArrayLike, ceiling: ArrayLike, max_tokens: int,
               censored: ArrayLike | None = None, sets: ArrayLike | None = None, *,
               min_set_rows: int = MIN_SET_ROWS, n_boot: int = 2000, seed: int = 0,
               level: float = 0.95) -> dict[str, Any]:
    """The share of the Spearman gap from `base` to `ceiling` predictions that `step` closes, with its interval.

    (S(step) - S(base)) / (S(ceiling) - S(base)), S the censored Spearman against `true` (pooled), or
    the within-set Spearman when `sets` holds two or more sets of `min_set_rows` rows. The rows are
    resampled together (within their set for the within-set figure), so the interval carries the
    uncertainty of all three Spearmans and of the ratio; a replicate whose gap is 0 is skipped.
    """
    true, base = _pair(true, base)
    step, ceiling = _pair(step, ceiling)
    if step.shape != true.shape:
        raise ValueError(f"true and step differ in length: {true.size} vs {step.size}")
    values, _ = censor(true, max_tokens, censored)
    rows, strata, score = np.ones(true.size, dtype=bool), None, spearman_batch
    if sets is not None:
        labels = np.asarray(sets, dtype=object).reshape(-1).astype(str)
        names = sorted(set(labels.tolist()))
        kept = [name for name in names if int((labels == name).sum()) >= min_set_rows]
        if len(kept) > 1:
            rows = np.isin(labels, kept)
            strata = labels[rows]
            score = _within_set_statistic([np.flatnonzero(strata == name) for name in kept])

    def statistic(t: np.ndarray, b: np.ndarray, s: np.ndarray, c: np.ndarray) -> np.ndarray:
        low = score(t, b)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (score(t, s) - low) / (score(t, c) - low)

    figure = bootstrap_ci(statistic, values[rows], base[rows], step[rows], ceiling[rows], n_boot=n_boot, seed=seed,
                          level=level, strata=strata, vectorized=True)
    return {**figure, "spearman": "within_set" if strata is not None else "pooled"}
