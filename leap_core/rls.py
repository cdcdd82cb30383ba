"""Recursive least squares correction of the readout from finished requests.

Every finished request reveals its true output length. RLS folds it into the readout exactly as if the
anchored ridge problem had been re-solved on the training data plus all feedback, at O(d^2) per batch:

    theta = A^-1 b,   A = U_s^T U_s + alpha D + sum U^T U,   b = U_s^T y_s + sum U^T y,

with U = [1, Z] (standardized features, intercept first), D = diag(0, 1, ..., 1), y in the target space.
The batch update on P = A^-1:

    V = P U^T;  S = I + U V;  G = V S^-1;  theta += G (y - U theta);  P -= G V^T.

Forgetting (rho < 1) discounts earlier information once per `update`: S becomes rho I + U V and the
downdated P is divided by rho. Memory layout, lazy folding and recovery: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.linalg import blas, lapack
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError
from threadpoolctl import ThreadpoolController

from leap_core.readout import LinearReadout

_BLAS: ThreadpoolController | None = None  # found on first use: introspecting the BLAS libraries costs ms
_STATE_KEYS = ("theta", "P", "A", "b", "mean", "scale", "counters", "alpha", "forgetting")


def _symmetric(upper: np.ndarray) -> NDArray[np.float64]:
    """The full symmetric matrix from its upper triangle."""
    return np.triu(upper) + np.triu(upper, 1).T


def _augment(Z: np.ndarray) -> NDArray[np.float64]:
    """U = [1, Z], C-ordered, so U.T is the Fortran-ordered (d+1, n) matrix BLAS wants."""
    U = np.empty((Z.shape[0], Z.shape[1] + 1), dtype=np.float64)
    U[:, 0] = 1.0
    U[:, 1:] = Z
    return U


class RLS(BaseEstimator):
    """Exact online ridge correction of a `LinearReadout`.

    Parameters
    ----------
    forgetting: rho in (0, 1]; 1 keeps all information (the default and the exact anchored ridge).
    fold_every: feedback rows kept in low-rank form before one full pass over the (d+1)^2 matrices.
    blas_threads: BLAS threads during `update` (None leaves the library's setting). One by default:
        an update is mostly memory traffic, and where the cores are busy (a serving process) a
        second BLAS thread mostly waits for a core: on a loaded 2-core machine two threads were
        2-6x slower at d = 4096 and up to 100x slower at d = 576.

    Start one with `RLS.from_readout(readout, X_train)` or `RLS.from_state_arrays(readout, arrays)`.
    """

    def __init__(self, forgetting: float = 1.0, fold_every: int = 64, blas_threads: int | None = 1):
        self.forgetting = forgetting
        self.fold_every = fold_every
        self.blas_threads = blas_threads

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_readout(cls, readout: LinearReadout, X_train: ArrayLike, alpha: float | None = None,
                     **params: Any) -> RLS:
        """Anchor at a fitted readout: P0 = (U_s^T U_s + alpha D)^-1, theta0 = readout.theta_.

        X_train are the readout's training features (raw, standardized here with the readout's own
        mean and scale). b0 = A0 theta0, which equals U_s^T y_s when the readout was fitted on
        X_train with the same alpha, so the training targets themselves are not needed.
        """
        rls = cls(**params)
        rls._check_params()
        alpha = float(readout.alpha if alpha is None else alpha)
        if not (np.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
        U_s = _augment(readout.standardize(X_train))
        p = U_s.shape[1]
        A = blas.dsyrk(1.0, U_s.T, trans=0, lower=0)
        A[np.arange(1, p), np.arange(1, p)] += alpha
        theta0 = readout.theta_
        rls._start(readout, alpha, A=np.asfortranarray(A), b=blas.dsymv(1.0, A, theta0, lower=0),
                   theta=theta0, P=None, counters=(0, 0, 0))
        return rls

    @classmethod
    def from_state_arrays(cls, readout: LinearReadout, arrays: dict[str, np.ndarray],
                          **params: Any) -> RLS:
        """Rebuild from `state_arrays()`; forgetting defaults to the stored value."""
        missing = [key for key in _STATE_KEYS if key not in arrays]
        if missing:
            raise ValueError(f"RLS state lacks arrays {missing}")
        params.setdefault("forgetting", float(np.asarray(arrays["forgetting"])))
        rls = cls(**params)
        rls._check_params()
        p = readout.n_params_
        shapes = {"theta": (p,), "P": (p, p), "A": (p, p), "b": (p,), "mean": (p - 1,),
                  "scale": (p - 1,), "counters": (3,)}
        for key, shape in shapes.items():
            if np.shape(arrays[key]) != shape:
                raise ValueError(f"RLS state array {key} has shape {np.shape(arrays[key])}, "
                                 f"expected {shape} for a readout of dim {p - 1}")
        if not (np.array_equal(arrays["mean"], readout.mean_)
                and np.array_equal(arrays["scale"], readout.scale_)):
            raise ValueError("RLS state was built on another standardization than this readout's")
        if not (np.isfinite(arrays["A"]).all() and np.isfinite(arrays["b"]).all()):
            raise ValueError("RLS anchor arrays A and b must be finite")
        counters = tuple(int(c) for c in np.asarray(arrays["counters"]))
        # P and theta are not checked here: a damaged P is rebuilt from A and b on the next update.
        rls._start(readout, float(np.asarray(arrays["alpha"])),
                   A=np.array(arrays["A"], dtype=np.float64, order="F"),
                   b=np.array(arrays["b"], dtype=np.float64),
                   theta=np.array(arrays["theta"], dtype=np.float64),
                   P=np.array(arrays["P"], dtype=np.float64, order="F"), counters=counters)
        return rls

    @classmethod
    def from_information(cls, readout: LinearReadout, A: ArrayLike, b: ArrayLike, *, alpha: float,
                         counters: tuple[int, int, int] = (0, 0, 0), **params: Any) -> RLS:
        """Start at the ridge problem whose information is A and b: theta = A^-1 b and P = A^-1, both
        from one Cholesky factor of A (the recovery path's solve).

        For information assembled outside an update, e.g. the sum of several replicas' states over one
        anchor (`leap_core.fleet_rls`). `readout` gives the standardization A and b were built on.
        """
        rls = cls(**params)
        rls._check_params()
        p = readout.n_params_
        A = np.asarray(A, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64).reshape(-1)
        if A.shape != (p, p) or b.shape != (p,):
            raise ValueError(f"information of shapes {A.shape} and {b.shape} does not fit a readout of dim {p - 1}")
        if not (np.isfinite(A).all() and np.isfinite(b).all()):
            raise ValueError("information arrays A and b must be finite")
        rls._start(readout, float(alpha), A=np.array(A, order="F"), b=b, theta=None, P=None,
                   counters=tuple(int(c) for c in counters))
        return rls

    def _check_params(self) -> None:
        if not (0.0 < float(self.forgetting) <= 1.0):
            raise ValueError(f"forgetting must lie in (0, 1], got {self.forgetting}")
        if int(self.fold_every) != self.fold_every or self.fold_every < 1:
            raise ValueError(f"fold_every must be a positive integer, got {self.fold_every}")
        if self.blas_threads is not None and (int(self.blas_threads) != self.blas_threads
                                              or self.blas_threads < 1):
            raise ValueError(f"blas_threads must be None or a positive integer, got {self.blas_threads}")

    def _blas_limit(self) -> contextlib.AbstractContextManager:
        global _BLAS
        if self.blas_threads is None:
            return contextlib.nullcontext()
        if _BLAS is None:
            _BLAS = ThreadpoolController()
        return _BLAS.limit(limits=int(self.blas_threads), user_api="blas")

    def _start(self, readout: LinearReadout, alpha: float, *, A: np.ndarray, b: np.ndarray,
               theta: np.ndarray | None, P: np.ndarray | None, counters: tuple[int, int, int]) -> None:
        p = readout.n_params_
        self.readout_ = readout
        self.alpha_ = alpha
        self.n_updates_, self.n_seen_, self.n_recoveries_ = counters
        self._A, self._b = A, np.array(b, dtype=np.float64)
        self._pending: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._pending_rows = 0
        self._folded_at = self.n_updates_
        self._W = np.zeros((p, int(self.fold_every)), dtype=np.float64, order="F")
        self._k = 0
        self._s = 1.0
        if P is None:
            self._rebuild_from_anchor(solve_theta=theta is None)
            if theta is not None:
                self.theta_ = np.array(theta, dtype=np.float64)
        else:
            self._B = P
            self.theta_ = theta

    # ------------------------------------------------------------------- updates

    def update(self, U: ArrayLike, y: ArrayLike) -> RLS:
        """Fold one batch of feedback into theta and P.

        U: (n, d+1) standardized features with the ones column first; y: (n,) targets in the
        readout's target space (e.g. sqrt of the true output length).
        """
        self._check_started()
        U = np.ascontiguousarray(np.atleast_2d(np.asarray(U, dtype=np.float64)))
        y = np.ascontiguousarray(np.asarray(y, dtype=np.float64).reshape(-1))
        n, p = U.shape
        if p != self.theta_.shape[0]:
            raise ValueError(f"U has {p} columns, expected d + 1 = {self.theta_.shape[0]}")
        if y.shape[0] != n:
            raise ValueError(f"U has {n} rows but y has {y.shape[0]}")
        if n == 0:
            return self
        if not (np.isfinite(U).all() and np.isfinite(y).all()):
            raise ValueError("feedback features and targets must be finite")

        self.n_updates_ += 1
        self.n_seen_ += n
        self._pending.append((U.copy(), y.copy(), self.n_updates_))
        self._pending_rows += n
        with self._blas_limit():
            gain = self._gain(U)
            if gain is None:
                self._recover()
            else:
                V, L = gain
                residual = y - U @ self.theta_
                self.theta_ += V @ lapack.dpotrs(L, residual, lower=1)[0]
                self._downdate(blas.dtrsm(1.0, L, V, side=1, lower=1, trans_a=1))
                if not self._healthy():
                    self._recover()
            if self._pending_rows >= self.fold_every:
                self._fold_anchor()
        return self

    def partial_fit(self, X: ArrayLike, lengths: ArrayLike) -> RLS:
        """Feedback as raw hidden states and true output lengths (standardized and transformed
        with the readout's own mean, scale and target)."""
        self._check_started()
        U = _augment(self.readout_.standardize(X))
        return self.update(U, self.readout_.target_values(lengths))

    def _gain(self, U: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """V = P U^T and the Cholesky factor of S = rho I + U V; None when P is unusable."""
        UT = U.T  # Fortran-ordered view
        V = blas.dsymm(self._s, self._B, UT, side=0, lower=0)
        if self._k:
            W = self._W[:, :self._k]
            V -= self._s * (W @ (W.T @ UT))
        if not np.isfinite(V).all():
            return None
        S = U @ V
        S = 0.5 * (S + S.T)
        S.flat[::S.shape[0] + 1] += float(self.forgetting)
        L, info = lapack.dpotrf(S, lower=1)
        if info != 0:
            return None
        return V, L

    def _downdate(self, W_new: np.ndarray) -> None:
        """P <- (P - W_new W_new^T) / rho, with P = s (B - W W^T) kept in low-rank form."""
        rho = float(self.forgetting)
        n = W_new.shape[1]
        if self._k + n > self._W.shape[1]:
            self._flush_downdates()
        if n > self._W.shape[1]:  # a batch wider than the buffer goes straight into B (s is 1 here)
            self._B = blas.dsyrk(-1.0 / rho, W_new, beta=1.0 / rho, c=self._B, trans=0, lower=0,
                                 overwrite_c=1)
            return
        self._W[:, self._k:self._k + n] = W_new / np.sqrt(self._s)
        self._k += n
        self._s /= rho

    def _flush_downdates(self) -> None:
        """B <- s (B - W W^T): one in-place pass over the upper triangle."""
        if self._k == 0 and self._s == 1.0:
            return
        W = self._W[:, :self._k]
        if self._k:
            self._B = blas.dsyrk(-self._s, W, beta=self._s, c=self._B, trans=0, lower=0, overwrite_c=1)
        else:
            self._B *= self._s
        self._k, self._s = 0, 1.0

    def _diag_P(self) -> NDArray[np.float64]:
        W = self._W[:, :self._k]
        return self._s * (np.diagonal(self._B) - np.einsum("ij,ij->i", W, W))

    def _healthy(self) -> bool:
        diag = self._diag_P()
        return bool(np.isfinite(self.theta_).all() and np.isfinite(diag).all() and (diag > 0).all())

    # ---------------------------------------------------------------- the anchor

    def _fold_anchor(self) -> None:
        """A <- rho^k A + sum rho^(t - t_j) U_j^T U_j (and b alike) for the pending batches."""
        if not self._pending:
            return
        rho = float(self.forgetting)
        now = self.n_updates_
        weights = [np.sqrt(rho ** (now - t)) if rho != 1.0 else 1.0 for _, _, t in self._pending]
        U = np.concatenate([w * U_j for w, (U_j, _, _) in zip(weights, self._pending)])
        y = np.concatenate([w * y_j for w, (_, y_j, _) in zip(weights, self._pending)])
        decay = rho ** (now - self._folded_at)
        self._A = blas.dsyrk(1.0, U.T, beta=decay, c=self._A, trans=0, lower=0, overwrite_c=1)
        self._b = decay * self._b + U.T @ y
        self._pending, self._pending_rows, self._folded_at = [], 0, now

    def _rebuild_from_anchor(self, solve_theta: bool = True) -> None:
        """P = A^-1 and (optionally) theta = A^-1 b, from the folded anchor."""
        self._fold_anchor()
        factor, info = lapack.dpotrf(self._A, lower=0, clean=0)
        if info != 0:
            raise np.linalg.LinAlgError(
                "the anchor information matrix is not positive definite; use alpha > 0 or more "
                "training rows")
        if solve_theta:
            theta = lapack.dpotrs(factor, self._b, lower=0)[0]
            if not np.isfinite(theta).all():
                raise FloatingPointError("RLS anchor solve produced non-finite weights")
            self.theta_ = theta
        P, info = lapack.dpotri(factor, lower=0, overwrite_c=1)
        if info != 0:
            raise np.linalg.LinAlgError("the anchor information matrix is singular")
        self._B = np.asfortranarray(P)
        self._k, self._s = 0, 1.0

    def _recover(self) -> None:
        self._rebuild_from_anchor(solve_theta=True)
        self.n_recoveries_ += 1

    # ------------------------------------------------------------------ results

    def _check_started(self) -> None:
        if not hasattr(self, "theta_"):
            raise NotFittedError("RLS is not started; use RLS.from_readout or RLS.from_state_arrays")

    @property
    def P_(self) -> NDArray[np.float64]:
        """The full symmetric (d+1, d+1) inverse information matrix (a copy)."""
        self._check_started()
        self._flush_downdates()
        return _symmetric(self._B)

    @property
    def dim_(self) -> int:
        self._check_started()
        return int(self.theta_.shape[0] - 1)

    def readout(self) -> LinearReadout:
        """A new readout with the current weights and the anchor readout's standardization."""
        self._check_started()
        base = self.readout_
        metadata = dict(base.metadata)
        metadata["rls_updates"] = int(self.n_updates_)
        return LinearReadout.from_weights(
            mean=base.mean_, scale=base.scale_, coef=self.theta_[1:], intercept=float(self.theta_[0]),
            alpha=base.alpha, target=base.target, max_tokens=base.max_tokens, metadata=metadata,
            length_distribution=getattr(base, "length_distribution_", None),
            target_map=getattr(base, "target_map_", None))

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything needed to resume (for versioning next to the readout file)."""
        self._check_started()
        self._fold_anchor()
        return {
            "theta": self.theta_.copy(),
            "P": self.P_,
            "A": _symmetric(self._A),
            "b": self._b.copy(),
            "mean": self.readout_.mean_.copy(),
            "scale": self.readout_.scale_.copy(),
            "counters": np.array([self.n_updates_, self.n_seen_, self.n_recoveries_], dtype=np.int64),
            "alpha": np.array(self.alpha_, dtype=np.float64),
            "forgetting": np.array(float(self.forgetting), dtype=np.float64),
        }

    def stats(self) -> dict[str, Any]:
        """Counters and the spread of P's diagonal (the remaining uncertainty of each weight)."""
        self._check_started()
        diag = self._diag_P()
        return {
            "dim": self.dim_,
            "n_updates": int(self.n_updates_),
            "n_seen": int(self.n_seen_),
            "n_recoveries": int(self.n_recoveries_),
            "pending_rows": int(self._pending_rows),
            "forgetting": float(self.forgetting),
            "alpha": float(self.alpha_),
            "p_diag_min": float(diag.min()),
            "p_diag_mean": float(diag.mean()),
        }


def fit_readout_with_anchor(X: ArrayLike, lengths: ArrayLike, *, alpha: float, max_tokens: int,
                            target: str = "sqrt", metadata: dict[str, Any] | None = None,
                            **rls_params: Any) -> tuple[LinearReadout, RLS]:
    """A `LinearReadout` fitted on (X, lengths) and the RLS anchored at the same rows and penalty.

    The pair every fitting path wants: the readout serves at once, and the RLS resumes from exactly
    the ridge problem the readout solved, so feedback folds in as if the fit had been redone on the
    training rows plus the feedback. `rls_params` go to `RLS` (forgetting, fold_every, blas_threads);
    `rls.state_arrays()` is what the registry stores next to the readout.
    """
    readout = LinearReadout(alpha=alpha, target=target, max_tokens=max_tokens,
                            metadata=metadata).fit(X, lengths)
    return readout, RLS.from_readout(readout, X, **rls_params)
