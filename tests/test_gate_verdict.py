"""The gate's paired verdict: a ratio with a bootstrap interval over requests, three outcomes, and the rule.

The replays themselves run on a real engine in the demo and `leap gate`; these tests give the verdict
per-request latencies whose answer is known.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.gate_replay import _arm_summary, arm_order, block_count, request_blocks
from leap_core.gate_verdict import BETTER, NO_DIFFERENCE, WORSE, gate_verdict


def _arm(ptl, tokens, repeats: int = 1) -> dict:
    ptl = np.asarray(ptl, dtype=float)
    return {"mean_ptl": float(ptl.mean()), "ptl": ptl.tolist(), "output_tokens": list(tokens), "repeats": repeats}


def _pair(ratio: float, noise: float, n: int = 64, repeats: int = 2, seed: int = 0) -> dict:
    """A champion and a challenger whose per-request PTLs differ by `ratio` times lognormal noise."""
    rng = np.random.default_rng(seed)
    tokens = np.tile(rng.integers(10, 500, n), repeats)
    bar = rng.lognormal(0.0, 0.5, n * repeats)
    challenger = bar * ratio * rng.lognormal(-noise ** 2 / 2, noise, n * repeats)  # noise of mean 1
    return {"fcfs": _arm(bar * 1.5, tokens, repeats), "champion": _arm(bar, tokens, repeats),
            "challenger": _arm(challenger, tokens, repeats)}


def test_a_clearly_faster_challenger_is_better_and_passes_with_its_interval():
    verdict = gate_verdict(_pair(0.8, 0.05))
    assert verdict["outcome"] == BETTER and verdict["passed"]
    assert verdict["ci_low"] <= verdict["mean_ptl_ratio"] <= verdict["ci_high"] < 1.0
    assert verdict["bar"] == "champion" and verdict["n_requests"] == 64 and verdict["repeats"] == 2
    assert verdict["fcfs_mean_ptl_ratio"] < 1.0


def test_a_clearly_slower_challenger_is_worse():
    verdict = gate_verdict(_pair(1.2, 0.05))
    assert verdict["outcome"] == WORSE and not verdict["passed"] and verdict["ci_low"] > 1.0


def test_an_equal_challenger_shows_no_difference_and_the_rule_decides_what_that_does():
    results = _pair(1.0, 0.3)
    kept = gate_verdict(results)
    assert kept["outcome"] == NO_DIFFERENCE and not kept["passed"]
    assert kept["ci_low"] < 1.0 < kept["ci_high"]
    fresher = gate_verdict(results, on_no_difference="noninferior", noninferiority=kept["ci_high"] - 1.0 + 1e-9)
    assert fresher["outcome"] == NO_DIFFERENCE and fresher["passed"]
    strict = gate_verdict(results, on_no_difference="noninferior", noninferiority=kept["ci_high"] - 1.0 - 1e-6)
    assert not strict["passed"]
    with pytest.raises(ValueError, match="on_no_difference"):
        gate_verdict(results, on_no_difference="promote")


def test_a_faster_point_estimate_inside_the_noise_is_not_better():
    """A 3% gain with per-request noise of 30% over 16 requests: the interval spans 1, so no promotion,
    where a point estimate against a 2% margin would have promoted it."""
    verdict = gate_verdict(_pair(0.97, 0.3, n=16, repeats=1, seed=3))
    assert verdict["ci_low"] < 1.0 < verdict["ci_high"]
    assert verdict["outcome"] == NO_DIFFERENCE and not verdict["passed"]


def test_the_interval_resamples_requests_with_all_their_repeats():
    """Two repeats of identical figures are one sample, not two: the interval matches one repeat's."""
    once = _pair(0.95, 0.2, n=32, repeats=1, seed=5)
    twice = {arm: _arm(np.tile(r["ptl"], 2), np.tile(r["output_tokens"], 2), repeats=2) for arm, r in once.items()}
    one, two = gate_verdict(once), gate_verdict(twice)
    assert two["n_requests"] == 32
    assert (two["ci_low"], two["ci_high"]) == pytest.approx((one["ci_low"], one["ci_high"]))


def test_replays_that_do_not_pair_fail_closed():
    results = _pair(0.8, 0.05)
    odd = dict(results, challenger=dict(results["challenger"], repeats=3))
    verdict = gate_verdict(odd)
    assert not verdict["passed"] and verdict["outcome"] is None and "not the same requests" in verdict["reason"]


def test_each_repeat_reverses_the_order_of_the_arms():
    assert [arm_order(("fcfs", "champion", "challenger"), r) for r in range(3)] == [
        ["fcfs", "champion", "challenger"], ["challenger", "champion", "fcfs"], ["fcfs", "champion", "challenger"]]


