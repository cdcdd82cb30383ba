"""Adaptive decode slots (`leap_core.decode_slots`): the rule's choice on flat and rising step-time curves,
checked against hand-computed values, its bounds; the step-time estimator's fit; the demand estimate."""

import math

import numpy as np
import pytest

from leap_core.decode_slots import DecodeSlotRule, DemandRate, StepTimeEstimator

FIXED, PER_REQUEST = 0.018, 0.0075  # a decode step on two CPU cores as vLLM's own stats measure it


def test_a_flat_curve_decodes_every_candidate():
    """Holding requests out cannot shorten a step whose cost does not grow with them: all decode, up to K."""
    rule = DecodeSlotRule(max_slots=64, min_slots=4, margin=0.25)
    for demand in (0.0, 10.0, 1e4):
        assert rule.slots(0.03, 0.0, demand, candidates=50) == 50
        assert rule.slots(0.03, 0.0, demand, candidates=200) == 64
    # nearly flat: decoding all 50 costs under 5% more than decoding the few that keep up
    assert rule.slots(0.03, 1e-6, 1.0, candidates=50) == 50


def test_a_rising_curve_takes_the_fewest_slots_that_stay_ahead_of_the_demand():
    """k / (0.018 + 0.0075 k) >= 1.25 x 80 = 100 tokens/s: k >= 0.018 x 100 / (1 - 0.0075 x 100) = 7.2, so 8."""
    rule = DecodeSlotRule(max_slots=64, min_slots=4, margin=0.25)
    k = rule.slots(FIXED, PER_REQUEST, 80.0, candidates=64)
    assert k == 8
    assert k / (FIXED + PER_REQUEST * k) >= 1.25 * 80.0 > (k - 1) / (FIXED + PER_REQUEST * (k - 1))
    # no margin: k >= 0.018 x 80 / (1 - 0.6) = 3.6, but never fewer than min_slots
    assert DecodeSlotRule(max_slots=64, min_slots=2, margin=0.0).slots(FIXED, PER_REQUEST, 80.0, 64) == 4
    assert DecodeSlotRule(max_slots=64, min_slots=6, margin=0.0).slots(FIXED, PER_REQUEST, 80.0, 64) == 6
    # more demand, more slots
    assert rule.slots(FIXED, PER_REQUEST, 100.0, 64) > k


def test_every_candidate_decodes_when_no_number_of_slots_keeps_up():
    """The curve serves at most 1 / 0.0075 = 133 tokens/s: a demand of 110 with 25% margin (137.5) is out of
    reach, so the engine serves as fast as it can (every candidate, at most max_slots)."""
    rule = DecodeSlotRule(max_slots=64, min_slots=4, margin=0.25)
    assert rule.slots(FIXED, PER_REQUEST, 110.0, candidates=40) == 40
    assert rule.slots(FIXED, PER_REQUEST, 110.0, candidates=300) == 64
    # a reachable demand needing more slots than there are candidates: all of them
    assert rule.slots(FIXED, PER_REQUEST, 104.0, candidates=30) == 30


def test_the_bounds_and_the_demand():
    rule = DecodeSlotRule(max_slots=16, min_slots=4, margin=0.25, drain_s=60.0)
    assert rule.slots(FIXED, PER_REQUEST, 0.0, candidates=100) == 4  # no demand: min_slots
    assert rule.slots(FIXED, PER_REQUEST, 0.0, candidates=3) == 3  # fewer candidates than min_slots: all
    # 1.25 x 100 = 125 tokens/s takes k >= 0.018 x 125 / (1 - 0.0075 x 125) = 36: capped at max_slots
    assert DecodeSlotRule(max_slots=64, margin=0.25).slots(FIXED, PER_REQUEST, 100.0, 100) == 36
    assert rule.slots(FIXED, PER_REQUEST, 100.0, candidates=100) == 16
    assert rule.demand(50.0, 600.0) == pytest.approx(60.0)  # arriving plus the backlog over drain_s
    assert rule.demand(-1.0, -5.0) == 0.0
    for bad in (dict(min_slots=0), dict(min_slots=65), dict(margin=-0.1), dict(drain_s=0.0)):
        with pytest.raises(ValueError):
            DecodeSlotRule(**bad)


def test_the_step_time_estimator_recovers_known_coefficients():
    """Synthetic steps priced by known costs, with 1% noise: the weighted fit finds them."""
    rng = np.random.default_rng(0)
    truth = np.array([0.018, 0.0075, 1e-4, 2e-6])
    estimator = StepTimeEstimator(min_steps=64)
    assert not estimator.fitted and np.all(estimator.coefficients() == 0)
    for _ in range(3000):
        decodes = int(rng.integers(1, 65))
        prefill = int(rng.integers(0, 600)) if rng.random() < 0.3 else 0
        context = decodes * int(rng.integers(100, 800))
        seconds = float(truth @ [1, decodes, prefill, context]) * (1 + 0.01 * rng.standard_normal())
        estimator.observe(decodes, prefill, context, seconds)
    estimator.observe(0, 0, 0, 1.0)  # a step that did nothing, and one without a time, are skipped
    estimator.observe(3, 0, 0, float("nan"))
    assert estimator.steps_ == 3000 and estimator.fitted
    np.testing.assert_allclose(estimator.coefficients(), truth, rtol=0.03)
    fixed, per_request = estimator.decode_step(400.0)
    assert fixed == pytest.approx(0.018, rel=0.03) and per_request == pytest.approx(0.0075 + 400 * 2e-6, rel=0.03)


def test_the_step_time_estimator_keeps_every_coefficient_non_negative():
    """Steps that an unconstrained fit would price at a negative cost per prefill token: that cost is 0 and
    the others stay >= 0 and still explain the decode steps."""
    rng = np.random.default_rng(1)
    estimator = StepTimeEstimator(min_steps=16)
    for _ in range(500):
        decodes, prefill = int(rng.integers(1, 65)), int(rng.integers(0, 600))
        estimator.observe(decodes, prefill, 300 * decodes, 0.05 + 0.002 * decodes - 1e-5 * prefill + 0.01)
    coefficients = estimator.coefficients()
    assert np.all(coefficients >= 0) and coefficients[2] == 0.0
    fixed, per_request = estimator.decode_step(300.0)
    assert fixed + 32 * per_request == pytest.approx(0.06 + 0.002 * 32, rel=0.1)


def test_the_demand_rate_converges_to_the_arriving_tokens_a_second():
    """L = 100 tokens arriving every 0.5 s for 20 time constants: the estimate brackets L / dt = 200."""
    rate = DemandRate(tau_s=30.0)
    assert rate.rate(0.0) == 0.0
    for k in range(1200):
        rate.add(0.5 * k, 100.0)
    just_after, just_before = rate.rate(599.5), rate.rate(599.999)
    assert just_before < 200.0 < just_after
    assert just_after == pytest.approx(200.0, rel=0.01) and just_before == pytest.approx(200.0, rel=0.01)
    assert rate.rate(599.5 + 30.0) == pytest.approx(just_after / math.e)  # no arrivals: it decays with tau
    with pytest.raises(ValueError):
        DemandRate(tau_s=0.0)
