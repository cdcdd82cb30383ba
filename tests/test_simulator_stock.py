"""Stock vLLM and adaptive decode slots in the step-loop simulator: vLLM's chunked-prefill token budget on a
case worked out by hand, agreement with the literal step loop, the adaptive rule holding requests out only
where the step-time curve rises, and the load study's stock and adaptive arms."""

from dataclasses import replace

import numpy as np
import pytest

from evaluation.simulated_load import LOADS, QUICK_LOADS, run_load
from evaluation.simulated_load_report import section_load
from evaluation.simulation import ADAPTIVE_SLOT_RULE, HEADLINE_LOAD, _workloads, adaptive_config
from leap_core.decode_slots import DecodeSlotRule
from leap_core.simulator import (
    VLLM_CPU_MAX_NUM_BATCHED_TOKENS,
    VLLM_CPU_MAX_NUM_SEQS,
    SimConfig,
    StepTimeModel,
    fcfs_capacity,
    poisson_arrivals,
    simulate,
)
from study_harness.noise import noisy_predictions
from tests.sim_reference import reference_simulate

HAND = StepTimeModel(base_s=0.01, per_decode_s=0.001, per_prefill_token_s=0.0001, per_prefill_pair_s=1e-5)


def test_stock_is_vllms_cpu_default():
    stock = SimConfig.stock(HAND)
    assert (VLLM_CPU_MAX_NUM_SEQS, VLLM_CPU_MAX_NUM_BATCHED_TOKENS) == (128, 2048)  # vLLM's OpenAI server on CPU
    assert (stock.max_resident, stock.decode_slots, stock.max_prefill_tokens_per_step) == (128, 128, 2048)
    assert stock.policy == "fcfs" and stock.chunked_prefill and stock.slot_rule is None and stock.step_model == HAND


def test_stock_budgets_decodes_first_and_chunks_a_long_prompt_as_vllm_does():
    """max_num_seqs 2, max_num_batched_tokens 6; A (prompt 3, 3 tokens), B (prompt 9, 2 tokens), C (prompt 2,
    1 token), all at t = 0. Step cost 0.01 + 0.001 decodes + 0.0001 prompt tokens + 1e-5 attending pairs, a
    chunk of n tokens from token c making n (c + (n + 1) / 2) pairs.

    1. A prefills whole (3 tokens, 6 pairs), B a first chunk of the 3 left (6 pairs): 0.01072 s. A's first token.
    2. A decodes, so 5 of the 6 tokens are left for B's next chunk (tokens 3-7, 30 pairs), one short of its
       prompt: 0.0118 s.
    3. A decodes its last token; B's last prompt token (9 pairs); C waits, both seats taken: 0.01119 s.
       A finishes, B has its first token.
    4. B decodes its last token; C prefills whole (3 pairs) in B's leftover budget: 0.01123 s.
    """
    config = SimConfig.stock(HAND, max_num_seqs=2, max_num_batched_tokens=6)
    result = simulate(np.zeros(3), [3, 9, 2], [3, 2, 1], [3, 2, 1], config)
    t1 = 0.01 + 6 * 0.0001 + 12 * 1e-5
    t2 = t1 + 0.01 + 0.001 + 5 * 0.0001 + 30 * 1e-5
    t3 = t2 + 0.01 + 0.001 + 1 * 0.0001 + 9 * 1e-5
    t4 = t3 + 0.01 + 0.001 + 2 * 0.0001 + 3 * 1e-5
    np.testing.assert_allclose(result.first_token, [t1, t3, t4], rtol=1e-12)
    np.testing.assert_allclose(result.finish, [t3, t4, t4], rtol=1e-12)
    assert (result.steps, result.tokens) == (4, 6)
    # the same engine admitting whole prompts beside its decodes (the LEAP arms' model) is another schedule
    whole = simulate(np.zeros(3), [3, 9, 2], [3, 2, 1], [3, 2, 1], replace(config, chunked_prefill=False))
    assert not np.allclose(whole.finish, result.finish)


