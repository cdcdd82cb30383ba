"""The decode-selection policies: countdown order, FCFS order, aging, and the starvation cap."""

import numpy as np
import pytest

from leap_core.policy import (
    CountdownPolicy,
    DecodePolicy,
    FcfsPolicy,
    advance_held_out,
    make_policy,
)


def _reference_order(priority: np.ndarray, arrival: np.ndarray) -> np.ndarray:
    """Full sort by (priority, arrival, index): what the O(n) selection must agree with."""
    return np.lexsort((np.arange(priority.shape[0]), arrival, priority))


def test_countdown_picks_the_k_smallest_predicted_remaining():
    rng = np.random.default_rng(1)
    n, k = 512, 64
    predicted = rng.integers(1, 2000, n).astype(float)
    generated = rng.integers(0, 300, n)
    arrival = rng.random(n) * 100
    held_out = np.zeros(n, dtype=int)

    chosen = CountdownPolicy(k=k).select(predicted, generated, held_out, arrival)

    remaining = np.maximum(predicted - generated, 1)
    expected = _reference_order(remaining, arrival)[:k]
    np.testing.assert_array_equal(chosen, expected)


def test_countdown_breaks_ties_by_arrival():
    rng = np.random.default_rng(2)
    n, k = 300, 40
    predicted = np.full(n, 50.0)
    generated = np.zeros(n)
    arrival = rng.permutation(n).astype(float)
    chosen = CountdownPolicy(k=k).select(predicted, generated, np.zeros(n, int), arrival)
    np.testing.assert_array_equal(arrival[chosen], np.arange(k))


def test_overrun_predictions_count_as_one_token_left():
    # Requests that ran past their prediction all have remaining 1 and go by arrival among themselves.
    predicted = np.array([10.0, 5.0, 300.0, 2.0, 7.0])
    generated = np.array([3, 9, 0, 8, 1])
    arrival = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    chosen = CountdownPolicy(k=2).select(predicted, generated, np.zeros(5, int), arrival)
    np.testing.assert_array_equal(chosen, [1, 3])


def test_aging_lets_a_long_waiting_request_overtake():
    rng = np.random.default_rng(3)
    n, k, aging = 256, 32, 0.05
    predicted = rng.integers(1, 1000, n).astype(float)
    generated = np.zeros(n)
    held_out = rng.integers(0, 100, n)
    arrival = rng.random(n)

    chosen = CountdownPolicy(k=k, waiting_cap=1000, aging=aging).select(predicted, generated, held_out, arrival)

    priority = np.maximum(predicted - generated, 1) * np.exp(-aging * held_out)
    np.testing.assert_array_equal(chosen, _reference_order(priority, arrival)[:k])
    plain = CountdownPolicy(k=k, waiting_cap=1000).select(predicted, generated, held_out, arrival)
    assert set(chosen) != set(plain)


def test_wait_aging_ranks_by_wait_over_predicted_remaining():
    rng = np.random.default_rng(5)
    n, k, rate = 256, 32, 0.5
    predicted = rng.integers(1, 1000, n).astype(float)
    generated = rng.integers(0, 50, n).astype(float)
    held_out = rng.integers(0, 20, n)
    waited = held_out + rng.integers(0, 2000, n)  # every step held out, not only the last run of them
    arrival = rng.random(n)

    chosen = CountdownPolicy(k=k, waiting_cap=1000, wait_aging=rate).select(predicted, generated, held_out, arrival,
                                                                            waited)

    remaining = np.maximum(predicted - generated, 1)
    np.testing.assert_array_equal(chosen, _reference_order(remaining * np.exp(-rate * waited / remaining),
                                                           arrival)[:k])
    plain = CountdownPolicy(k=k, waiting_cap=1000).select(predicted, generated, held_out, arrival, waited)
    assert set(chosen) != set(plain)
    # without waits (a caller that counts none) the order is countdown's
    np.testing.assert_array_equal(
        CountdownPolicy(k=k, waiting_cap=1000, wait_aging=rate).select(predicted, generated, held_out, arrival), plain)


def test_a_long_request_that_waited_its_length_overtakes_a_fresh_short_one():
    policy = CountdownPolicy(k=1, waiting_cap=10_000, wait_aging=1.0)
    predicted, generated, held_out, arrival = np.array([1000.0, 50.0]), np.zeros(2), np.zeros(2, int), np.zeros(2)
    assert policy.select(predicted, generated, held_out, arrival, np.array([2000, 0])).tolist() == [1]
    assert policy.select(predicted, generated, held_out, arrival, np.array([4000, 0])).tolist() == [0]
    assert policy.select_steps(predicted, generated, held_out, arrival, np.array([4000, 0]))[1] == 1


def test_fcfs_decodes_the_earliest_arrivals_in_order():
    rng = np.random.default_rng(4)
    n, k = 512, 64
    arrival = rng.integers(0, 200, n).astype(float)  # many ties: broken by position
    chosen = FcfsPolicy(k=k).select(np.ones(n), np.zeros(n), np.zeros(n, int), arrival)
    expected = np.lexsort((np.arange(n), arrival))[:k]
    np.testing.assert_array_equal(chosen, expected)
    assert len(FcfsPolicy(k=k).select(np.ones(5), np.zeros(5), np.zeros(5, int), arrival[:5])) == 5


