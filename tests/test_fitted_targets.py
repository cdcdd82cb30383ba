"""Fitted targets (rank, softbin): their maps, the soft-bin head they equal, their readout files, and RLS in
their space."""

import io
import json

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.linear_model import Ridge

from evaluation.target_heads import SoftBinClassifier
from leap_core import targets
from leap_core.readout import LinearReadout
from leap_core.readout_format import ReadoutFormatError, from_bytes, to_bytes
from leap_core.rls import RLS

MAX_TOKENS = 1024


def _data(seed, n=500, d=12):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)) * rng.uniform(0.5, 3.0, d) + rng.uniform(-2, 2, d)
    drive = X[:, :3] @ np.array([0.8, -0.5, 0.3]) / X[:, :3].std(0).mean()
    lengths = np.clip(np.round(np.exp(4.0 + drive + 0.6 * rng.standard_normal(n))), 1, MAX_TOKENS)
    return X, lengths


def test_the_rank_map_gives_tied_lengths_one_mid_rank_normal_score():
    lengths = np.r_[np.full(50, 10.0), np.arange(11, 61, dtype=float), np.full(100, float(MAX_TOKENS))]
    target_map = targets.fit_map("rank", lengths, MAX_TOKENS)
    scores = targets.transform(lengths, "rank", target_map)
    assert np.unique(scores[:50]).size == 1 and np.unique(scores[-100:]).size == 1  # ties share a score
    # 200 lengths: the 50 tied at 10 sit at mid-rank 25 of 200 (share 0.125), the 100 at M at 100 + 50 (0.75)
    np.testing.assert_allclose(scores[[0, -1]], [norm.ppf(0.125), norm.ppf(0.75)], rtol=1e-12)
    assert np.all(np.diff(targets.transform(np.arange(1, MAX_TOKENS + 1), "rank", target_map)) > 0)
    assert target_map.log_lengths[0] == 0.0 and target_map.max_tokens == MAX_TOKENS


def test_a_rank_map_over_many_distinct_lengths_keeps_at_most_max_knots():
    lengths = np.arange(1, 20001, dtype=float)
    target_map = targets.fit_map("rank", lengths, 32768)
    assert target_map.log_lengths.size <= targets.MAX_KNOTS
    scores = targets.transform(lengths, "rank", target_map)
    assert abs(np.median(scores)) < 0.01 and np.all(np.diff(scores) > 0)


def test_the_softbin_target_is_the_soft_bin_heads_linear_score():
    """Ridge is linear in its targets and each row's soft labels sum to 1, so the unclipped head's expected center
    is one ridge on the expected center of the labels: the softbin readout's score, up to the map's 257-knot
    table. The head decodes exp(score), the target the map's inverse: both rank the requests alike."""
    X, lengths = _data(1)
    head = SoftBinClassifier(alpha=30.0, max_tokens=MAX_TOKENS, clip=False).fit(X[:400], lengths[:400])
    readout = LinearReadout(alpha=30.0, target="softbin", max_tokens=MAX_TOKENS).fit(X[:400], lengths[:400])
    np.testing.assert_allclose(head.predict_proba(X[400:]).sum(axis=1), 1.0, rtol=1e-9)
    expected_center = head.predict_proba(X[400:]) @ head.centers_
    np.testing.assert_allclose(readout.predict_transformed(X[400:]), expected_center, atol=2e-3)
    np.testing.assert_array_equal(np.argsort(readout.predict(X[400:])), np.argsort(head.predict(X[400:])))
    clipped = SoftBinClassifier(alpha=30.0, max_tokens=MAX_TOKENS).fit(X[:400], lengths[:400]).predict(X[400:])
    assert np.abs(np.log(clipped) - expected_center).max() > 0.05, "the clip is what makes the published head non-linear"


@pytest.mark.parametrize("target", targets.FITTED_TARGETS)
def test_rls_on_a_fitted_target_is_one_ridge_solve_in_the_anchors_space(target):
    """Feedback goes through the anchor's map (never refitted), so RLS equals the ridge solve on training plus
    feedback rows with the same map and standardization."""
    X, lengths = _data(2)
    readout = LinearReadout(alpha=10.0, target=target, max_tokens=MAX_TOKENS).fit(X[:300], lengths[:300])
    rls = RLS.from_readout(readout, X[:300])
    for rows in np.array_split(np.arange(300, 500), 4):
        rls.partial_fit(X[rows], lengths[rows])
    ridge = Ridge(alpha=10.0).fit(readout.standardize(X), targets.transform(lengths, target, readout.target_map_))
    np.testing.assert_allclose(rls.theta_, np.r_[ridge.intercept_, ridge.coef_], rtol=1e-7, atol=1e-9)
    corrected = rls.readout()
    assert corrected.target_map_ == readout.target_map_
    np.testing.assert_allclose(corrected.predict(X), targets.to_lengths(
        ridge.predict(readout.standardize(X)), target, MAX_TOKENS, readout.target_map_), rtol=1e-7)


