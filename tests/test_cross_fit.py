"""Cross-fitted predictions: each row predicted by a readout fitted without it."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.model_selection import KFold

from leap_core.cross_fit import cross_fitted_predictions
from leap_core.readout import LinearReadout


def _rows(n: int = 60, d: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    return X, np.clip(np.round(np.exp(4 + X[:, 0] + 0.3 * rng.normal(size=n))), 1, 512)


def test_each_row_is_predicted_by_the_readout_of_the_other_folds():
    X, lengths = _rows()
    predicted = cross_fitted_predictions(X, lengths, alpha=3.0, max_tokens=512, folds=3, seed=1)
    for fit_rows, held_rows in KFold(3, shuffle=True, random_state=1).split(X):
        readout = LinearReadout(alpha=3.0, max_tokens=512).fit(X[fit_rows], lengths[fit_rows])
        np.testing.assert_allclose(predicted[held_rows], readout.predict(X[held_rows]))
    # a readout fitted on every row predicts its own rows better than the rows it never saw
    fitted = LinearReadout(alpha=3.0, max_tokens=512).fit(X, lengths).predict(X)
    assert np.abs(fitted - lengths).mean() < np.abs(predicted - lengths).mean()


def test_too_few_rows_or_folds_and_mismatched_rows_are_refused():
    X, lengths = _rows(n=7)
    with pytest.raises(ValueError, match="cannot be cross-fitted"):
        cross_fitted_predictions(X, lengths, alpha=1.0, max_tokens=512, folds=5)
    with pytest.raises(ValueError, match="folds must be >= 2"):
        cross_fitted_predictions(X, lengths, alpha=1.0, max_tokens=512, folds=1)
    with pytest.raises(ValueError, match="one row per length"):
        cross_fitted_predictions(X, lengths[:-1], alpha=1.0, max_tokens=512)
