"""Refresh in serving: re-estimating a decoding request's remaining length at set generated counts.

Fast parts first (no engine): which batch rows are decode states at a checkpoint, the settings, the
refresh message kind through the in-process hand-off and the socket, and the runtime driven through its
scheduler hooks with real vLLM requests. Then one engine test: the real engine and model, refresh at
g = 4 and 8, checked request by request.
"""

from __future__ import annotations

import io
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from serving.capture.hidden_states import (
    FeatureSender,
    RowSink,
    decode_checkpoint_rows,
    prompt_end_rows,
    unregister_local_receiver,
)
from serving.config import LeapConfig, leap_config_from_vllm
from serving.capture.receiver import (
    BadMessage,
    CaptureReceiver,
    decode_message,
    decode_refresh_message,
    refresh_message,
)
from serving.telemetry import Telemetry
from tests.runtime_fixtures import DIM, LAYER, build, channel, engine_config, eventually, first_value_readout  # noqa: F401

pytest.importorskip("vllm")

CHECKPOINTS = (4, 8)


# -- which rows are decode states at a checkpoint --------------------------------------------------------
# One flattened step, request by request: (computed before the step, prompt length, scheduled tokens).
STEP = {
    "prefill-chunk": (0, 10, 4),  # the first chunk of a long prompt
    "prompt-ends": (4, 10, 6),  # the chunk that ends the prompt: a prefill feature, not a decode state
    "one-token-prompt-end": (9, 10, 1),  # a one-token chunk ending the prompt: g would be 0
    "one-token-mid-prompt": (3, 10, 1),
    "decode-g4": (8, 5, 1),  # input is the 4th generated token: g = 8 - 5 + 1
    "decode-g5": (9, 5, 1),
    "decode-g8": (10, 3, 1),
    "drafts-from-g4": (7, 4, 3),  # a multi-token step past the prompt (speculative drafts)
}


def step_layout() -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    ids = list(STEP)
    computed, prompt, scheduled = (np.array(column) for column in zip(*STEP.values()))
    return ids, computed, prompt, np.concatenate([[0], np.cumsum(scheduled)])


def test_decode_rows_are_one_token_steps_past_the_prompt_at_a_checkpoint_only():
    ids, computed, prompt, query_start = step_layout()
    index, rows, generated = decode_checkpoint_rows(computed, prompt, query_start, CHECKPOINTS)
    assert [ids[i] for i in index] == ["decode-g4", "decode-g8"]
    assert generated.tolist() == [4, 8]
    assert rows.tolist() == [query_start[ids.index("decode-g4")], query_start[ids.index("decode-g8")]]


def test_prefill_rows_are_never_decode_rows_in_any_batch():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 12))
        prompt = rng.integers(1, 40, n)
        computed = rng.integers(0, 60, n)
        scheduled = np.where(rng.random(n) < 0.5, 1, rng.integers(1, 20, n))
        query_start = np.concatenate([[0], np.cumsum(scheduled)])
        index, rows, generated = decode_checkpoint_rows(computed, prompt, query_start, CHECKPOINTS)
        prefill, _ = prompt_end_rows(computed, prompt, query_start)
        assert not set(index.tolist()) & set(prefill.tolist())
        assert (computed[index] >= prompt[index]).all() and (scheduled[index] == 1).all()
        assert set(generated.tolist()) <= set(CHECKPOINTS)
        np.testing.assert_array_equal(generated, computed[index] - prompt[index] + 1)


def test_no_checkpoints_select_no_rows():
    _, computed, prompt, query_start = step_layout()
    index, rows, generated = decode_checkpoint_rows(computed, prompt, query_start, ())
    assert index.size == rows.size == generated.size == 0


class RecordingSender:
    """A FeatureSender without the socket: it keeps what would be sent."""

    def __init__(self) -> None:
        self.features: list[tuple[str, np.ndarray]] = []
        self.refreshes: list[tuple[str, int, np.ndarray]] = []

    def send(self, request_ids, features) -> None:
        self.features += [(rid, np.array(row)) for rid, row in zip(request_ids, features)]

    def send_refresh(self, request_ids, generated, features) -> None:
        self.refreshes += [(rid, int(g), np.array(row)) for rid, g, row in zip(request_ids, generated, features)]


class FakeV2Runner:
    """The V2 runner's step state; its module name is what marks it as V2."""


FakeV2Runner.__module__ = "vllm.v1.worker.gpu.model_runner"


