"""The readout, its target transforms and its file format."""

import io

import numpy as np
import pytest
from sklearn.base import BaseEstimator

from leap_core import targets
from leap_core.readout import LinearReadout, Standardizer
from leap_core.readout_format import ReadoutFormatError, ReadoutMismatchError, from_bytes, to_bytes

MAX_TOKENS = 1024


def _hidden_states(rng, n, d):
    """Features whose columns differ wildly in mean and scale, as hidden-state dimensions do."""
    return rng.standard_normal((n, d)) * rng.uniform(0.05, 20.0, d) + rng.uniform(-50, 50, d)


def _lengths_from(rng, X, max_tokens=MAX_TOKENS, noise=1.0):
    """Lengths whose sqrt is linear in the standardized features, plus noise, within [1, M]."""
    Z = (X - X.mean(0)) / X.std(0)
    w = rng.standard_normal(X.shape[1])
    root = 14.0 + 4.0 * Z @ w / np.sqrt(X.shape[1]) + noise * rng.standard_normal(X.shape[0])
    return np.clip(np.round(root ** 2), 1, max_tokens)


def _anchored_solve(X, lengths, alpha, target):
    """theta of (U^T U + alpha D) theta = U^T y with U = [1, Z] and an unpenalized intercept."""
    Z = Standardizer().fit(X).transform(X)
    U = np.column_stack([np.ones(len(Z)), Z])
    D = np.eye(U.shape[1])
    D[0, 0] = 0.0
    y = targets.transform(lengths, target, targets.fit_map(target, lengths, MAX_TOKENS))
    return np.linalg.solve(U.T @ U + alpha * D, U.T @ y)


# ------------------------------------------------------------------ targets


@pytest.mark.parametrize("target", targets.TARGETS)
def test_transform_inverse_round_trip_and_bounds(target):
    lengths = np.arange(1, MAX_TOKENS + 1, dtype=float)
    trained = np.round(np.exp(np.random.default_rng(0).uniform(1.0, 6.0, 300)))  # a fitted target's training lengths
    target_map = targets.fit_map(target, trained, MAX_TOKENS)
    assert (target_map is None) == (target not in targets.FITTED_TARGETS)
    values = targets.transform(lengths, target, target_map)
    np.testing.assert_allclose(targets.inverse(values, target, target_map), lengths, rtol=1e-9)
    assert np.all(np.diff(values) > 0), "the transform must keep the order of lengths"
    lo, hi = targets.bounds(target, MAX_TOKENS, target_map)
    assert lo == pytest.approx(values[0]) and hi == pytest.approx(values[-1])
    clipped = targets.to_lengths([lo - 5.0, hi + 5.0, values[99]], target, MAX_TOKENS, target_map)
    np.testing.assert_allclose(clipped, [1.0, MAX_TOKENS, 100.0], rtol=1e-9)


def test_unknown_target_is_refused():
    with pytest.raises(ValueError, match="unknown target"):
        targets.transform([1, 2], "cube")
    with pytest.raises(ValueError, match="unknown target"):
        LinearReadout(target="cube").fit(np.ones((3, 2)), [1, 2, 3])


# ------------------------------------------------------------------ readout


@pytest.mark.parametrize("target", targets.TARGETS)
@pytest.mark.parametrize(("n", "d", "alpha"), [(200, 12, 1.0), (40, 90, 3.0), (300, 25, 0.0)])
def test_ridge_fit_equals_anchored_normal_equations(target, n, d, alpha):
    rng = np.random.default_rng(n + d)
    X = _hidden_states(rng, n, d)
    lengths = _lengths_from(rng, X)
    readout = LinearReadout(alpha=alpha, target=target, max_tokens=MAX_TOKENS).fit(X, lengths)
    expected = _anchored_solve(X, lengths, alpha, target)
    np.testing.assert_allclose(readout.theta_, expected, rtol=1e-8, atol=1e-8 * np.abs(expected).max())
    assert readout.theta_[0] == readout.intercept_
    assert readout.dim_ == d and readout.n_params_ == d + 1


def test_predict_is_clipped_inverse_of_the_linear_score():
    rng = np.random.default_rng(1)
    X = _hidden_states(rng, 150, 20)
    readout = LinearReadout(alpha=2.0, target="sqrt", max_tokens=MAX_TOKENS).fit(X, _lengths_from(rng, X))
    X_new = _hidden_states(rng, 60, 20) * 3.0  # far out of distribution: some predictions clip
    Z = (X_new - readout.mean_) / readout.scale_
    score = Z @ readout.coef_ + readout.intercept_
    np.testing.assert_allclose(readout.predict_transformed(X_new), score, rtol=1e-10, atol=1e-10)
    expected = np.clip(score, 1.0, np.sqrt(MAX_TOKENS)) ** 2
    predicted = readout.predict(X_new)
    np.testing.assert_allclose(predicted, expected, rtol=1e-10)
    assert predicted.dtype == np.float64
    assert predicted.min() >= 1.0 and predicted.max() <= MAX_TOKENS
    huge = readout.predict(np.vstack([readout.mean_ + 1e6 * np.sign(readout.coef_ / readout.scale_),
                                      readout.mean_ - 1e6 * np.sign(readout.coef_ / readout.scale_)]))
    np.testing.assert_array_equal(huge, [MAX_TOKENS, 1.0])