def test_each_repeat_replays_its_block_and_the_summary_counts_each_request_once_a_cycle():
    requests = [f"r{i}" for i in range(7)]
    assert request_blocks(requests, 2, 2) == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6"]]
    assert request_blocks(requests, 1, 3) == [requests]
    for blocks, repeats in ((2, 3), (0, 2), (8, 8)):
        with pytest.raises(ValueError):
            request_blocks(requests, blocks, repeats)
    # the most blocks that divide the repeats and hold 4 requests each
    assert block_count(2, 2) == 2 and block_count(2, 3) == 1 and block_count(2, 4, 100) == 2
    assert block_count(2, 2, 7) == 1 and block_count(4, 4, 12) == 2

    class Replay:  # one repeat's per-request figures, as harness.replay returns them (no steps)
        def __init__(self, ptl):
            self.per_request = {"ptl": np.asarray(ptl, float), "output_tokens": np.arange(len(ptl)) + 1}
            self.per_step = {"shapes": np.zeros((0, 2)), "seconds": np.zeros(0)}

        def summary(self):
            return {"n": len(self.per_request["ptl"])}

    # 4 repeats over 2 blocks (4 and 3 requests): block 0, block 1, block 0, block 1
    replays = [Replay([1.0] * 4), Replay([2.0] * 3), Replay([3.0] * 4), Replay([4.0] * 3)]
    summary = _arm_summary(replays, clock=None, blocks=2)
    assert summary["repeats"] == 2 and summary["blocks"] == 2 and len(summary["ptl"]) == 14
    # entry i is request i % 7: request 0's two replays are entries 0 and 7
    assert summary["ptl"][0] == 1.0 and summary["ptl"][7] == 3.0 and summary["ptl"][4] == 2.0


def test_two_blocks_of_distinct_requests_make_one_verdict_over_all_of_them():
    results = _pair(0.8, 0.05, n=128, repeats=1)
    verdict = gate_verdict(results)
    assert verdict["n_requests"] == 128 and verdict["repeats"] == 1 and verdict["outcome"] == BETTER


def test_the_settings_refuse_blocks_that_do_not_divide_the_repeats(tmp_path):
    from pydantic import ValidationError

    from flows.settings import PipelineSettings

    assert PipelineSettings(home=tmp_path).gate_blocks == 2
    with pytest.raises(ValidationError, match="gate_blocks"):
        PipelineSettings(home=tmp_path, gate_repeats=3, gate_blocks=2)


def _long_pair(long_factor: float, n: int = 64, repeats: int = 2, spread: float = 0.05, seed: int = 0) -> dict:
    """Equal mean PTL on short requests; the longest quartile slowed by `long_factor` x lognormal noise."""
    rng = np.random.default_rng(seed)
    tokens = np.tile(rng.integers(10, 500, n), repeats)
    bar = rng.lognormal(0.0, 0.3, n * repeats)
    long = tokens >= np.quantile(tokens, 0.75)
    challenger = bar.copy()
    challenger[long] *= long_factor * rng.lognormal(0.0, spread, int(long.sum()))
    return {"champion": _arm(bar, tokens, repeats), "challenger": _arm(challenger, tokens, repeats)}


def test_long_requests_starved_beyond_the_bound_make_the_challenger_worse():
    verdict = gate_verdict(_long_pair(1.6))
    assert verdict["outcome"] == WORSE and not verdict["passed"]
    assert verdict["long_p95_ci_low"] > verdict["p95_bound"]
    assert verdict["long_p95_ci_low"] <= verdict["long_p95_ratio"] <= verdict["long_p95_ci_high"]


def test_one_slow_long_request_is_not_evidence_of_starvation():
    """On 8 long requests the quartile's P95 is nearly its maximum: one request 2x slower puts the point
    estimate above the bound, but its interval spans it, so the guard does not call the challenger worse."""
    results = _long_pair(1.0, n=32, spread=0.0)
    challenger = np.asarray(results["challenger"]["ptl"])
    tokens = np.asarray(results["challenger"]["output_tokens"])
    slowest = int(np.flatnonzero(tokens >= np.quantile(tokens, 0.75))[np.argmax(challenger[tokens >= np.quantile(
        tokens, 0.75)])])
    challenger[slowest] *= 2.0
    results["challenger"] = _arm(challenger, tokens, 2)
    verdict = gate_verdict(results)
    assert verdict["long_p95_ratio"] > verdict["p95_bound"]
    assert verdict["long_p95_ci_low"] <= verdict["p95_bound"] < verdict["long_p95_ci_high"]
    assert verdict["outcome"] == NO_DIFFERENCE
