"""Capture the residual stream after decoder layer L at the last prompt token, in the step that ends prefill.

Two routes, one result (a float32 vector per request, pushed to the scheduler process over ZeroMQ):
`AuxStateCapture` (default) uses vLLM's auxiliary hidden-state outputs, the path EAGLE-3 uses, so it works
under torch.compile and CUDA graphs at full speed; `PrefillCapture` uses forward hooks and serves models
without aux-state support only when the operator runs with `enforce_eager=True`. Either way the batch
layout finds the requests whose prompt ends in this step (chunked prefill included), and rows are copied
to pinned host memory without blocking, so the step never synchronizes with the device for LEAP.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import zmq

from leap_core.recipes import Recipe, RecipeError, request_columns, union
from serving import vllm_compat
from serving.capture.pooling import PromptPool
from serving.supervise import SupervisedThread

logger = logging.getLogger(__name__)

_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers",
                "transformer.h", "model.decoder.layers")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a vLLM causal LM (Llama, Qwen, Mistral and most HF decoders)."""
    for path in _LAYER_PATHS:
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList) and len(node) > 0:
            return node
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def residual_stream(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM decoder layers return (hidden, residual); the residual stream after the layer is their sum."""
    if isinstance(output, tuple):
        hidden = output[0]
        residual = output[1] if len(output) > 1 else None
        if isinstance(residual, torch.Tensor) and residual.shape == hidden.shape:
            return hidden, residual
        return hidden, None
    return output, None


def prompt_end_rows(num_computed: np.ndarray, num_prompt: np.ndarray, query_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request indices, flattened row indices) of the requests whose last prompt token is in this batch."""
    scheduled = np.diff(query_start)
    ends = (num_computed < num_prompt) & (num_prompt <= num_computed + scheduled)
    index = np.flatnonzero(ends)
    rows = query_start[index] + (num_prompt[index] - num_computed[index]) - 1
    return index, rows


class LocalReceiver(Protocol):
    """What a receiver bound in this process takes: a step's prefill features."""

    def deliver_local(self, request_ids: list[str], features: np.ndarray) -> None: ...


# Receivers bound in this process, by channel address. With one device the worker runs inside the
# engine-core process (vLLM's UniProcExecutor, in-process engines too), and the scheduler's receiver is
# here: features are then handed over in the step itself instead of through a socket and two threads, so
# a linear readout's prediction is ready before the request's first decode.
_local_receivers: dict[str, LocalReceiver] = {}


def register_local_receiver(address: str, receiver: LocalReceiver) -> None:
    _local_receivers[address] = receiver


def unregister_local_receiver(address: str, receiver: LocalReceiver) -> None:
    if _local_receivers.get(address) is receiver:
        del _local_receivers[address]


class FeatureSender:
    """Sends (request id, float32 vector) pairs to the scheduler's receiver; never blocks the forward pass.

    In-process receivers get the whole batch by a call; others a ZeroMQ message per request, whose
    send queue is bounded (`SNDHWM`): what does not fit is dropped and counted.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self.sent = 0
        self.dropped = 0
        self.local = 0

    def send(self, request_ids: list[str], features: np.ndarray) -> None:
        features = np.ascontiguousarray(features, dtype=np.float32)
        local = _local_receivers.get(self.address)
        if local is not None:
            try:
                local.deliver_local(list(request_ids), features)
                self.sent += len(request_ids)
                self.local += len(request_ids)
            except Exception:  # the receiver counts what it rejects; this is only a last guard
                logger.exception("LEAP capture: in-process delivery failed; %d features lost", len(request_ids))
                self.dropped += len(request_ids)
            return
        for request_id, row in zip(request_ids, features):
            try:
                self._socket.send_multipart([request_id.encode(), row.tobytes()], flags=zmq.NOBLOCK,
                                            copy=False)
                self.sent += 1
            except zmq.Again:
                self.dropped += 1


def select_rows(states: Sequence[torch.Tensor], rows: np.ndarray) -> torch.Tensor:
    """`states[k][rows]` concatenated along features, on the states' device."""
    row_index = torch.from_numpy(rows).to(states[0].device, non_blocking=True)
    parts = [state.index_select(0, row_index) for state in states]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


COPY_QUEUE_MAX = 1024  # steps whose device-to-host copies may wait for the copy thread at once


class RowSink:
    """Selects the prompt-end rows of one step from a [tokens, hidden] state and sends them, never blocking."""

    def __init__(self, sender: FeatureSender) -> None:
        self.sender = sender
        self.captured = 0
        self.copier: SupervisedThread | None = None  # the device-to-host copy loop, started at the first copy
        self._copies: queue.Queue | None = None

    def prompt_end(self, runner: Any) -> tuple[list[str], np.ndarray] | None:
        """(request ids, flattened rows) of the requests whose prompt ends in this step, or None."""
        req_ids, num_computed, num_prompt, query_start = vllm_compat.step_prompt_layout(runner)
        if len(req_ids) == 0:
            return None
        index, rows = prompt_end_rows(np.asarray(num_computed), np.asarray(num_prompt), np.asarray(query_start))
        if index.size == 0:
            return None
        return [req_ids[i] for i in index], rows

    def send(self, ids: list[str], vectors: torch.Tensor) -> None:
        """Send one recipe vector per request (rows of `vectors`, on the host or the device)."""
        self.captured += len(ids)
        self._ship(vectors, functools.partial(self.sender.send, ids), self._count_lost_features)

    def _ship(self, selected: torch.Tensor, deliver: Callable[[np.ndarray], None],
              lost: Callable[[int], None]) -> None:
        """Hand `selected` to `deliver` on the host; on a device, after a copy that never blocks the step."""
        selected = selected.float()
        if selected.device.type == "cpu":
            deliver(selected.numpy())
            return
        host = torch.empty(selected.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(selected, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if self._copies is None:
            self._copies = queue.Queue(maxsize=COPY_QUEUE_MAX)
            self.copier = SupervisedThread("leap-capture-copy", self._send_copies).start()
        try:
            self._copies.put_nowait((done, host, deliver, lost))
        except queue.Full:
            lost(int(selected.shape[0]))

    def _count_lost_features(self, count: int) -> None:
        self.sender.dropped += count


    def _send_copies(self) -> None:
        assert self._copies is not None
        while True:
            done, host, deliver, lost = self._copies.get()
            try:
                done.synchronize()
                deliver(host.numpy())
            except Exception:  # one failed copy must not end the thread that serves every request
                logger.exception("LEAP capture copy failed; %d rows lost", len(host))
                lost(len(host))


def checked_layers(layer: int | list[int], num_layers: int) -> list[int]:
    wanted = [layer] if isinstance(layer, int) else list(layer)
    for index in wanted:
        if not -num_layers <= index < num_layers:
            raise ValueError(f"layer {index} out of range: the model has {num_layers} decoder layers")
    return sorted({index % num_layers for index in wanted})


def capture_recipe(what: int | list[int] | Recipe | str, num_layers: int) -> Recipe:
    """The recipe a capture records: a recipe (or its name) as given, or the last-token state of one
    layer or of several (concatenated in layer order, the layer study)."""
    if isinstance(what, (Recipe, str)):
        return Recipe.parse(what).check_layers(num_layers)
    return union([Recipe.last(index) for index in checked_layers(what, num_layers)])


class _LayerCapture:
    """What both routes share: the recipe, the layers it reads (sorted, in range) and the sink its rows go to."""

    method = ""

    def __init__(self, runner: Any, what: int | list[int] | Recipe | str, sender: FeatureSender) -> None:
        self.runner = runner
        self.num_layers = len(decoder_layers(runner.get_model()))
        self.recipe = capture_recipe(what, self.num_layers)
        self.layers = list(self.recipe.layers)
        self.layer = self.layers[0] if len(self.layers) == 1 else -1  # -1: several
        self.sink = RowSink(sender)

    @property
    def sender(self) -> FeatureSender:
        return self.sink.sender

    @property
    def captured(self) -> int:
        return self.sink.captured


class AuxStateCapture(_LayerCapture):
    """The compiled-mode capture: the model returns the recipe's layers as aux hidden states.

    Aux index L + 1 is the stream after decoder layer L (vLLM adds `hidden + residual` after each listed
    index), i.e. transformers' `hidden_states[L + 1]`; the model returns them in index order. One vector
    per request holds the recipe's blocks in order (`leap_core.recipes`): last-token rows, prompt
    pools accumulated across prefill chunks (`serving.capture.pooling`), and the request's own columns (prompt
    length, decoding settings, domain) read from its sampling parameters when it was scheduled.
    """

    method = "aux_hidden_states"

    def __init__(self, runner: Any, what: int | list[int] | Recipe | str, sender: FeatureSender) -> None:
        super().__init__(runner, what, sender)
        self.pool = PromptPool(self.recipe, self.layers, functools.partial(vllm_compat.compute_logits, runner)) \
            if self.recipe.pools else None
        self.needs_requests = any(b.kind in REQUEST_KINDS for b in self.recipe.blocks)
        self._requests: dict[str, Any] = {}  # request id -> sampling params, until its prompt ends
        self.settings_missing = 0
        self.seconds = 0.0  # host seconds in the capture's step work (see `block_seconds` for its parts)
        self._assembly: dict[str, float] = {}
        vllm_compat.enable_aux_hidden_states(runner, tuple(index + 1 for index in self.layers))
        vllm_compat.after_each_forward(runner, self._after_forward)

    def _after_forward(self, runner: Any) -> None:
        start = time.perf_counter()
        try:
            self._step(runner)
        except Exception:  # never fail the engine's step for LEAP: the request is served without a prediction
            logger.exception("LEAP capture failed for one step")
            self.sink.sender.dropped += 1
        finally:
            self.seconds += time.perf_counter() - start

    def block_seconds(self) -> dict[str, float]:
        """Host seconds per recipe block: pooling (and the entropy logits) while prompts are computed, and
        assembling each block at the prompt's end."""
        out = dict(self._assembly)
        for name, seconds in (self.pool.seconds if self.pool is not None else {}).items():
            out[name] = out.get(name, 0.0) + seconds
        return out

    def _step(self, runner: Any) -> None:
        if self.needs_requests:
            self._remember_requests(runner)
        req_ids, *layout = vllm_compat.step_prompt_layout(runner)
        num_computed, num_prompt, query_start = (np.asarray(a) for a in layout)
        states = None
        if self.pool is not None and len(req_ids):
            states = vllm_compat.step_aux_states(runner)
            if states:
                final = vllm_compat.step_final_states(runner) if self.pool.entropy else None
                self.pool.add(req_ids, num_computed, num_prompt, query_start, states, final)
        index, rows = prompt_end_rows(num_computed, num_prompt, query_start) if len(req_ids) else ((), ())
        if len(index) == 0:
            return
        states = states or vllm_compat.step_aux_states(runner)
        if not states:
            return
        ids = [req_ids[i] for i in index]
        vectors = self._vectors(ids, rows, num_prompt[index], list(states))
        if vectors is None:
            self.sink.sender.dropped += len(ids)
        else:
            self.sink.send(ids, vectors)

    def _remember_requests(self, runner: Any) -> None:
        for request_id, params in vllm_compat.step_new_requests(runner):
            self._requests[request_id] = params
        while len(self._requests) > REQUESTS_MAX:  # requests aborted before their prompt ended
            self._requests.pop(next(iter(self._requests)))

    def _vectors(self, ids: list[str], rows: np.ndarray, prompt_tokens: np.ndarray,
                 states: list[torch.Tensor]) -> torch.Tensor | None:
        """[requests, recipe dim] in block order, or None when a pooled sum was lost."""
        pooled = None
        if self.pool is not None:
            pooled = self.pool.pop(ids)
            if pooled is None:
                return None
        hidden = states[0].shape[1]
        device = states[0].device
        row_index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device)
        columns = [self._request_columns(rid, int(n)) for rid, n in zip(ids, prompt_tokens)] \
            if self.needs_requests else []
        parts, k = [], 0
        clock = time.perf_counter()
        for block in self.recipe.blocks:
            if block.kind == "last":
                parts.append(states[self.layers.index(block.layer)].index_select(0, row_index).float())
            elif block.kind in ("mean", "entropy"):
                parts.append(pooled[:, k * hidden:(k + 1) * hidden])
                k += 1
            else:
                values = np.stack([c[block.name] for c in columns])
                parts.append(torch.from_numpy(values).to(device))
            now = time.perf_counter()
            self._assembly[block.name] = self._assembly.get(block.name, 0.0) + now - clock
            clock = now
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _request_columns(self, request_id: str, prompt_tokens: int) -> dict[str, np.ndarray]:
        params = self._requests.pop(request_id, None)
        if params is None:
            self.settings_missing += 1
        settings, max_tokens, domain = vllm_compat.sampling_settings(params, self.runner)
        return request_columns(self.recipe, prompt_tokens, settings, max_tokens, domain)


REQUEST_KINDS = ("prompt", "decoding", "domain")
REQUESTS_MAX = 65_536  # sampling parameters kept for requests whose prompt has not ended


class PrefillCapture(_LayerCapture):
    """The eager-mode fallback: forward hooks on one decoder layer or several, one message per request.

    Hooks never fire under torch.compile, so this serves only engines run with `enforce_eager=True`, on
    the V1 model runner, and only recipes of last-token blocks. With several layers each hook keeps its
    layer's residual stream for the step and the last one sends the rows in the recipe's block order.
    """

    method = "forward_hook"

    def __init__(self, runner: Any, what: int | list[int] | Recipe | str, sender: FeatureSender) -> None:
        if vllm_compat.is_v2_model_runner(runner):
            raise RuntimeError("the forward-hook capture reads the V1 model runner's batch; "
                               "set VLLM_USE_V2_MODEL_RUNNER=0 or use a model with aux hidden states")
        super().__init__(runner, what, sender)
        if any(b.kind != "last" for b in self.recipe.blocks):
            raise RecipeError(f"the forward-hook capture records last-token blocks only, not recipe {self.recipe}; "
                              f"serve this model with a last@L recipe")
        self._order = [self.layers.index(b.layer) for b in self.recipe.blocks]
        layers = decoder_layers(runner.get_model())
        self._found: tuple[list[str], np.ndarray] | None = None
        self._states: list[torch.Tensor] = []
        self.handles = [layers[index].register_forward_hook(self._hook_for(position))
                        for position, index in enumerate(self.layers)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook_for(self, position: int):
        last = position == len(self.layers) - 1

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            try:
                self._hook(output, position, last)
            except Exception:  # never fail the forward pass for LEAP
                logger.exception("LEAP capture hook failed for one step")
                self.sink.sender.dropped += 1

        return hook

    def _hook(self, output: Any, position: int, last: bool) -> None:
        if position == 0:
            self._found = self.sink.prompt_end(self.runner)
            self._states = []
        if self._found is None:
            return
        hidden, residual = residual_stream(output)
        self._states.append(hidden if residual is None else hidden + residual)
        if last:
            ids, rows = self._found
            self.sink.send(ids, select_rows([self._states[p] for p in self._order], rows))
            self._states, self._found = [], None