def v1_runner(aux):
    ids, computed, prompt, query_start = step_layout()
    batch = SimpleNamespace(num_reqs=len(ids), req_ids=ids, num_computed_tokens_cpu=computed, num_prompt_tokens=prompt)
    return SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=query_start),
                           execute_model_state=SimpleNamespace(aux_hidden_states=[aux]))


def v2_runner(aux):
    """V2 keeps prompt lengths per request state, reached through the batch's index mapping."""
    ids, computed, prompt, query_start = step_layout()
    mapping = np.arange(len(ids))[::-1].copy()  # request states in another order than the batch
    prompt_len = np.empty(len(ids), dtype=np.int64)
    prompt_len[mapping] = prompt
    batch = SimpleNamespace(num_reqs=len(ids), req_ids=ids, num_computed_tokens_np=computed, idx_mapping_np=mapping,
                            query_start_loc_np=query_start)
    runner = FakeV2Runner()
    runner.execute_model_state = SimpleNamespace(input_batch=batch, aux_hidden_states=[aux])
    runner.req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=prompt_len))
    return runner


def test_both_runner_layouts_send_the_checkpoint_rows_as_refreshes_with_their_g():
    import torch

    _, _, _, query_start = step_layout()
    aux = torch.arange(int(query_start[-1]) * 3, dtype=torch.float32).reshape(-1, 3)
    for make in (v1_runner, v2_runner):
        sender = RecordingSender()
        sink = RowSink(sender)
        ids, generated, rows = sink.decode_checkpoints(make(aux), CHECKPOINTS)
        sink.send_refresh(ids, generated, [aux], rows)
        assert [(rid, g) for rid, g, _ in sender.refreshes] == [("decode-g4", 4), ("decode-g8", 8)], make
        for (_, _, vector), row in zip(sender.refreshes, rows):
            np.testing.assert_array_equal(vector, aux[row].numpy())
        assert sender.features == [] and sink.refreshes == 2 and sink.captured == 0


# -- settings --------------------------------------------------------------------------------------------
def test_refresh_is_off_by_default():
    config = LeapConfig()
    assert config.refresh_at == () and config.refresh_readout_path is None and not config.refresh_configured


def test_refresh_needs_both_settings():
    assert not LeapConfig(refresh_at=(16,)).refresh_configured
    assert not LeapConfig(refresh_readout_path="r.bin").refresh_configured
    assert LeapConfig(refresh_at=(16,), refresh_readout_path="r.bin").refresh_configured


def test_refresh_at_comes_from_the_environment_as_a_comma_list(monkeypatch):
    monkeypatch.setenv("LEAP_REFRESH_AT", "16, 32,64")
    assert LeapConfig().refresh_at == (16, 32, 64)
    monkeypatch.setenv("LEAP_REFRESH_AT", "")
    assert LeapConfig().refresh_at == ()


def test_refresh_at_travels_in_the_engine_config_as_a_list():
    vllm_config = SimpleNamespace(additional_config={"leap": {"refresh_at": [4, 8], "refresh_readout_path": "r"}})
    assert leap_config_from_vllm(vllm_config).refresh_at == (4, 8)


@pytest.mark.parametrize("value", ["0,4", "8,4", "4,4", "-1", "four", [2.5], "4;8"])
def test_refresh_at_must_be_increasing_counts_of_at_least_one(value):
    with pytest.raises(ValueError, match="refresh_at"):
        LeapConfig(refresh_at=value)


# -- the refresh message kind ---------------------------------------------------------------------------
def test_a_refresh_message_round_trips_and_is_never_read_as_a_prefill_message():
    vector = np.arange(DIM, dtype=np.float32)
    frames = refresh_message("req-1", 32, vector)
    request_id, generated, decoded = decode_refresh_message(frames, {DIM})
    assert (request_id, generated) == ("req-1", 32)
    np.testing.assert_array_equal(decoded, vector)
    with pytest.raises(BadMessage) as refused:
        decode_message(frames, {DIM})
    assert refused.value.reason == "bad_frame"
    with pytest.raises(BadMessage):
        decode_refresh_message([b"req-1", vector.tobytes()], {DIM})


