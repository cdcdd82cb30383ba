"""Intervals for every figure LEAP quotes: the studies, the canary, the shadow and the promotion gate.

Two kinds, by what varies between measurements. Over rows (requests, prompts, workloads): a percentile
bootstrap (`bootstrap_ci`), paired when several arrays are resampled together, stratified (`strata`), or
nested in groups (`hierarchical_bootstrap_ci`: groups first, then rows within each). Over a few runs: a
Student-t interval (`mean_over_runs`, `ratio_over_runs`), because runs, not requests, are then the unit
that varies. A proportion gets the Wilson interval (`wilson_interval`).

One module so that every caller resamples alike: the same seed and row count draw the same replicates,
which pairs the figures of several predictors on one test set, and replicates whose value is not finite
(a constant resample, say) are dropped rather than failing the interval.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

_BOOT_CELLS = 1 << 20  # resampled values held at once per array (replicates x rows), ~8 MB of float64


def resample_rows(n: int, n_boot: int, rng: np.random.Generator,
                  groups: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """(n_boot, n) row indices drawn with replacement; within each group's own columns when given."""
    if groups is None:
        return rng.integers(0, n, size=(n_boot, n))
    index = np.empty((n_boot, n), dtype=np.int64)
    for columns in groups:
        index[:, columns] = columns[rng.integers(0, columns.size, size=(n_boot, columns.size))]
    return index


