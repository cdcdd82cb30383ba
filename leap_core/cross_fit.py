"""Cross-fitted predictions: how a readout errs on rows it never saw, measured on its training rows alone.

The training rows are split into folds; each fold is predicted by the readout (same alpha, target and
budget) fitted on the other folds. The pairs (cross-fitted prediction, true length) describe a readout's
errors on unseen prompts without touching any held-out set, which is what the Gittins order's length
distribution (`leap_core.gittins.LengthGivenPrediction`) is fitted on, in the fit flow and in the load
study alike.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.model_selection import KFold

from leap_core.gittins import LengthGivenPrediction
from leap_core.readout import LinearReadout

FOLDS = 5
DISTRIBUTION_BINS = 10
"""Bins of predicted length of a readout's length distribution (`cross_fitted_distribution`)."""


def cross_fitted_predictions(X: ArrayLike, lengths: ArrayLike, *, alpha: float, max_tokens: int,
                             target: str = "sqrt", folds: int = FOLDS, seed: int = 0) -> NDArray[np.float64]:
    """Each row's predicted length by the readout `LinearReadout(alpha, target, max_tokens)` fitted on the
    other folds of a shuffled `folds`-fold split (seeded by `seed`)."""
    X = np.asarray(X)
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if X.ndim != 2 or X.shape[0] != lengths.shape[0]:
        raise ValueError(f"features of shape {X.shape} do not give one row per length ({lengths.shape[0]})")
    if folds < 2 or X.shape[0] < 2 * folds:
        raise ValueError(f"{X.shape[0]} rows cannot be cross-fitted in {folds} folds of at least 2 rows "
                         "(folds must be >= 2)")
    predicted = np.empty(X.shape[0], dtype=np.float64)
    for fit_rows, held_rows in KFold(folds, shuffle=True, random_state=seed).split(X):
        readout = LinearReadout(alpha=alpha, target=target, max_tokens=max_tokens).fit(X[fit_rows], lengths[fit_rows])
        predicted[held_rows] = readout.predict(X[held_rows])
    return predicted


def cross_fitted_distribution(X: ArrayLike, lengths: ArrayLike, *, alpha: float, max_tokens: int,
                              target: str = "sqrt") -> tuple[LengthGivenPrediction, NDArray[np.float64]]:
    """The distribution of true length given the readout's prediction, which the Gittins order ranks by,
    fitted on each row's cross-fitted prediction (so it holds the errors of a readout on prompts it never
    saw), and those predictions. ValueError when the rows are too few to cross-fit and fill the bins, or
    the table would be too large."""
    predicted = cross_fitted_predictions(X, lengths, alpha=alpha, target=target, max_tokens=max_tokens)
    distribution = LengthGivenPrediction(n_bins=DISTRIBUTION_BINS, max_tokens=int(max_tokens))
    return distribution.fit(predicted, lengths), predicted