def test_float32_features_predict_like_float64():
    rng = np.random.default_rng(2)
    X = _hidden_states(rng, 200, 64)
    readout = LinearReadout(max_tokens=MAX_TOKENS).fit(X, _lengths_from(rng, X))
    X_new = _hidden_states(rng, 30, 64)
    p64 = readout.predict(X_new)
    p32 = readout.predict(X_new.astype(np.float32))
    assert p32.dtype == np.float64
    np.testing.assert_allclose(p32, p64, rtol=1e-4)
    np.testing.assert_allclose(readout.predict(X_new[0]), p64[:1])  # one vector is one row


def test_constant_column_gets_unit_scale_and_no_weight():
    rng = np.random.default_rng(3)
    X = _hidden_states(rng, 80, 6)
    lengths = _lengths_from(rng, X)
    X[:, 2] = 7.5
    readout = LinearReadout().fit(X, lengths)
    assert readout.scale_[2] == 1.0 and readout.mean_[2] == 7.5
    assert readout.coef_[2] == pytest.approx(0.0, abs=1e-12)
    assert np.isfinite(readout.predict(X)).all()


def test_readout_ranks_held_out_requests():
    rng = np.random.default_rng(4)
    X = _hidden_states(rng, 2000, 32)
    lengths = _lengths_from(rng, X, noise=0.5)
    readout = LinearReadout(alpha=1.0, max_tokens=MAX_TOKENS).fit(X[:1500], lengths[:1500])
    from scipy.stats import spearmanr

    assert spearmanr(readout.predict(X[1500:]), lengths[1500:]).statistic > 0.9


def test_from_weights_reproduces_a_fitted_readout_without_sklearn_state():
    rng = np.random.default_rng(5)
    X = _hidden_states(rng, 100, 10)
    fitted = LinearReadout(alpha=0.5, target="log", max_tokens=512).fit(X, _lengths_from(rng, X, 512))
    rebuilt = LinearReadout.from_weights(fitted.mean_, fitted.scale_, fitted.coef_, fitted.intercept_,
                                         alpha=0.5, target="log", max_tokens=512,
                                         metadata={"layer": 3})
    np.testing.assert_array_equal(rebuilt.predict(X), fitted.predict(X))
    np.testing.assert_array_equal(rebuilt.theta_, fitted.theta_)
    assert rebuilt.metadata == {"layer": 3}
    # Prediction uses plain arrays: no fitted scikit-learn estimator is kept on the readout.
    assert not any(isinstance(value, BaseEstimator) for value in vars(fitted).values())


def test_wrong_feature_dim_is_refused():
    rng = np.random.default_rng(6)
    X = _hidden_states(rng, 50, 8)
    readout = LinearReadout().fit(X, _lengths_from(rng, X))
    with pytest.raises(ValueError, match="dim 9"):
        readout.predict(np.ones((2, 9)))


# ------------------------------------------------------------------ file format

_IDENTITY = {"model_id": "tiny-lm", "model_fingerprint": "sha256:abc", "layer": 21, "version": "v3",
             "created_at": "2025-01-01T00:00:00Z"}


def _fitted(rng, d=16, target="sqrt"):
    X = _hidden_states(rng, 120, d)
    readout = LinearReadout(alpha=1.5, target=target, max_tokens=MAX_TOKENS, metadata=dict(_IDENTITY))
    return readout.fit(X, _lengths_from(rng, X)), X


def _rewrite(data, drop=(), **changes):
    """A copy of a readout file with some arrays (or metadata entries) replaced or dropped."""
    import json

    with np.load(io.BytesIO(data)) as stored:
        arrays = {key: stored[key] for key in stored.files}
    metadata = json.loads(arrays["metadata"].tobytes())
    metadata.update(changes.pop("metadata", {}))
    for key in drop:
        metadata.pop(key)
    arrays["metadata"] = np.frombuffer(json.dumps(metadata).encode(), dtype=np.uint8)
    arrays.update(changes)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize("target", targets.TARGETS)