def percentile_interval(value: float, replicates: np.ndarray, level: float) -> dict[str, float]:
    """{"value", "ci_low", "ci_high"}: the (1 - level)/2 and (1 + level)/2 quantiles of the finite replicates
    (NaN when none is)."""
    replicates = replicates[np.isfinite(replicates)]
    if replicates.size == 0:
        return {"value": value, "ci_low": float("nan"), "ci_high": float("nan")}
    low, high = np.quantile(replicates, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return {"value": value, "ci_low": float(low), "ci_high": float(high)}


def bounds(figure: Mapping[str, float]) -> list[float]:
    """[ci_low, ci_high] of an interval, the pair a saved result stores beside its value."""
    return [figure["ci_low"], figure["ci_high"]]


def _check_bootstrap(level: float, n_boot: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")


# Vectorised statistics for `bootstrap_ci(..., vectorized=True)`: each reduces the last axis (the rows).
def mean_last_axis(a: np.ndarray) -> np.ndarray:
    return np.mean(a, axis=-1)


def ratio_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Paired rows: mean of a over mean of b."""
    return np.mean(a, axis=-1) / np.mean(b, axis=-1)


def difference_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Paired rows: mean of a minus mean of b."""
    return np.mean(a, axis=-1) - np.mean(b, axis=-1)


def bootstrap_ci(statistic: Callable[..., Any], *arrays: ArrayLike, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95, strata: ArrayLike | None = None, vectorized: bool = False) -> dict[str, float]:
    """A statistic of paired rows and its percentile bootstrap interval: {"value", "ci_low", "ci_high"}.

    Rows (the i-th element of every array together) are resampled with replacement, `n_boot` times
    (`bootstrap_replicates`), and the interval is the (1 - level)/2 and (1 + level)/2 quantiles of the
    statistic over the replicates whose value is finite (NaN when none is).
    """
    _check_bootstrap(level, n_boot)
    return percentile_interval(*bootstrap_replicates(statistic, *arrays, n_boot=n_boot, seed=seed, strata=strata,
                                                     vectorized=vectorized), level)


def mean_ci(values: ArrayLike, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """The mean of `values` with its percentile bootstrap interval (`bootstrap_ci`)."""
    return bootstrap_ci(mean_last_axis, values, n_boot=n_boot, seed=seed, level=level, vectorized=True)


def bootstrap_replicates(statistic: Callable[..., Any], *arrays: ArrayLike, n_boot: int = 2000, seed: int = 0,
                         strata: ArrayLike | None = None, vectorized: bool = False) -> tuple[float, np.ndarray]:
    """The statistic of paired rows and its `n_boot` bootstrap replicates (NaN where degenerate).

    Rows (the i-th element of every array together) are resampled with replacement. With `strata`, each
    row is drawn from its own stratum only, and column j of every replicate comes from row j's stratum, so
    a statistic may group columns by stratum (see `leap_core.metrics.within_set_spearman`). The same seed
    and row count draw the same replicates, so figures of several predictors on one test set are
    resampled alike.

    statistic: f(*arrays) -> float on 1-D arrays; with vectorized=True, f takes (..., n) arrays and
        reduces the last axis (one value per replicate), which is much faster than a Python loop.
        (scipy.stats.bootstrap does the unstratified case; resampling here keeps strata and keeps
        degenerate replicates as NaN instead of failing on them.)
    """
    columns = [np.asarray(a).reshape(-1) for a in arrays]
    if not columns:
        raise ValueError("bootstrap needs at least one array")
    n = columns[0].size
    if any(c.size != n for c in columns):
        raise ValueError(f"arrays differ in length: {[c.size for c in columns]}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if n == 0:
        return float("nan"), np.empty(0)
    if vectorized:
        value = float(np.asarray(statistic(*(c[None, :] for c in columns))).reshape(-1)[0])
    else:
        value = float(statistic(*columns))
    groups = None
    if strata is not None:
        labels = np.asarray(strata).reshape(-1)
        if labels.size != n:
            raise ValueError(f"strata has {labels.size} rows, the arrays have {n}")
        _, codes = np.unique(labels.astype(str), return_inverse=True)
        groups = [np.flatnonzero(codes == code) for code in range(int(codes.max()) + 1)]
    rng = np.random.default_rng(seed)
    chunk = max(1, min(n_boot, _BOOT_CELLS // n))
    replicates = []
    for start in range(0, n_boot, chunk):
        index = resample_rows(n, min(chunk, n_boot - start), rng, groups)
        if vectorized:
            replicates.append(np.asarray(statistic(*(c[index] for c in columns)), dtype=np.float64).reshape(-1))
        else:
            replicates.append(np.asarray([statistic(*(c[row] for c in columns)) for row in index], dtype=np.float64))
    return value, np.concatenate(replicates)


def hierarchical_bootstrap_ci(statistic: Callable[..., Any], *arrays: ArrayLike, n_boot: int = 2000, seed: int = 0,
                              level: float = 0.95) -> dict[str, float]:
    """A statistic of paired rows nested in groups, with a two-level percentile bootstrap interval.

    Every array is (groups, rows): row j of group g of every array belongs together (a paired workload of
    one train/test split, say). Each replicate draws the groups with replacement and then, within each
    drawn group, its rows with replacement, so the interval carries both the spread between groups and
    the noise within them; pooling the rows and resampling them alone would ignore the first. The value
    is the statistic of every row of every group. `statistic` is vectorised as in `bootstrap_ci`: it takes
    (..., n) arrays and reduces the last axis. With one group this is `bootstrap_ci` over its rows (the
    same draws); replicates whose value is not finite are skipped.
    """
    blocks = [np.asarray(a, dtype=np.float64) for a in arrays]
    if not blocks:
        raise ValueError("hierarchical_bootstrap_ci needs at least one array")
    if any(b.ndim != 2 or b.shape != blocks[0].shape for b in blocks):
        raise ValueError(f"every array must be (groups, rows) of one shape: {[b.shape for b in blocks]}")
    n_groups, n_rows = blocks[0].shape
    if n_groups == 1:
        return bootstrap_ci(statistic, *(b[0] for b in blocks), n_boot=n_boot, seed=seed, level=level,
                            vectorized=True)
    _check_bootstrap(level, n_boot)
    nan = float("nan")
    if n_rows == 0:
        return {"value": nan, "ci_low": nan, "ci_high": nan}
    value = float(np.asarray(statistic(*(b.reshape(1, -1) for b in blocks))).reshape(-1)[0])
    rng = np.random.default_rng(seed)
    cells = n_groups * n_rows
    chunk = max(1, min(n_boot, _BOOT_CELLS // cells))
    replicates = []
    for start in range(0, n_boot, chunk):
        size = min(chunk, n_boot - start)
        groups = rng.integers(0, n_groups, size=(size, n_groups, 1))
        rows = rng.integers(0, n_rows, size=(size, n_groups, n_rows))
        replicates.append(np.asarray(statistic(*(b[groups, rows].reshape(size, cells) for b in blocks)),
                                     dtype=np.float64).reshape(-1))
    return percentile_interval(value, np.concatenate(replicates), level)


def ratio_over_requests(num: ArrayLike, den: ArrayLike, repeats: int, n_boot: int = 2000, seed: int = 0,
                        level: float = 0.95) -> dict[str, float]:
    """Ratio of means of two arms' per-(repeat, request) figures laid out repeat after repeat (entry i is
    request i % (size / repeats)), with a bootstrap interval that resamples requests, each with all its
    repeats, jointly for both arms."""
    num, den = np.asarray(num, dtype=np.float64).reshape(-1), np.asarray(den, dtype=np.float64).reshape(-1)
    by_request = np.arange(num.size) % (num.size // repeats)
    return bootstrap_ci(ratio_of_means, np.bincount(by_request, num), np.bincount(by_request, den), n_boot=n_boot,
                        seed=seed, level=level, vectorized=True)


# ------------------------------------------------------------------ over runs


def mean_over_runs(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """The mean of a few independent measurements (runs) with its Student-t interval ({value, ci_low,
    ci_high}); NaN bounds with fewer than two."""
    from scipy import stats

    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if x.size < 2:
        return {"value": mean, "ci_low": float("nan"), "ci_high": float("nan")}
    half = float(stats.t.ppf((1 + level) / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
    return {"value": mean, "ci_low": mean - half, "ci_high": mean + half}


def ratio_over_runs(num: ArrayLike, den: ArrayLike, level: float = 0.95) -> dict[str, float]:
    """Ratio of two arms' figures where the unit that varies is the run: each run's ratio num[i] / den[i]
    (paired: one run of each arm on the same workload), their geometric mean, and a Student-t interval on the
    log ratios over runs ({"value", "ci_low", "ci_high", "runs"}). With one run, or a run whose figure is not
    positive and finite, the interval is NaN: a single run says nothing of how runs vary."""
    from scipy import stats

    num, den = np.asarray(num, dtype=np.float64).reshape(-1), np.asarray(den, dtype=np.float64).reshape(-1)
    if num.shape != den.shape:
        raise ValueError(f"one figure per run for each arm: {num.size} and {den.size}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ok = np.isfinite(num) & np.isfinite(den) & (num > 0) & (den > 0)
    logs = np.log(num[ok] / den[ok])
    nan = float("nan")
    if logs.size == 0:
        return {"value": nan, "ci_low": nan, "ci_high": nan, "runs": 0}
    value = float(np.exp(logs.mean()))
    if logs.size < 2 or not ok.all():
        return {"value": value, "ci_low": nan, "ci_high": nan, "runs": int(logs.size)}
    half = stats.t.ppf((1.0 + level) / 2.0, logs.size - 1) * logs.std(ddof=1) / np.sqrt(logs.size)
    return {"value": value, "ci_low": float(np.exp(logs.mean() - half)), "ci_high": float(np.exp(logs.mean() + half)),
            "runs": int(logs.size)}


# ------------------------------------------------------------------ proportions


def wilson_interval(hits: int, trials: int, level: float = 0.95) -> dict[str, float]:
    """The share hits / trials with its Wilson score interval ({"value", "ci_low", "ci_high"}); NaN for
    no trials."""
    from scipy.stats import binomtest

    if trials == 0:
        return {"value": float("nan"), "ci_low": float("nan"), "ci_high": float("nan")}
    interval = binomtest(hits, trials).proportion_ci(confidence_level=level, method="wilson")
    return {"value": hits / trials, "ci_low": float(interval.low), "ci_high": float(interval.high)}
