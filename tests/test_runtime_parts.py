"""The parts the LEAP runtime is composed of, each on its own: predictor, receiver checks, per-request
tracking, readout service, supervision, and the validated settings."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from pydantic import ValidationError

from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from leap_io.push_bundle import make_bundle
from serving.capture.receiver import BadMessage, decode_message
from serving.config import LeapConfig
from serving.readout.predictor import PredictorService
from serving.readout.saved_state import ReadoutState
from serving.readout.service import ReadoutService
from serving.supervise import RateLimitedLog, SupervisedThread
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker

DIM, LAYER = 8, 3


def first_feature_readout(version: str, max_tokens: int = 4096) -> LinearReadout:
    coef = np.zeros(DIM)
    coef[0] = 1.0
    return LinearReadout.from_weights(mean=np.zeros(DIM), scale=np.ones(DIM), coef=coef, intercept=0.0,
                                      alpha=1.0, target="raw", max_tokens=max_tokens,
                                      metadata={"layer": LAYER, "version": version})


def vector(first: float) -> np.ndarray:
    v = np.ones(DIM, dtype=np.float32)
    v[0] = first
    return v


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the predictor ---------------------------------------------------------------------------------------
class RaisesOnPoison:
    """A predictor (an evaluation head) that raises on one kind of input, as a model can on a bad vector."""

    def __init__(self) -> None:
        self.metadata = {"version": "head"}

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(X)
        if (X[:, 0] < 0).any():
            raise ValueError("negative input")
        return X[:, 0].astype(np.float64)


def test_one_bad_vector_in_a_batch_costs_one_prediction():
    got: dict[str, float] = {}
    drops = []
    service = PredictorService(RaisesOnPoison(), lambda ids, values, version, enq: got.update(zip(ids, values)),
                               on_drop=lambda reason, n: drops.append((reason, n)))
    for i in range(9):
        service.submit(f"good{i}", vector(10.0 + i))
    service.submit("poison", vector(-1.0))
    service.start()  # all ten are waiting: they go in one batch
    try:
        assert service.flush(5.0)
        assert got == {f"good{i}": 10.0 + i for i in range(9)}
        assert service.errors == 1 and service.row_errors == 1 and drops == [("predict_error", 1)]
        assert service.running
    finally:
        service.stop()


def test_the_predictor_queue_is_bounded_and_a_failing_callback_does_not_stop_it():
    calls = []

    def callback(ids, values, version, enqueued):
        calls.append(list(ids))
        if len(calls) == 1:
            raise RuntimeError("consumer bug")

    drops = []
    service = PredictorService(first_feature_readout("v"), callback, max_pending=3,
                               on_drop=lambda reason, n: drops.append((reason, n)))
    accepted = [service.submit(f"r{i}", vector(5.0)) for i in range(5)]
    assert accepted == [True, True, True, False, False] and service.dropped == 2
    service.start()
    try:
        assert service.flush(5.0)
        service.submit("after", vector(6.0))
        assert service.flush(5.0)
        assert calls[-1] == ["after"] and service.running and service.errors == 1
        assert ("queue_full", 1) in drops and ("callback_error", 3) in drops
    finally:
        service.stop()


# -- capture messages ------------------------------------------------------------------------------------
@pytest.mark.parametrize("frames, reason", [
    ([b"id", b"12345"], "not_float32"),
    ([b"id", np.ones(DIM - 1, np.float32).tobytes()], "wrong_dim"),
    ([b"id", np.array([np.inf] * DIM, np.float32).tobytes()], "non_finite"),
    ([b"\xc3\x28", np.ones(DIM, np.float32).tobytes()], "bad_id"),
    ([b"", np.ones(DIM, np.float32).tobytes()], "bad_id"),
    ([b"x" * 2000, np.ones(DIM, np.float32).tobytes()], "bad_id"),
    ([b"only"], "bad_frame"),
])
def test_malformed_capture_messages_are_named(frames, reason):
    with pytest.raises(BadMessage) as refused:
        decode_message(frames, {DIM, 4 * DIM})
    assert refused.value.reason == reason


def test_a_capture_message_of_every_layer_is_accepted_when_that_is_what_is_captured():
    rid, feature = decode_message([b"req-1", np.arange(4 * DIM, dtype=np.float32).tobytes()], {4 * DIM})
    assert rid == "req-1" and feature.shape == (4 * DIM,)


# -- per-request tracking --------------------------------------------------------------------------------
def test_late_features_and_predictions_of_finished_requests_are_dropped():
    telemetry = Telemetry()
    tracker = RequestTracker(telemetry, finished_memory=100)
    for i in range(10_000):
        rid = f"gone-{i}"
        tracker.finish(rid)
        assert not tracker.add_feature(rid, vector(1.0))
        assert tracker.add_predictions([rid], np.array([3.0]), "v") == 0
    sizes = tracker.sizes()
    assert (sizes["features"], sizes["predictions"], sizes["orphans"]) == (0, 0, 0)
    assert sizes["finished_memory"] == 100  # the memory of finished ids is bounded
    assert telemetry.dropped("feature", "finished") == 10_000
    assert telemetry.dropped("prediction", "finished") == 10_000


def test_state_of_ids_that_never_become_resident_expires():
    telemetry, clock = Telemetry(), Clock()
    tracker = RequestTracker(telemetry, orphan_ttl_s=60.0, clock=clock)
    for i in range(50):
        tracker.add_feature(f"stray-{i}", vector(1.0))
    tracker.add_predictions([f"stray-{i}" for i in range(50)], np.full(50, 7.0), "v")
    clock.now += 30
    assert tracker.expire() == 0  # not yet: a feature may arrive a step before its request is tracked
    clock.now += 31
    assert tracker.expire() == 50
    assert tracker.sizes()["features"] == tracker.sizes()["predictions"] == 0
    assert telemetry.dropped("feature", "expired") == 50 and telemetry.dropped("prediction", "expired") == 50


def test_non_finite_predictions_are_not_stored():
    telemetry = Telemetry()
    tracker = RequestTracker(telemetry)
    stored = tracker.add_predictions(["a", "b", "c"], np.array([np.nan, np.inf, 12.0]), "v")
    assert stored == 1 and tracker.predictions == {"c": 12.0}
    assert telemetry.dropped("prediction", "non_finite") == 2


def test_wait_for_returns_the_ids_still_missing_at_one_deadline_and_wakes_on_arrival():
    tracker = RequestTracker(Telemetry())
    tracker.add_predictions(["ready"], np.array([5.0]), "v")
    start = time.perf_counter()
    assert tracker.wait_for(["ready"], 5.0) == []
    assert time.perf_counter() - start < 0.05
    start = time.perf_counter()
    assert tracker.wait_for(["ready", "x", "y"], 0.1) == ["x", "y"]
    assert 0.09 <= time.perf_counter() - start < 0.5
    timer = threading.Timer(0.05, lambda: tracker.add_predictions(["x", "y"], np.array([1.0, 2.0]), "v"))
    timer.start()
    start = time.perf_counter()
    assert tracker.wait_for(["x", "y"], 5.0) == []
    assert time.perf_counter() - start < 1.0
    timer.join()


# -- the readout service ---------------------------------------------------------------------------------
@pytest.fixture
def service(tmp_path):
    telemetry = Telemetry()
    tracker = RequestTracker(telemetry)
    config = LeapConfig(rls=True, rls_every=4, state_dir=str(tmp_path / "state"))
    made = ReadoutService(config, {"layer": LAYER, "dim": DIM}, tracker, telemetry).start()
    yield made
    made.close()


def _bundle(readout: LinearReadout) -> bytes:
    X = np.random.default_rng(0).normal(scale=3.0, size=(6 * DIM, DIM))
    return make_bundle(to_bytes(readout), RLS.from_readout(readout, X).state_arrays())


def test_an_rls_publish_from_before_a_push_is_dropped(service):
    service.push(_bundle(first_feature_readout("v1")))
    stale_generation = service.learner.generation
    learned = first_feature_readout("v1+rls1")
    service.push(_bundle(first_feature_readout("v2")))
    service.publish_learned(learned, stale_generation)
    assert service.version == "v2"
    assert service._telemetry.dropped("readout", "stale_generation") == 1
    current = first_feature_readout("v2+rls1")
    service.publish_learned(current, service.learner.generation)
    assert service.version == "v2+rls1" and service.source == "push"


def test_rls_learns_on_the_service_and_publishes_under_the_current_generation(service):
    service.push(_bundle(first_feature_readout("v1")))
    rng = np.random.default_rng(1)
    for _ in range(4):
        service.observe(rng.normal(size=DIM), 40)
    assert service.learner.wait_idle(5)
    assert service.version == "v1+rls1"


def test_a_publish_rescores_every_live_request(service):
    service.push(to_bytes(first_feature_readout("v1")))
    tracker = service._tracker
    for i in range(20):
        tracker.add_feature(f"r{i}", vector(10.0 + i))
    service.push(to_bytes(first_feature_readout("v2")))
    assert tracker.predictions == {f"r{i}": 10.0 + i for i in range(20)}
    assert set(tracker.versions.values()) == {"v2"}


def test_the_state_folder_detects_a_torn_write(tmp_path):
    state = ReadoutState(tmp_path)
    state.save(b"readout-bytes", {"theta": np.arange(3.0)}, "v1")
    readout_bytes, rls_state, meta = state.load()
    assert readout_bytes == b"readout-bytes" and meta["version"] == "v1"
    np.testing.assert_array_equal(rls_state["theta"], np.arange(3.0))
    (tmp_path / ReadoutState.RLS).write_bytes(b"torn")
    with pytest.raises(RuntimeError, match="does not match"):
        state.load()


# -- supervision -----------------------------------------------------------------------------------------
def test_a_supervised_loop_that_raises_is_restarted_and_counted():
    runs = []
    done = threading.Event()

    def loop() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError(f"failure {len(runs)}")
        done.set()

    errors = []
    thread = SupervisedThread("test-loop", loop, on_error=errors.append, backoff_s=0.001).start()
    assert done.wait(5)
    thread.stop()
    assert len(runs) == 3 and thread.errors == 2 and thread.restarts == 2 and len(errors) == 2
    assert thread.last_error == "RuntimeError: failure 2"


def test_rate_limited_warnings_count_what_they_leave_out(caplog):
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("serving.test"), every_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="serving.test"):
        assert [limited.warning("k", "bad %s", i) for i in range(5)] == [True, False, False, False, False]
        clock.now += 61
        assert limited.warning("k", "bad %s", 5)
    assert [r.getMessage() for r in caplog.records] == ["bad 0", "bad 5 (4 similar since the last warning)"]


# -- settings --------------------------------------------------------------------------------------------
def test_the_policy_is_validated_on_construction_and_assignment():
    for name in ("fcfs", "leap", "oracle", "client"):
        assert LeapConfig(policy=name).policy == name
    with pytest.raises(ValidationError, match="unknown policy"):
        LeapConfig(policy="shortest-first")
    config = LeapConfig(policy="fcfs")
    with pytest.raises(ValidationError):
        config.policy = "nope"
    assert config.policy == "fcfs"
    assert (config.decode_order, config.length_source) == ("fcfs", "none")
    config.policy = "leap"
    assert (config.decode_order, config.length_source) == ("countdown", "predicted")


def test_the_order_is_countdown_or_gittins_for_predictor_policies_and_never_ages_the_index(monkeypatch):
    assert LeapConfig().order == "countdown" and LeapConfig().decode_order == "countdown"
    config = LeapConfig(order="gittins")
    assert config.decode_order == "gittins"
    config.policy = "oracle"  # true lengths, client lengths and FCFS have their own orders
    assert config.decode_order == "countdown"
    config.policy = "fcfs"
    assert config.decode_order == "fcfs"
    monkeypatch.setenv("LEAP_ORDER", "gittins")  # the environment reaches a config built from it, only
    assert LeapConfig.from_environment().order == "gittins" and LeapConfig().order == "countdown"
    monkeypatch.setenv("LEAP_ORDER", "shortest")
    with pytest.raises(ValidationError, match="'countdown' or 'gittins'"):
        LeapConfig.from_environment()
    monkeypatch.delenv("LEAP_ORDER")
    with pytest.raises(ValidationError, match="aging"):
        LeapConfig(order="gittins", aging=0.1)
    config = LeapConfig(order="gittins")
    with pytest.raises(ValidationError, match="countdown order only"):
        config.aging = 0.2
    assert config.aging == 0.0  # a refused assignment changes nothing
    config = LeapConfig(aging=0.2)
    with pytest.raises(ValidationError, match="countdown order only"):
        config.order = "gittins"
    assert config.order == "countdown"


def test_two_pushes_at_once_are_taken_one_after_the_other_and_the_newer_serves(service, monkeypatch):
    import serving.readout.service as readout_service

    service.push(_bundle(first_feature_readout("v1")))
    real = readout_service.validate_push
    entered = threading.Event()

    def slow_first(body, *args, **kwargs):  # the older push is still being checked when the newer arrives
        checked = real(body, *args, **kwargs)
        if checked[0].metadata["version"] == "v2":
            entered.set()
            time.sleep(0.5)
        return checked

    monkeypatch.setattr(readout_service, "validate_push", slow_first)
    older = threading.Thread(target=service.push, args=(_bundle(first_feature_readout("v2")),))
    older.start()
    assert entered.wait(5)
    service.push(_bundle(first_feature_readout("v3")))
    older.join(5)
    assert service.version == "v3"
    assert service.state.saved()[0] == "v3"  # the state a restart serves is the one serving