def test_a_request_at_the_cap_is_forced_in_first():
    n, k, cap = 40, 4, 10  # 40 <= k * (cap + 1): the cap can be kept
    predicted = np.arange(1, n + 1, dtype=float)
    held_out = np.zeros(n, dtype=int)
    held_out[[30, 35]] = cap  # predicted long, waited too long
    chosen = CountdownPolicy(k=k, waiting_cap=cap).select(predicted, np.zeros(n), held_out, np.arange(n, dtype=float))
    np.testing.assert_array_equal(chosen, [30, 35, 0, 1])


def test_advance_held_out_resets_decoded_and_ages_the_rest():
    held_out = np.array([0, 3, 7, 2])
    mask = np.array([True, False, True, False])
    np.testing.assert_array_equal(advance_held_out(held_out, mask), [0, 4, 0, 3])
    np.testing.assert_array_equal(held_out, [0, 3, 7, 2])


def _run_resident_loop(policy, predicted_of, steps: int, resident: int, rng) -> dict:
    """Keep `resident` requests in memory for `steps` steps, replacing each finished one with a new one."""
    true_len = rng.geometric(1 / 60, resident)
    predicted = predicted_of(true_len, np.arange(resident))
    generated = np.zeros(resident, dtype=int)
    held_out = np.zeros(resident, dtype=int)
    arrival = np.zeros(resident)
    joined = np.zeros(resident, dtype=int)
    decodes = np.zeros(resident, dtype=int)
    max_held = 0
    next_id = resident
    finished_ok = True
    for step in range(steps):
        chosen = policy.select(predicted, generated, held_out, arrival)
        assert len(chosen) == min(policy.k, resident) and len(set(chosen.tolist())) == len(chosen)
        mask = np.zeros(resident, dtype=bool)
        mask[chosen] = True
        generated[mask] += 1
        decodes[mask] += 1
        held_out = advance_held_out(held_out, mask)
        max_held = max(max_held, int(held_out.max()))
        # every request has been decoded at least once per cap + 1 steps while resident
        finished_ok &= bool(np.all(decodes >= (step + 1 - joined) // (policy.waiting_cap + 1)))
        done = np.flatnonzero(generated >= true_len)
        if done.size:
            true_len[done] = rng.geometric(1 / 60, done.size)
            predicted[done] = predicted_of(true_len[done], np.arange(next_id, next_id + done.size))
            next_id += done.size
            generated[done] = 0
            held_out[done] = 0
            arrival[done] = step + 1
            joined[done] = step + 1
            decodes[done] = 0
    return {"max_held": max_held, "every_request_decoded": finished_ok, "served": next_id - resident}


@pytest.mark.parametrize("huge_every", [64, 1])  # a few requests predicted huge; then nearly all at start
def test_held_out_never_exceeds_the_cap_under_adversarial_predictions(huge_every):
    rng = np.random.default_rng(5)
    k, cap = 64, 128

    def predicted_of(true_len, ids):
        predicted = true_len.astype(float)
        huge = ids % huge_every == 0 if huge_every > 1 else ids < 448
        predicted[huge] = 1e9
        return predicted

    stats = _run_resident_loop(CountdownPolicy(k=k, waiting_cap=cap), predicted_of, steps=10_000,
                               resident=512, rng=rng)
    assert stats["max_held"] <= cap
    assert stats["every_request_decoded"]
    assert stats["served"] > 5_000  # requests keep finishing, so the loop exercised replacement


def test_make_policy():
    assert isinstance(make_policy("countdown", k=8, waiting_cap=4, aging=0.1), CountdownPolicy)
    assert make_policy("countdown", k=8, waiting_cap=4).waiting_cap == 4
    assert isinstance(make_policy("fcfs", k=8), FcfsPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("oracle")


def test_both_orders_are_decode_policies_built_by_name():
    for name, cls in (("countdown", CountdownPolicy), ("fcfs", FcfsPolicy)):
        policy = make_policy(name, k=3)
        assert isinstance(policy, DecodePolicy) and isinstance(policy, cls) and policy.k == 3
        chosen = policy.select(np.array([9.0, 1.0, 5.0, 3.0]), np.zeros(4), np.zeros(4, int),
                               np.array([0.0, 1.0, 2.0, 3.0]))
        assert len(chosen) == 3
    assert not isinstance(object(), DecodePolicy)


def test_advance_held_out_over_several_steps_equals_repeated_single_steps():
    rng = np.random.default_rng(6)
    held_out = rng.integers(0, 50, 64)
    mask = rng.random(64) < 0.3
    repeated = held_out
    for _ in range(7):
        repeated = advance_held_out(repeated, mask)
    np.testing.assert_array_equal(advance_held_out(held_out, mask, steps=7), repeated)
