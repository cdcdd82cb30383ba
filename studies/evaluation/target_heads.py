"""The soft-bin classification head as published, for the target study (`evaluation.offline.run_targets`).

`SoftBinClassifier`: one ridge output per log-length bin (bins at the training quantiles), fitted to
Gaussian soft labels around each row's log length (`leap_core.targets.soft_labels`), decoded to the
expected log length under the outputs clipped at 0 and renormalized, as a classifier's probabilities
would be. Without the clip its expected center is exactly the score of the linear readout on the
`softbin` target (see `leap_core.targets`), which is what serving runs; the study measures what the clip
adds. The clip makes
the decode non-linear in the weights, so this head is measured here and not served.

It standardizes the features and decodes to lengths clipped to [1, M], as `LinearReadout` does.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from leap_core.targets import soft_labels, softbin_centers

HEADS = ("softbin_clipped",)


class SoftBinClassifier(RegressorMixin, BaseEstimator):
    """Multi-output ridge on soft bin labels of the log length, decoded to the expected log length under the
    outputs clipped at 0 and renormalized (`clip=False`: the plain expected value, the `softbin` target)."""

    def __init__(self, alpha: float = 1.0, max_tokens: int = 2048, clip: bool = True) -> None:
        self.alpha = alpha
        self.max_tokens = max_tokens
        self.clip = clip

    def fit(self, X: ArrayLike, lengths: ArrayLike) -> SoftBinClassifier:
        log_length = np.log(np.clip(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0, self.max_tokens))
        self.centers_ = softbin_centers(log_length, int(self.max_tokens))
        self.model_ = make_pipeline(StandardScaler(), Ridge(alpha=self.alpha))
        self.model_.fit(np.asarray(X, dtype=np.float64), soft_labels(log_length, self.centers_))
        return self

    def predict_proba(self, X: ArrayLike) -> NDArray[np.float64]:
        """Each row's bin weights: the outputs clipped at 0 and renormalized (uniform where all are <= 0);
        with `clip=False`, the raw outputs (they sum to 1)."""
        raw = np.atleast_2d(self.model_.predict(np.asarray(X, dtype=np.float64)))
        if not self.clip:
            return raw
        raw = np.clip(raw, 0.0, None)
        total = raw.sum(axis=1, keepdims=True)
        uniform = np.full_like(raw, 1.0 / raw.shape[1])
        return np.where(total > 0, raw / np.where(total > 0, total, 1.0), uniform)

    def predict(self, X: ArrayLike) -> NDArray[np.float64]:
        expected = self.predict_proba(X) @ self.centers_
        return np.clip(np.exp(expected), 1.0, float(self.max_tokens))


def make_head(name: str, alpha: float, max_tokens: int) -> BaseEstimator:
    """The head called `name` (one of HEADS)."""
    if name == "softbin_clipped":
        return SoftBinClassifier(alpha=alpha, max_tokens=max_tokens)
    raise ValueError(f"unknown head {name!r}; expected one of {HEADS}")


def choose_head_alpha(name: str, X: ArrayLike, lengths: ArrayLike, max_tokens: int, alphas: ArrayLike,
                      n_splits: int, seed: int) -> float:
    """The alpha of the grid with the lowest cross-validated MAE in tokens on these (training) rows (shuffled
    K-fold, every fold fitting its own bins)."""
    from sklearn.model_selection import GridSearchCV, KFold

    search = GridSearchCV(make_head(name, 1.0, max_tokens), {"alpha": [float(a) for a in alphas]},
                          scoring="neg_mean_absolute_error", cv=KFold(n_splits, shuffle=True, random_state=seed))
    search.fit(np.asarray(X, dtype=np.float64), np.asarray(lengths, dtype=np.float64).reshape(-1))
    return float(search.best_params_["alpha"])


__all__ = ["HEADS", "SoftBinClassifier", "choose_head_alpha", "make_head"]
