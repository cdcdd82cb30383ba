"""The step-loop simulator: agreement with a literal one-step-at-a-time loop, conservation, policy order,
capacity, the step-time fit, and the `leap simulate` command on the real trace."""

import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from leap_core.simulator import SimConfig, fcfs_capacity, poisson_arrivals, repeated_seconds, simulate, steps_to_cover
from leap_core.step_time import StepTimeModel
from study_harness.noise import noisy_predictions
from tests.sim_reference import reference_simulate


def _small_load(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    arrival = np.round(poisson_arrivals(n, rate=8.0, seed=seed), 2)  # rounded: some arrive together
    prompt = rng.integers(1, 160, n)
    out = np.minimum(rng.geometric(1 / 25, n), 200)
    return arrival, prompt, out, rng


@pytest.mark.parametrize("policy,aging,wait_aging,predictions", [
    ("fcfs", 0.0, 0.0, "true"),
    ("countdown", 0.0, 0.0, "true"),
    ("countdown", 0.0, 0.0, "noisy"),
    ("countdown", 0.2, 0.0, "noisy"),
    ("countdown", 0.0, 0.5, "noisy"),
])
def test_matches_a_literal_step_by_step_loop(policy, aging, wait_aging, predictions):
    arrival, prompt, out, rng = _small_load(seed=11)
    predicted = out if predictions == "true" else noisy_predictions(out, 0.6, seed=3)
    config = SimConfig(max_resident=24, decode_slots=6, waiting_cap=5, aging=aging, wait_aging=wait_aging,
                       policy=policy,
                       max_prefill_tokens_per_step=100,
                       step_model=StepTimeModel(base_s=0.02, per_decode_s=0.004, per_prefill_token_s=0.0002,
                                                 per_context_token_s=2e-5, per_prefill_pair_s=1e-7,
                                                 decode_base_s=(0.0, 0.021, 0.03, 0.026, 0.028)))
    result = simulate(arrival, prompt, out, predicted, config)
    first, finish, max_held = reference_simulate(arrival, prompt, out, predicted, config)
    np.testing.assert_allclose(result.first_token, first, rtol=1e-9)
    np.testing.assert_allclose(result.finish, finish, rtol=1e-9)
    np.testing.assert_array_equal(result.max_held_out, max_held)
    assert np.nanmax(max_held) > 0  # the load did queue, so selection was exercised
    if wait_aging:  # the waits were counted and moved the order
        plain = simulate(arrival, prompt, out, predicted, replace(config, wait_aging=0.0))
        assert not np.allclose(plain.finish, result.finish)


def _saturated_load(n: int = 1500, seed: int = 0, load: float = 1.5):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 1500, n)
    out = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 1, 2000).astype(int)
    config = SimConfig()
    arrival = poisson_arrivals(n, rate=load * fcfs_capacity(prompt, out, config), seed=seed)
    return arrival, prompt, out, config


def test_every_request_completes_once_and_no_token_is_generated_twice():
    arrival, prompt, out, config = _saturated_load(n=1000)
    predicted = noisy_predictions(out, 0.7, seed=1)
    result = simulate(arrival, prompt, out, predicted, config)
    assert np.all(np.isfinite(result.finish)) and np.all(np.isfinite(result.first_token))
    assert result.tokens == out.sum()
    assert np.all(result.first_token > arrival)
    assert np.all(result.finish >= result.first_token)
    # each token after the first needs its own step, and no step is shorter than the base cost
    assert np.all(result.finish - result.first_token >= (out - 1) * config.step_model.base_s - 1e-9)
    assert np.all(result.finish[out == 1] == result.first_token[out == 1])
    assert result.max_held_out.max() <= config.waiting_cap


def test_oracle_beats_noisy_countdown_beats_fcfs_when_saturated():
    arrival, prompt, out, config = _saturated_load()
    fcfs = simulate(arrival, prompt, out, out, SimConfig(policy="fcfs")).aggregates()
    noisy = simulate(arrival, prompt, out, noisy_predictions(out, 0.7, seed=2), config).aggregates()
    oracle = simulate(arrival, prompt, out, out, config).aggregates()
    assert oracle["mean_ptl"] <= noisy["mean_ptl"] <= fcfs["mean_ptl"]
    assert oracle["mean_ptl"] < 0.9 * fcfs["mean_ptl"]
    assert noisy["max_steps_held_out"] <= config.waiting_cap < fcfs["max_steps_held_out"]
    for summary in (fcfs, noisy, oracle):
        assert summary["n"] == len(out)
        assert summary["p50_ptl"] <= summary["p90_ptl"] <= summary["p95_ptl"]
        assert summary["mean_ttft"] > 0 and summary["throughput"] > 0


