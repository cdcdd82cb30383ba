"""Bootstrap intervals, censoring and per-set figures, on synthetic samples with a known truth."""

import math

import numpy as np
import pytest
from scipy import stats

from leap_core import intervals, metrics
from study_harness.noise import noisy_predictions


def _population_sample(n: int, rho: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A bivariate normal pair of correlation rho; its population Spearman is 6/pi * asin(rho / 2)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    y = rho * x + math.sqrt(1 - rho ** 2) * rng.standard_normal(n)
    return x, y


RHO = 0.6
TRUE_SPEARMAN = 6 / math.pi * math.asin(RHO / 2)  # 0.5824...


def test_spearman_batch_is_scipy_row_by_row_ties_included():
    rng = np.random.default_rng(0)
    true = rng.integers(1, 20, size=(5, 60)).astype(float)  # many ties
    pred = true + rng.normal(0, 4, size=(5, 60))
    expected = [stats.spearmanr(t, p).statistic for t, p in zip(true, pred)]
    np.testing.assert_allclose(metrics.spearman_batch(true, pred), expected, rtol=1e-12)
    assert np.isnan(metrics.spearman_batch(np.ones((1, 5)), np.arange(5.0)[None]))[0]
    np.testing.assert_allclose(metrics.mae_batch(true, pred), np.abs(true - pred).mean(axis=1))


def test_bootstrap_interval_covers_the_population_spearman():
    """Over 20 independent samples of 300 rows, the 95% interval holds the population value nearly always."""
    covered = 0
    for seed in range(20):
        x, y = _population_sample(300, RHO, seed)
        figure = intervals.bootstrap_ci(metrics.spearman_batch, x, y, n_boot=500, seed=seed, vectorized=True)
        assert figure["value"] == pytest.approx(metrics.spearman(x, y))
        assert figure["ci_low"] < figure["value"] < figure["ci_high"]
        covered += figure["ci_low"] <= TRUE_SPEARMAN <= figure["ci_high"]
    assert covered >= 17  # 95% nominal: 19 expected; fewer than 17 of 20 has probability < 2%


def test_bootstrap_interval_narrows_like_one_over_root_n():
    widths = {}
    for n in (100, 1600):
        x, y = _population_sample(n, RHO, seed=n)
        figure = intervals.bootstrap_ci(metrics.spearman_batch, x, y, n_boot=1000, vectorized=True)
        widths[n] = figure["ci_high"] - figure["ci_low"]
    assert 2.5 < widths[100] / widths[1600] < 6.0  # sqrt(16) = 4


def test_vectorised_and_plain_statistics_draw_the_same_replicates():
    x, y = _population_sample(150, RHO, seed=3)
    fast = intervals.bootstrap_ci(metrics.spearman_batch, x, y, n_boot=300, seed=5, vectorized=True)
    slow = intervals.bootstrap_ci(metrics.spearman, x, y, n_boot=300, seed=5)
    assert fast == pytest.approx(slow, rel=1e-12)
    other_seed = intervals.bootstrap_ci(metrics.spearman, x, y, n_boot=300, seed=6)
    assert other_seed["value"] == slow["value"] and other_seed["ci_low"] != slow["ci_low"]


def test_bootstrap_refuses_bad_arguments_and_handles_degenerate_data():
    with pytest.raises(ValueError, match="differ in length"):
        intervals.bootstrap_ci(metrics.mae, [1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="level"):
        intervals.bootstrap_ci(metrics.mae, [1, 2], [1, 2], level=1.0)
    constant = intervals.bootstrap_ci(metrics.spearman_batch, np.ones(20), np.arange(20.0), vectorized=True)
    assert math.isnan(constant["value"]) and math.isnan(constant["ci_low"]) and math.isnan(constant["ci_high"])


def test_stratified_resampling_keeps_every_row_in_its_stratum():
    strata = np.repeat(["a", "b", "c"], [5, 30, 65])
    seen = []

    def statistic(labels: np.ndarray) -> np.ndarray:
        seen.append(labels)
        return np.zeros(labels.shape[:-1])

    intervals.bootstrap_ci(statistic, strata, n_boot=50, strata=strata, vectorized=True)
    replicates = seen[-1]
    assert replicates.shape == (50, 100)
    assert (replicates == strata[None, :]).all()  # column j always holds a row of row j's stratum


def test_hierarchical_bootstrap_draws_groups_then_rows_with_known_answers():
    """Two groups constant within: a replicate's mean is 0, 1/2 or 1 with chances 1/4, 1/2, 1/4, so the 95%
    interval is [0, 1], where resampling the pooled rows alone would give about 0.5 +- 0.22."""
    two = np.repeat([[0.0], [1.0]], 10, axis=1)
    nested = intervals.hierarchical_bootstrap_ci(intervals.mean_last_axis, two, n_boot=4000)
    assert nested == {"value": 0.5, "ci_low": 0.0, "ci_high": 1.0}
    pooled = intervals.bootstrap_ci(intervals.mean_last_axis, two.reshape(-1), n_boot=4000, vectorized=True)
    assert 0.25 < pooled["ci_low"] < 0.4 and 0.6 < pooled["ci_high"] < 0.75
    # groups that agree add nothing: one value, a point interval
    assert intervals.hierarchical_bootstrap_ci(intervals.mean_last_axis, np.full((3, 4), 2.0)) == {
        "value": 2.0, "ci_low": 2.0, "ci_high": 2.0}


def test_hierarchical_bootstrap_variance_is_between_groups_plus_within_over_rows():
    """The replicate mean's variance is (Var of the group means + mean within-group variance / rows) / groups
    (population variances of the sample at hand): the interval's half-width is 1.96 of its root."""
    rng = np.random.default_rng(0)
    groups, rows = 6, 40
    values = rng.normal(0.0, 1.0, (groups, 1)) + rng.normal(0.0, 2.0, (groups, rows))
    expected = np.sqrt((values.mean(axis=1).var() + values.var(axis=1).mean() / rows) / groups)
    figure = intervals.hierarchical_bootstrap_ci(intervals.mean_last_axis, values, n_boot=20000, seed=1)
    assert figure["value"] == pytest.approx(values.mean())
    assert (figure["ci_high"] - figure["ci_low"]) / 2 == pytest.approx(1.96 * expected, rel=0.06)


def test_hierarchical_bootstrap_of_identical_groups_is_the_pooled_bootstrap_and_of_one_group_the_plain_one():
    rng = np.random.default_rng(2)
    a, b = rng.lognormal(0.0, 0.5, 30), rng.lognormal(0.3, 0.5, 30)
    copies = intervals.hierarchical_bootstrap_ci(intervals.ratio_of_means, np.tile(a, (5, 1)), np.tile(b, (5, 1)),
                                               n_boot=20000)
    pooled = intervals.bootstrap_ci(intervals.ratio_of_means, np.tile(a, 5), np.tile(b, 5), n_boot=20000,
                                  vectorized=True)
    assert copies["value"] == pytest.approx(pooled["value"])
    for end in ("ci_low", "ci_high"):
        assert copies[end] == pytest.approx(pooled[end], rel=0.01)
    one = intervals.hierarchical_bootstrap_ci(intervals.ratio_of_means, a[None], b[None], n_boot=500, seed=3)
    assert one == intervals.bootstrap_ci(intervals.ratio_of_means, a, b, n_boot=500, seed=3, vectorized=True)
    with pytest.raises(ValueError, match="one shape"):
        intervals.hierarchical_bootstrap_ci(intervals.ratio_of_means, np.ones((2, 3)), np.ones((2, 4)))


# ------------------------------------------------------------------ censoring


def test_censored_rows_tie_at_the_budget_above_every_uncensored_row():
    M = 100
    true = np.array([10, 40, 70, 100, 100, 55])
    finish_length = np.array([False, False, False, True, True, True])  # the last stopped early by another limit
    values, mask = metrics.censor(true, M, finish_length)
    np.testing.assert_array_equal(values, [10, 40, 70, 100, 100, 100])
    np.testing.assert_array_equal(mask, finish_length)
    # a prediction ranking the censored rows in any order among themselves scores the same
    pred_a = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    pred_b = np.array([1.0, 2.0, 3.0, 6.0, 4.0, 5.0])
    assert metrics.censored_spearman(true, pred_a, M, finish_length) == pytest.approx(
        metrics.censored_spearman(true, pred_b, M, finish_length))
    assert metrics.censored_spearman(true, pred_a, M, finish_length) == pytest.approx(
        stats.spearmanr([10, 40, 70, 100, 100, 100], pred_a).statistic)
    # without the finish reason, only lengths >= M count as censored
    assert metrics.censored_share(true, M) == pytest.approx(2 / 6)
    assert metrics.censored_share(true, M, finish_length) == pytest.approx(3 / 6)
    # MAE leaves out the censored rows, whose error is unknown
    pred = np.array([20.0, 40.0, 60.0, 1.0, 1.0, 1.0])
    assert metrics.uncensored_mae(true, pred, M, finish_length) == pytest.approx((10 + 0 + 10) / 3)
    assert math.isnan(metrics.uncensored_mae([100, 120], [1, 2], M))


def test_per_set_metrics_pooled_versus_within_set():
    """Two sets whose lengths differ: a predictor that only tells the sets apart scores high pooled, ~0 within."""
    rng = np.random.default_rng(0)
    n = 400
    sets = np.repeat(["short", "long"], n // 2)
    true = np.where(sets == "short", rng.integers(10, 100, n), rng.integers(300, 1024, n)).astype(float)
    pred = np.where(sets == "short", 50.0, 600.0) + rng.normal(0, 1, n)  # the set, nothing more
    figures = metrics.per_set_metrics(sets, true, pred, None, max_tokens=1024, n_boot=500)
    assert figures["pooled"]["n"] == n and set(figures["per_set"]) == {"short", "long"}
    assert figures["pooled"]["spearman"]["value"] > 0.7  # ~0.76: the set split alone
    within = figures["within_set_spearman"]
    assert within["ci_low"] < 0.0 < within["ci_high"] and abs(within["value"]) < 0.15
    assert within["sets"] == ["long", "short"]
    long_set = figures["per_set"]["long"]
    assert long_set["censored_share"] == pytest.approx(np.mean(true[sets == "long"] >= 1024))
    expected_mae = metrics.uncensored_mae(true[sets == "long"], pred[sets == "long"], 1024)
    assert long_set["mae"]["value"] == pytest.approx(expected_mae)
    assert long_set["mae"]["ci_low"] < expected_mae < long_set["mae"]["ci_high"]
    # n-weighted mean of the per-set values
    per_set = [figures["per_set"][s]["spearman"]["value"] for s in ("long", "short")]
    assert within["value"] == pytest.approx(np.mean(per_set))
    pooled_only = metrics.per_set_metrics(None, true, pred, None, max_tokens=1024, n_boot=100)
    assert pooled_only["per_set"] == {} and pooled_only["within_set_spearman"] is None


def test_gap_closed_is_zero_at_the_base_and_one_at_the_ceiling():
    rng = np.random.default_rng(1)
    true = rng.integers(1, 1024, 300).astype(float)
    base = noisy_predictions(true, 0.4, seed=1)
    ceiling = noisy_predictions(true, 0.9, seed=2)
    middle = noisy_predictions(true, 0.65, seed=3)
    assert metrics.gap_closed(true, base, base, ceiling, 1024, n_boot=200)["value"] == pytest.approx(0.0)
    assert metrics.gap_closed(true, base, ceiling, ceiling, 1024, n_boot=200)["value"] == pytest.approx(1.0)
    figure = metrics.gap_closed(true, base, middle, ceiling, 1024, n_boot=500)
    s = [metrics.spearman(true, p) for p in (base, middle, ceiling)]
    assert figure["value"] == pytest.approx((s[1] - s[0]) / (s[2] - s[0]))
    assert figure["ci_low"] < figure["value"] < figure["ci_high"] and figure["spearman"] == "pooled"


def test_noise_targets_the_metrics_spearman():
    true = np.random.default_rng(4).integers(1, 2048, 2000).astype(float)
    pred = noisy_predictions(true, 0.7, seed=0)
    assert metrics.spearman(true, pred) == pytest.approx(0.7, abs=0.002)



def test_mean_over_runs_is_a_t_interval():
    values = [4.0, 5.0, 6.0]
    half = stats.t.ppf(0.975, 2) * 1.0 / np.sqrt(3)
    assert intervals.mean_over_runs(values) == pytest.approx({"value": 5.0, "ci_low": 5.0 - half, "ci_high": 5.0 + half})
    assert np.isnan(intervals.mean_over_runs([3.0])["ci_low"])


def test_wilson_interval_is_scipys():
    expected = stats.binomtest(17, 40).proportion_ci(confidence_level=0.95, method="wilson")
    assert intervals.wilson_interval(17, 40) == {"value": 17 / 40, "ci_low": expected.low, "ci_high": expected.high}
    assert np.isnan(intervals.wilson_interval(0, 0)["value"])
