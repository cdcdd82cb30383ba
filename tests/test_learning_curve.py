"""The learning curve (evaluation.learning_curve) on rows whose signal is known, and its page section."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.learning_curve import curve_figures, curve_sizes, learning_curve, subsamples
from evaluation.learning_curve_report import section_learning_curve
from leap_core.metrics import spearman


def _rows(n: int, dim: int = 40, noise: float = 2.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features whose linear signal sets sqrt(length), plus label noise: more rows estimate it better."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, dim)).astype(np.float32)
    w = rng.normal(size=dim) / np.sqrt(dim)
    root = np.clip(14.0 + 5.0 * (X @ w) + noise * rng.normal(size=n), 1.0, 32.0)
    return X, np.round(root ** 2).astype(np.int64)


def test_sizes_end_at_the_pool_and_draws_are_seeded_subsamples():
    assert curve_sizes(2600, (500, 1000, 4000)) == [500, 1000, 2600]
    assert curve_sizes(1000, (500, 1000)) == [500, 1000]
    draws = subsamples(2600, 500, 3, seed=0)
    assert len(draws) == 3 and all(d.size == 500 and np.unique(d).size == 500 for d in draws)
    assert not np.array_equal(draws[0], draws[1])  # different draws
    assert all(np.array_equal(a, b) for a, b in zip(draws, subsamples(2600, 500, 3, seed=0)))  # same seed, same rows
    whole = subsamples(2600, 2600, 3)
    assert len(whole) == 1 and np.array_equal(whole[0], np.arange(2600))


def test_more_rows_rank_better_and_the_intervals_carry_the_draws():
    X_all, y_all = _rows(3200, seed=1)
    X_pool, y_pool, X_test, y_test = X_all[:2600], y_all[:2600], X_all[2600:], y_all[2600:]
    result = learning_curve(X_pool, y_pool, X_test, y_test, max_tokens=1024, sizes=(60, 250, 1000),
                            draws=3, targets=("sqrt",), n_boot=300, goal=0.99)
    assert result["sizes"] == [60, 250, 1000, 2600] and result["n_test"] == 600
    points = result["targets"]["sqrt"]["points"]
    values = [p["spearman"]["value"] for p in points]
    assert values[0] < values[-1] - 0.05  # 60 rows of 40 features fit the signal worse than 2,600
    for point in points:
        figure = point["spearman"]
        assert figure["ci_low"] <= figure["value"] <= figure["ci_high"]
        assert len(point["alphas"]) == point["draws"]
    assert points[0]["draws"] == 3 and points[-1]["draws"] == 1
    low, high = points[0]["draw_spread"]
    assert low < high  # three draws of 60 rows differ
    slope = result["targets"]["sqrt"]["slope_per_doubling"]
    assert slope["over_rows"] == [1000, 2600]
    assert slope["ci_low"] <= slope["value"] <= slope["ci_high"]


def test_curve_figures_recover_a_known_slope_and_extend_it_to_the_goal():
    """Predictions built so that Spearman rises by a fixed step per doubling: the slope is that step, and a
    straight line reaches the goal where the arithmetic says; a flat curve never reaches it."""
    rng = np.random.default_rng(3)
    n = 4000
    truth = rng.normal(size=n)
    noise = rng.normal(size=n)
    sizes = [1000, 2000, 4000, 8000]
    # correlation r with the truth: pred = r * truth + sqrt(1 - r^2) * noise; ranks follow closely
    targets = {1000: 0.50, 2000: 0.55, 4000: 0.60, 8000: 0.65}
    predictions = {s: (targets[s] * truth + np.sqrt(1 - targets[s] ** 2) * noise)[None, :] for s in sizes}
    figures = curve_figures(truth, predictions, n_boot=200, goal=0.75)
    measured = [spearman(truth, predictions[s][0]) for s in sizes]
    assert [p["spearman"]["value"] for p in figures["points"]] == pytest.approx(measured)
    slope = figures["slope_per_doubling"]
    expected = np.polyfit(np.log2(sizes), measured, 1)[0]
    assert slope["value"] == pytest.approx(expected)
    reach = figures["rows_for_goal"]
    assert reach["value"] == pytest.approx(8000 * 2 ** ((0.75 - measured[-1]) / expected))
    assert reach["ci_low"] <= reach["value"] <= reach["ci_high"]
    flat = curve_figures(truth, {s: predictions[1000] for s in sizes}, n_boot=50, goal=0.75)
    assert flat["slope_per_doubling"]["value"] == pytest.approx(0.0, abs=1e-12)
    assert math.isinf(flat["rows_for_goal"]["value"])


def test_the_section_prints_every_size_and_the_extrapolation_as_one():
    X_all, y_all = _rows(1500, dim=20, seed=4)
    result = learning_curve(X_all[:1100], y_all[:1100], X_all[1100:], y_all[1100:], max_tokens=1024,
                            sizes=(250, 500, 1000), draws=2, n_boot=100, goal=0.95)
    result.update(layer=22, pool="sharegpt:1100", test="held out", goal=0.95, command="leap eval curve --save")
    text = section_learning_curve(result, "results/curve.png")
    for size in ("250", "500", "1,000", "1,100"):
        assert f"| {size} |" in text
    assert "sqrt Spearman" in text and "log Spearman" in text
    assert "an extrapolation from 1,100" in text
    assert "Regenerate: `leap eval curve --save`" in text
    with pytest.raises(ValueError, match="one row per request"):
        learning_curve(X_all[:10], y_all[:9], X_all[10:20], y_all[10:20], max_tokens=1024)


def test_the_command_runs_on_the_committed_snapshot():
    """`leap eval curve --json` on the snapshot's rows (no engine): a small pool, one draw per size."""
    import json

    from typer.testing import CliRunner

    from leap_cli.main import app

    done = CliRunner().invoke(app, ["eval", "curve", "--pool", "1400", "--draws", "1", "--n-boot", "100",
                                    "--no-build", "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["study"] == "curve" and result["layer"] == 22
    assert result["sizes"][-1] == result["n_pool"] > 1300 and result["n_test"] > 950
    for target in ("sqrt", "log"):
        points = result["targets"][target]["points"]
        assert [p["rows"] for p in points] == result["sizes"]
        assert 0.3 < points[-1]["spearman"]["value"] < 0.8  # the readout ranks held-out ShareGPT
        assert "slope_per_doubling" in result["targets"][target]


def test_extrapolated_row_counts_beyond_reason_are_printed_as_such():
    from evaluation.learning_curve_report import _rows

    assert _rows(192_157.4) == "192,157"
    assert _rows(3.5e9) == "more than 10,000,000"
    assert _rows(float("inf")) == "never (slope <= 0)"