def test_fcfs_capacity_separates_light_from_heavy_load():
    rng = np.random.default_rng(4)
    n = 2000
    prompt = rng.integers(20, 800, n)
    out = np.clip(rng.geometric(1 / 120, n), 1, 1000)
    capacity = fcfs_capacity(prompt, out)
    light = simulate(poisson_arrivals(n, 0.5 * capacity, seed=1), prompt, out, out, SimConfig(policy="fcfs"))
    heavy = simulate(poisson_arrivals(n, 2.0 * capacity, seed=1), prompt, out, out, SimConfig(policy="fcfs"))
    # below capacity the engine keeps up; above it the backlog grows over the whole run
    assert light.finish.max() - light.arrival.max() < 0.1 * (heavy.finish.max() - heavy.arrival.max())
    saturated_throughput = out.sum() / (heavy.finish.max() - heavy.arrival.min())
    assert saturated_throughput == pytest.approx(capacity * out.mean(), rel=0.25)


def test_step_model_fit_recovers_known_coefficients():
    rng = np.random.default_rng(5)
    truth = StepTimeModel(base_s=0.015, per_decode_s=0.0008, per_prefill_token_s=0.00004, per_context_token_s=2e-6,
                          per_prefill_pair_s=2e-8)
    decodes = rng.integers(0, 65, 400)
    prefill = rng.integers(0, 2049, 400) * (rng.random(400) < 0.3)
    context = decodes * rng.integers(50, 1500, 400)
    pairs = prefill * (prefill + 1) // 2
    seconds = truth.step_seconds(decodes, prefill, context, pairs) * np.exp(rng.normal(0, 0.02, 400))
    fitted = StepTimeModel.fit(decodes, prefill, seconds, context, pairs)
    for cost in ("base_s", "per_decode_s", "per_context_token_s", "per_prefill_pair_s"):
        assert getattr(fitted, cost) == pytest.approx(getattr(truth, cost), rel=0.15), cost
    shapes = np.column_stack((decodes, prefill, context, pairs))
    assert fitted.shape_seconds(shapes) == pytest.approx(fitted.step_seconds(decodes, prefill, context, pairs))
    without = StepTimeModel.fit(decodes, prefill, seconds)  # counts not given: their cost is 0
    assert without.per_context_token_s == 0.0 and without.per_prefill_pair_s == 0.0


def test_step_model_fit_by_decode_count_recovers_a_fixed_cost_that_is_not_linear():
    """As on two CPU cores, where 3 or 4 decodes cost less than 2: each count seen often enough gets its own
    fixed cost, a count between seen ones is interpolated, and past the table the linear fit takes over."""
    rng = np.random.default_rng(6)
    table = (0.0, 0.018, 0.0198, 0.0172, 0.0168, 0.0175, 0.0176, 0.0194, 0.0208)
    truth = StepTimeModel(per_context_token_s=1.8e-6, per_prefill_token_s=5e-4, decode_base_s=table)
    decodes = rng.integers(1, 9, 3000)
    decodes[decodes == 5] = 4  # never seen: interpolated between 4 and 6
    prefill = rng.integers(0, 300, 3000) * (rng.random(3000) < 0.1)
    context = decodes * rng.integers(40, 900, 3000)
    seconds = truth.step_seconds(decodes, prefill, context) * np.exp(rng.normal(0, 0.02, 3000))
    fitted = StepTimeModel.fit_shapes(np.column_stack((decodes, prefill, context)), seconds)
    assert len(fitted.decode_base_s) == 9
    for d in (1, 2, 3, 4, 6, 7, 8):
        assert fitted.decode_base_s[d] == pytest.approx(table[d], rel=0.05), d
    assert fitted.decode_base_s[5] == pytest.approx((fitted.decode_base_s[4] + fitted.decode_base_s[6]) / 2)
    assert fitted.per_context_token_s == pytest.approx(1.8e-6, rel=0.1)
    assert fitted.step_seconds(12, 0) == pytest.approx(fitted.base_s + 12 * fitted.per_decode_s)  # past the table
    assert StepTimeModel(**{**asdict(fitted), "decode_base_s": list(fitted.decode_base_s)}) == fitted  # from JSON


def test_steps_to_cover_a_gap_while_each_step_grows():
    for first, growth, gap in [(0.02, 0.0, 1.0), (0.02, 1e-5, 1.0), (0.025, 3e-4, 7.3), (0.01, 1e-6, 0.01)]:
        steps = steps_to_cover(gap, first, growth)
        assert repeated_seconds(steps, first, growth) >= gap > repeated_seconds(steps - 1, first, growth)
        assert repeated_seconds(steps, first, growth) == pytest.approx(sum(first + k * growth for k in range(steps)))
    assert steps_to_cover(0.0, 0.02, 1e-5) == 0


