"""Predictor and schedule figures."""

import math

import numpy as np
import pytest

from leap_core import metrics


def test_rank_correlations_see_only_order():
    rng = np.random.default_rng(0)
    true = rng.integers(1, 2048, 300).astype(float)
    noisy = true + rng.normal(0, 300, 300)
    for correlation in (metrics.spearman, metrics.kendall):
        assert correlation(true, true) == pytest.approx(1.0)
        assert correlation(true, -true) == pytest.approx(-1.0)
        # A monotone transform of the prediction leaves rank figures unchanged.
        assert correlation(true, np.exp(noisy / 500)) == pytest.approx(correlation(true, noisy))
        assert 0.0 < correlation(true, noisy) < 1.0
        assert math.isnan(correlation(true, np.full(300, 5.0)))
        assert math.isnan(correlation([3.0], [4.0]))
    assert abs(metrics.kendall(true, noisy)) < abs(metrics.spearman(true, noisy))


def test_mae_is_mean_absolute_difference():
    assert metrics.mae([1, 2, 3], [2, 2, 5]) == pytest.approx(1.0)
    assert math.isnan(metrics.mae([], []))
    with pytest.raises(ValueError, match="length"):
        metrics.mae([1, 2], [1])


def test_bucket_edges_scale_with_the_budget():
    assert metrics.bucket_edges(2048) == (256, 1024)
    assert metrics.bucket_edges(1024) == (128, 512)
    assert metrics.bucket_edges(4096) == (512, 2048)


def test_mae_by_bucket_splits_on_the_true_length():
    rng = np.random.default_rng(1)
    true = rng.integers(1, 1024, 500).astype(float)
    pred = true + rng.normal(0, 50, 500)
    buckets = metrics.mae_by_bucket(true, pred, max_tokens=1024)
    low, high = metrics.bucket_edges(1024)
    assert buckets["short"] == pytest.approx(metrics.mae(true[true < low], pred[true < low]))
    middle = (true >= low) & (true < high)
    assert buckets["medium"] == pytest.approx(metrics.mae(true[middle], pred[middle]))
    assert buckets["long"] == pytest.approx(metrics.mae(true[true >= high], pred[true >= high]))
    assert buckets["all"] == pytest.approx(metrics.mae(true, pred))
    only_short = metrics.mae_by_bucket([10, 20], [12, 30], max_tokens=2048)
    assert only_short["short"] == pytest.approx(6.0)
    assert math.isnan(only_short["medium"]) and math.isnan(only_short["long"])


def test_ptl_divides_latency_by_output_tokens():
    ptl = metrics.ptl(arrival=[0.0, 1.0], finish=[2.0, 5.0], output_tokens=[4, 8])
    np.testing.assert_allclose(ptl, [0.5, 0.5])
    with pytest.raises(ValueError, match="output token"):
        metrics.ptl([0.0], [1.0], [0])


def test_summary_percentiles_are_ordered():
    rng = np.random.default_rng(2)
    values = rng.exponential(1.0, 1000)
    figures = metrics.summary(values)
    assert figures["p50"] == pytest.approx(np.median(values))
    assert figures["mean"] == pytest.approx(values.mean())
    assert figures["p50"] < figures["p90"] < figures["p95"] <= values.max()
    assert all(math.isnan(v) for v in metrics.summary([]).values())


def test_throughput_is_tokens_per_second():
    assert metrics.throughput([100, 300], start=10.0, end=14.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="after"):
        metrics.throughput([1], start=5.0, end=5.0)
