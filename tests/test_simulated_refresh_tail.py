"""The simulator's refresh option and the simulated refresh and tail studies: refresh off changes nothing,
refresh on agrees with a literal step loop, the refresh and tail studies return what they document, and the
load, refresh and tail studies' plots and report sections. The load study itself is in test_simulated_load.py."""

import json
from dataclasses import replace

import numpy as np
import pytest

from evaluation.simulated_load_report import plot_load, section_load
from evaluation.simulated_refresh import life_error, run_refresh
from evaluation.simulated_refresh_report import plot_refresh, section_refresh
from evaluation.simulated_tail import run_tail
from evaluation.simulated_tail_report import plot_tail, section_tail
from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity, poisson_arrivals, simulate
from study_harness.noise import noisy_predictions
from tests.sim_reference import reference_simulate
from tests.test_simulated_load import STEP_MODEL, _pool, load_result  # noqa: F401  (load_result: a fixture)


def _estimates(out, points, noise: float, seed: int = 0):
    """Remaining-length estimates at each refresh point (NaN past the end), log-normal around the truth."""
    rng = np.random.default_rng(seed)
    points = np.asarray(points)
    remaining = out[:, None] - points[None, :]
    fresh = np.maximum(remaining, 1) * np.exp(noise * rng.standard_normal(remaining.shape))
    return np.where(remaining > 0, fresh, np.nan)


def test_refresh_off_is_exactly_the_plain_simulator():
    prompt, out, predicted = _pool()
    arrival = poisson_arrivals(out.size, 1.5 * fcfs_capacity(prompt, out), seed=3)
    plain = simulate(arrival, prompt, out, predicted, SimConfig())
    off = simulate(arrival, prompt, out, predicted, SimConfig(refresh_cost_s=1.0),
                   refreshed=_estimates(out, (16,), 1.0))
    np.testing.assert_array_equal(off.first_token, plain.first_token)
    np.testing.assert_array_equal(off.finish, plain.finish)
    np.testing.assert_array_equal(off.max_held_out, plain.max_held_out)
    assert (off.steps, off.tokens) == (plain.steps, plain.tokens)


@pytest.mark.parametrize("points,noise,cost", [((3, 6, 12), 0.8, 0.01), ((1, 2, 4, 8, 16), 0.3, 0.0),
                                               ((7, 50), 1.5, 0.002)])
def test_refresh_matches_a_literal_step_by_step_loop(points, noise, cost):
    rng = np.random.default_rng(11)
    n = 200
    arrival = np.round(poisson_arrivals(n, rate=8.0, seed=11), 2)  # rounded: some arrive together
    prompt = rng.integers(1, 160, n)
    out = np.minimum(rng.geometric(1 / 25, n), 200)
    predicted = noisy_predictions(out, 0.6, seed=3)
    fresh = _estimates(out, points, noise, seed=4)
    fresh[::7, 0] = np.nan  # a missing estimate keeps the countdown
    config = SimConfig(max_resident=24, decode_slots=6, waiting_cap=5, max_prefill_tokens_per_step=100,
                       step_model=StepTimeModel(base_s=0.02, per_decode_s=0.004, per_prefill_token_s=0.0002,
                                                 per_context_token_s=2e-5, per_prefill_pair_s=1e-7,
                                                 decode_base_s=(0.0, 0.021, 0.03, 0.026, 0.028)),
                       refresh_at=points, refresh_cost_s=cost)
    result = simulate(arrival, prompt, out, predicted, config, refreshed=fresh)
    first, finish, _ = reference_simulate(arrival, prompt, out, predicted, config, refreshed=fresh)
    np.testing.assert_allclose(result.first_token, first, rtol=1e-9)
    np.testing.assert_allclose(result.finish, finish, rtol=1e-9)
    assert result.tokens == out.sum()
    plain = simulate(arrival, prompt, out, predicted, replace(config, refresh_at=()))
    assert not np.allclose(result.finish, plain.finish)  # the refresh did change the schedule


