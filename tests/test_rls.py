"""RLS equals the one-shot anchored ridge solve, recovers from damage, and resumes from its state."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from leap_core import targets
from leap_core.readout import LinearReadout
from leap_core.rls import RLS

MAX_TOKENS = 2048


def _hidden_states(rng, n, d, shift=0.0):
    scales = np.linspace(0.1, 30.0, d)
    return rng.standard_normal((n, d)) * scales + np.linspace(-20, 20, d) + shift


def _lengths(rng, X, w):
    root = 20.0 + (X - X.mean(0)) / X.std(0) @ w + 0.5 * rng.standard_normal(len(X))
    return np.clip(np.round(root ** 2), 1, MAX_TOKENS)


def _augment(readout, X):
    return np.column_stack([np.ones(len(X)), readout.standardize(X)])


def _anchor(readout, X_train, lengths, alpha):
    """A = U_s^T U_s + alpha D and b = U_s^T y_s, written out directly."""
    U = _augment(readout, X_train)
    D = np.eye(U.shape[1])
    D[0, 0] = 0.0
    return U.T @ U + alpha * D, U.T @ targets.transform(lengths, readout.target)


def _setup(seed, d, n_train, alpha=1.0, target="sqrt"):
    rng = np.random.default_rng(seed)
    X = _hidden_states(rng, n_train, d)
    w = rng.standard_normal(d) * 4.0 / np.sqrt(d)
    lengths = _lengths(rng, X, w)
    readout = LinearReadout(alpha=alpha, target=target, max_tokens=MAX_TOKENS,
                            metadata={"layer": 7}).fit(X, lengths)
    return rng, readout, X, lengths, w


def _feedback(rng, d, sizes, w):
    for size in sizes:
        X = _hidden_states(rng, size, d, shift=1.0)
        yield X, np.clip(np.round((20.0 + X[:, :d] @ w / 30.0) ** 2), 1, MAX_TOKENS)


def _assert_matches_solve(rls, A, b):
    expected_theta = np.linalg.solve(A, b)
    np.testing.assert_allclose(rls.theta_, expected_theta, rtol=1e-8,
                               atol=1e-8 * np.abs(expected_theta).max())
    expected_P = np.linalg.inv(A)
    np.testing.assert_allclose(rls.P_, expected_P, rtol=1e-8, atol=1e-8 * np.abs(expected_P).max())


SCENARIOS = [
    # (seed, d, n_train, alpha, batch sizes, fold_every)
    (0, 12, 200, 1.0, [1] * 30, 64),
    (1, 20, 150, 2.0, [3] * 25, 8),
    (2, 16, 300, 0.5, [8] * 20, 64),
    (3, 10, 100, 1.0, [50] * 4, 16),  # batches wider than the low-rank buffer
    (4, 40, 25, 3.0, [1, 3, 8, 50, 2, 13, 1, 64, 5], 16),  # d > n_train, mixed sizes
    (5, 24, 120, 1.0, None, 32),  # random sizes
]


@pytest.mark.parametrize(("seed", "d", "n_train", "alpha", "sizes", "fold_every"), SCENARIOS)
def test_updates_equal_one_shot_anchored_ridge(seed, d, n_train, alpha, sizes, fold_every):
    rng, readout, X, lengths, w = _setup(seed, d, n_train, alpha)
    if sizes is None:
        sizes = list(rng.integers(1, 40, size=12))
    rls = RLS.from_readout(readout, X, fold_every=fold_every)
    A, b = _anchor(readout, X, lengths, alpha)
    _assert_matches_solve(rls, A, b)
    for X_f, lengths_f in _feedback(rng, d, sizes, w):
        rls.partial_fit(X_f, lengths_f)
        U_f = _augment(readout, X_f)
        A += U_f.T @ U_f
        b += U_f.T @ targets.transform(lengths_f, "sqrt")
    _assert_matches_solve(rls, A, b)
    assert rls.n_updates_ == len(sizes) and rls.n_seen_ == sum(sizes) and rls.n_recoveries_ == 0


@pytest.mark.parametrize("target", ["log", "raw"])
def test_update_works_in_the_readout_target_space(target):
    rng, readout, X, lengths, w = _setup(6, 15, 120, 1.0, target=target)
    rls = RLS.from_readout(readout, X)
    A, b = _anchor(readout, X, lengths, 1.0)
    for X_f, lengths_f in _feedback(rng, 15, [4] * 6, w):
        U_f = _augment(readout, X_f)
        rls.update(U_f, targets.transform(lengths_f, target))
        A += U_f.T @ U_f
        b += U_f.T @ targets.transform(lengths_f, target)
    _assert_matches_solve(rls, A, b)


@pytest.mark.parametrize("rho", [0.97, 0.8])
def test_forgetting_equals_the_discounted_solve(rho):
    rng, readout, X, lengths, w = _setup(7, 14, 90, 1.5)
    rls = RLS.from_readout(readout, X, forgetting=rho, fold_every=10)
    A, b = _anchor(readout, X, lengths, 1.5)
    for X_f, lengths_f in _feedback(rng, 14, [1, 6, 3, 20, 2, 9, 4, 4, 11], w):
        rls.partial_fit(X_f, lengths_f)
        U_f = _augment(readout, X_f)
        A = rho * A + U_f.T @ U_f
        b = rho * b + U_f.T @ targets.transform(lengths_f, "sqrt")
    _assert_matches_solve(rls, A, b)


def test_forgetting_one_is_the_default():
    rng, readout, X, _, w = _setup(8, 10, 60)
    default, explicit = RLS.from_readout(readout, X), RLS.from_readout(readout, X, forgetting=1.0)
    for X_f, lengths_f in _feedback(rng, 10, [5, 1, 9], w):
        default.partial_fit(X_f, lengths_f)
        explicit.partial_fit(X_f, lengths_f)
    np.testing.assert_array_equal(default.theta_, explicit.theta_)
    np.testing.assert_array_equal(default.P_, explicit.P_)


@pytest.mark.parametrize("rho", [1.0, 0.9])
@pytest.mark.parametrize("where", ["off_diagonal", "diagonal", "theta"])
def test_recovery_after_damage_restores_the_exact_solution(where, rho):
    rng, readout, X, lengths, w = _setup(9, 18, 80)
    rls = RLS.from_readout(readout, X, forgetting=rho, fold_every=16)
    A, b = _anchor(readout, X, lengths, 1.0)
    batches = list(_feedback(rng, 18, [3, 5, 2, 7, 4, 6], w))
    for i, (X_f, lengths_f) in enumerate(batches):
        if i == 3:  # damage the state the way a numeric blow-up would
            if where == "off_diagonal":
                rls._B[2, 9] = rls._B[9, 2] = np.nan
            elif where == "diagonal":
                rls._B[4, 4] = -1.0
            else:
                rls.theta_[5] = np.inf
        rls.partial_fit(X_f, lengths_f)
        U_f = _augment(readout, X_f)
        A = rho * A + U_f.T @ U_f
        b = rho * b + U_f.T @ targets.transform(lengths_f, "sqrt")
    assert rls.n_recoveries_ == 1
    assert rls.stats()["n_recoveries"] == 1
    _assert_matches_solve(rls, A, b)


def test_damaged_stored_state_recovers_on_the_next_update():
    rng, readout, X, lengths, w = _setup(10, 12, 70)
    rls = RLS.from_readout(readout, X)
    (X_1, L_1), (X_2, L_2) = _feedback(rng, 12, [4, 6], w)
    rls.partial_fit(X_1, L_1)
    state = rls.state_arrays()
    state["P"][0, :] = np.inf
    resumed = RLS.from_state_arrays(readout, state)
    resumed.partial_fit(X_2, L_2)
    A, b = _anchor(readout, X, lengths, 1.0)
    for X_f, L_f in ((X_1, L_1), (X_2, L_2)):
        U_f = _augment(readout, X_f)
        A += U_f.T @ U_f
        b += U_f.T @ targets.transform(L_f, "sqrt")
    assert resumed.n_recoveries_ == 1
    _assert_matches_solve(resumed, A, b)


def test_state_round_trip_through_npz_resumes_exactly(tmp_path):
    rng, readout, X, _, w = _setup(11, 16, 100)
    rls = RLS.from_readout(readout, X, forgetting=0.95, fold_every=8)
    batches = list(_feedback(rng, 16, [3, 5, 2, 7, 4, 6, 1], w))
    for X_f, L_f in batches[:4]:
        rls.partial_fit(X_f, L_f)
    np.savez(tmp_path / "rls_state.npz", **rls.state_arrays())
    with np.load(tmp_path / "rls_state.npz") as stored:
        resumed = RLS.from_state_arrays(readout, {key: stored[key] for key in stored.files})
    assert resumed.forgetting == 0.95 and resumed.n_updates_ == 4
    for X_f, L_f in batches[4:]:
        rls.partial_fit(X_f, L_f)
        resumed.partial_fit(X_f, L_f)
    np.testing.assert_allclose(resumed.theta_, rls.theta_, rtol=1e-10)
    np.testing.assert_allclose(resumed.P_, rls.P_, rtol=1e-10, atol=1e-14)


def test_state_of_another_standardization_is_refused():
    _, readout, X, _, _ = _setup(12, 8, 50)
    _, other, X_other, _, _ = _setup(13, 8, 50)
    state = RLS.from_readout(readout, X).state_arrays()
    with pytest.raises(ValueError, match="standardization"):
        RLS.from_state_arrays(other, state)
    with pytest.raises(ValueError, match="shape"):
        RLS.from_state_arrays(_setup(14, 9, 50)[1], state)


def test_corrected_readout_predicts_with_the_new_weights_and_adapts_to_drift():
    rng, readout, X, _, w = _setup(15, 20, 400)
    rls = RLS.from_readout(readout, X)
    drifted = rng.standard_normal(20) * 4.0 / np.sqrt(20)  # the length relation changes in serving
    X_new = _hidden_states(rng, 1200, 20)
    lengths_new = _lengths(rng, X_new, drifted)
    for start in range(0, 800, 8):
        rls.partial_fit(X_new[start:start + 8], lengths_new[start:start + 8])
    corrected = rls.readout()
    Z = readout.standardize(X_new)
    np.testing.assert_allclose(corrected.predict_transformed(X_new), Z @ rls.theta_[1:] + rls.theta_[0],
                               rtol=1e-10)
    assert corrected.metadata == {"layer": 7, "rls_updates": 100}
    assert (corrected.alpha, corrected.target, corrected.max_tokens) == (1.0, "sqrt", MAX_TOKENS)
    np.testing.assert_array_equal(corrected.mean_, readout.mean_)
    held_out = slice(800, None)
    before = np.mean(np.abs(readout.predict(X_new[held_out]) - lengths_new[held_out]))
    after = np.mean(np.abs(corrected.predict(X_new[held_out]) - lengths_new[held_out]))
    assert after < 0.7 * before


def test_bad_feedback_is_refused_without_changing_state():
    rng, readout, X, _, _ = _setup(16, 6, 40)
    rls = RLS.from_readout(readout, X)
    theta, P = rls.theta_.copy(), rls.P_
    U = np.ones((2, 7))
    with pytest.raises(ValueError, match="finite"):
        rls.update(U, [np.nan, 1.0])
    with pytest.raises(ValueError, match="columns"):
        rls.update(np.ones((2, 6)), [1.0, 2.0])
    rls.update(np.empty((0, 7)), [])
    np.testing.assert_array_equal(rls.theta_, theta)
    np.testing.assert_array_equal(rls.P_, P)
    assert rls.n_updates_ == 0


def test_singular_anchor_is_refused():
    _, readout, X, _, _ = _setup(17, 30, 10, alpha=1.0)
    with pytest.raises(np.linalg.LinAlgError, match="alpha"):
        RLS.from_readout(readout, X, alpha=0.0)


def test_bench_rls_prints_its_figures():
    from leap_cli.main import app  # the console command's app, study commands included

    result = CliRunner().invoke(app, ["bench", "rls", "--dim", "64", "--batch", "4", "--repeats", "5",
                                      "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["dim"] == 64 and figures["batch"] == 4
    assert 0 < figures["update_ms_median"] <= figures["update_ms_p95"]
    assert figures["setup_s"] > 0


def test_the_registry_stores_the_state_as_upper_triangles_and_resumes_it_bit_for_bit(tmp_path):
    from registry import rls_file

    rng = np.random.default_rng(5)
    X, L = rng.normal(size=(200, 40)), rng.integers(1, 400, 200)
    readout = LinearReadout(alpha=2.0, max_tokens=512).fit(X, L)
    rls = RLS.from_readout(readout, X)
    rls.partial_fit(rng.normal(size=(8, 40)), rng.integers(1, 400, 8))
    arrays = rls.state_arrays()
    rls_file.save(tmp_path / "packed.npz", arrays)
    np.savez(tmp_path / "full.npz", **arrays)  # as versions registered before were stored
    with np.load(tmp_path / "packed.npz") as stored:
        assert "P" not in stored.files and stored["P_upper"].size == 41 * 42 // 2
    for name in ("packed.npz", "full.npz"):
        loaded = rls_file.load(tmp_path / name)
        assert set(loaded) == set(arrays)
        for key, value in arrays.items():
            np.testing.assert_array_equal(loaded[key], value)
    assert (tmp_path / "packed.npz").stat().st_size < 0.6 * (tmp_path / "full.npz").stat().st_size
