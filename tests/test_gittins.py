"""The Gittins index under the predictor's length distribution: the formula against its definition, the
table, the policy's order and waiting cap, and the load study's uncertainty-aware arm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from leap_core.gittins import LengthGivenPrediction, gittins_index
from leap_core.policy import CountdownPolicy, GittinsPolicy, make_policy
from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity, poisson_arrivals, simulate
from study_harness.noise import noisy_predictions


def _by_definition(lengths: np.ndarray, a: int, weights: np.ndarray) -> float:
    """sup over every quantum Delta = 1..max remaining of E[w 1{R <= Delta} | L > a] / E[min(R, Delta) | L > a]."""
    alive = lengths > a
    r, w = lengths[alive] - a, weights[alive]
    return max(np.sum(w * (r <= d)) / np.sum(np.minimum(r, d)) for d in range(1, int(r.max()) + 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sorted_formula_is_the_supremum_over_every_quantum(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, 40).astype(float)
    for a in (0, 5, 60, 150):
        for weights in (np.ones_like(lengths), 1.0 / lengths):
            assert gittins_index(lengths, a, weights) == pytest.approx(_by_definition(lengths, a, weights))
    assert np.isnan(gittins_index(lengths, int(lengths.max())))


def test_a_known_length_is_shortest_weighted_remaining_and_a_gamble_changes_with_age():
    assert gittins_index([100.0], 40) == pytest.approx(1 / 60)
    assert gittins_index([100.0], 40, [1 / 100]) == pytest.approx(1 / 6000)
    # half finish at 10 tokens, half run 1,000: worth a small quantum first, ...
    gamble = np.array([10.0, 1000.0])
    assert gittins_index(gamble, 0) == pytest.approx(1 / 20)  # 1 of 2 done per 2 x 10 tokens invested
    # ... and once it has outlived the short outcome only the long one is left
    assert gittins_index(gamble, 10) == pytest.approx(1 / 990)
    # a request sure to need 100 tokens ranks below the gamble at age 0 (1/100 against 1/20)
    assert gittins_index([100.0], 0) < gittins_index(gamble, 0)


def test_the_table_uses_the_bin_of_the_prediction_then_the_pool_then_the_budget():
    predicted = np.array([10.0] * 50 + [500.0] * 50)
    true = np.array([12.0] * 50 + [480.0] * 50)
    dist = LengthGivenPrediction(n_bins=2, max_tokens=1024, weight="latency").fit(predicted, true)
    assert dist.index_.shape == (2, 1024) and dist.n_ == 100
    assert dist.index([10.0], [0])[0] == pytest.approx(1 / 12)
    assert dist.index([500.0], [100])[0] == pytest.approx(1 / 380)
    # past every sample of the short bin: the pooled samples (the long ones)
    assert dist.index([10.0], [20])[0] == pytest.approx(1 / 460)
    # past every sample: only the budget ends it; generated counts beyond M - 1 read the last column
    assert dist.index([500.0], [700])[0] == pytest.approx(1 / 324)
    assert dist.index([500.0], [5000])[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="weight"):
        LengthGivenPrediction(weight="tokens").fit(predicted, true)
    with pytest.raises(ValueError, match="cannot fill"):
        LengthGivenPrediction(n_bins=10).fit(predicted[:5], true[:5])


def test_with_exact_predictions_the_policy_orders_like_countdown():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 400, 2000).astype(float)
    dist = LengthGivenPrediction(n_bins=400, max_tokens=512, weight="latency").fit(lengths, lengths)
    total = np.array([30.0, 300.0, 120.0, 60.0, 390.0, 200.0])
    generated = np.array([0, 290, 0, 50, 0, 10])
    args = (total, generated, np.zeros(6, dtype=np.int64), np.arange(6.0))
    gittins = GittinsPolicy(dist, k=3).select(*args)
    countdown = CountdownPolicy(k=3).select(*args)
    assert set(gittins.tolist()) == set(countdown.tolist()) == {0, 1, 3}


def test_the_waiting_cap_still_forces_a_held_out_request_in():
    dist = LengthGivenPrediction(n_bins=2, max_tokens=1024).fit([10.0, 10.0, 900.0, 900.0],
                                                                 [10.0, 12.0, 900.0, 1000.0])
    policy = make_policy("gittins", k=1, waiting_cap=4, distribution=dist)
    total = np.array([10.0, 900.0])
    chosen = policy.select(total, np.zeros(2), np.array([0, 4]), np.zeros(2))
    assert chosen.tolist() == [1]  # held out at the cap: forced in ahead of the better index
    assert policy.select(total, np.zeros(2), np.array([0, 0]), np.zeros(2)).tolist() == [0]
    assert policy.select_steps(total, np.zeros(2), np.array([0, 0]), np.zeros(2))[1] == 1
    with pytest.raises(ValueError, match="distribution"):
        make_policy("gittins")


def test_wait_aging_ages_the_index_by_wait_over_predicted_remaining():
    dist = LengthGivenPrediction(n_bins=2, max_tokens=1024).fit([10.0, 10.0, 900.0, 900.0],
                                                                 [10.0, 12.0, 900.0, 1000.0])
    policy = make_policy("gittins", k=1, waiting_cap=10_000, distribution=dist, wait_aging=1.0)
    total, generated, held_out, arrival = np.array([10.0, 900.0]), np.zeros(2), np.zeros(2, dtype=np.int64), np.zeros(2)
    index = dist.index(total, generated)
    for waited_long in (0, 900, 9000):
        waited = np.array([0, waited_long])
        aged = 1.0 / index * np.exp(-waited / np.maximum(total - generated, 1.0))
        assert policy.select(total, generated, held_out, arrival, waited).tolist() == [int(np.argmin(aged))]
    assert policy.select(total, generated, held_out, arrival, np.array([0, 9000])).tolist() == [1]


def test_the_simulator_runs_the_gittins_order_and_it_helps_where_predictions_are_coarse():
    """Predictions that know only whether a request is short or long (two values): countdown cannot order
    within a class, the index can (within a class it serves the requests that have outlived the short
    outcomes last). Same arrivals, same requests; every request finishes under both."""
    rng = np.random.default_rng(5)
    n = 600
    out = np.where(rng.random(n) < 0.5, rng.integers(5, 60, n), rng.integers(200, 800, n))
    predicted = np.where(out < 100, 40.0, 400.0)
    noisy = np.where(rng.random(n) < 0.2, 440.0 - predicted, predicted)  # a fifth in the wrong class
    dist = LengthGivenPrediction(n_bins=2, max_tokens=1024).fit(noisy[:300], out[:300])
    prompt = rng.integers(10, 100, n)
    config = SimConfig(max_resident=256, decode_slots=8, step_model=StepTimeModel())
    arrival = poisson_arrivals(n, 0.9 * fcfs_capacity(prompt, out, config), seed=6)
    countdown = simulate(arrival, prompt, out, noisy, config)
    gittins = simulate(arrival, prompt, out, noisy, SimConfig(**{**config.__dict__, "policy": "gittins",
                                                                 "distribution": dist}))
    assert np.isfinite(gittins.finish).all() and gittins.tokens == countdown.tokens
    assert gittins.ptl.mean() < countdown.ptl.mean()


def _study_pool(seed: int, n: int = 300):
    """(prompt tokens, log-normal true lengths, predictions at Spearman 0.6, their length distribution)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 800, n)
    out = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 1, 1024).astype(int)
    predicted = noisy_predictions(out, 0.6, seed=seed + 1)
    return prompt, out, predicted, LengthGivenPrediction(max_tokens=1024).fit(predicted, out)