def test_exact_free_refresh_of_the_oracle_changes_nothing():
    prompt, out, _ = _pool()
    arrival = poisson_arrivals(out.size, 1.5 * fcfs_capacity(prompt, out), seed=5)
    oracle = simulate(arrival, prompt, out, out, SimConfig())
    points = (16, 32, 64)
    refreshed = simulate(arrival, prompt, out, out, SimConfig(refresh_at=points),
                         refreshed=_estimates(out, points, 0.0))
    np.testing.assert_allclose(refreshed.finish, oracle.finish, rtol=1e-9)
    assert refreshed.steps == oracle.steps and refreshed.tokens == out.sum()
    with pytest.raises(ValueError, match="refresh_at"):
        simulate(arrival, prompt, out, out, SimConfig(refresh_at=(32, 16)), refreshed=_estimates(out, (32, 16), 0))
    with pytest.raises(ValueError, match="refreshed estimates"):
        simulate(arrival, prompt, out, out, SimConfig(refresh_at=(16,)))


POINTS = (16, 32, 64, 128)


@pytest.fixture(scope="module")
def refresh_results():
    prompt, out, predicted = _pool()
    kwargs = dict(n_requests=400, seeds=4, decode_slots=8)
    good = run_refresh(prompt, out, predicted, _estimates(out, POINTS, 0.2), POINTS, STEP_MODEL, 0.0, **kwargs)
    costly = run_refresh(prompt, out, predicted, _estimates(out, POINTS, 0.2), POINTS, STEP_MODEL, 0.05, **kwargs)
    return good, costly


def test_run_refresh_measures_both_arms_with_intervals(refresh_results):
    good, costly = refresh_results
    json.dumps(good, allow_nan=False)
    assert set(good["table"]) == {"countdown", "refresh", "fcfs", "oracle"}
    ratio = good["ratios"]["refresh_over_countdown"]
    assert ratio["ci_low"] <= ratio["value"] <= ratio["ci_high"]
    # near-exact free refreshes order better than a Spearman-0.6 countdown, and the study says so
    assert ratio["ci_high"] < 1.0 and good["refresh_wins"]
    assert ratio["value"] == pytest.approx(good["table"]["refresh"]["mean_ptl"] / good["table"]["countdown"]["mean_ptl"])
    # countdown is the same run in both (the cost only touches refresh), and a cost raises refresh's latency
    assert costly["table"]["countdown"] == good["table"]["countdown"]
    assert costly["table"]["refresh"]["mean_latency_s"] > good["table"]["refresh"]["mean_latency_s"]
    life = good["life_error"]
    assert [p["generated"] for p in life["per_point"]] == [0, *POINTS]
    first = life["per_point"][0]
    assert first["countdown_mae"] == first["refresh_mae"]  # at g = 0 both hold the prefill prediction
    assert first["n"] == 400 and life["per_point"][-1]["n"] == int(np.sum(_pool()[1] > 128))
    assert life["over_life"]["refresh"]["value"] < life["over_life"]["countdown"]["value"]
    assert life["over_life_difference"]["ci_high"] < 0


def test_life_error_counts_each_request_once_over_the_points_it_reaches():
    out = np.array([10, 40])
    predicted = np.array([20.0, 40.0])
    fresh = np.array([[np.nan, np.nan], [20.0, 5.0]])  # request 0 ends before g = 16
    life = life_error(out, predicted, fresh, np.array([16, 32]))
    assert [p["n"] for p in life["per_point"]] == [2, 1, 1]
    # request 0: |20 - 10| = 10 at g = 0 only; request 1: countdown exact (0, 0, 0), refresh 0, |20-24|, |5-8|
    assert life["over_life"]["countdown"]["value"] == pytest.approx((10 + 0) / 2)
    assert life["over_life"]["refresh"]["value"] == pytest.approx((10 + (0 + 4 + 3) / 3) / 2)


@pytest.fixture(scope="module")
def tail_result():
    prompt, out, predicted = _pool()
    return run_tail(prompt, out, predicted, STEP_MODEL, waiting_caps=(16, 128, 1024), agings=(0.0, 0.01),
                    wait_agings=(0.3, 3.0), n_requests=400, seeds=3, decode_slots=8, max_resident=128)


