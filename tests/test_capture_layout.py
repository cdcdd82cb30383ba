"""The compiled-mode capture on both vLLM model-runner layouts, without an engine.

The V2 model runner (`vllm/v1/worker/gpu/`) only runs on CUDA machines, so its batch layout is faked
here with the same field names; the V1 layout is the one the real CPU engine uses (tests/test_engine.py
covers it end to end). What is checked: after each forward, exactly the requests whose prompt ends in
this step are sent, with the residual-stream rows of their last prompt token, across chunked prefill.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from serving import vllm_compat
from serving.capture.hidden_states import RowSink, prompt_end_rows, select_rows


class RecordingSender:
    """A FeatureSender without the socket: it keeps what would be sent."""

    def __init__(self) -> None:
        self.sent_ids: list[str] = []
        self.rows: list[np.ndarray] = []
        self.sent = 0
        self.dropped = 0

    def send(self, request_ids, features) -> None:
        self.sent_ids += list(request_ids)
        self.rows += [np.array(row) for row in features]
        self.sent += len(request_ids)


# Three requests in one flattened step: r0 finishes its 5-token prompt (computed 0, scheduled 5);
# r1 is a 10-token prompt in its first chunk (computed 0, scheduled 4: no capture yet); r2 decodes.
REQ_IDS = ["r0", "r1", "r2"]
COMPUTED = np.array([0, 0, 7])
PROMPT = np.array([5, 10, 7])
QUERY_START = np.array([0, 5, 9, 10])
AUX = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)  # [tokens, hidden]


def v1_runner():
    batch = SimpleNamespace(num_reqs=3, req_ids=REQ_IDS, num_computed_tokens_cpu=COMPUTED,
                            num_prompt_tokens=PROMPT)
    runner = SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=QUERY_START),
                             execute_model_state=SimpleNamespace(aux_hidden_states=[AUX]))
    return runner


class FakeV2Runner:
    """The V2 runner's step state; its module name is what marks it as V2."""


FakeV2Runner.__module__ = "vllm.v1.worker.gpu.model_runner"


def v2_runner():
    batch = SimpleNamespace(num_reqs=3, req_ids=REQ_IDS, num_computed_prefill_tokens_np=COMPUTED,
                            prefill_len_np=PROMPT, query_start_loc_np=QUERY_START)
    runner = FakeV2Runner()
    runner.execute_model_state = SimpleNamespace(input_batch=batch, aux_hidden_states=[AUX])
    return runner


def test_prompt_end_rows_select_the_last_prompt_token_of_finishing_prompts_only():
    index, rows = prompt_end_rows(COMPUTED, PROMPT, QUERY_START)
    assert index.tolist() == [0]
    assert rows.tolist() == [4]


def test_both_runner_layouts_send_the_same_rows():
    for make in (v1_runner, v2_runner):
        runner = make()
        assert vllm_compat.is_v2_model_runner(runner) == (make is v2_runner)
        sender = RecordingSender()
        sink = RowSink(sender)
        ids, rows = sink.prompt_end(runner)
        sink.send(ids, select_rows(vllm_compat.step_aux_states(runner), rows))
        assert sender.sent_ids == ["r0"]
        np.testing.assert_array_equal(sender.rows[0], AUX[4].numpy())


def test_chunked_prefill_sends_once_at_the_chunk_that_ends_the_prompt():
    runner = v1_runner()
    sender = RecordingSender()
    sink = RowSink(sender)
    # Next step: r1's second chunk (computed 4, scheduled 6) ends its prompt at row 5 of its slice.
    runner.input_batch.req_ids = ["r1"]
    runner.input_batch.num_reqs = 1
    runner.input_batch.num_computed_tokens_cpu = np.array([4])
    runner.input_batch.num_prompt_tokens = np.array([10])
    runner.query_start_loc = SimpleNamespace(np=np.array([0, 6]))
    ids, rows = sink.prompt_end(runner)
    assert ids == ["r1"] and rows.tolist() == [5]


def test_several_aux_layers_are_concatenated_in_layer_order():
    runner = v1_runner()
    second = AUX + 100.0
    sender = RecordingSender()
    sink = RowSink(sender)
    ids, rows = sink.prompt_end(runner)
    sink.send(ids, select_rows([AUX, second], rows))
    np.testing.assert_array_equal(sender.rows[0], np.concatenate([AUX[4].numpy(), second[4].numpy()]))


