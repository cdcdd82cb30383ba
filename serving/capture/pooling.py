"""Pooling over the prompt tokens, accumulated across prefill chunks (the `mean@L` and `entropy@L` blocks).

A prompt may be computed in several steps (chunked prefill), so each step adds the sum of its prompt
rows to a per-request accumulator, and the request's vector is read when its last prompt token is
computed. Each step costs one gather and one `index_add_` per pooled block; `entropy@L` also runs the
model's own logits over the step's prompt rows (in slices of `LOGIT_ROWS`), which is the one
expensive part of these recipes and is measured by `leap bench recipes`.

A request whose prefill starts again from token 0 (a recomputation after preemption) starts a fresh
sum. The accumulators are bounded: past `max_requests` the oldest is evicted and counted (`evicted`),
so a request aborted during its prefill cannot leak memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from leap_core.recipes import Recipe

LOGIT_ROWS = 256  # prompt rows whose logits are computed at once for the entropy weights
ENTROPY_LOGITS = "entropy_logits"  # the timing key of the logits every entropy block shares


def prompt_rows(num_computed: np.ndarray, num_prompt: np.ndarray, query_start: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request indices, prompt rows taken per such request, flattened row indices) of this step's
    prompt tokens: request i contributes its first min(scheduled, prompt left) rows."""
    scheduled = np.diff(query_start)
    take = np.minimum(scheduled, np.maximum(num_prompt - num_computed, 0))
    index = np.flatnonzero(take > 0)
    counts = take[index]
    if index.size == 0:
        return index, counts, np.zeros(0, dtype=np.int64)
    starts = np.repeat(query_start[index], counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return index, counts, (starts + offsets).astype(np.int64)


def entropy_of_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row's softmax (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


class PromptPool:
    """Running sums over each request's prompt rows for a recipe's pooled blocks.

    `layers` are the captured layers in the order of the step's aux states; `logits_of` turns final
    hidden states into next-token logits (the model's `compute_logits`).
    """

    def __init__(self, recipe: Recipe, layers: Sequence[int], logits_of: Callable[[torch.Tensor], torch.Tensor],
                 max_requests: int = 4096) -> None:
        self.blocks = [b for b in recipe.blocks if b.kind in ("mean", "entropy")]
        self.positions = [list(layers).index(b.layer) for b in self.blocks]
        self.entropy = any(b.kind == "entropy" for b in self.blocks)
        self.logits_of = logits_of
        self.max_requests = max_requests
        # request id -> (sums [blocks, hidden], token count, entropy weight total)
        self._sums: OrderedDict[str, list] = OrderedDict()
        self.evicted = 0
        self.seconds: dict[str, float] = {}  # host seconds spent per block (and ENTROPY_LOGITS), see `_charge`

    def _charge(self, name: str, since: float) -> float:
        """Add the host time since `since` to `name`; return now. On a CPU engine this is the work itself;
        on an accelerator only the launches (the device runs asynchronously)."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - since
        return now

    def __len__(self) -> int:
        return len(self._sums)

    def add(self, req_ids: Sequence[str], num_computed: np.ndarray, num_prompt: np.ndarray,
            query_start: np.ndarray, states: Sequence[torch.Tensor], final: torch.Tensor | None) -> None:
        """Add this step's prompt rows to their requests' sums."""
        index, counts, rows = prompt_rows(num_computed, num_prompt, query_start)
        if index.size == 0:
            return
        device = states[0].device
        row_t = torch.from_numpy(rows).to(device)
        seg_t = torch.from_numpy(np.repeat(np.arange(index.size), counts)).to(device)
        clock = time.perf_counter()
        weights = self._entropy(final, row_t) if self.entropy else None
        if self.entropy:
            clock = self._charge(ENTROPY_LOGITS, clock)
        step = torch.zeros((index.size, len(self.blocks), states[0].shape[1]), dtype=torch.float32, device=device)
        for k, (block, position) in enumerate(zip(self.blocks, self.positions)):
            x = states[position].index_select(0, row_t).float()
            if block.kind == "entropy":
                x = x * weights[:, None]
            step[:, k].index_add_(0, seg_t, x)
            clock = self._charge(block.name, clock)
        wsum = (torch.zeros(index.size, dtype=torch.float32, device=device).index_add_(0, seg_t, weights)
                if weights is not None else None)
        for j, i in enumerate(index):
            rid = req_ids[i]
            if num_computed[i] == 0:
                self._sums.pop(rid, None)
                self._sums[rid] = [torch.zeros_like(step[j]), 0, 0.0]
                if len(self._sums) > self.max_requests:
                    self._sums.popitem(last=False)
                    self.evicted += 1
            acc = self._sums.get(rid)
            if acc is None:  # its earlier chunks were evicted: a partial sum would be wrong, `pop` says so
                continue
            acc[0] += step[j]
            acc[1] += int(counts[j])
            acc[2] = acc[2] + (wsum[j] if wsum is not None else 0.0)

    def _entropy(self, final: torch.Tensor | None, row_t: torch.Tensor) -> torch.Tensor:
        if final is None:
            raise RuntimeError("entropy pooling needs the step's final hidden states, which this runner does not keep")
        parts = []
        for start in range(0, row_t.numel(), LOGIT_ROWS):
            logits = self.logits_of(final.index_select(0, row_t[start:start + LOGIT_ROWS]))
            parts.append(entropy_of_logits(logits))
        return torch.cat(parts)

    def pop(self, request_ids: Sequence[str]) -> torch.Tensor | None:
        """[requests, blocks * hidden] pooled vectors, in block order; None if a request has no sum (its
        earlier chunks were evicted), and then every one of these requests' sums is dropped."""
        found = [self._sums.pop(rid, None) for rid in request_ids]
        if any(acc is None for acc in found):
            return None
        out = []
        for sums, count, wsum in found:
            denominators = [max(float(wsum), 1e-12) if b.kind == "entropy" else float(count) for b in self.blocks]
            out.append(torch.cat([sums[k] / d for k, d in enumerate(denominators)]))
        return torch.stack(out)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._sums.pop(rid, None)