def test_file_round_trip_through_disk(tmp_path, target):
    rng = np.random.default_rng(7)
    readout, X = _fitted(rng, target=target)
    path = tmp_path / "readout.leap"
    path.write_bytes(to_bytes(readout))
    loaded = from_bytes(path.read_bytes(), expect={"model_fingerprint": "sha256:abc", "layer": 21,
                                                   "dim": 16, "target": target, "max_tokens": MAX_TOKENS})
    np.testing.assert_array_equal(loaded.predict(X), readout.predict(X))
    np.testing.assert_array_equal(loaded.theta_, readout.theta_)
    assert (loaded.alpha, loaded.target, loaded.max_tokens) == (1.5, target, MAX_TOKENS)
    for key, value in _IDENTITY.items():
        assert loaded.metadata[key] == value
    assert loaded.metadata["n_train"] == 120
    assert to_bytes(loaded) == to_bytes(from_bytes(to_bytes(loaded)))


@pytest.mark.parametrize(("key", "expected"), [("layer", 20), ("model_fingerprint", "sha256:other"),
                                               ("dim", 4096), ("target", "log"), ("max_tokens", 2048)])
def test_mismatch_names_key_file_value_and_expected(key, expected):
    rng = np.random.default_rng(8)
    data = to_bytes(_fitted(rng)[0])
    with pytest.raises(ReadoutMismatchError) as error:
        from_bytes(data, expect={key: expected})
    written = {**_IDENTITY, "dim": 16, "target": "sqrt", "max_tokens": MAX_TOKENS}
    found = written[key]
    message = str(error.value)
    assert key in message and repr(found) in message and repr(expected) in message
    assert isinstance(error.value, ValueError)


def test_expecting_an_unrecorded_key_is_a_mismatch():
    rng = np.random.default_rng(9)
    with pytest.raises(ReadoutMismatchError, match="tokenizer"):
        from_bytes(to_bytes(_fitted(rng)[0]), expect={"tokenizer": "bpe"})


@pytest.mark.parametrize("data", [b"", b"not a readout at all", b"PK\x03\x04truncated zip"])
def test_malformed_bytes_raise_format_error(data):
    with pytest.raises(ReadoutFormatError, match="readout"):
        from_bytes(data)


def test_plain_npy_array_is_not_a_readout():
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(4))
    with pytest.raises(ReadoutFormatError, match="npz"):
        from_bytes(buffer.getvalue())


def test_invalid_contents_raise_format_error():
    rng = np.random.default_rng(10)
    data = to_bytes(_fitted(rng)[0])
    bad_coef = np.zeros(16)
    bad_coef[3] = np.nan
    cases = {
        "non-finite": _rewrite(data, coef=bad_coef),
        "shape": _rewrite(data, mean=np.zeros(15)),
        "unknown": _rewrite(data, metadata={"target": "cube"}),
        "format_version": _rewrite(data, metadata={"format_version": 99}),
        "scale": _rewrite(data, scale=np.zeros(16)),
        "lacks": _rewrite(data, drop=("dim",)),
    }
    for fragment, broken in cases.items():
        with pytest.raises(ReadoutFormatError, match=fragment):
            from_bytes(broken)


# ------------------------------------------------------------------ the length distribution block


def _with_distribution(rng, max_tokens=MAX_TOKENS):
    """A fitted readout carrying the distribution of true length given its predictions."""
    from leap_core.gittins import LengthGivenPrediction

    readout, X = _fitted(rng)
    lengths = _lengths_from(rng, X)
    readout.length_distribution_ = LengthGivenPrediction(n_bins=4, max_tokens=max_tokens).fit(readout.predict(X),
                                                                                                lengths)
    return readout, X


def test_the_length_distribution_travels_with_the_readout_and_old_files_load_without_it():
    rng = np.random.default_rng(11)
    readout, X = _with_distribution(rng)
    data = to_bytes(readout)
    loaded = from_bytes(data).length_distribution_
    sent = readout.length_distribution_
    assert (loaded.n_bins, loaded.max_tokens, loaded.weight, loaded.n_) == (4, MAX_TOKENS, "ptl", 120)
    np.testing.assert_array_equal(loaded.edges_, sent.edges_)
    for stored, fitted in zip(loaded.samples_, sent.samples_, strict=True):
        np.testing.assert_array_equal(stored, fitted)
    np.testing.assert_allclose(loaded.index_, sent.index_, rtol=1e-12)
    assert "length_distribution" not in from_bytes(data).metadata
    with np.load(io.BytesIO(data)) as stored:
        assert stored["length_samples"].dtype == np.int16  # two bytes a training row
    assert to_bytes(from_bytes(data)) == data
    # a file written without the block (every file before it existed) loads with none
    plain = to_bytes(_fitted(np.random.default_rng(11))[0])
    assert from_bytes(plain).length_distribution_ is None
    assert not {"length_edges", "length_samples", "length_bin_sizes"} & set(np.load(io.BytesIO(plain)).files)


