"""The switchback experiment of the serving bench's shadow arm: blocks of steps on and off in ABBA order, the
decode-only steps' seconds fitted on the requests they decode, and the throughput on over off from the
residuals paired by neighbouring blocks, with a bootstrap interval."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.bench.switchback import block_is_on, pair_deltas, throughput_ratio


def test_blocks_run_in_abba_order_so_a_drift_lands_on_both_sides_of_a_pair():
    on = [block_is_on(step, 2) for step in range(16)]
    assert on == [True, True, False, False, False, False, True, True] * 2


def run(steps: int, block_steps: int, cost_s: float, rng: np.random.Generator, drift: float = 0.02) -> dict:
    """A synthetic engine run: decode-only steps cost 20 ms + 1 ms a decode, every tenth step prefills a chunk
    of 2,048 tokens (0.3-1.5 s), the machine drifts slowly, and `on` steps cost `cost_s` more."""
    on = np.array([block_is_on(k, block_steps) for k in range(steps)])
    decodes = rng.integers(1, 65, steps)
    prefill = np.where(rng.random(steps) < 0.1, rng.integers(256, 2049, steps), 0)
    speed = 1.0 + drift * np.sin(np.arange(steps) / 50.0)
    seconds = speed * (0.02 + 0.001 * decodes + 0.0006 * prefill) * rng.lognormal(0.0, 0.03, steps)
    seconds = seconds + cost_s * on
    return {"on": on.tolist(), "tokens": decodes.tolist(), "seconds": seconds.tolist(), "decodes": decodes.tolist(),
            "prefill": prefill.tolist()}


def test_a_one_percent_cost_hidden_under_prefill_chunks_and_drift_is_found_and_none_is_not():
    rng = np.random.default_rng(3)
    base = 0.02 + 0.001 * 32.5  # a decode-only step's mean seconds
    costly = throughput_ratio([run(4000, 4, 0.01 * base, rng) for _ in range(2)], 4)
    assert costly["ci_low"] < 1 / 1.01 < costly["ci_high"] < 1.0
    assert costly["unadjusted_ratio"] != pytest.approx(costly["ratio"], abs=1e-4)  # the prefill chunks' noise
    free = throughput_ratio([run(4000, 4, 0.0, rng) for _ in range(2)], 4)
    assert free["ci_low"] < 1.0 < free["ci_high"] and free["ci_high"] - free["ci_low"] < 0.01
    assert free["pairs"] == 2 * 4000 // 8 and free["steps"] == 8000 and 0.8 * 8000 < free["steps_compared"] < 8000


def test_a_run_shorter_than_a_pair_gives_no_figure():
    rng = np.random.default_rng(0)
    figure = throughput_ratio([run(7, 4, 0.0, rng)], 4)
    assert figure["ratio"] is None and figure["pairs"] == 0 and figure["steps"] == 7


def test_records_that_disagree_or_are_not_the_abba_blocks_of_their_size_are_refused():
    rng = np.random.default_rng(0)
    record = run(16, 4, 0.0, rng)
    with pytest.raises(ValueError, match="disagree"):
        pair_deltas({**record, "seconds": record["seconds"][:-1]}, 4)
    with pytest.raises(ValueError, match="ABBA"):
        pair_deltas(record, 2)
