"""The simulator-against-wall-clock study's arithmetic: the steady rate, the capacity interval, the paired
ratios and whether a simulated value lies inside its live interval (the engine run is in
tests/test_eval_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.fidelity import compare, loop_periods, paired_ratio, ratio_pairs, relative_errors, steady_rate


def test_steady_rate_counts_the_middle_half_of_completions():
    # ramp-up and a long drain tail around a steady stretch of one completion every 0.5 s
    finish = np.concatenate([[0.1, 0.2], 10 + 0.5 * np.arange(16), [40.0, 80.0]])
    n = finish.size
    low, high = n // 4, (3 * n) // 4
    expected = (high - low) / (np.sort(finish)[high] - np.sort(finish)[low])
    assert steady_rate(np.random.default_rng(0).permutation(finish)) == pytest.approx(expected)
    assert steady_rate(finish) == pytest.approx(2.0)  # the window lies inside the steady stretch
    with pytest.raises(ValueError, match="steady window"):
        steady_rate(np.ones(8))


def test_paired_ratio_resamples_repeats_then_requests():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.01, 0.1, size=20)
    den = np.concatenate([base, base * 1.1])  # 2 repeats of 20 requests
    num = 0.8 * den
    r = paired_ratio(num, den, repeats=2)
    assert r["value"] == pytest.approx(0.8) and r["ci_low"] == pytest.approx(0.8) and r["ci_high"] == pytest.approx(0.8)
    assert r["per_repeat"] == pytest.approx([0.8, 0.8])
    noisy = num * rng.uniform(0.7, 1.3, size=num.size)
    r = paired_ratio(noisy, den, repeats=2)
    assert r["ci_low"] < r["value"] < r["ci_high"]
    # one slow run per pair of repeats, the same for every request in it: the interval spans the runs'
    # spread, which resampling requests alone (each with all its repeats) would not see
    den = np.tile(base, 6)
    num = den * np.repeat([0.9, 1.1, 0.9, 1.1, 0.9, 1.1], base.size)
    r = paired_ratio(num, den, repeats=6)
    assert r["value"] == pytest.approx(1.0)
    assert r["ci_low"] < 0.97 and r["ci_high"] > 1.03
    assert r["per_repeat"] == pytest.approx([0.9, 1.1] * 3)


def test_compare_marks_a_simulated_ratio_outside_the_live_interval():
    rng = np.random.default_rng(2)
    fcfs = rng.uniform(0.05, 0.1, size=60)
    live = {"fcfs": fcfs, "leap": 0.7 * fcfs * rng.uniform(0.95, 1.05, size=60), "oracle": 0.6 * fcfs,
            "trail_mlp": 0.9 * fcfs}
    pairs = ratio_pairs(("fcfs", "leap", "trail_mlp", "oracle"), "trail_mlp")
    assert set(pairs) == {"leap_over_fcfs", "trail_mlp_over_fcfs", "oracle_over_fcfs", "leap_over_oracle",
                          "leap_over_baseline"}
    close = {"fcfs": fcfs, "leap": 0.7 * fcfs, "oracle": 0.6 * fcfs, "trail_mlp": 0.9 * fcfs}
    far = {**close, "leap": 0.9 * fcfs}
    assert compare(live, close, pairs, repeats=3)["leap_over_fcfs"]["inside"]
    outside = compare(live, far, pairs, repeats=3)
    assert not outside["leap_over_fcfs"]["inside"] and outside["leap_over_fcfs"]["sim"] == pytest.approx(0.9)
    assert outside["oracle_over_fcfs"]["inside"]


def test_relative_errors_are_against_the_wall_clock():
    assert relative_errors([1.1, 0.8], [1.0, 1.0]) == pytest.approx([0.1, 0.2])


def test_loop_periods_run_from_step_start_to_step_start():
    per_step = {"started": np.array([0.0, 0.012, 0.030]), "seconds": np.array([0.010, 0.015, 0.011])}
    assert loop_periods(per_step) == pytest.approx([0.012, 0.018, 0.011])
