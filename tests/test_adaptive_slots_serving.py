"""Adaptive decode slots in serving: K chosen each step from the step time the runtime measured and the
demand it saw arrive, through the scheduler hooks (real vLLM requests, the real capture channel, no engine,
as in tests/test_gittins_serving.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request

from leap_core.decode_slots import DecodeSlotRule
from serving.capture.hidden_states import FeatureSender
from tests.runtime_fixtures import DIM, build, eventually, first_value_readout  # noqa: F401  (pytest fixtures, used by name)

N = 12
LENGTHS = np.arange(10.0, 10.0 * (N + 1), 10.0)  # predicted totals: 10, 20, ..., 120


def _decoding_requests(runtime) -> list[Request]:
    """N requests past prefill with predictions 10 ... 120 (the feature's first value), one token generated."""
    requests = [Request(f"adaptive-{i:04d}", [1, 2, 3, 4], SamplingParams(max_tokens=4000), None,
                        arrival_time=time.time()) for i in range(N)]
    runtime.before_schedule(requests, 0)  # prefill: tracked, never held
    features = np.random.default_rng(0).normal(size=(N, DIM)).astype(np.float32)
    features[:, 0] = LENGTHS
    FeatureSender(runtime.config.channel).send([r.request_id for r in requests], features)
    assert eventually(lambda: {r.request_id for r in requests} <= set(runtime.tracker.predictions))
    for r in requests:
        r.num_computed_tokens = r.num_prompt_tokens
        r.append_output_token_ids([7])
    return requests


def _measured(runtime, fixed_s: float, per_decode_s: float, steps: int = 200) -> None:
    """Steps of 1 to 40 decodes that took fixed + per_decode * decodes seconds."""
    for i in range(steps):
        decodes = 1 + i % 40
        runtime.steps.step_times.observe(decodes, 0, 0, fixed_s + per_decode_s * decodes)


def test_a_rising_step_time_holds_out_all_but_the_slots_that_keep_up_with_the_demand(build):
    runtime = build(policy="leap", decode_slots=64, adaptive_slots=True, slot_margin=0.25)
    runtime.reset_readout(first_value_readout("v1"), None)
    requests = _decoding_requests(runtime)
    _measured(runtime, 0.018, 0.0075)
    runtime.before_schedule(requests, 1)  # the demand now counts the N arrivals' predicted lengths
    slots = runtime.steps.slots
    fixed, per_request = runtime.steps.step_times.decode_step(4.0)
    demand = DecodeSlotRule(margin=0.25).demand(runtime.steps.demand.rate(time.time()),
                                                float((LENGTHS - 1).sum()))
    assert 4 <= slots < N
    assert slots == DecodeSlotRule(margin=0.25).slots(fixed, per_request, demand, N)
    # the shortest predicted decode, the rest wait
    held = {r.request_id for r in requests[slots:]}
    assert runtime.steps.last_held == held
    assert runtime.stats()["decode_slots"]["slots"] == slots
    assert runtime.metrics_registry.get_sample_value("leap:decode_slots") == slots


@pytest.mark.parametrize("adaptive, per_decode_s, slots", [
    (True, 0.0, N),  # a flat step time: holding requests out would not shorten a step, so all decode
    (False, 0.0075, 64),  # fixed slots ignore the step time
])
def test_every_request_decodes_on_a_flat_curve_or_with_fixed_slots(build, adaptive, per_decode_s, slots):
    runtime = build(policy="leap", decode_slots=64, adaptive_slots=adaptive)
    runtime.reset_readout(first_value_readout("v1"), None)
    requests = _decoding_requests(runtime)
    _measured(runtime, 0.018, per_decode_s)
    runtime.before_schedule(requests, 1)
    assert runtime.steps.last_held == set()
    assert runtime.steps.slots == slots


def test_until_enough_steps_are_measured_the_configured_slots_hold(build):
    runtime = build(policy="leap", decode_slots=8, adaptive_slots=True)
    runtime.reset_readout(first_value_readout("v1"), None)
    requests = _decoding_requests(runtime)
    runtime.before_schedule(requests, 1)
    assert runtime.steps.slots == 8
    assert len(runtime.steps.last_held) == N - 8