def test_readouts_corrected_by_rls_keep_their_anchors_distribution():
    from leap_core.rls import RLS

    rng = np.random.default_rng(12)
    readout, X = _with_distribution(rng)
    corrected = RLS.from_readout(readout, X).partial_fit(X[:10], _lengths_from(rng, X[:10])).readout()
    assert corrected.length_distribution_ is readout.length_distribution_


def _drop_arrays(data, *names):
    with np.load(io.BytesIO(data)) as stored:
        arrays = {key: stored[key] for key in stored.files if key not in names}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_a_corrupt_length_distribution_is_a_format_error():
    rng = np.random.default_rng(13)
    data = to_bytes(_with_distribution(rng)[0])
    with np.load(io.BytesIO(data)) as stored:
        edges, lengths, sizes = stored["length_edges"], stored["length_samples"], stored["length_bin_sizes"]
    settings = {"n_bins": 4, "max_tokens": MAX_TOKENS, "weight": "ptl"}
    unsorted = lengths.copy()
    unsorted[: sizes[0]] = unsorted[: sizes[0]][::-1]
    cases = {
        "incomplete": _drop_arrays(data, "length_samples"),
        "missing \\['length_distribution'\\]": _rewrite(data, drop=("length_distribution",)),
        "strictly increasing": _rewrite(data, length_edges=edges[::-1]),
        "finite": _rewrite(data, length_edges=np.where(np.arange(edges.size) == 0, np.nan, edges)),
        "outside \\[1, 1024\\]": _rewrite(data, length_samples=np.where(np.arange(lengths.size) == 0, 0,
                                                                           lengths).astype(np.int16)),
        "not sorted": _rewrite(data, length_samples=unsorted),
        "do not count": _rewrite(data, length_bin_sizes=sizes + 1),
        "integer array": _rewrite(data, length_samples=lengths.astype(np.float64)),
        "expected": _rewrite(data, length_bin_sizes=np.array([lengths.size])),
        "weight": _rewrite(data, metadata={"length_distribution": {**settings, "weight": "tokens"}}),
        "n_bins must be": _rewrite(data, metadata={"length_distribution": {**settings, "n_bins": "4"}}),
        "not the readout's": _rewrite(data, metadata={"length_distribution": {**settings, "max_tokens": 2048}}),
        "an object of": _rewrite(data, metadata={"length_distribution": [4, 1024]}),
        "beyond": _rewrite(data, metadata={"max_tokens": 1 << 22, "length_distribution": {
            **settings, "max_tokens": 1 << 22}}),
    }
    for fragment, broken in cases.items():
        with pytest.raises(ReadoutFormatError, match=fragment):
            from_bytes(broken)
    assert from_bytes(data).length_distribution_ is not None  # the untouched file still loads


# ------------------------------------------------------------------ fit with its RLS anchor


@pytest.mark.parametrize("target", ["sqrt", "log"])
def test_fit_with_anchor_is_the_fit_then_the_anchor(target):
    """fit_readout_with_anchor = LinearReadout(...).fit then RLS.from_readout on the same rows, array for array."""
    from leap_core.rls import RLS, fit_readout_with_anchor

    rng = np.random.default_rng(11)
    X = _hidden_states(rng, 300, 24).astype(np.float32)
    lengths = _lengths_from(rng, X)
    metadata = {"model_id": "m", "layer": 3}
    readout, rls = fit_readout_with_anchor(X, lengths, alpha=7.0, max_tokens=MAX_TOKENS, target=target,
                                           metadata=metadata, forgetting=0.99)
    before = LinearReadout(alpha=7.0, target=target, max_tokens=MAX_TOKENS, metadata=dict(metadata)).fit(X, lengths)
    anchor = RLS.from_readout(before, X, forgetting=0.99)
    assert (readout.alpha, readout.target, readout.max_tokens, readout.metadata) == (7.0, target, MAX_TOKENS, metadata)
    np.testing.assert_array_equal(readout.theta_, before.theta_)
    mine, theirs = rls.state_arrays(), anchor.state_arrays()
    assert set(mine) == set(theirs)
    for key in mine:
        np.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)
    np.testing.assert_allclose(readout.theta_, _anchored_solve(X, lengths, 7.0, target), rtol=1e-6, atol=1e-8)
    # the anchor resumes from the ridge problem the readout solved: one feedback batch moves both alike
    X_new, y_new = X[:8] + 1.0, lengths[:8]
    np.testing.assert_allclose(rls.partial_fit(X_new, y_new).theta_, anchor.partial_fit(X_new, y_new).theta_)