def test_chunked_prefill_needs_a_budget_beyond_the_decodes():
    with pytest.raises(ValueError, match="chunked_prefill"):
        simulate([0.0], [5], [1], [1], SimConfig(max_resident=8, decode_slots=4, max_prefill_tokens_per_step=4,
                                                 chunked_prefill=True))
    simulate([0.0], [5], [1], [1], SimConfig.stock(HAND, max_num_seqs=4, max_num_batched_tokens=4))  # vLLM's floor


def _small_load(seed: int, n: int = 250):
    rng = np.random.default_rng(seed)
    arrival = np.round(poisson_arrivals(n, rate=6.0, seed=seed), 2)  # rounded: some arrive together
    prompt = rng.integers(1, 400, n)
    out = np.minimum(rng.geometric(1 / 25, n), 200)
    return arrival, prompt, out, noisy_predictions(out, 0.6, seed=seed + 1)


RISING = StepTimeModel(base_s=0.018, per_decode_s=0.0075, per_prefill_token_s=1e-4, per_context_token_s=2e-6,
                       per_prefill_pair_s=1e-8)


@pytest.mark.parametrize("config", [
    SimConfig.stock(RISING, max_num_seqs=24, max_num_batched_tokens=100),
    SimConfig(max_resident=24, decode_slots=6, waiting_cap=5, max_prefill_tokens_per_step=100, chunked_prefill=True,
              step_model=RISING),
])
def test_chunked_prefill_matches_a_literal_step_by_step_loop(config):
    arrival, prompt, out, predicted = _small_load(seed=11)
    result = simulate(arrival, prompt, out, predicted, config)
    first, finish, max_held = reference_simulate(arrival, prompt, out, predicted, config)
    np.testing.assert_allclose(result.first_token, first, rtol=1e-9)
    np.testing.assert_allclose(result.finish, finish, rtol=1e-9)
    np.testing.assert_array_equal(result.max_held_out, max_held)
    assert result.tokens == out.sum()


def test_adaptive_slots_agree_with_a_literal_loop_that_chooses_them_every_step():
    """The simulator chooses the slots where it decides (arrivals, finishes), the literal loop every step: on a
    load that makes it hold requests out, the two schedules agree to well under a percent."""
    arrival, prompt, out, predicted = _small_load(seed=5, n=300)
    config = SimConfig(max_resident=64, decode_slots=32, waiting_cap=64, step_model=RISING,
                       slot_rule=DecodeSlotRule(max_slots=32, min_slots=2, margin=0.25, drain_s=20.0))
    result = simulate(arrival, prompt, out, predicted, config)
    first, finish, max_held = reference_simulate(arrival, prompt, out, predicted, config)
    assert max_held.max() > 0 and result.max_held_out.max() > 0  # the rule did hold requests out
    assert np.mean(result.finish - arrival) == pytest.approx(np.mean(finish - arrival), rel=5e-3)
    assert np.mean(np.isclose(result.finish, finish, rtol=1e-9)) > 0.9
    assert result.tokens == out.sum()


def _moderate_load(step_model: StepTimeModel, load: float, n: int = 600):
    rng = np.random.default_rng(0)
    prompt = rng.integers(20, 300, n)
    out = np.clip(np.round(rng.lognormal(np.log(100), 1.0, n)), 1, 1000).astype(int)
    fixed = SimConfig(max_resident=256, decode_slots=256, step_model=step_model)  # K = R: never holds out
    arrival = poisson_arrivals(n, load * fcfs_capacity(prompt, out, fixed), seed=2)
    return arrival, prompt, out, noisy_predictions(out, 0.7, seed=1), fixed


