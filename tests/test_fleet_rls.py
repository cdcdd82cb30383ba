"""Replicas that corrected one anchor with different feedback merge into the one-shot anchored ridge
refit on the training rows and all their feedback, to 1e-8, and again after re-anchoring at the merge."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from leap_core import targets
from leap_core.fleet_rls import (
    anchored_refit,
    check_mergeable,
    feedback_rows,
    merge_anchored,
    refit_max_abs_diff,
)
from leap_core.rls import RLS, fit_readout_with_anchor

MAX_TOKENS = 2048
ALPHA = 2.0


def _rows(rng, n, d, w, shift=0.0):
    X = rng.standard_normal((n, d)) * np.linspace(0.5, 20.0, d) + np.linspace(-5, 5, d) + shift
    lengths = np.clip(np.round((20.0 + (X / np.linspace(0.5, 20.0, d)) @ w + rng.standard_normal(n)) ** 2),
                      1, MAX_TOKENS)
    return X, lengths


def _refit(readout, X, lengths):
    """The anchored ridge problem re-solved from scratch: U = [1, standardized X] with the anchor's
    mean and scale, A = U^T U + alpha D, b = U^T y, one general solve."""
    Z = (X - readout.mean_) / readout.scale_
    U = np.column_stack([np.ones(len(X)), Z])
    D = np.eye(U.shape[1])
    D[0, 0] = 0.0
    y = targets.transform(lengths, readout.target)
    return scipy.linalg.solve(U.T @ U + ALPHA * D, U.T @ y, assume_a="sym")


def _fold(rls, X, lengths, batch, rng):
    """Feed rows in batches of random size around `batch` (fold_every is smaller, so folding is lazy)."""
    start = 0
    while start < len(X):
        size = int(rng.integers(1, 2 * batch))
        rls.partial_fit(X[start:start + size], lengths[start:start + size])
        start += size
    return rls


@pytest.mark.parametrize(("seed", "d", "n_train", "replica_rows"), [
    (0, 12, 300, [80, 50, 120]),
    (1, 24, 60, [40, 90]),   # fewer training rows than twice the dim: the penalty carries the anchor
    (2, 8, 200, [0, 30, 7]),  # a replica that learned nothing
])
def test_merged_replicas_equal_the_anchored_refit_on_all_feedback_twice_over(seed, d, n_train, replica_rows):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(d) * 3.0 / np.sqrt(d)
    X_train, lengths_train = _rows(rng, n_train, d, w)
    readout, base = fit_readout_with_anchor(X_train, lengths_train, alpha=ALPHA, max_tokens=MAX_TOKENS,
                                            metadata={"version": "base"}, fold_every=16)
    X_seen, lengths_seen = [X_train], [lengths_train]
    anchor_readout, anchor = readout, base.state_arrays()
    for round_shift in (1.0, -2.0):  # round two starts every replica from the merged state
        replicas = []
        for rows in replica_rows:
            X_f, lengths_f = _rows(rng, rows, d, w, shift=round_shift)
            replica = RLS.from_state_arrays(anchor_readout, anchor, fold_every=16)
            replicas.append(_fold(replica, X_f, lengths_f, batch=24, rng=rng))
            X_seen.append(X_f)
            lengths_seen.append(lengths_f)
        assert check_mergeable(anchor, replicas) == replica_rows
        merged = merge_anchored(anchor_readout, anchor, replicas)

        expected = _refit(readout, np.concatenate(X_seen), np.concatenate(lengths_seen))
        assert np.max(np.abs(merged.theta_ - expected)) < 1e-8
        assert np.max(np.abs(merged.readout().theta_ - expected)) < 1e-8
        np.testing.assert_allclose(merged.P_, np.linalg.inv(merged.state_arrays()["A"]), rtol=1e-7, atol=1e-12)
        assert merged.n_seen_ == int(np.asarray(anchor["counters"])[1]) + sum(replica_rows)
        assert feedback_rows(base, merged) == sum(len(x) for x in X_seen[1:])

        X_new = np.concatenate(X_seen[-len(replica_rows):])
        lengths_new = np.concatenate(lengths_seen[-len(replica_rows):])
        assert refit_max_abs_diff(merged, anchor_readout, anchor, X_new, lengths_new) < 1e-8
        np.testing.assert_allclose(anchored_refit(anchor_readout, anchor, X_new, lengths_new), expected,
                                   rtol=0, atol=1e-8)
        anchor_readout, anchor = merged.readout(), merged.state_arrays()

    merged.partial_fit(*_rows(rng, 5, d, w))  # the merged state serves and learns on
    assert merged.n_recoveries_ == 0


def _pair(seed=0, d=6, **rls_params):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(d)
    X, lengths = _rows(rng, 100, d, w)
    readout, base = fit_readout_with_anchor(X, lengths, alpha=ALPHA, max_tokens=MAX_TOKENS, **rls_params)
    replica = RLS.from_state_arrays(readout, base.state_arrays())
    replica.partial_fit(*_rows(rng, 10, d, w, shift=1.0))
    return rng, w, readout, base, replica


def test_forgetting_is_refused():
    _, _, readout, base, _ = _pair(forgetting=0.99)
    with pytest.raises(ValueError, match="forgetting"):
        merge_anchored(readout, base, [base])
    _, _, readout, base, replica = _pair()
    replica.forgetting = 0.9
    with pytest.raises(ValueError, match="replica 0: forgetting"):
        merge_anchored(readout, base, [replica])


def test_another_alpha_or_standardization_is_refused():
    _, _, readout, base, replica = _pair()
    state = replica.state_arrays()
    with pytest.raises(ValueError, match="alpha"):
        merge_anchored(readout, base, [{**state, "alpha": np.array(ALPHA + 1)}])
    with pytest.raises(ValueError, match="standardization"):
        merge_anchored(readout, base, [{**state, "scale": state["scale"] * 2}])


def test_a_state_not_anchored_at_the_base_is_refused():
    rng, w, readout, base, replica = _pair()
    later = RLS.from_state_arrays(readout, replica.state_arrays())  # anchored at the replica, not the base
    later.partial_fit(*_rows(rng, 4, 6, w))
    state = later.state_arrays()
    with pytest.raises(ValueError, match="counter says"):  # its counters start from the replica's
        merge_anchored(readout, base, [{**state, "counters": np.array([1, 4, 0])}])
    with pytest.raises(ValueError, match="not anchored at this base"):  # fewer rows than the base holds
        merge_anchored(readout, replica, [base])
    with pytest.raises(ValueError, match="non-finite|finite"):
        bad = replica.state_arrays()
        bad["b"][1] = np.nan
        merge_anchored(readout, base, [bad])
