"""Two heads beside the linear readout's targets, for the target study (`evaluation.offline.run_targets`).

- `RankNormalRidge`: ridge on the rank-normalized length: log length mapped through the training rows'
  quantiles to a standard normal score (scikit-learn's QuantileTransformer), decoded back through the
  same quantiles. A monotone, data-fitted target: the fitted map is state the serving readout file
  does not carry, so it is measured here before it is served.
- `SoftBinRidge`: a soft-label bin head, as in predictors that classify the length into bins: one ridge
  output per log-length bin (bins at the training quantiles), fitted to Gaussian soft labels around each
  row's log length, decoded to the expected log length under the clipped, renormalized outputs. Still
  linear in the features (one matrix of outputs), so an RLS update would stay exact column by column.

Both standardize the features and decode to lengths clipped to [1, M], as `LinearReadout` does.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.compose import TransformedTargetRegressor
from sklearn.linear_model import Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import QuantileTransformer, StandardScaler

HEADS = ("rank", "softbin")


class RankNormalRidge(RegressorMixin, BaseEstimator):
    """Ridge on the normal score of each length's rank among the training lengths (in log space)."""

    def __init__(self, alpha: float = 1.0, max_tokens: int = 2048, n_quantiles: int = 256) -> None:
        self.alpha = alpha
        self.max_tokens = max_tokens
        self.n_quantiles = n_quantiles

    def fit(self, X: ArrayLike, lengths: ArrayLike) -> RankNormalRidge:
        y = np.log(np.clip(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0, self.max_tokens))
        ranks = QuantileTransformer(n_quantiles=min(self.n_quantiles, y.size), output_distribution="normal",
                                    random_state=0)
        self.model_ = TransformedTargetRegressor(regressor=make_pipeline(StandardScaler(), Ridge(alpha=self.alpha)),
                                                 transformer=ranks, check_inverse=False)
        self.model_.fit(np.asarray(X, dtype=np.float64), y)
        return self

    def predict(self, X: ArrayLike) -> NDArray[np.float64]:
        log_length = self.model_.predict(np.asarray(X, dtype=np.float64)).reshape(-1)
        return np.clip(np.exp(log_length), 1.0, float(self.max_tokens))


class SoftBinRidge(RegressorMixin, BaseEstimator):
    """Multi-output ridge on soft bin labels of the log length, decoded to the expected log length."""

    def __init__(self, alpha: float = 1.0, max_tokens: int = 2048, n_bins: int = 16, width: float = 0.5) -> None:
        self.alpha = alpha
        self.max_tokens = max_tokens
        self.n_bins = n_bins
        self.width = width

    def _labels(self, log_length: np.ndarray) -> np.ndarray:
        weights = np.exp(-0.5 * ((log_length[:, None] - self.centers_[None, :]) / self.width) ** 2)
        return weights / weights.sum(axis=1, keepdims=True)

    def fit(self, X: ArrayLike, lengths: ArrayLike) -> SoftBinRidge:
        log_length = np.log(np.clip(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0, self.max_tokens))
        edges = np.unique(np.quantile(log_length, np.linspace(0.0, 1.0, self.n_bins + 1)))
        self.centers_ = 0.5 * (edges[1:] + edges[:-1])
        self.model_ = make_pipeline(StandardScaler(), Ridge(alpha=self.alpha))
        self.model_.fit(np.asarray(X, dtype=np.float64), self._labels(log_length))
        return self

    def predict_proba(self, X: ArrayLike) -> NDArray[np.float64]:
        """Each row's bin weights: the outputs clipped at 0 and renormalized (uniform where all are <= 0)."""
        raw = np.clip(np.atleast_2d(self.model_.predict(np.asarray(X, dtype=np.float64))), 0.0, None)
        total = raw.sum(axis=1, keepdims=True)
        uniform = np.full_like(raw, 1.0 / raw.shape[1])
        return np.where(total > 0, raw / np.where(total > 0, total, 1.0), uniform)

    def predict(self, X: ArrayLike) -> NDArray[np.float64]:
        expected = self.predict_proba(X) @ self.centers_
        return np.clip(np.exp(expected), 1.0, float(self.max_tokens))


def make_head(name: str, alpha: float, max_tokens: int) -> BaseEstimator:
    """The head called `name` (one of HEADS)."""
    if name == "rank":
        return RankNormalRidge(alpha=alpha, max_tokens=max_tokens)
    if name == "softbin":
        return SoftBinRidge(alpha=alpha, max_tokens=max_tokens)
    raise ValueError(f"unknown head {name!r}; expected one of {HEADS}")


def choose_head_alpha(name: str, X: ArrayLike, lengths: ArrayLike, max_tokens: int, alphas: ArrayLike,
                      n_splits: int, seed: int) -> float:
    """The alpha of the grid with the lowest cross-validated MAE in tokens on these (training) rows (shuffled
    K-fold, every fold fitting its own quantiles or bins)."""
    from sklearn.model_selection import GridSearchCV, KFold

    search = GridSearchCV(make_head(name, 1.0, max_tokens), {"alpha": [float(a) for a in alphas]},
                          scoring="neg_mean_absolute_error", cv=KFold(n_splits, shuffle=True, random_state=seed))
    search.fit(np.asarray(X, dtype=np.float64), np.asarray(lengths, dtype=np.float64).reshape(-1))
    return float(search.best_params_["alpha"])


__all__ = ["HEADS", "RankNormalRidge", "SoftBinRidge", "choose_head_alpha", "make_head"]
