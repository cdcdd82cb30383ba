"""Exact merge of several replicas' RLS states that started from one common anchor.

With forgetting 1 an RLS state is the information of the anchored ridge problem (`leap_core.rls`):

    A_i = A_0 + sum_{r in R_i} u_r u_r^T,     b_i = b_0 + sum_{r in R_i} u_r y_r,

so the one-shot solve over every replica's feedback has

    A* = A_0 + sum_i (A_i - A_0),     b* = b_0 + sum_i (b_i - b_0),

and theta* = A*^-1 b*, P* = A*^-1 come from one Cholesky factor. This holds only on one problem (same
standardization, same alpha, no forgetting); anything else, or a state that does not extend the anchor,
is refused with a ValueError. After a merge every replica is anchored at it, so no row counts twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from leap_core.readout import LinearReadout
from leap_core.rls import RLS

State = Mapping[str, np.ndarray]
_ROW_TOLERANCE = 1e-6


def _arrays(state: RLS | State) -> dict[str, np.ndarray]:
    return state.state_arrays() if isinstance(state, RLS) else {k: np.asarray(v) for k, v in state.items()}


def _scalar(state: State, key: str) -> float:
    return float(np.asarray(state[key]).reshape(-1)[0])


def feedback_rows(base: RLS | State, state: RLS | State) -> int:
    """The rows `state` folded on top of `base`: the growth of A[0, 0] (the intercept's information).

    ValueError when it is not a non-negative whole number (the state does not extend this anchor).
    """
    base, state = _arrays(base), _arrays(state)
    grown = float(state["A"][0, 0]) - float(base["A"][0, 0])
    rows = round(grown)
    if rows < 0 or abs(grown - rows) > _ROW_TOLERANCE * max(1.0, abs(float(base["A"][0, 0]))):
        raise ValueError(f"the state's intercept information grew by {grown:.6g} over the anchor's, which no "
                         "whole number of feedback rows gives: it is not anchored at this base")
    return int(rows)


_MERGE_KEYS = ("A", "b", "mean", "scale", "counters", "alpha", "forgetting")


def _check_complete(state: State, where: str) -> None:
    """ValueError unless `state` holds every array a merge reads and was learned without forgetting."""
    missing = [key for key in _MERGE_KEYS if key not in state]
    if missing:
        raise ValueError(f"{where}: the state lacks arrays {missing}")
    if _scalar(state, "forgetting") != 1.0:
        raise ValueError(f"{where}: forgetting is {_scalar(state, 'forgetting')}; an exact merge needs "
                         "forgetting 1 (a discounted anchor cannot be separated from the feedback)")


def check_mergeable(base: RLS | State, replicas: Sequence[RLS | State]) -> list[int]:
    """The rows each replica folded on top of `base`; ValueError, naming the replica (by position) and
    the reason, when a state cannot enter an exact merge (see the module docstring)."""
    base = _arrays(base)
    _check_complete(base, "the base")
    rows = []
    for index, replica in enumerate(replicas):
        replica = _arrays(replica)
        where = f"replica {index}"
        _check_complete(replica, where)
        if np.shape(replica["A"]) != np.shape(base["A"]) or np.shape(replica["b"]) != np.shape(base["b"]):
            raise ValueError(f"{where}: information of shape {np.shape(replica['A'])} does not match the "
                             f"base's {np.shape(base['A'])}")
        if not (np.array_equal(replica["mean"], base["mean"]) and np.array_equal(replica["scale"], base["scale"])):
            raise ValueError(f"{where}: the state was built on another standardization than the base's")
        if _scalar(replica, "alpha") != _scalar(base, "alpha"):
            raise ValueError(f"{where}: alpha {_scalar(replica, 'alpha')} differs from the base's "
                             f"{_scalar(base, 'alpha')}")
        if not (np.isfinite(replica["A"]).all() and np.isfinite(replica["b"]).all()):
            raise ValueError(f"{where}: the information arrays A and b must be finite")
        try:
            folded = feedback_rows(base, replica)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        seen = int(np.asarray(replica["counters"])[1]) - int(np.asarray(base["counters"])[1])
        if seen != folded:
            raise ValueError(f"{where}: its information holds {folded} rows beyond the base but its counter says "
                             f"{seen}: it is not anchored at this base")
        rows.append(folded)
    return rows


def merge_anchored(readout: LinearReadout, base: RLS | State, replicas: Sequence[RLS | State],
                   **rls_params: Any) -> RLS:
    """The RLS of the one-shot anchored ridge solve on the base's rows and every replica's feedback.

    `readout` is the anchor readout (its standardization, target and metadata); `base` its RLS state,
    and `replicas` the states each replica reached from it. A = A_0 + sum_i (A_i - A_0), b likewise;
    theta and P from one Cholesky factor (`RLS.from_information`). Counters add up the same way.
    """
    base = _arrays(base)
    states = [_arrays(replica) for replica in replicas]
    check_mergeable(base, states)
    if not (np.array_equal(readout.mean_, base["mean"]) and np.array_equal(readout.scale_, base["scale"])):
        raise ValueError("the base state was built on another standardization than the readout's")
    A = np.array(base["A"], dtype=np.float64)
    b = np.array(base["b"], dtype=np.float64)
    counters = np.asarray(base["counters"], dtype=np.int64).copy()
    for state in states:
        A += np.asarray(state["A"], dtype=np.float64) - np.asarray(base["A"], dtype=np.float64)
        b += np.asarray(state["b"], dtype=np.float64) - np.asarray(base["b"], dtype=np.float64)
        counters += np.asarray(state["counters"], dtype=np.int64) - np.asarray(base["counters"], dtype=np.int64)
    rls_params.setdefault("forgetting", 1.0)
    return RLS.from_information(readout, A, b, alpha=_scalar(base, "alpha"),
                                counters=tuple(int(c) for c in counters), **rls_params)


def anchored_refit(readout: LinearReadout, base: RLS | State, X: ArrayLike, lengths: ArrayLike) -> np.ndarray:
    """theta of the anchored ridge problem re-solved in one shot on the base's information and the
    feedback rows (X, lengths): solve(A_0 + U^T U, b_0 + U^T y), by a general solver, independent of
    any RLS update. The reference a merged state is checked against (`refit_max_abs_diff`)."""
    base = _arrays(base)
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    U = np.column_stack([np.ones(X.shape[0]), readout.standardize(X)]) if X.size else np.zeros((0, readout.n_params_))
    y = readout.target_values(lengths)
    if U.shape[0] != y.shape[0]:
        raise ValueError(f"{U.shape[0]} feedback rows but {y.shape[0]} lengths")
    A = np.asarray(base["A"], dtype=np.float64) + U.T @ U
    b = np.asarray(base["b"], dtype=np.float64) + U.T @ y
    return np.linalg.solve(A, b)


def refit_max_abs_diff(merged: RLS, readout: LinearReadout, base: RLS | State, X: ArrayLike,
                       lengths: ArrayLike) -> float:
    """max |theta_merged - theta_refit| over the weights: how far a merge is from re-solving the anchored
    ridge problem on the base and all the feedback rows the replicas folded (X, lengths)."""
    return float(np.max(np.abs(merged.theta_ - anchored_refit(readout, base, X, lengths))))