def test_run_tail_shapes_and_a_small_cap_does_not_hurt_long_requests(tail_result):
    result = tail_result
    json.dumps(result, allow_nan=False)
    keys = {"long_p95_latency_s", "all_p95_latency_s", "mean_ptl"}
    keys |= {f"{k}_ci" for k in keys}
    assert set(result["fcfs"]) == keys
    for row in (result["fcfs"], *result["cap"], *result["aging"], *result["wait_aging"]):
        for name in ("long_p95_latency_s", "all_p95_latency_s", "mean_ptl"):
            low, high = row[f"{name}_ci"]
            assert low <= row[name] <= high
    assert [row["waiting_cap"] for row in result["cap"]] == [16, 128, 1024]
    assert [row["aging"] for row in result["aging"]] == [0.0, 0.01]
    goal = {"long_p95_over_fcfs", "mean_ptl_over_fcfs", "meets_goal"}
    assert all(set(row) == keys | goal | {"waiting_cap"} for row in result["cap"])
    assert all(set(row) == keys | goal | {"aging"} for row in result["aging"])
    assert [row["wait_aging"] for row in result["wait_aging"]] == [0.3, 3.0]
    assert all(set(row) == keys | goal | {"wait_aging"} for row in result["wait_aging"])
    for row in (*result["cap"], *result["aging"], *result["wait_aging"]):  # the ratios are those of the means, paired by seed
        for name, ratio in (("long_p95_latency_s", "long_p95_over_fcfs"), ("mean_ptl", "mean_ptl_over_fcfs")):
            assert row[ratio]["value"] == pytest.approx(row[name] / result["fcfs"][name])
            assert row[ratio]["ci_low"] <= row[ratio]["value"] <= row[ratio]["ci_high"]
        assert row["meets_goal"] == (row["long_p95_over_fcfs"]["value"] <= 1.2
                                     and row["mean_ptl_over_fcfs"]["value"] <= 0.5)
    met = [{"waiting_cap": r["waiting_cap"]} for r in result["cap"] if r["meets_goal"]] + \
        [{"aging": r["aging"]} for r in result["aging"] if r["meets_goal"]] + \
        [{"wait_aging": r["wait_aging"]} for r in result["wait_aging"] if r["meets_goal"]]
    assert result["met_by"] == met
    _, out, _ = _pool()
    assert result["long_threshold_tokens"] == pytest.approx(np.quantile(out, 0.9))
    # aging 0 at cap 128 is the cap-128 run: same workload, same policy
    assert {k: result["aging"][0][k] for k in keys} == {k: result["cap"][1][k] for k in keys}
    by_cap = {row["waiting_cap"]: row for row in result["cap"]}
    assert by_cap[16]["long_p95_latency_s"] <= 1.02 * by_cap[1024]["long_p95_latency_s"]
    # aging by the wait moves long requests ahead: the stronger rate shortens their tail against countdown's
    assert result["wait_aging"][1]["long_p95_latency_s"] < by_cap[128]["long_p95_latency_s"]


def test_plots_write_pngs_and_sections_hold_tables(tmp_path, load_result, refresh_results, tail_result):
    studies = [(plot_load, section_load, load_result), (plot_refresh, section_refresh, refresh_results[0]),
               (plot_tail, section_tail, tail_result)]
    for plot, section, result in studies:
        path = tmp_path / f"{plot.__name__}.png"
        plot(result, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
        text = section({**result, "command": "leap evaluate simulated",
                        "goals": {"beats_fcfs": {"target": "< fcfs", "measured": 0.5, "met": True}}},
                       path.name)
        assert text.startswith("## ")
        assert "|---|" in text and "![" in text and f"]({path.name})" in text
        assert "Regenerate: `leap evaluate simulated`" in text
        assert "beats_fcfs" in text and "met" in text
        assert "Regenerate" not in section(result, path.name)
    tail_text = section_tail(tail_result, "x.png")
    assert "| meets the goal |" in tail_text and "The goal: long-request P95 latency <= 1.2 x FCFS's" in tail_text
    assert "| meets the goal |" not in section_tail({k: v for k, v in tail_result.items() if k != "goal"}, "x.png")
    assert "| 1.5 | oracle |" in section_load(load_result, "x.png")
    load_text = section_load(load_result, "x.png")
    assert "leap_over_best_baseline" in load_text and "chosen on these test seeds" in load_text
    assert "Tail at 0.9 of capacity" in load_text and "| oracle |" in load_text.split("Tail at 0.9")[1]
    assert "| ratio | 0.7 | 0.9 | 1.5 |" in load_text
    new_keys = ("tail", "ratios_by_load", "best_baseline_chosen_on")
    old_result = {k: v for k, v in load_result.items() if k not in new_keys}
    assert "Tail at" not in section_load(old_result, "x.png")  # results saved before these keys still render
    assert "refresh wins" in section_refresh(refresh_results[0], "x.png")
    assert "exp(-aging x held_out)" in section_tail(tail_result, "x.png")
    assert "| wait aging |" in section_tail(tail_result, "x.png")
