"""The length readout: standardized prefill hidden state -> one linear layer -> output length.

A ridge regression on standardized features, fitted in a transformed target space (see
`leap_core.targets`). After fitting only four arrays are kept (mean, scale, coef, intercept), so
prediction in the serving loop is one numpy matmul with no scikit-learn call.

The weights live in the standardized space with the intercept first, theta = [intercept, coef]:
the parameterisation U = [1, Z] that the RLS corrector (`leap_core.rls`) updates.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import Ridge
from sklearn.preprocessing import StandardScaler

from leap_core import targets
from leap_core.gittins import LengthGivenPrediction


def _as_matrix(X: ArrayLike) -> np.ndarray:
    """A 2-D array; a single feature vector becomes one row. float32 and float64 are kept as is."""
    X = np.asarray(X)
    if X.dtype not in (np.float32, np.float64):
        X = X.astype(np.float64)
    if X.ndim == 1:
        X = X[None, :]
    if X.ndim != 2:
        raise ValueError(f"features must be 1-D or 2-D, got shape {X.shape}")
    return X


class Standardizer(BaseEstimator):
    """Per-column mean and scale of the training features (scale 1 for a constant column).

    Hidden-state dimensions differ in magnitude by orders of magnitude; standardizing makes one ridge
    penalty fair to all of them and keeps the RLS matrix well conditioned.
    """

    def fit(self, X: ArrayLike) -> Standardizer:
        scaler = StandardScaler().fit(np.asarray(_as_matrix(X), dtype=np.float64))
        self.mean_ = np.asarray(scaler.mean_, dtype=np.float64)
        self.scale_ = np.asarray(scaler.scale_, dtype=np.float64)
        return self

    def transform(self, X: ArrayLike) -> NDArray[np.float64]:
        if not hasattr(self, "mean_"):
            raise NotFittedError("Standardizer is not fitted; call fit first")
        X = np.asarray(_as_matrix(X), dtype=np.float64)
        return (X - self.mean_) / self.scale_


class LinearReadout(BaseEstimator):
    """Predicts a request's output length from one prefill hidden state.

    Parameters
    ----------
    alpha: ridge penalty on the standardized coefficients (the intercept is not penalised).
    target: regression space, one of `leap_core.targets.TARGETS`.
    max_tokens: the output token budget M; predictions are clipped to [1, M].
    metadata: identity of the features (model_id, model_fingerprint, layer, version, ...), carried
        into the readout file so a readout is never applied to another model's hidden states.

    Learned besides the weights: `length_distribution_`, the distribution of the true length given this
    readout's prediction (`leap_core.gittins.LengthGivenPrediction`) that the Gittins decode order ranks
    by. `fit` leaves it None; the fit flow fits it on cross-fitted predictions (`leap_core.cross_fit`), the
    readout file carries it, and readouts corrected by RLS keep their anchor's. `target_map_`: the fitted
    target's map (`leap_core.targets.TargetMap`, learned from the training lengths by `fit`; None for a fixed
    target), kept by RLS corrections so feedback lands in the anchor's space.
    """

    def __init__(self, alpha: float = 1.0, target: str = "sqrt", max_tokens: int = 2048,
                 metadata: dict[str, Any] | None = None):
        self.alpha = alpha
        self.target = target
        self.max_tokens = max_tokens
        self.metadata = {} if metadata is None else metadata

    # ------------------------------------------------------------------ fitting

    def fit(self, X: ArrayLike, lengths: ArrayLike) -> LinearReadout:
        """Standardize X and fit Ridge(alpha) on transform(lengths)."""
        self._check_params()
        X = _as_matrix(X)
        lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
        if lengths.shape[0] != X.shape[0]:
            raise ValueError(f"X has {X.shape[0]} rows but lengths has {lengths.shape[0]}")
        self.target_map_ = targets.fit_map(self.target, lengths, int(self.max_tokens))
        y = targets.transform(lengths, self.target, self.target_map_)
        standardizer = Standardizer().fit(X)
        Z = standardizer.transform(X)
        ridge = Ridge(alpha=float(self.alpha), fit_intercept=True).fit(Z, y)
        self._set_weights(standardizer.mean_, standardizer.scale_, ridge.coef_, float(ridge.intercept_))
        self.n_train_ = int(X.shape[0])
        self.length_distribution_ = None
        return self

    @classmethod
    def from_weights(cls, mean: ArrayLike, scale: ArrayLike, coef: ArrayLike, intercept: float,
                     alpha: float = 1.0, target: str = "sqrt", max_tokens: int = 2048,
                     metadata: dict[str, Any] | None = None,
                     length_distribution: LengthGivenPrediction | None = None,
                     target_map: targets.TargetMap | None = None) -> LinearReadout:
        """A fitted readout from stored or corrected weights (the file format and RLS use this). A fitted
        target needs its `target_map`, fitted for this `max_tokens`; a fixed one takes none."""
        readout = cls(alpha=alpha, target=target, max_tokens=max_tokens,
                      metadata=dict(metadata) if metadata else {})
        readout._check_params()
        if (target in targets.FITTED_TARGETS) != (target_map is not None):
            raise ValueError(f"the {target} target takes {'a' if target in targets.FITTED_TARGETS else 'no'} "
                             "target map")
        if target_map is not None:
            if target_map.name != target or target_map.max_tokens != int(max_tokens):
                raise ValueError(f"the target map is for {target_map.name!r} up to {target_map.max_tokens} tokens, "
                                 f"not {target!r} up to {max_tokens}")
        readout.target_map_ = target_map
        readout._set_weights(mean, scale, coef, intercept)
        readout.length_distribution_ = length_distribution
        return readout

    def _check_params(self) -> None:
        targets.check_target(self.target)
        if not (np.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0, got {self.alpha}")
        if int(self.max_tokens) != self.max_tokens or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")

    def _set_weights(self, mean: ArrayLike, scale: ArrayLike, coef: ArrayLike, intercept: float) -> None:
        mean = np.array(mean, dtype=np.float64).reshape(-1)
        scale = np.array(scale, dtype=np.float64).reshape(-1)
        coef = np.array(coef, dtype=np.float64).reshape(-1)
        intercept = float(np.asarray(intercept, dtype=np.float64).reshape(-1)[0])
        if not (mean.shape == scale.shape == coef.shape) or mean.size == 0:
            raise ValueError(f"mean, scale and coef must have one equal, non-zero length; got "
                             f"{mean.shape}, {scale.shape}, {coef.shape}")
        if not (np.isfinite(mean).all() and np.isfinite(scale).all() and np.isfinite(coef).all()
                and np.isfinite(intercept)):
            raise ValueError("readout weights must be finite")
        if (scale <= 0).any():
            raise ValueError("every scale must be > 0")
        self.mean_, self.scale_, self.coef_, self.intercept_ = mean, scale, coef, intercept
        # Serving-side copies: centering in the input's own dtype, then one matmul with coef/scale.
        self._slope = {np.dtype(np.float64): coef / scale,
                       np.dtype(np.float32): (coef / scale).astype(np.float32)}
        self._center = {np.dtype(np.float64): mean, np.dtype(np.float32): mean.astype(np.float32)}

    # ---------------------------------------------------------------- prediction

    def _check_fitted(self) -> None:
        if not hasattr(self, "coef_"):
            raise NotFittedError("LinearReadout is not fitted; call fit or from_weights first")

    def standardize(self, X: ArrayLike) -> NDArray[np.float64]:
        """Z = (X - mean_) / scale_ in float64: the features RLS works on."""
        self._check_fitted()
        X = np.asarray(_as_matrix(X), dtype=np.float64)
        self._check_dim(X)
        return (X - self.mean_) / self.scale_

    def _check_dim(self, X: np.ndarray) -> None:
        if X.shape[1] != self.coef_.shape[0]:
            raise ValueError(f"features have dim {X.shape[1]}, readout expects {self.coef_.shape[0]}")

    def predict_transformed(self, X: ArrayLike) -> NDArray[np.float64]:
        """Unclipped prediction in the target space: standardize(X) @ coef_ + intercept_."""
        self._check_fitted()
        X = _as_matrix(X)
        self._check_dim(X)
        centered = X - self._center[X.dtype]
        return np.asarray(centered @ self._slope[X.dtype], dtype=np.float64) + self.intercept_

    def predict(self, X: ArrayLike) -> NDArray[np.float64]:
        """Predicted output lengths in tokens, within [1, max_tokens]."""
        return targets.to_lengths(self.predict_transformed(X), self.target, int(self.max_tokens), self.target_map_)

    def target_values(self, lengths: ArrayLike) -> NDArray[np.float64]:
        """Output lengths in this readout's target space (through its fitted map, if any): what RLS regresses."""
        self._check_fitted()
        return targets.transform(np.asarray(lengths, dtype=np.float64).reshape(-1), self.target, self.target_map_)

    # ------------------------------------------------------------------ shapes

    @property
    def theta_(self) -> NDArray[np.float64]:
        """[intercept_, *coef_]: the weights in the standardized space, intercept first (RLS layout)."""
        self._check_fitted()
        return np.concatenate([[self.intercept_], self.coef_])

    @property
    def dim_(self) -> int:
        self._check_fitted()
        return int(self.coef_.shape[0])

    @property
    def n_params_(self) -> int:
        return self.dim_ + 1