def _rewrite(data, drop=(), **arrays_in):
    with np.load(io.BytesIO(data)) as stored:
        arrays = {key: stored[key] for key in stored.files if key not in drop}
    arrays.update(arrays_in)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_a_readout_file_carries_its_map_and_hostile_maps_are_refused():
    X, lengths = _data(3)
    readout = LinearReadout(alpha=3.0, target="rank", max_tokens=MAX_TOKENS).fit(X, lengths)
    data = to_bytes(readout)
    loaded = from_bytes(data)
    assert loaded.target_map_ == readout.target_map_
    np.testing.assert_array_equal(loaded.predict(X), readout.predict(X))
    knots, values = readout.target_map_.log_lengths, readout.target_map_.values
    hostile = {
        "needs": _rewrite(data, drop=("target_knots",)),
        "strictly increasing": _rewrite(data, target_values=values[::-1].copy()),
        "finite": _rewrite(data, target_values=np.where(np.arange(values.size) == 3, np.nan, values)),
        "max_tokens": _rewrite(data, target_knots=knots * 0.9),
        "1-D float": _rewrite(data, target_knots=knots.astype(np.int64)),
        "knots": _rewrite(data, target_knots=np.linspace(0, knots[-1], targets.MAX_KNOTS + 1),
                          target_values=np.linspace(-3, 3, targets.MAX_KNOTS + 1)),
    }
    for reason, bad in hostile.items():
        with pytest.raises(ReadoutFormatError, match=reason):
            from_bytes(bad)
    fixed = to_bytes(LinearReadout(alpha=3.0, target="log", max_tokens=MAX_TOKENS).fit(X, lengths))
    with pytest.raises(ReadoutFormatError, match="fixed but the file carries"):
        from_bytes(_rewrite(fixed, target_knots=knots, target_values=values))
    with np.load(io.BytesIO(data)) as stored:
        assert json.loads(stored["metadata"].tobytes())["target"] == "rank"


def test_weights_without_their_map_or_with_another_budgets_are_refused():
    X, lengths = _data(4)
    readout = LinearReadout(alpha=3.0, target="softbin", max_tokens=MAX_TOKENS).fit(X, lengths)
    weights = dict(mean=readout.mean_, scale=readout.scale_, coef=readout.coef_, intercept=readout.intercept_)
    with pytest.raises(ValueError, match="takes a target map"):
        LinearReadout.from_weights(**weights, target="softbin", max_tokens=MAX_TOKENS)
    with pytest.raises(ValueError, match="takes no target map"):
        LinearReadout.from_weights(**weights, target="sqrt", max_tokens=MAX_TOKENS, target_map=readout.target_map_)
    with pytest.raises(ValueError, match="up to 1024 tokens"):
        LinearReadout.from_weights(**weights, target="softbin", max_tokens=2048, target_map=readout.target_map_)
    with pytest.raises(ValueError, match="pass its TargetMap"):
        targets.transform([1, 2], "rank")


@pytest.mark.parametrize("target", targets.FITTED_TARGETS)
@pytest.mark.parametrize("lengths", [[7.0] * 8, [MAX_TOKENS] * 8, [1.0] * 8, [5.0] * 7 + [6.0]],
                         ids=["one-length", "all-at-M", "all-at-1", "two-lengths"])
def test_a_fitted_target_on_nearly_equal_lengths_still_maps_every_length(target, lengths):
    """A fold of a small window may see one or two distinct lengths: the map still covers [1, M], increasing."""
    target_map = targets.fit_map(target, lengths, MAX_TOKENS)
    values = targets.transform(np.arange(1, MAX_TOKENS + 1), target, target_map)
    assert np.all(np.diff(values) > 0) and target_map.max_tokens == MAX_TOKENS
    X = np.random.default_rng(0).standard_normal((8, 3))
    predicted = LinearReadout(alpha=1.0, target=target, max_tokens=MAX_TOKENS).fit(X, lengths).predict(X)
    assert ((predicted >= 1) & (predicted <= MAX_TOKENS)).all()
