"""The simulated scheduling studies and the simulator's refresh option: refresh off changes nothing, refresh
on agrees with a literal step loop, and the load, refresh and tail studies return what they document."""

import json
from dataclasses import replace

import numpy as np
import pytest

from evaluation.simulated import (plot_load, plot_refresh, plot_tail, refresh_sigma, run_load, run_refresh,
                                  run_tail, section_load, section_refresh, section_tail)
from leap_core.metrics import spearman
from leap_core.noise import noisy_predictions
from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity, poisson_arrivals, simulate
from tests.sim_reference import reference_simulate

STEP_MODEL = StepTimeModel()


def _pool(n: int = 400, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 800, n)
    out = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 1, 2000).astype(int)
    return prompt, out, noisy_predictions(out, 0.6, seed=seed + 1)


def test_refresh_off_is_exactly_the_plain_simulator():
    prompt, out, predicted = _pool()
    arrival = poisson_arrivals(out.size, 1.5 * fcfs_capacity(prompt, out), seed=3)
    plain = simulate(arrival, prompt, out, predicted, SimConfig())
    off = simulate(arrival, prompt, out, predicted,
                   SimConfig(refresh_every=0, refresh_cost_s=1.0, refresh_sigma=2.0, refresh_seed=9))
    np.testing.assert_array_equal(off.first_token, plain.first_token)
    np.testing.assert_array_equal(off.finish, plain.finish)
    np.testing.assert_array_equal(off.max_held_out, plain.max_held_out)
    assert (off.steps, off.tokens) == (plain.steps, plain.tokens)


@pytest.mark.parametrize("every,sigma,cost", [(3, 0.8, 0.01), (1, 0.3, 0.0), (7, 1.5, 0.002)])
def test_refresh_matches_a_literal_step_by_step_loop(every, sigma, cost):
    rng = np.random.default_rng(11)
    n = 200
    arrival = np.round(poisson_arrivals(n, rate=8.0, seed=11), 2)  # rounded: some arrive together
    prompt = rng.integers(1, 160, n)
    out = np.minimum(rng.geometric(1 / 25, n), 200)
    predicted = noisy_predictions(out, 0.6, seed=3)
    config = SimConfig(max_resident=24, decode_slots=6, waiting_cap=5, max_prefill_tokens_per_step=100,
                       step_model=StepTimeModel(base_s=0.02, per_decode_s=0.004, per_prefill_token_s=0.0002),
                       refresh_every=every, refresh_cost_s=cost, refresh_sigma=sigma, refresh_seed=4)
    result = simulate(arrival, prompt, out, predicted, config)
    first, finish, _ = reference_simulate(arrival, prompt, out, predicted, config)
    np.testing.assert_allclose(result.first_token, first, rtol=1e-9)
    np.testing.assert_allclose(result.finish, finish, rtol=1e-9)
    assert result.tokens == out.sum()
    plain = simulate(arrival, prompt, out, predicted, replace(config, refresh_every=0))
    assert not np.allclose(result.finish, plain.finish)  # the refresh did change the schedule


def test_exact_free_refresh_of_the_oracle_changes_nothing():
    prompt, out, _ = _pool()
    arrival = poisson_arrivals(out.size, 1.5 * fcfs_capacity(prompt, out), seed=5)
    oracle = simulate(arrival, prompt, out, out, SimConfig())
    refreshed = simulate(arrival, prompt, out, out, SimConfig(refresh_every=16, refresh_sigma=0.0))
    np.testing.assert_allclose(refreshed.finish, oracle.finish, rtol=1e-9)
    assert refreshed.steps == oracle.steps and refreshed.tokens == out.sum()
    with pytest.raises(ValueError, match="refresh"):
        simulate(arrival, prompt, out, out, SimConfig(refresh_every=-1))


