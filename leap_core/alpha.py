"""Choosing the readout's ridge penalty: the whole alpha grid scored over any cross-validation split.

The fit flow and the offline studies choose alpha here, on one grid (`ALPHAS`) with the readout's own
estimator, so their choices agree; they differ only in the split (`newest_split` for the fit flow,
shuffled K-fold for the studies) and the score ("mse_target" or "mae" in tokens). One eigendecomposition
per split serves the whole grid, which keeps a wide grid over many layers or rows cheap.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.model_selection import KFold, PredefinedSplit

from leap_core import targets
from leap_core.readout import Standardizer

ALPHAS: tuple[float, ...] = tuple(float(a) for a in np.logspace(0, 6, 13))
"""The ridge penalties every alpha choice tries: 1 to 1e6, two per decade."""

SCORINGS = ("mae", "mse_target")
"""mae: mean absolute error in tokens; mse_target: mean squared error in the target space (clipped)."""

N_SPLITS = 5
CV_SEED = 0


class AlphaSelection(NamedTuple):
    """The chosen penalty, the grid, and each penalty's held-out score (lower is better)."""

    alpha: float
    alphas: tuple[float, ...]
    scores: tuple[float, ...]
    scoring: str


def newest_split(n: int, fraction: float) -> PredefinedSplit:
    """One split of rows in arrival order: the newest `fraction` (at least 1 row, leaving 2 to fit) is held out."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}")
    n_held = min(max(round(n * fraction), 1), n - 2)
    if n_held < 1:
        raise ValueError(f"choosing alpha needs at least 3 training rows, got {n}")
    fold = np.full(n, -1, dtype=np.int64)  # -1: always fitted on
    fold[n - n_held:] = 0
    return PredefinedSplit(fold)


def kfold(n_splits: int = N_SPLITS, seed: int = CV_SEED) -> KFold:
    """The offline studies' split: shuffled K-fold with a fixed seed."""
    return KFold(n_splits, shuffle=True, random_state=seed)


def _rows(X: np.ndarray, index: np.ndarray) -> np.ndarray:
    """X[index], as a view when the index is one contiguous run (the newest-rows split on 100k rows)."""
    if index.size and index[-1] - index[0] + 1 == index.size and np.all(np.diff(index) == 1):
        return X[index[0]: index[-1] + 1]
    return X[index]


def held_out_path(X_fit: ArrayLike, y_fit: ArrayLike, X_held: ArrayLike,
                  alphas: ArrayLike) -> NDArray[np.float64]:
    """Held-out predictions in the target space, one column per alpha, unclipped.

    The readout's estimator: X_fit is standardized on its own rows (and centered exactly), the
    intercept is mean(y_fit) and unpenalized, so column k equals
    `LinearReadout(alphas[k]).fit(X_fit, ...).predict_transformed(X_held)`.
    """
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    y_fit = np.asarray(y_fit, dtype=np.float64).reshape(-1)
    standardizer = Standardizer().fit(X_fit)
    Z = standardizer.transform(X_fit)
    z_mean = Z.mean(axis=0)
    Z -= z_mean
    Z_held = standardizer.transform(X_held)
    Z_held -= z_mean
    y_mean = float(y_fit.mean())
    centered = y_fit - y_mean
    if Z.shape[0] < Z.shape[1]:  # dual: Z_held Z^T (Z Z^T + alpha I)^-1 y
        eigval, Q = np.linalg.eigh(Z @ Z.T)
        left, right = (Z_held @ Z.T) @ Q, Q.T @ centered
    else:  # primal: Z_held (Z^T Z + alpha I)^-1 Z^T y
        eigval, Q = np.linalg.eigh(Z.T @ Z)
        right = Q.T @ (Z.T @ centered)
        del Z
        left = Z_held @ Q
    eigval = np.maximum(eigval, 0.0)  # round-off can leave tiny negative eigenvalues
    return left @ (right[:, None] / (eigval[:, None] + alphas[None, :])) + y_mean


def cv_scores(X: ArrayLike, lengths: ArrayLike, *, target: str, max_tokens: int,
              alphas: ArrayLike = ALPHAS, cv: Any = None, scoring: str = "mae") -> NDArray[np.float64]:
    """Each alpha's held-out score, averaged over every held-out row of the splits of `cv`.

    cv: a scikit-learn splitter (default: `kfold()`, shuffled 5-fold, seed 0) or an int (that many
        shuffled folds, seed 0).
    scoring: "mae" (tokens, after clipping to [1, M]) or "mse_target" (target space, clipped).
    """
    X = np.asarray(X)
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    if lengths.shape[0] != X.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but lengths has {lengths.shape[0]}")
    if alphas.size == 0 or not (alphas > 0).all():
        raise ValueError(f"cross-validation needs a non-empty grid with every alpha > 0, got {alphas.tolist()}")
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; expected one of {SCORINGS}")
    splitter = kfold() if cv is None else kfold(int(cv)) if isinstance(cv, int) else cv
    total, n_held = np.zeros(alphas.size), 0
    for fit_rows, held_rows in splitter.split(X):
        target_map = targets.fit_map(target, lengths[fit_rows], int(max_tokens))  # a fitted target sees its fold only
        y_fit = targets.transform(lengths[fit_rows], target, target_map)
        pred = held_out_path(_rows(X, fit_rows), y_fit, _rows(X, held_rows), alphas)
        if scoring == "mae":
            error = np.abs(targets.to_lengths(pred, target, int(max_tokens), target_map) - lengths[held_rows, None])
        else:
            low, high = targets.bounds(target, int(max_tokens), target_map)
            y_held = targets.transform(lengths[held_rows], target, target_map)
            error = np.square(np.clip(pred, low, high) - y_held[:, None])
        total += error.sum(axis=0)
        n_held += held_rows.size
    return total / n_held


def select_alpha(X: ArrayLike, lengths: ArrayLike, *, target: str = "sqrt", max_tokens: int,
                 alphas: ArrayLike = ALPHAS, cv: Any = None, scoring: str = "mae") -> AlphaSelection:
    """The alpha of the grid with the lowest held-out score (`cv_scores`); the first one on a tie."""
    grid = tuple(float(a) for a in np.asarray(alphas, dtype=np.float64).reshape(-1))
    scores = cv_scores(X, lengths, target=target, max_tokens=max_tokens, alphas=grid, cv=cv, scoring=scoring)
    return AlphaSelection(grid[int(np.argmin(scores))], grid, tuple(float(s) for s in scores), scoring)
