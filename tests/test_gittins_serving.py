"""The gittins decode order in serving: ranked by the Gittins index of the serving readout's length
distribution, which a push replaces, and countdown (reported, counted) while the readout carries none.

Real parts: a LEAP runtime driven through its scheduler hooks with real vLLM requests and the real capture
channel (no engine, as in tests/test_kill_switch.py); readouts reach it as pushes, through the readout file.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request

from leap_core.gittins import LengthGivenPrediction
from serving.capture.hidden_states import FeatureSender
from tests.runtime_fixtures import DIM, build, eventually, first_value_readout  # noqa: F401  (pytest fixtures, used by name)

# Requests predicted near 100 tokens end after 10 or after 1,000, half and half; those predicted near 500
# always take 200. A request that has generated 20 of a predicted 100 has outlived the short outcome, so
# it has 980 to go, while one just started on a predicted 500 has 199: countdown decodes the first (80
# predicted remaining against 499), the Gittins index the second.
SHORT_OR_LONG, ALWAYS_200 = 100.0, 500.0


def _distribution() -> LengthGivenPrediction:
    predicted = np.array([SHORT_OR_LONG] * 40 + [ALWAYS_200] * 40)
    true = np.array([10.0, 1000.0] * 20 + [200.0] * 40)
    return LengthGivenPrediction(n_bins=2, max_tokens=4096).fit(predicted, true)


def _readout(version: str, distribution: LengthGivenPrediction | None):
    readout = first_value_readout(version)  # predicts the feature's first value
    readout.length_distribution_ = distribution
    return readout


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4000), None, arrival_time=time.time())


def _decoded(r: Request, tokens: int) -> Request:
    r.num_computed_tokens = r.num_prompt_tokens + r.num_output_tokens + tokens - 1
    r.append_output_token_ids([7] * tokens)
    return r


def _two_requests(runtime) -> tuple[Request, Request]:
    """Outlived (predicted 100, 20 generated) and fresh (predicted 500, 1 generated), both decoding."""
    outlived, fresh = _request("outlived-0001"), _request("fresh-000001")
    runtime.before_schedule([outlived, fresh], 0)
    features = np.random.default_rng(0).normal(size=(2, DIM)).astype(np.float32)
    features[:, 0] = [SHORT_OR_LONG, ALWAYS_200]
    FeatureSender(runtime.config.channel).send([outlived.request_id, fresh.request_id], features)
    assert eventually(lambda: {outlived.request_id, fresh.request_id} <= set(runtime.tracker.predictions))
    return _decoded(outlived, 20), _decoded(fresh, 1)


def test_the_gittins_order_decodes_by_the_index_of_the_served_distribution(build):
    runtime = build(policy="leap", order="gittins", decode_slots=1)
    runtime.reset_readout(_readout("v1", _distribution()), None)  # a push: through the readout file
    outlived, fresh = _two_requests(runtime)
    runtime.before_schedule([outlived, fresh], 1)
    assert runtime.steps.last_held == {outlived.request_id}  # the fresh request's index is the larger
    order = runtime.health()["decode_order"]
    assert order == {"configured": "gittins", "serving": "gittins", "fallback": None, "fallbacks": 0}
    assert runtime.metrics_registry.get_sample_value("leap:order_fallback") == 0.0

    runtime.config.order = "countdown"  # the same requests under countdown's ranking go the other way
    runtime.configure()
    runtime.before_schedule([outlived, fresh], 2)
    assert runtime.steps.last_held == {fresh.request_id}


def test_without_a_distribution_the_gittins_order_counts_down_says_so_and_takes_the_next_pushed_one(build):
    runtime = build(policy="leap", order="gittins", decode_slots=1)
    runtime.reset_readout(_readout("v1", None), None)
    outlived, fresh = _two_requests(runtime)
    runtime.before_schedule([outlived, fresh], 1)
    assert runtime.steps.last_held == {fresh.request_id}  # countdown: 80 predicted remaining before 499
    order = runtime.describe()["decode_order"]
    assert order["configured"] == "gittins" and order["serving"] == "countdown" and order["fallbacks"] == 1
    assert order["fallback"] == "the serving readout 'v1' carries no length distribution"
    assert runtime.health()["decode_order"] == order
    assert runtime.metrics_registry.get_sample_value("leap:order_fallback") == 1.0

    runtime.reset_readout(_readout("v2", _distribution()), None)  # the next push brings one
    runtime.before_schedule([outlived, fresh], 2)
    assert runtime.steps.last_held == {outlived.request_id}
    order = runtime.health()["decode_order"]
    assert (order["serving"], order["fallback"], order["fallbacks"]) == ("gittins", None, 1)
    assert runtime.metrics_registry.get_sample_value("leap:order_fallback") == 0.0

    runtime.reset_readout(_readout("v3", None), None)  # and one without takes it away again, counted
    runtime.before_schedule([outlived, fresh], 3)
    assert runtime.steps.last_held == {fresh.request_id}
    assert runtime.health()["decode_order"]["fallbacks"] == 2


def test_a_push_with_a_corrupt_distribution_is_refused_and_the_serving_order_goes_on(build):
    import io

    from leap_core.readout_format import to_bytes
    from leap_io.push_bundle import make_bundle
    from serving.readout.push import PushRefused

    runtime = build(policy="leap", order="gittins", decode_slots=1)
    runtime.reset_readout(_readout("v1", _distribution()), None)
    with np.load(io.BytesIO(to_bytes(_readout("v2", _distribution())))) as stored:
        arrays = {key: stored[key] for key in stored.files}
    arrays["length_samples"] = arrays["length_samples"][::-1].copy()  # no longer sorted within its bins
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with pytest.raises(PushRefused, match="length distribution") as refused:
        runtime.push_readout(make_bundle(buffer.getvalue(), None))
    assert refused.value.status == 422
    assert runtime.readouts.version == "v1" and runtime.health()["decode_order"]["serving"] == "gittins"