@pytest.mark.parametrize("frames, reason", [
    (refresh_message("r", 0, np.zeros(DIM, np.float32)), "bad_generated"),
    (refresh_message("r", 4, np.zeros(DIM + 1, np.float32)), "wrong_dim"),
    (refresh_message("r", 4, np.full(DIM, np.nan, np.float32)), "non_finite"),
    ([b"leap-refresh", b"r", b"\x04\x00", np.zeros(DIM, np.float32).tobytes()], "bad_generated"),
])
def test_a_bad_refresh_message_names_why_it_is_dropped(frames, reason):
    with pytest.raises(BadMessage) as refused:
        decode_refresh_message(frames, {DIM})
    assert refused.value.reason == reason


class Collected:
    """What a receiver handed over, by kind."""

    def __init__(self) -> None:
        self.features: list[str] = []
        self.batches: list[str] = []
        self.refreshes: list[tuple[str, int]] = []

    def receiver(self, address: str, telemetry: Telemetry, refresh: bool = True) -> CaptureReceiver:
        return CaptureReceiver(
            address, (DIM,), lambda rid, f: self.features.append(rid), telemetry,
            deliver_batch=lambda ids, rows: self.batches.extend(ids),
            deliver_refresh=(lambda ids, gs, rows: self.refreshes.extend(zip(ids, gs.tolist()))) if refresh else None)



def test_in_process_refresh_rows_reach_only_the_refresh_handler():
    address, telemetry, got = channel(), Telemetry(), Collected()
    receiver = got.receiver(address, telemetry).start()
    try:
        sender = FeatureSender(address)
        rows = np.stack([np.ones(DIM, np.float32), np.full(DIM, np.nan, np.float32), np.zeros(DIM, np.float32)])
        sender.send_refresh(["a", "b", "c"], np.array([4, 4, 8]), rows)
        assert got.refreshes == [("a", 4), ("c", 8)] and got.batches == [] and got.features == []
        assert telemetry.dropped("refresh", "non_finite") == 1
        assert sender.refresh_sent == 3 and sender.sent == 0 and sender.local == 0
        sender.send(["p"], rows[:1])
        assert got.batches == ["p"] and got.refreshes == [("a", 4), ("c", 8)]
    finally:
        receiver.close()


def test_refresh_rows_over_the_socket_reach_only_the_refresh_handler():
    address, telemetry, got = channel(), Telemetry(), Collected()
    receiver = got.receiver(address, telemetry).start()
    unregister_local_receiver(address, receiver)  # as for a worker in another process
    try:
        sender = FeatureSender(address)
        sender.send_refresh(["a"], np.array([16]), np.ones((1, DIM), np.float32))
        sender.send(["p"], np.ones((1, DIM), np.float32))
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(address)
        raw.send_multipart(refresh_message("zero", 0, np.ones(DIM, np.float32)))
        raw.close(linger=1000)
        assert eventually(lambda: got.refreshes == [("a", 16)] and got.features == ["p"]
                          and telemetry.dropped("refresh", "bad_generated") == 1)
        assert receiver.stats()["refresh_delivered"] == 1 and receiver.stats()["delivered"] == 1
    finally:
        receiver.close()


def test_a_receiver_without_a_refresh_handler_counts_refresh_rows_as_dropped():
    address, telemetry, got = channel(), Telemetry(), Collected()
    receiver = got.receiver(address, telemetry, refresh=False).start()
    try:
        FeatureSender(address).send_refresh(["a", "b"], np.array([4, 8]), np.ones((2, DIM), np.float32))
        assert telemetry.dropped("refresh", "refresh_off") == 2 and got.batches == [] and got.features == []
    finally:
        receiver.close()


# -- the runtime ---------------------------------------------------------------------------------------