def test_the_load_study_reports_the_gittins_arm_beside_countdown():
    from evaluation.simulated_load import run_load
    from evaluation.simulation import Order

    prompt, out, predicted, dist = _study_pool(seed=0)
    gittins = Order("leap", "gittins_over_countdown", overrides={"distribution": dist})
    guard = Order("leap", "guard_over_countdown", policy="countdown", overrides={"wait_aging": 1.0})
    result = run_load(prompt, out, {"leap": predicted}, StepTimeModel(), loads=(0.9,), headline=0.9, overloads=(),
                      n_requests=200, seeds=4, orders={"leap-gittins": gittins, "leap-guard": guard},
                      decode_slots=8, max_resident=128)
    json.dumps(result, allow_nan=False)
    assert set(result["table"]["0.9"]) == {"leap", "leap-adaptive", "leap-gittins", "leap-guard", "fcfs", "oracle",
                                           "stock"}
    # the tail goal beside each policy: long-request P95 and mean PTL over FCFS's, paired by seed
    for name, goal in result["tail_goal"].items():
        assert goal["long_p95_over_fcfs"] == result["long_p95_over_fcfs"][name]
        assert goal["mean_ptl_over_fcfs"]["value"] == pytest.approx(
            result["table"]["0.9"][name]["mean_ptl"] / result["table"]["0.9"]["fcfs"]["mean_ptl"])
        assert goal["meets_goal"] == (goal["long_p95_over_fcfs"]["value"] <= 1.2
                                      and goal["mean_ptl_over_fcfs"]["value"] <= 0.5)
    assert result["ratios"]["guard_over_countdown"]["value"] != 1.0  # the wait aging moved the order
    ratio = result["ratios"]["gittins_over_countdown"]
    assert ratio["ci_low"] <= ratio["value"] <= ratio["ci_high"]
    head = result["table"]["0.9"]
    assert ratio["value"] == pytest.approx(head["leap-gittins"]["mean_ptl"] / head["leap"]["mean_ptl"])
    assert set(result["long_p95_over_fcfs"]) == {"leap", "leap-adaptive", "leap-gittins", "leap-guard", "oracle",
                                                 "stock"}
    assert result["ratios"]["leap_gittins_over_oracle"]["value"] == pytest.approx(
        head["leap-gittins"]["mean_ptl"] / head["oracle"]["mean_ptl"])
    with pytest.raises(ValueError, match="order 'fcfs'"):
        run_load(prompt, out, {"leap": predicted}, StepTimeModel(), n_requests=20, seeds=1, orders={"fcfs": gittins})
    with pytest.raises(ValueError, match="order 'x'"):
        run_load(prompt, out, {"leap": predicted}, StepTimeModel(), n_requests=20, seeds=1,
                 orders={"x": Order("absent", "r")})