def test_after_each_forward_runs_only_when_the_step_left_its_state():
    calls = []

    class Runner:
        execute_model_state = None

        def execute_model(self, output):
            self.execute_model_state = None if output is not None else SimpleNamespace(aux_hidden_states=[])
            return output

    runner = Runner()
    vllm_compat.after_each_forward(runner, lambda r: calls.append(r))
    assert runner.execute_model("direct output") == "direct output"
    assert calls == []
    assert runner.execute_model(None) is None
    assert calls == [runner]


def test_an_unknown_vllm_version_fails_fast_with_a_clear_message(monkeypatch):
    vllm_compat.check_version.cache_clear()
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: "0.99.0")
    monkeypatch.delenv(vllm_compat.ALLOW_UNKNOWN_ENV, raising=False)
    try:
        try:
            vllm_compat.check_version()
        except vllm_compat.UnsupportedVllmVersion as exc:
            assert "0.99.0" in str(exc) and "0.32" in str(exc)
        else:
            raise AssertionError("an unknown vLLM version was accepted")
        vllm_compat.check_version.cache_clear()
        monkeypatch.setenv(vllm_compat.ALLOW_UNKNOWN_ENV, "1")
        assert vllm_compat.check_version() == "0.99.0"
    finally:
        vllm_compat.check_version.cache_clear()


def test_installed_vllm_is_supported():
    assert vllm_compat.is_supported(vllm_compat.installed_version())


class PlainDecoder(torch.nn.Module):
    """A decoder without vLLM's aux hidden-state interface (SupportsEagle3)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(4)])


def _worker(enforce_eager: bool, tmp_path):
    model = PlainDecoder()
    runner = SimpleNamespace(get_model=lambda: model, speculative_config=None, use_aux_hidden_state_outputs=False,
                             parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                             input_batch=SimpleNamespace(num_reqs=0, req_ids=[]))
    config = SimpleNamespace(additional_config={"leap": {"layer": 2, "channel": f"ipc://{tmp_path}/c.sock"}},
                             model_config=SimpleNamespace(model="acme/PlainDecoder-1B", enforce_eager=enforce_eager),
                             instance_id="t")
    return SimpleNamespace(vllm_config=config, model_runner=runner)


def test_a_model_without_aux_states_is_refused_at_start_naming_the_model_and_the_fallback(tmp_path):
    from serving.worker import install_capture

    try:
        install_capture(_worker(enforce_eager=False, tmp_path=tmp_path))
    except RuntimeError as exc:
        message = str(exc)
        assert "acme/PlainDecoder-1B" in message and "--enforce-eager" in message and "tok/s" in message
    else:
        raise AssertionError("a model without aux hidden states started without the eager fallback")


def test_in_eager_mode_the_same_model_gets_the_forward_hook_capture(tmp_path):
    from serving.worker import install_capture

    capture = install_capture(_worker(enforce_eager=True, tmp_path=tmp_path))
    assert capture.method == "forward_hook" and capture.layer == 2
    capture.remove()


def test_in_process_features_skip_the_socket_and_bad_rows_are_dropped_and_counted(tmp_path):
    from serving.capture.hidden_states import FeatureSender
    from serving.capture.receiver import CaptureReceiver
    from serving.telemetry import Telemetry

    address = f"ipc://{tmp_path}/in-process.sock"
    batches = []
    telemetry = Telemetry()
    receiver = CaptureReceiver(address, (3,), lambda rid, f: None, telemetry,
                               deliver_batch=lambda ids, rows: batches.append((ids, [r.copy() for r in rows])))
    receiver.start()
    try:
        sender = FeatureSender(address)
        features = np.array([[1, 2, 3], [np.nan, 0, 0], [4, 5, 6]], dtype=np.float32)
        sender.send(["a", "b", "c"], features)
        assert sender.local == 3 and sender.dropped == 0
        assert [ids for ids, _ in batches] == [["a", "c"]]  # delivered in the call, no thread involved
        np.testing.assert_array_equal(batches[0][1][1], [4, 5, 6])
        assert telemetry.dropped("capture", "non_finite") == 1
    finally:
        receiver.close()
    sender.send(["d"], features[:1])  # after close: the socket path again
    assert sender.local == 3