def vector(first: float, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    values[0] = first
    return values


def decoding(rid: str, generated: int, prompt: int = 4):
    """A real vLLM request past prefill with `generated` output tokens."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=512), None, arrival_time=time.time())
    request.num_computed_tokens = prompt + generated - 1
    request.append_output_token_ids([7] * generated)
    return request



@pytest.fixture
def refresh_file(tmp_path):
    path = tmp_path / "refresh.bin"
    path.write_bytes(to_bytes(first_value_readout("refresh-1")))
    return str(path)


def test_a_refresh_reorders_decodes_and_feedback_keeps_the_prefill_feature_and_prediction(build, refresh_file):
    from vllm.v1.request import RequestStatus

    runtime = build(policy="leap", refresh_at=CHECKPOINTS, refresh_readout_path=refresh_file)
    runtime.reset_readout(first_value_readout("v1"), None)
    rows = []
    runtime.listeners.append(rows.append)
    a, b = decoding("a-00000001", 4), decoding("b-00000001", 4)
    sender = FeatureSender(runtime.config.channel)
    sender.send([a.request_id, b.request_id], np.stack([vector(10.0), vector(50.0)]))
    runtime.before_schedule([a, b], 1)
    assert b.request_id in runtime.last_held  # countdown: a has 6 left, b 46

    sender.send_refresh([a.request_id], np.array([4]), vector(100.0, seed=1)[None])
    entry = runtime.tracked[a.request_id]
    assert (entry.refreshed_at, entry.refreshed_total) == (4, pytest.approx(104.0))
    runtime.before_schedule([a, b], 2)
    assert a.request_id in runtime.last_held  # refreshed: a has 100 left, b still 46

    runtime.reset_readout(first_value_readout("v2"), None)  # a publish rescores prefill predictions only
    assert runtime.tracked[a.request_id].refreshed_total == pytest.approx(104.0)
    sender.send_refresh([a.request_id, "gone-00000001"], np.array([4, 8]), np.stack([vector(1.0), vector(1.0)]))
    assert runtime.tracked[a.request_id].refreshed_total == pytest.approx(104.0)
    assert runtime.telemetry.dropped("refresh", "stale") == 1
    assert runtime.telemetry.dropped("refresh", "not_resident") == 1

    assert runtime.stats()["refreshed"] == 1
    assert runtime.describe()["refresh"] == {"active": True, "paused": False, "at": [4, 8], "version": "refresh-1",
                                             "error": None, "refreshed": 1}
    assert runtime.metrics_registry.get_sample_value("leap_refreshes_total") == 1.0
    a.status = RequestStatus.FINISHED_LENGTH_CAPPED
    runtime.on_finished(a)
    (row,) = rows
    np.testing.assert_array_equal(row["feature"], vector(10.0))
    assert row["predicted_latest"] == pytest.approx(10.0) and row["predicted_at_admission"] == pytest.approx(10.0)


def test_a_paused_refresh_keeps_the_countdown_and_counts_the_rows_it_drops(build, refresh_file):
    runtime = build(policy="leap", refresh_at=CHECKPOINTS, refresh_readout_path=refresh_file)
    runtime.reset_readout(first_value_readout("v1"), None)
    runtime.configure(refresh=False)  # the countdown arm of a paired replay on a refresh-capturing engine
    a = decoding("a-00000002", 4)
    sender = FeatureSender(runtime.config.channel)
    sender.send([a.request_id], vector(10.0)[None])
    runtime.before_schedule([a], 1)
    sender.send_refresh([a.request_id], np.array([4]), vector(100.0, seed=1)[None])
    assert runtime.tracked[a.request_id].refreshed_total is None
    assert runtime.telemetry.dropped("refresh", "refresh_paused") == 1
    assert runtime.describe_refresh()["paused"] and not runtime.describe_refresh()["active"]
    runtime.configure(refresh=True)
    sender.send_refresh([a.request_id], np.array([8]), vector(100.0, seed=1)[None])
    assert runtime.tracked[a.request_id].refreshed_total == pytest.approx(108.0)
    assert runtime.describe_refresh()["active"]


def test_refresh_cannot_be_resumed_where_it_does_not_serve(build):
    runtime = build(policy="leap")
    with pytest.raises(ValueError, match="refresh does not serve here"):
        runtime.configure(refresh=True)
    runtime.configure(refresh=False)  # pausing what is off is harmless


def nan_readout_bytes() -> bytes:
    with np.load(io.BytesIO(to_bytes(first_value_readout("nan")))) as stored:
        arrays = {name: stored[name] for name in stored.files}
    arrays["coef"] = arrays["coef"].copy()
    arrays["coef"][1] = np.nan
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


BAD_REFRESH_FILES = {
    "wrong dim": lambda: to_bytes(first_value_readout("r", dim=DIM + 1)),
    "wrong layer": lambda: to_bytes(first_value_readout("r", layer=LAYER + 1)),
    "nan weights": nan_readout_bytes,
    "not a readout": lambda: b"hello",
    "unreadable": None,
}


@pytest.mark.parametrize("case", list(BAD_REFRESH_FILES))
def test_a_refresh_readout_that_does_not_fit_is_logged_and_refresh_stays_off(build, tmp_path, caplog, case):
    path = tmp_path / "refresh.bin"
    if BAD_REFRESH_FILES[case] is not None:
        path.write_bytes(BAD_REFRESH_FILES[case]())
    with caplog.at_level(logging.ERROR, logger="serving"):
        runtime = build(policy="leap", refresh_at=CHECKPOINTS, refresh_readout_path=str(path))
    assert any("refresh is off" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records
               if r.levelno == logging.ERROR)
    described = runtime.describe()["refresh"]
    assert not described["active"] and str(path) in described["error"]
    runtime.reset_readout(first_value_readout("v1"), None)
    request = decoding("a-00000001", 4)
    sender = FeatureSender(runtime.config.channel)
    sender.send([request.request_id], vector(10.0)[None])
    sender.send_refresh([request.request_id], np.array([4]), vector(100.0)[None])
    assert runtime.predictions[request.request_id] == pytest.approx(10.0)  # the engine serves on
    assert runtime.telemetry.dropped("refresh", "refresh_off") == 1 and runtime.stats()["refreshed"] == 0


def test_refresh_at_without_a_readout_file_is_off_with_a_warning(build, caplog):
    with caplog.at_level(logging.WARNING, logger="serving"):
        runtime = build(policy="leap", refresh_at=CHECKPOINTS)
    assert runtime.refresher is None and "refresh_readout_path" in runtime.describe()["refresh"]["error"]
    assert any("refresh is off" in r.getMessage() for r in caplog.records)


def test_the_worker_captures_decode_states_only_for_a_refresh_readout_that_fits(tmp_path, refresh_file):
    from serving.worker import refresh_checkpoints

    from leap_core.recipes import Recipe

    worker = SimpleNamespace(vllm_config=engine_config())
    layers = worker.vllm_config.model_config.hf_text_config.num_hidden_layers
    fits = LeapConfig(refresh_at=CHECKPOINTS, refresh_readout_path=refresh_file)
    assert refresh_checkpoints(worker, fits, Recipe.last(LAYER), layers) == CHECKPOINTS
    # a refresh row holds every captured layer's state at the decode row, whatever block reads the layer
    assert refresh_checkpoints(worker, fits, Recipe.parse(f"last@{LAYER + 1}+mean@{LAYER}"), layers) == CHECKPOINTS
    assert refresh_checkpoints(worker, fits, Recipe.last(LAYER + 1), layers) == ()
    assert refresh_checkpoints(worker, LeapConfig(refresh_at=CHECKPOINTS), Recipe.last(LAYER), layers) == ()
    missing = LeapConfig(refresh_at=CHECKPOINTS, refresh_readout_path=str(tmp_path / "missing.bin"))
    assert refresh_checkpoints(worker, missing, Recipe.last(LAYER), layers) == ()


# -- the real engine -----------------------------------------------------------------------------------
ENGINE_LENGTHS = (2, 4, 6, 12)  # generated tokens per request: refreshes at g = 4 need 5 or more


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_decode_state_at(model_path: str, layer: int, prompt: list[int], output: list[int], g: int,
                           state: np.ndarray) -> None:
    """`state` is transformers' layer-L state at position P + g - 1 of prompt + output (the decode-state
    corpus' row for g), and not a neighbour's: adjacent positions differ well beyond the engine's numerics."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt + output]), output_hidden_states=True).hidden_states[layer + 1][0]
    position = len(prompt) + g - 1
    cosines = {p: cosine(state, reference[p].numpy()) for p in (position - 1, position, position + 1)}
    assert max(cosines, key=cosines.get) == position and cosines[position] >= 0.995, (g, cosines)


@pytest.mark.engine
def test_engine_refreshes_requests_past_each_checkpoint_and_feedback_keeps_prefill_features(tmp_path):
    from vllm import SamplingParams

    from harness.engine import EngineSettings, build_engine, leap_scheduler
    from harness.model_prep import prepare_model
    from serving.vllm_compat import external_request_id, in_process_worker
    from tests.engine_fixtures import LAYER as ENGINE_LAYER
    from tests.engine_fixtures import PROMPTS, chat_ids, spread_readout

    model = prepare_model()
    rng = np.random.default_rng(0)
    refresh = LinearReadout(alpha=1.0, target="sqrt", max_tokens=64, metadata={
        "model_id": model.model_id, "model_fingerprint": model.fingerprint, "layer": ENGINE_LAYER,
        "version": "refresh-test-1"}).fit(rng.normal(size=(64, model.hidden_size)), rng.integers(1, 64, size=64))
    refresh_path = tmp_path / "refresh.bin"
    refresh_path.write_bytes(to_bytes(refresh))
    config = LeapConfig(policy="leap", layer=ENGINE_LAYER, max_resident=16, decode_slots=16, waiting_cap=1000,
                        rls=False, refresh_at=CHECKPOINTS, refresh_readout_path=str(refresh_path))
    engine = build_engine(EngineSettings(model=model.path, max_model_len=2048, max_num_batched_tokens=256), config)
    try:
        runtime = leap_scheduler(engine).leap
        serving = spread_readout(model, runtime.dim)
        runtime.reset_readout(serving, None)
        rows = []
        runtime.listeners.append(rows.append)
        sender = in_process_worker(engine).leap_capture.sender
        sent: dict[tuple[str, int], np.ndarray] = {}
        send_refresh = sender.send_refresh

        def record_refresh(request_ids, generated, features):  # what the capture puts on the channel
            sent.update({(external_request_id(rid), int(g)): np.array(row, dtype=np.float64)
                         for rid, g, row in zip(request_ids, generated, features)})
            send_refresh(request_ids, generated, features)

        sender.send_refresh = record_refresh
        prompts = PROMPTS[:len(ENGINE_LENGTHS)]
        # each prompt twice: generating, and with one token only, whose feature can only be the prefill state
        for tag, lengths in (("gen", ENGINE_LENGTHS), ("prefill", (1,) * len(prompts))):
            for i, (text, tokens) in enumerate(zip(prompts, lengths)):
                params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0,
                                        extra_args={"leap_request_id": f"{tag}-{i}"})
                engine.add_request(f"{tag}-{i}", {"prompt_token_ids": chat_ids(engine, text)}, params)
        seen: dict[str, set[int]] = {}
        totals: dict[str, dict[int, float]] = {}
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[external_request_id(output.request_id)] = list(output.outputs[0].token_ids)
            for rid, entry in list(runtime.tracked.items()):
                name = external_request_id(rid)
                seen.setdefault(name, set()).add(entry.refreshed_at)
                if entry.refreshed_total is not None:
                    totals.setdefault(name, {})[entry.refreshed_at] = entry.refreshed_total
        stats = in_process_worker(engine).leap_capture_stats()
        prompt_ids = [chat_ids(engine, text) for text in prompts]
    finally:
        engine.engine_core.shutdown()

    for i, tokens in enumerate(ENGINE_LENGTHS):
        expected = {0, *(g for g in CHECKPOINTS if g < tokens)}
        observed = seen.get(f"gen-{i}", set()) | {0}  # a 2-token request may finish before a step sees it
        assert observed == expected, (tokens, observed)
        for g, total in totals.get(f"gen-{i}", {}).items():
            assert g + 1 <= total <= g + 64  # g + the refresh readout's remaining length, within [1, M]
    refreshes = sum(g < tokens for tokens in ENGINE_LENGTHS for g in CHECKPOINTS)
    assert runtime.stats()["refreshed"] == refreshes == stats["refresh_sent"] == stats["refresh_captured"]
    assert stats["refresh_dropped"] == 0
    assert runtime.metrics_registry.get_sample_value("leap_refreshes_total") == refreshes
    assert runtime.describe_refresh()["active"]
    assert not [key for key in runtime.telemetry.snapshot()["dropped"] if key.startswith("refresh/")]

    assert sorted(sent) == sorted((f"gen-{i}", g) for i, tokens in enumerate(ENGINE_LENGTHS)
                                  for g in CHECKPOINTS if g < tokens)
    for (name, g), state in sent.items():
        i = int(name.split("-")[1])
        assert_decode_state_at(model.path, ENGINE_LAYER, prompt_ids[i], outputs[name], g, state)

    by_id = {row["client_request_id"]: row for row in rows}
    assert len(by_id) == 2 * len(prompts)
    for i in range(len(prompts)):
        generated, prefill = by_id[f"gen-{i}"], by_id[f"prefill-{i}"]
        assert generated["output_tokens"] == ENGINE_LENGTHS[i]
        a, b = (np.asarray(row["feature"], dtype=np.float64) for row in (generated, prefill))
        assert cosine(a, b) >= 0.999, i
        assert generated["predicted_latest"] == pytest.approx(float(serving.predict(generated["feature"])[0]))