def test_the_tail_guard_takes_the_cheapest_knob_that_meets_the_goal_on_its_validation_pool():
    from evaluation.simulated_load import choose_tail_guard
    from evaluation.simulation import TAIL_GOAL, TAIL_MEAN_GOAL, Order

    prompt, out, predicted, dist = _study_pool(seed=7)
    guard = choose_tail_guard(prompt, out, predicted, StepTimeModel(),
                              Order("leap", "r", overrides={"distribution": dist}), caps=(2, 1024),
                              wait_agings=(0.0, 1.0), n_requests=200, seeds=3, decode_slots=8, max_resident=128)
    json.dumps(guard, allow_nan=False)
    assert [(row["waiting_cap"], row["wait_aging"]) for row in guard["table"]] == [(2, 0.0), (2, 1.0), (1024, 0.0),
                                                                                    (1024, 1.0)]
    assert guard["goal"] == {"long_p95_over_fcfs": TAIL_GOAL, "mean_ptl_over_fcfs": TAIL_MEAN_GOAL}
    long = {(row["waiting_cap"], row["wait_aging"]): row["long_p95_over_fcfs"]["value"] for row in guard["table"]}
    mean = {(row["waiting_cap"], row["wait_aging"]): row["mean_ptl_over_fcfs"]["value"] for row in guard["table"]}
    meeting = [knob for knob in long if long[knob] <= TAIL_GOAL and mean[knob] <= TAIL_MEAN_GOAL]
    keeping = [knob for knob in long if mean[knob] <= TAIL_MEAN_GOAL]
    expected = (min(meeting, key=mean.get) if meeting else min(keeping, key=long.get) if keeping
                else min(mean, key=mean.get))
    assert guard["met_on_validation"] == bool(meeting)
    assert (guard["waiting_cap"], guard["wait_aging"]) == expected
    # a cap of 2 steps all but restores arrival order for the long requests; no cap and no aging lets them wait,
    # and aging by the wait shortens that
    by_knob = {(row["waiting_cap"], row["wait_aging"]): row for row in guard["table"]}
    assert by_knob[(2, 0.0)]["long_p95_latency_s"] < by_knob[(1024, 0.0)]["long_p95_latency_s"]
    assert by_knob[(1024, 1.0)]["long_p95_latency_s"] < by_knob[(1024, 0.0)]["long_p95_latency_s"]
