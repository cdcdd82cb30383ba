"""The LEAP runtime beside a scheduler, driven through its scheduler hooks with real vLLM requests.

No engine runs: the runtime is built from the few `VllmConfig` fields it reads, requests are real
`vllm.v1.request.Request` objects moved through prefill, decode and finish by hand, and features reach it
through the real capture channel (`serving.capture.hidden_states.FeatureSender` -> ZeroMQ -> the runtime's receiver).
Each test is one way a client, a push or a fault used to take a replica down or lose work.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from prometheus_client import generate_latest

from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from leap_io.push_bundle import make_bundle

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from serving.capture.hidden_states import FeatureSender
from tests.runtime_fixtures import DIM, build, eventually, first_value_readout  # noqa: F401 (build is a fixture)


def feature(first: float, seed: int = 0) -> np.ndarray:
    vector = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    vector[0] = first
    return vector


def make_request(rid: str, max_tokens: int = 64, extra: dict | None = None, prompt: int = 4) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, extra_args=extra),
                   None, arrival_time=time.time())


def decode(request: Request, tokens: int = 1) -> Request:
    """Move a request past prefill with `tokens` generated, as the engine would."""
    request.num_computed_tokens = request.num_prompt_tokens + tokens - 1
    request.append_output_token_ids([7] * tokens)
    return request


def finish(request: Request, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> Request:
    request.status = status
    return request


def sample(runtime, name: str, **labels) -> float:
    return runtime.metrics_registry.get_sample_value(name, labels) or 0.0



@pytest.fixture
def sender_for():
    senders = []

    def _sender(runtime) -> FeatureSender:
        sender = FeatureSender(runtime.config.channel)
        senders.append(sender)
        return sender

    return _sender


# -- client extras -------------------------------------------------------------------------------------
BAD_EXTRAS = {"leap_predicted_length": "x", "leap_oracle_length": float("nan"), "leap_planned_arrival": "soon",
              "leap_domain": 5, "leap_tenant": ["t"], "leap_request_id": 7, "leap_colour": "blue"}


def test_bad_client_extras_are_ignored_counted_and_warned_about_once_in_a_while(build, caplog):
    runtime = build(policy="client", decode_slots=1)
    good = decode(make_request("good-00000001", max_tokens=500, extra={"leap_predicted_length": 300}))
    bad = [decode(make_request(f"bad{i}-00000001", max_tokens=20, extra=dict(BAD_EXTRAS))) for i in range(50)]
    with caplog.at_level(logging.WARNING, logger="serving"):
        runtime.before_schedule([good, *bad], 0)
        for request in bad:
            runtime.on_finished(finish(request))
    # a bad prediction is no prediction: the request goes by its max_tokens (20 < 300), so `good` waits
    assert good.request_id in runtime.steps.last_held
    for key in BAD_EXTRAS:
        label = "unknown" if key == "leap_colour" else key  # a key LEAP does not know is counted as unknown
        assert sample(runtime, "leap:bad_request_extras_total", key=label) == 50, key
    warnings = [r for r in caplog.records if "leap_" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # rate limited, not one per request


def test_ten_thousand_distinct_unknown_extras_leave_the_metrics_bounded(build):
    runtime = build(policy="leap", decode_slots=1)
    requests = [make_request(f"odd{i}-00000001", extra={f"leap_x{i * 100 + k}": 1 for k in range(100)})
                for i in range(100)]  # 10,000 distinct key names in all
    runtime.before_schedule(requests, 0)
    for request in requests:
        runtime.on_finished(finish(request, RequestStatus.FINISHED_ABORTED))
    assert sample(runtime, "leap:bad_request_extras_total", key="unknown") == 10_000
    text = generate_latest(runtime.metrics_registry).decode()
    assert text.count("leap:bad_request_extras_total{") == 1 and "leap_x" not in text
    assert runtime.telemetry.snapshot()["bad_request_extras"] == {"unknown": 10_000}


def test_bad_extras_in_feedback_rows_fall_back_to_what_the_engine_knows(build, sender_for):
    runtime = build(policy="leap")
    runtime.reset_readout(first_value_readout(), None)
    rows = []
    runtime.recorder.listeners.append(rows.append)
    request = make_request("req-00000001", extra=dict(BAD_EXTRAS))
    runtime.before_schedule([request], 0)  # prefill: tracked, never held
    sender_for(runtime).send([request.request_id], feature(30.0)[None])
    assert eventually(lambda: request.request_id in runtime.tracker.predictions)
    runtime.before_schedule([decode(request)], 1)
    runtime.on_finished(finish(decode(request, 3)))
    assert len(rows) == 1
    row = rows[0]
    assert row["client_request_id"] == "req" and row["domain"] is None and row["tenant"] is None
    assert row["arrival_time"] == pytest.approx(request.arrival_time)
    assert row["predicted_latest"] == pytest.approx(30.0)


# -- the capture receiver ------------------------------------------------------------------------------
def test_receiver_drops_malformed_messages_with_a_reason_and_keeps_serving(build, sender_for):
    runtime = build(policy="leap")
    runtime.reset_readout(first_value_readout(), None)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(runtime.config.channel)
    try:
        raw.send_multipart([b"odd-size", b"12345"])
        raw.send_multipart([b"short", feature(5.0)[:-1].tobytes()])
        raw.send_multipart([b"nan", np.full(DIM, np.nan, np.float32).tobytes()])
        raw.send_multipart([b"\xff\xfe-not-utf8", feature(6.0).tobytes()])
        raw.send_multipart([b"one-part"])
        raw.send_multipart([b"three", b"parts", feature(7.0).tobytes()])
    finally:
        raw.close(linger=1000)
    sender_for(runtime).send(["after"], feature(42.0)[None])
    assert eventually(lambda: "after" in runtime.tracker.predictions)
    assert runtime.tracker.predictions["after"] == pytest.approx(42.0)
    assert not {"odd-size", "short", "nan"} & set(runtime.tracker.features)
    expected = {"not_float32": 1, "wrong_dim": 1, "non_finite": 1, "bad_id": 1, "bad_frame": 2}

    def dropped() -> dict:
        return {reason: sample(runtime, "leap:dropped_total", what="capture", reason=reason) for reason in expected}

    # two PUSH sockets into one PULL keep no order between them: "after" may be read before the raw ones
    assert eventually(lambda: dropped() == expected), dropped()
    health = runtime.health()
    assert health["threads"]["receiver"]["alive"] and health["healthy"]


# -- every prefilled request gets its feedback row -------------------------------------------------------
def test_a_request_that_ends_in_the_step_that_prefilled_it_gets_its_row(build, sender_for):
    runtime = build(policy="leap")
    rows = []
    runtime.recorder.listeners.append(rows.append)
    request = make_request("one-00000001", max_tokens=1)  # never resident at a step start: never tracked
    sender_for(runtime).send([request.request_id], feature(3.0)[None])
    assert eventually(lambda: request.request_id in runtime.tracker.features)
    runtime.on_finished(finish(decode(request, 1)))
    assert [row["client_request_id"] for row in rows] == ["one"] and rows[0]["output_tokens"] == 1


def test_two_requests_with_one_client_id_get_rows_of_their_own_keyed_by_the_process(build, sender_for):
    runtime = build(policy="leap")
    rows = []
    runtime.recorder.listeners.append(rows.append)
    first, second = (make_request(f"x-0000000{i}", max_tokens=1, extra={"leap_request_id": "reused\x00"})
                     for i in range(2))
    sender_for(runtime).send([first.request_id, second.request_id], np.stack([feature(3.0), feature(4.0)]))
    assert eventually(lambda: {first.request_id, second.request_id} <= set(runtime.tracker.features))
    for request in (first, second):
        runtime.on_finished(finish(decode(request, 1)))
    assert [row["client_request_id"] for row in rows] == ["reused\ufffd"] * 2  # NUL: no store's text holds it
    keys = [row["request_id"] for row in rows]
    assert len(set(keys)) == 2 and all(key.startswith(f"{runtime.recorder.row_ids.token}-") for key in keys)


def test_a_feature_that_lands_after_its_request_finished_still_makes_the_row(build, sender_for):
    runtime = build(policy="leap")
    rows = []
    runtime.recorder.listeners.append(rows.append)
    request = make_request("late-00000001")
    runtime.before_schedule([request], 0)
    runtime.on_finished(finish(decode(request, 3)))  # the worker's ZeroMQ message is still on its way
    assert rows == [] and runtime.tracker.sizes()["awaiting_feature"] == 1
    sent = feature(9.0)
    sender_for(runtime).send([request.request_id], sent[None])

    def settled() -> bool:
        runtime.after_schedule([], {})  # every engine step settles the rows waiting for a feature
        return bool(rows)

    assert eventually(settled)
    assert len(rows) == 1 and rows[0]["output_tokens"] == 3
    np.testing.assert_array_equal(rows[0]["feature"], sent)
    assert runtime.tracker.sizes()["awaiting_feature"] == 0
    assert sample(runtime, "leap:dropped_total", what="feedback_row", reason="feature_never_arrived") == 0
    assert sample(runtime, "leap:dropped_total", what="feature", reason="finished") == 0


def test_the_last_rows_are_written_while_the_engine_idles(build, sender_for):
    # no step follows the last finish of a burst: the idle settle writes its row when the feature lands
    runtime = build(policy="leap")
    rows = []
    runtime.recorder.listeners.append(rows.append)
    request = make_request("idle-00000001")
    runtime.before_schedule([request], 0)
    runtime.on_finished(finish(decode(request, 4)))
    assert rows == [] and runtime.tracker.sizes()["awaiting_feature"] == 1
    sender_for(runtime).send([request.request_id], feature(5.0)[None])
    assert eventually(lambda: bool(rows)), "the row waited for a step that never came"
    assert len(rows) == 1 and rows[0]["output_tokens"] == 4 and rows[0]["feature"] is not None
    assert runtime.health()["threads"]["idle_settle"]["alive"]


def test_a_feature_that_never_arrives_costs_one_counted_row_after_a_bounded_wait(build, monkeypatch):
    import serving.feedback.finished

    monkeypatch.setattr(serving.feedback.finished, "LATE_FEATURE_S", 0.05)
    runtime = build(policy="leap")
    rows = []
    runtime.recorder.listeners.append(rows.append)
    request = make_request("lost-00000001")
    runtime.before_schedule([request], 0)
    runtime.on_finished(finish(decode(request, 2)))
    time.sleep(0.1)
    runtime.after_schedule([], {})
    assert rows == [] and runtime.tracker.sizes()["awaiting_feature"] == 0
    assert sample(runtime, "leap:dropped_total", what="feedback_row", reason="feature_never_arrived") == 1
    assert runtime.stats()["finished"] == 1


# -- predictions that are not numbers ------------------------------------------------------------------
class FlakyHead:
    """An evaluation head (a non-linear predictor on the features) that yields NaN on one input."""

    def __init__(self) -> None:
        self.metadata = {"version": "flaky-head"}

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(X)
        return np.where(X[:, 0] == 13.0, np.nan, X[:, 0]).astype(np.float64)


def test_a_nan_prediction_is_no_prediction_and_the_request_goes_by_max_tokens(build, sender_for):
    runtime = build(policy="leap", decode_slots=1)
    runtime.serve_predictor(FlakyHead(), "flaky-head")
    runtime.configure(policy="leap", rls=False)
    short = make_request("short-00000001", max_tokens=10)
    long = make_request("long-00000001", max_tokens=500)
    runtime.before_schedule([short, long], 0)
    sender_for(runtime).send([short.request_id, long.request_id], np.stack([feature(13.0), feature(100.0)]))
    assert eventually(lambda: long.request_id in runtime.tracker.predictions)
    assert runtime.readouts.predictor.flush(2.0)
    assert short.request_id not in runtime.tracker.predictions
    assert sample(runtime, "leap:dropped_total", what="prediction", reason="non_finite") == 1
    runtime.before_schedule([decode(short), decode(long)], 1)
    assert runtime.steps.last_held == {long.request_id}  # 10 tokens (max_tokens) before 100 predicted


# -- waiting for predictions -----------------------------------------------------------------------------
def test_requests_without_a_prediction_share_one_bounded_wait_per_step(build):
    runtime = build(policy="leap", decode_slots=2, ready_wait_ms=150.0)
    runtime.reset_readout(first_value_readout(), None)
    requests = [make_request(f"r{i}-00000001", max_tokens=10 + i) for i in range(6)]
    runtime.before_schedule(requests, 0)
    start = time.perf_counter()
    runtime.before_schedule([decode(r) for r in requests], 1)
    elapsed = time.perf_counter() - start
    assert 0.14 <= elapsed < 0.4  # one 150 ms deadline for all six, not six in a row
    assert runtime.stats()["missed"] == 6
    assert runtime.steps.last_held == {r.request_id for r in requests[2:]}  # by max_tokens: 10 and 11 first
    start = time.perf_counter()
    runtime.before_schedule(requests, 2)  # the misses of a step are waited for once, not every step
    assert time.perf_counter() - start < 0.1


def test_a_prediction_arriving_during_the_wait_ends_it(build, sender_for):
    runtime = build(policy="leap", decode_slots=1, ready_wait_ms=3000.0)
    runtime.reset_readout(first_value_readout(), None)
    late = make_request("late-00000001", max_tokens=50)
    other = make_request("other-00000001", max_tokens=40)
    runtime.before_schedule([late, other], 0)
    sender = sender_for(runtime)
    sender.send([other.request_id], feature(30.0)[None])
    assert eventually(lambda: other.request_id in runtime.tracker.predictions)
    timer = threading.Timer(0.05, lambda: sender.send([late.request_id], feature(5.0)[None]))
    timer.start()
    start = time.perf_counter()
    runtime.before_schedule([decode(late), decode(other)], 1)
    assert time.perf_counter() - start < 1.5
    timer.join()
    assert runtime.steps.last_held == {other.request_id}  # predicted 5 beats predicted 30
    assert runtime.stats()["ready"] == 1 and runtime.stats()["missed"] == 1


# -- publishing while requests come and go ---------------------------------------------------------------
def test_a_push_while_features_arrive_and_requests_finish_never_fails(build, sender_for):
    runtime = build(policy="leap")
    runtime.reset_readout(first_value_readout("v0"), None)
    resident = [make_request(f"live{i}-00000001") for i in range(2000)]
    runtime.before_schedule(resident, 0)
    sender = sender_for(runtime)
    sender.send([r.request_id for r in resident], np.stack([feature(10.0 + i % 50) for i in range(2000)]))
    assert eventually(lambda: len(runtime.tracker.predictions) == 2000)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            ids = [f"churn{i}-{j}" for j in range(64)]
            sender.send(ids, np.tile(feature(3.0), (64, 1)))
            i += 1
            time.sleep(0.0005)

    thread = threading.Thread(target=churn, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread.start()
    try:
        deadline = time.monotonic() + 3.0
        version = 0
        while time.monotonic() < deadline:
            version += 1
            runtime.reset_readout(first_value_readout(f"v{version}"), None)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert runtime.readouts.version == f"v{version}"


# -- per-request state stays bounded ---------------------------------------------------------------------
def test_ten_thousand_aborted_requests_leave_no_per_request_state(build, sender_for):
    runtime = build(policy="leap")
    runtime.reset_readout(first_value_readout(), None)
    sender = sender_for(runtime)
    n = 10_000
    for i in range(n):
        request = make_request(f"gone{i}-00000001")
        runtime.before_schedule([request], i)  # resident, in prefill
        runtime.on_finished(finish(request, RequestStatus.FINISHED_ABORTED))
        sender.send([request.request_id], feature(20.0)[None])  # its feature arrives after the abort
    assert eventually(lambda: sample(runtime, "leap:dropped_total", what="feature", reason="finished") == n, 30)
    assert runtime.readouts.predictor.flush(5.0)
    assert (len(runtime.tracker.tracked), len(runtime.tracker.features), len(runtime.tracker.predictions)) == (0, 0, 0)


# -- health ----------------------------------------------------------------------------------------------
def test_health_reports_every_thread_and_the_drop_counters(build, tmp_path):
    runtime = build(policy="leap", feedback_dir=str(tmp_path / "feedback"))
    runtime.reset_readout(first_value_readout(), None)
    health = runtime.health()
    assert health["healthy"] is True
    assert {"receiver", "predictor", "rls", "feedback"} <= set(health["threads"])
    assert all(t["alive"] for t in health["threads"].values())
    assert {"dropped", "bad_request_extras", "thread_errors", "state"} <= set(health["counters"])
    json.dumps(health)  # plain data: it serialises as the admin API sends it
    exposed = generate_latest(runtime.metrics_registry).decode()
    for thread in ("receiver", "predictor", "rls", "feedback"):
        assert f'leap:thread_alive{{thread="{thread}"}} 1.0' in exposed
    assert "leap:feedback_rows_written" in exposed  # the writer's own counters, on the same registry


# -- the readout a replica starts with -------------------------------------------------------------------
def _anchor(readout: LinearReadout) -> dict:
    X = np.random.default_rng(3).normal(scale=4.0, size=(4 * DIM, DIM))
    return RLS.from_readout(readout, X).state_arrays()


def test_an_accepted_push_is_restored_at_the_next_start(build, tmp_path):
    state = tmp_path / "state"
    first = build(policy="leap", rls=True, state_dir=str(state))
    assert first.describe()["source"] == "none"
    readout = first_value_readout("pushed-1")
    first.push_readout(make_bundle(to_bytes(readout), _anchor(readout)))
    assert first.describe()["source"] == "push"
    first.close()

    second = build(policy="leap", rls=True, state_dir=str(state))
    described = second.describe()
    assert described["source"] == "state" and described["version"] == "pushed-1"
    assert described["rls"]["active"] is True
    np.testing.assert_allclose(second.readouts.readout.coef_, readout.coef_)


def test_a_damaged_state_folder_is_logged_and_never_fatal(build, tmp_path, caplog):
    state = tmp_path / "state"
    first = build(policy="leap", state_dir=str(state))
    first.push_readout(to_bytes(first_value_readout("pushed-1")))
    first.close()
    path = state / "readout.bin"
    path.write_bytes(path.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING, logger="serving"):
        second = build(policy="leap", state_dir=str(state))
    assert second.describe()["source"] == "none" and second.readouts.version == ""
    assert any("state" in r.getMessage() for r in caplog.records)


def test_the_configured_readout_file_serves_when_there_is_no_state(build, tmp_path):
    path = tmp_path / "readout.leap"
    path.write_bytes(to_bytes(first_value_readout("from-file")))
    runtime = build(policy="leap", readout_path=str(path), state_dir=str(tmp_path / "state"))
    assert runtime.describe()["source"] == "config" and runtime.readouts.version == "from-file"


# -- one tenant cannot fill what RLS learns -------------------------------------------------------------
def test_a_tenant_past_its_share_of_the_label_rows_teaches_rls_no_more_while_others_send(build, sender_for):
    runtime = build(policy="leap", rls=True, rls_every=1000, rls_tenant_max_share=0.5, rls_tenant_window=8)
    readout = first_value_readout("tenants-1")
    runtime.push_readout(make_bundle(to_bytes(readout), _anchor(readout)))
    sender = sender_for(runtime)
    tenants = ["big"] * 6 + ["small"] + ["big"] * 5  # big alone first: no cap while it is the only tenant
    requests = [make_request(f"t{i}-0000000{i % 10}", max_tokens=1, extra={"leap_tenant": tenant})
                for i, tenant in enumerate(tenants)]
    for request in requests:
        sender.send([request.request_id], feature(2.0)[None])
    assert eventually(lambda: all(r.request_id in runtime.tracker.features for r in requests))
    for request in requests:
        runtime.on_finished(finish(decode(request, 1), RequestStatus.FINISHED_STOPPED))
    # big: 6 learned alone; once small sends, big's rows wait until fewer than 4 of the last 8 are its own
    # learned rows: the 4 next are refused, the 5th (the window has moved past 4 of its early rows) learned
    assert eventually(lambda: runtime.readouts.learner.stats()["observed"] == 6 + 1 + 1)
    assert sample(runtime, "leap:dropped_total", what="rls_row", reason="tenant_share") == 4


def test_one_tenant_alone_teaches_rls_every_row(build, sender_for):
    runtime = build(policy="leap", rls=True, rls_every=1000, rls_tenant_max_share=0.5, rls_tenant_window=4)
    readout = first_value_readout("tenants-2")
    runtime.push_readout(make_bundle(to_bytes(readout), _anchor(readout)))
    sender = sender_for(runtime)
    requests = [make_request(f"solo{i}-0000000{i}", max_tokens=1) for i in range(9)]
    for request in requests:
        sender.send([request.request_id], feature(2.0)[None])
    assert eventually(lambda: all(r.request_id in runtime.tracker.features for r in requests))
    for request in requests:
        runtime.on_finished(finish(decode(request, 1), RequestStatus.FINISHED_STOPPED))
    assert eventually(lambda: runtime.readouts.learner.stats()["observed"] == 9)
    assert sample(runtime, "leap:dropped_total", what="rls_row", reason="tenant_share") == 0