def test_adaptive_slots_hold_requests_out_on_a_rising_curve_and_never_on_a_flat_one():
    rule = DecodeSlotRule(max_slots=256, margin=0.25, drain_s=60.0)  # an eager rule, so it holds requests out
    arrival, prompt, out, predicted, fixed = _moderate_load(RISING, 0.6)
    adaptive = simulate(arrival, prompt, out, predicted, replace(fixed, slot_rule=rule))
    plain = simulate(arrival, prompt, out, predicted, fixed)
    assert plain.max_held_out.max() == 0 and adaptive.max_held_out.max() > 0
    assert adaptive.tokens == plain.tokens == out.sum()
    flat = StepTimeModel(base_s=0.03, per_decode_s=0.0, per_prefill_token_s=1e-4)
    arrival, prompt, out, predicted, fixed = _moderate_load(flat, 0.6)
    adaptive = simulate(arrival, prompt, out, predicted, replace(fixed, slot_rule=rule))
    plain = simulate(arrival, prompt, out, predicted, fixed)
    assert adaptive.max_held_out.max() == 0
    np.testing.assert_array_equal(adaptive.finish, plain.finish)


def test_the_load_study_runs_stock_and_adaptive_leap_and_puts_stock_first():
    rng = np.random.default_rng(3)
    n = 200
    prompt = rng.integers(20, 800, n)
    out = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 1, 2000).astype(int)
    predicted = noisy_predictions(out, 0.6, seed=4)
    result = run_load(prompt, out, {"leap": predicted}, RISING, loads=(0.5, 0.9), headline=0.9, overloads=(),
                      n_requests=150, seeds=2, decode_slots=16, max_resident=256)
    head = result["table"]["0.9"]
    assert set(head) == {"leap", "leap-adaptive", "fcfs", "oracle", "stock"}
    assert list(result["ratios"])[:4] == ["leap_over_stock", "leap_adaptive_over_stock", "leap_over_stock_latency",
                                          "leap_adaptive_over_stock_latency"]
    # each arm's figures are the simulator's on the same draws: stock at vLLM's shape, adaptive at K <= 16
    capacity = result["capacity_rps"]["value"]
    base = SimConfig(step_model=RISING, decode_slots=16, max_resident=256)
    stock, adaptive = [], []
    for idx, arrival_seed in _workloads(n, 150, 2, 0):
        arrival = poisson_arrivals(150, 0.9 * capacity, seed=arrival_seed)
        stock.append(simulate(arrival, prompt[idx], out[idx], out[idx], SimConfig.stock(RISING)).ptl.mean())
        adaptive.append(simulate(arrival, prompt[idx], out[idx], predicted[idx], adaptive_config(base)).ptl.mean())
    assert head["stock"]["mean_ptl"] == pytest.approx(np.mean(stock))
    assert head["leap-adaptive"]["mean_ptl"] == pytest.approx(np.mean(adaptive))
    assert result["ratios"]["leap_over_stock"]["value"] == pytest.approx(head["leap"]["mean_ptl"] / np.mean(stock))
    assert result["adaptive_slots"]["max_slots"] == 16 and result["adaptive_slots"]["margin"] == \
        ADAPTIVE_SLOT_RULE.margin
    assert result["stock_capacity_rps"] > 0 and result["stock"]["max_num_seqs"] == 128
    text = section_load(result, "x.png")
    assert "`stock` is stock vLLM at its CPU defaults" in text and "`leap-adaptive` is LEAP's countdown" in text
    by_load = text.split("The same ratios at every load")[1]
    assert "| leap_over_stock |" in by_load and "| leap_adaptive_over_stock_latency |" in by_load
    assert by_load.index("| leap_over_stock |") < by_load.index("| leap_over_fcfs |")
    with pytest.raises(ValueError, match="added by the study"):
        run_load(prompt, out, {"stock": predicted}, RISING, n_requests=20, seeds=1)


def test_the_load_sweep_reaches_half_load_and_the_headline():
    for loads in (LOADS, QUICK_LOADS):
        assert {0.5, 0.8, 0.95, HEADLINE_LOAD} <= set(loads)