def test_refresh_sigma_reproduces_the_predictor_spearman():
    _, out, _ = _pool(n=3000, seed=2)
    sigma = refresh_sigma(out, 0.6, seed=0)
    fresh = out * np.exp(sigma * np.random.default_rng(99).standard_normal(out.size))  # independent draw
    assert spearman(out, fresh) == pytest.approx(0.6, abs=0.02)
    assert refresh_sigma(out, 0.8) < sigma < refresh_sigma(out, 0.4)
    assert refresh_sigma(out, 1.0) == 0.0
    with pytest.raises(ValueError, match="target_spearman"):
        refresh_sigma(out, -0.1)


@pytest.fixture(scope="module")
def load_result():
    prompt, out, predicted = _pool()
    return run_load(prompt, out, {"noisy": predicted, "leap": np.sqrt(predicted * out)}, STEP_MODEL,
                    loads=(0.7, 0.9), headline=0.9, overloads=(1.5,), n_requests=400, seeds=6)


def test_run_load_returns_the_documented_shape_and_oracle_beats_fcfs(load_result):
    result = load_result
    json.dumps(result, allow_nan=False)
    assert result["capacity_rps"] > 0 and result["n_requests"] == 400 and result["seeds"] == 6
    assert list(result["table"]) == ["0.7", "0.9", "1.5"]
    assert result["overloads"] == [{"load": 1.5, "horizon_requests": 400,
                                    "horizon_s": pytest.approx(400 / (1.5 * result["capacity_rps"]))}]
    for row in result["table"].values():
        assert set(row) == {"noisy", "leap", "fcfs", "oracle"}
        for figures in row.values():
            assert set(figures) == {"mean_latency_s", "p95_latency_s", "mean_ptl", "p95_ptl", "mean_ptl_ci_low",
                                    "mean_ptl_ci_high"}
            assert figures["mean_ptl_ci_low"] <= figures["mean_ptl"] <= figures["mean_ptl_ci_high"]
    assert result["table"]["1.5"]["oracle"]["mean_ptl"] <= result["table"]["1.5"]["fcfs"]["mean_ptl"]
    sweep = result["sweep"]
    assert sweep["multipliers"] == [0.7, 0.9, 1.5]
    for key in ("mean_ptl", "mean_latency_s"):
        assert all(len(values) == 3 for values in sweep[key].values())
        assert sweep[key]["fcfs"][0] < sweep[key]["fcfs"][-1]  # more load, more latency
    # the ratios are paired by seed: the value is the ratio of the seed means, inside its interval
    assert result["best_baseline"] == "noisy"
    for key in ("leap_over_fcfs", "leap_over_best_baseline", "leap_over_oracle"):
        r = result["ratios"][key]
        assert r["ci_low"] <= r["value"] <= r["ci_high"]
    head = result["table"]["0.9"]
    assert result["ratios"]["leap_over_fcfs"]["value"] == pytest.approx(head["leap"]["mean_ptl"]
                                                                        / head["fcfs"]["mean_ptl"])
    assert result["ratios"]["leap_over_oracle"]["value"] >= 1.0 - 1e-9  # nothing orders better than the truth
    assert set(result["goals"]) == {"leap_over_fcfs", "leap_over_best_baseline", "leap_over_oracle"}


def test_sustained_capacity_excludes_the_drain_tail():
    """Steady-state throughput is above what one pool released at once reaches over its whole makespan."""
    from leap_core.simulator import SimConfig, simulate

    prompt, out, _ = _pool()
    config = SimConfig(step_model=STEP_MODEL, decode_slots=16, max_resident=64, policy="fcfs")
    sustained = fcfs_capacity(prompt, out, config)
    makespan = simulate(np.zeros(out.size), prompt, out, out, config).finish.max()
    assert sustained > out.size / makespan
    # at 0.9 of it every request finishes
    short = simulate(poisson_arrivals(out.size, 0.9 * sustained, seed=1), prompt, out, out, config)
    assert np.isfinite(short.latency).all()


def test_studies_reject_clashing_names_and_missing_costs():
    prompt, out, predicted = _pool(n=50)
    with pytest.raises(ValueError, match="oracle"):
        run_load(prompt, out, {"oracle": predicted}, STEP_MODEL, n_requests=10, seeds=1)
    with pytest.raises(ValueError, match="refresh cost"):
        run_refresh(prompt, out, {"noisy": predicted}, STEP_MODEL, {}, n_requests=10, repeats=1)
    with pytest.raises(ValueError, match="policy"):
        run_load(prompt, out, {"noisy": predicted}, STEP_MODEL, n_requests=10, seeds=1, policy="fcfs")


