"""The switchback experiment of the serving bench's shadow arm: blocks of steps on and off in ABBA order,
summed per block, and the throughput on over off pooled over neighbouring pairs with a bootstrap interval."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.bench.switchback import block_is_on, blocks, throughput_ratio


def test_blocks_run_in_abba_order_so_a_drift_lands_on_both_sides_of_a_pair():
    on = [block_is_on(step, 2) for step in range(16)]
    assert on == [True, True, False, False, False, False, True, True] * 2


def test_per_step_records_sum_into_whole_blocks_and_a_short_last_block_is_left_out():
    steps = 8 * 5 + 3
    on = [block_is_on(k, 8) for k in range(steps)]
    summed = blocks(np.array(on), np.ones(steps) * 64, np.full(steps, 0.05), 8)
    assert summed["on"] == [True, False, False, True, True]
    assert summed["tokens"] == [512.0] * 5 and summed["seconds"] == pytest.approx([0.4] * 5)
    assert blocks(np.array(on[:7]), np.ones(7), np.ones(7), 8) == {"on": [], "tokens": [], "seconds": []}


def test_records_that_disagree_or_a_block_that_mixes_on_and_off_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        blocks(np.array([True] * 8), np.ones(7), np.ones(8), 8)
    with pytest.raises(ValueError, match="mixes"):
        blocks(np.array([True] * 4 + [False] * 4), np.ones(8), np.ones(8), 8)


def test_a_cost_hidden_in_noise_between_pairs_is_found_with_an_interval_that_covers_it():
    rng = np.random.default_rng(1)
    pairs, cost = 400, 0.01
    records = []
    for _ in range(2):
        speed = rng.lognormal(0.0, 0.1, pairs)  # the machine's speed drifts pair to pair by ~10%
        on, tokens, seconds = [], [], []
        for j in range(pairs):
            first_on = j % 2 == 0  # ABBA: on, off | off, on | ...
            for block_on in (first_on, not first_on):
                tok = 512.0
                on.append(block_on)
                tokens.append(tok)
                seconds.append(tok / (1000.0 * speed[j]) * (1 + cost if block_on else 1.0) * rng.lognormal(0, 0.01))
        records.append({"on": on, "tokens": tokens, "seconds": seconds})
    figure = throughput_ratio(records)
    assert figure["pairs"] == 2 * pairs
    assert figure["ci_low"] < 1 / (1 + cost) < figure["ci_high"] < 1.0  # the cost, seen through the drift
    assert figure["ci_high"] - figure["ci_low"] < 0.005


def test_no_pairs_give_no_figure_and_a_pair_of_two_like_blocks_is_refused():
    assert throughput_ratio([{"on": [True], "tokens": [1.0], "seconds": [1.0]}])["ratio"] is None
    with pytest.raises(ValueError, match="not one block on and one off"):
        throughput_ratio([{"on": [True, True], "tokens": [1.0, 1.0], "seconds": [1.0, 1.0]}])