def test_step_model_fit_keeps_costs_non_negative():
    rng = np.random.default_rng(6)
    decodes = rng.integers(1, 65, 200)
    prefill = np.zeros(200)  # never exercised: its cost stays 0
    seconds = 0.001 * decodes - 0.0005 + rng.normal(0, 1e-4, 200)  # least squares would give base < 0
    fitted = StepTimeModel.fit(decodes, prefill, seconds)
    assert fitted.base_s >= 0 and fitted.per_prefill_token_s == 0
    assert fitted.per_decode_s == pytest.approx(0.001, rel=0.1)


def test_poisson_arrivals():
    arrival = poisson_arrivals(20_000, rate=4.0, seed=7)
    assert np.all(np.diff(arrival) > 0)
    assert np.mean(np.diff(arrival)) == pytest.approx(0.25, rel=0.03)
    np.testing.assert_array_equal(arrival, poisson_arrivals(20_000, rate=4.0, seed=7))
    assert not np.array_equal(arrival, poisson_arrivals(20_000, rate=4.0, seed=8))


def test_rejects_empty_outputs_and_mismatched_arrays():
    with pytest.raises(ValueError, match="output_tokens"):
        simulate([0.0, 1.0], [5, 5], [3, 0], [3, 1])
    with pytest.raises(ValueError, match="equal length"):
        simulate([0.0, 1.0], [5, 5], [3, 2], [3])
    with pytest.raises(ValueError, match="no requests"):
        simulate([], [], [], [])


def test_simulate_command_on_the_real_trace(tmp_path):
    from typer.testing import CliRunner

    from harness.datasets import shared_dir
    from leap_cli.main import app  # the console command's app, study commands included

    if shared_dir() is None or not (shared_dir() / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv").is_file():
        pytest.skip("the shared Azure trace is not present")
    runner = CliRunner()
    summaries = {}
    for policy in ("fcfs", "countdown", "oracle"):
        outcome = runner.invoke(app, ["simulate", "--policy", policy, "--limit", "2000", "--rate-scale", "1.0",
                                      "--json"])
        assert outcome.exit_code == 0, outcome.output
        summaries[policy] = json.loads(outcome.stdout.strip().splitlines()[-1])
    for policy, summary in summaries.items():
        assert summary["policy"] == policy and summary["n"] == 2000 and summary["rate_scale"] == 1.0
        for key in ("mean_ptl", "p95_ptl", "mean_ttft", "throughput"):
            assert summary[key] > 0
    assert summaries["fcfs"]["spearman_of_predictions"] is None
    assert summaries["countdown"]["spearman_of_predictions"] == pytest.approx(0.7, abs=0.01)
    assert summaries["oracle"]["spearman_of_predictions"] == 1.0
    assert summaries["oracle"]["mean_ptl"] <= summaries["countdown"]["mean_ptl"] <= summaries["fcfs"]["mean_ptl"]

    # countdown on a file of the true lengths is the oracle
    from harness.datasets import load_trace, trace_path

    predictions = tmp_path / "predicted.txt"
    np.savetxt(predictions, load_trace(trace_path("conv"), limit=2000)["output_tokens"], fmt="%d")
    outcome = runner.invoke(app, ["simulate", "--policy", "countdown", "--predictions", str(predictions),
                                  "--limit", "2000", "--json"])
    assert outcome.exit_code == 0, outcome.output
    from_file = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert from_file["spearman_of_predictions"] == pytest.approx(1.0)
    assert from_file["mean_ptl"] == summaries["oracle"]["mean_ptl"]

    bad = runner.invoke(app, ["simulate", "--policy", "fcfs", "--noise-spearman", "0.5", "--limit", "10"])
    assert bad.exit_code != 0


@pytest.mark.parametrize("target", [0.3, 0.5, 0.7, 0.9])
def test_noisy_predictions_meet_the_target_spearman(target):
    from scipy.stats import spearmanr

    rng = np.random.default_rng(8)
    true = np.clip(np.round(rng.lognormal(np.log(150), 1.0, 5000)), 1, 2000)  # integer lengths: many ties
    predicted = noisy_predictions(true, target, seed=9)
    assert abs(spearmanr(predicted, true).statistic - target) <= 0.01
    assert np.all(predicted > 0)
    np.testing.assert_array_equal(predicted, noisy_predictions(true, target, seed=9))
    assert not np.array_equal(predicted, noisy_predictions(true, target, seed=10))


def test_noisy_predictions_edge_targets():
    true = np.arange(1, 101, dtype=float)
    np.testing.assert_array_equal(noisy_predictions(true, 1.0), true)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="target_spearman"):
            noisy_predictions(true, bad)