@pytest.fixture(scope="module")
def refresh_results():
    prompt, out, predicted = _pool()
    kwargs = dict(refresh_every=(0, 16), n_requests=400, repeats=1)
    free = run_refresh(prompt, out, {"noisy": predicted}, STEP_MODEL, {"noisy": 0.0}, **kwargs)
    costly = run_refresh(prompt, out, {"noisy": predicted}, STEP_MODEL, {"noisy": 0.05}, **kwargs)
    return free, costly


def test_run_refresh_off_equals_countdown_and_cost_raises_latency(refresh_results):
    free, costly = refresh_results
    json.dumps(free, allow_nan=False)
    rows = {(row["mode"], row["refresh_every"]): row for row in free["rows"]}
    assert set(rows) == {("countdown", 0), ("refresh", 0), ("refresh", 16)}
    for key in ("mean_latency_s", "p95_latency_s", "mean_ptl", "mae_at_admission", "mae_mean_over_life"):
        assert rows[("refresh", 0)][key] == rows[("countdown", 0)][key]
    assert free["change_vs_countdown"]["noisy"]["0"] == 0.0
    # a fresh estimate of a shrinking remainder is closer to the truth than the counted-down prefill one
    assert rows[("refresh", 16)]["mae_mean_over_life"] < rows[("countdown", 0)]["mae_mean_over_life"]
    assert rows[("countdown", 0)]["mae_mean_over_life"] <= rows[("countdown", 0)]["mae_at_admission"]
    costly_rows = {(row["mode"], row["refresh_every"]): row for row in costly["rows"]}
    assert costly_rows[("refresh", 16)]["mean_latency_s"] > rows[("refresh", 16)]["mean_latency_s"]
    assert costly["change_vs_countdown"]["noisy"]["16"] > free["change_vs_countdown"]["noisy"]["16"]
    assert costly_rows[("countdown", 0)] == {**rows[("countdown", 0)], "cost_s_per_refresh": 0.0}
    assert free["predictors"]["noisy"]["refresh_sigma"] > 0
    assert set(free["reference"]) == {"fcfs", "oracle"}


@pytest.fixture(scope="module")
def tail_result():
    prompt, out, predicted = _pool()
    return run_tail(prompt, out, predicted, STEP_MODEL, waiting_caps=(16, 128, 1024), agings=(0.0, 0.01),
                    n_requests=400, repeats=1)


def test_run_tail_shapes_and_a_small_cap_does_not_hurt_long_requests(tail_result):
    result = tail_result
    json.dumps(result, allow_nan=False)
    keys = {"long_p95_latency_s", "all_p95_latency_s", "mean_ptl"}
    assert set(result["fcfs"]) == keys
    assert [row["waiting_cap"] for row in result["cap"]] == [16, 128, 1024]
    assert [row["aging"] for row in result["aging"]] == [0.0, 0.01]
    assert all(set(row) == keys | {"waiting_cap"} for row in result["cap"])
    assert all(set(row) == keys | {"aging"} for row in result["aging"])
    _, out, _ = _pool()
    assert result["long_threshold_tokens"] == pytest.approx(np.quantile(out, 0.9))
    # aging 0 at cap 128 is the cap-128 run: same workload, same policy
    assert {k: result["aging"][0][k] for k in keys} == {k: result["cap"][1][k] for k in keys}
    by_cap = {row["waiting_cap"]: row for row in result["cap"]}
    assert by_cap[16]["long_p95_latency_s"] <= 1.02 * by_cap[1024]["long_p95_latency_s"]


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
    assert "| 1.5 | oracle |" in section_load(load_result, "x.png")
    assert "leap_over_best_baseline" in section_load(load_result, "x.png")
    assert "exp(sigma z)" in section_refresh(refresh_results[0], "x.png")
    assert "exp(-aging x held_out)" in section_tail(tail_result, "x.png")
