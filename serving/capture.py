"""Capture the residual stream after decoder layer L at the last prompt token, in the step that ends prefill.

The hook runs inside the model's forward. It reads the model runner's flattened batch layout (which rows
belong to which request, how many prompt tokens each has computed) to find, with a few numpy operations,
the requests whose prompt ends in this step; chunked prefill is covered because a chunk that does not
reach the prompt's end is skipped. The selected rows are copied off the accelerator (non-blocking, into
pinned memory on a GPU) and pushed to the scheduler process over a ZeroMQ socket, so the model never
waits for the predictor. Hooks only fire in eager mode: the engine must run with `enforce_eager=True`.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import numpy as np
import torch
import zmq

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


class FeatureSender:
    """Pushes (request id, float32 vector) messages; never blocks the forward pass."""

    def __init__(self, address: str) -> None:
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(address)
        self.sent = 0
        self.dropped = 0

    def send(self, request_ids: list[str], features: np.ndarray) -> None:
        features = np.ascontiguousarray(features, dtype=np.float32)
        for request_id, row in zip(request_ids, features):
            try:
                self._socket.send_multipart([request_id.encode(), row.tobytes()], flags=zmq.NOBLOCK,
                                            copy=False)
                self.sent += 1
            except zmq.Again:
                self.dropped += 1


class PrefillCapture:
    """Forward hooks on one decoder layer (serving) or on several (the layer study), one message per request.

    With several layers, each hook keeps its rows and the last one sends them concatenated in layer order,
    so a request's vector is `len(layers) * hidden_size` long.
    """

    def __init__(self, runner: Any, layer: int | list[int], sender: FeatureSender) -> None:
        self.runner = runner
        self.sender = sender
        self._copies: queue.SimpleQueue | None = None
        layers = decoder_layers(runner.get_model())
        self.num_layers = len(layers)
        wanted = [layer] if isinstance(layer, int) else list(layer)
        for index in wanted:
            if not -len(layers) <= index < len(layers):
                raise ValueError(f"layer {index} out of range: the model has {len(layers)} decoder layers")
        self.layers = [index % len(layers) for index in wanted]
        self.layer = self.layers[0] if len(self.layers) == 1 else -1
        self._parts: list[torch.Tensor] = []
        self.handles = [layers[index].register_forward_hook(self._hook_for(position))
                        for position, index in enumerate(self.layers)]
        self.captured = 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook_for(self, position: int):
        last = position == len(self.layers) - 1

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._hook(output, position, last)

        return hook

    def _hook(self, output: Any, position: int, last: bool) -> None:
        batch = self.runner.input_batch
        n = batch.num_reqs
        if n == 0:
            return
        query_start = self.runner.query_start_loc.np[: n + 1]
        index, rows = prompt_end_rows(batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n],
                                      query_start)
        if index.size == 0:
            return
        hidden, residual = residual_stream(output)
        row_index = torch.from_numpy(rows).to(hidden.device, non_blocking=True)
        state = hidden.index_select(0, row_index)
        if residual is not None:
            state = state + residual.index_select(0, row_index)
        state = state.float()
        if len(self.layers) > 1:
            if position == 0:
                self._parts = []
            self._parts.append(state)
            if not last:
                return
            state = torch.cat(self._parts, dim=1)
            self._parts = []
        req_ids = batch.req_ids
        ids = [req_ids[i] for i in index]
        self.captured += int(index.size)
        if state.device.type == "cpu":
            self.sender.send(ids, state.numpy())
            return
        # Accelerator: copy into pinned memory without blocking, and let a helper thread wait for the copy
        # while the host keeps launching the remaining layers.
        host = torch.empty(state.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(state, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if self._copies is None:
            self._copies = queue.SimpleQueue()
            threading.Thread(target=self._send_copies, name="leap-capture-copy", daemon=True).start()
        self._copies.put((done, host, ids))

    def _send_copies(self) -> None:
        assert self._copies is not None
        while True:
            done, host, ids = self._copies.get()
            done.synchronize()
            self.sender.send(ids, host.numpy())
