"""Decode states: the layer-L state the engine computes after a request has generated g tokens, with the
length that remained, for the refresh study (re-estimating a request's remaining length during decoding).

Per batch of prompts, two passes through the real engine:

1. Each prompt is generated greedily with the corpus' budget and decoding, keeping its output tokens;
   the capture records its prefill state (the g = 0 row).
2. For each checkpoint g below the output's length, prompt + the first g output tokens goes back in as a
   prompt with one output token, and the capture records the state at its last token. That is the state
   the engine computed at position P + g - 1 while decoding the request (causal attention: it depends on
   those tokens only); computing it as a prefill reuses the serving capture unchanged.

Every row is a `Corpus` row, so the cache, the snapshot and their hashes hold it as they hold prefill
rows: id `<prompt id>@<g>`, prompt_tokens P + g, output_tokens the remaining length L - g, the whole
output's finish reason ("length" rows are censored at M). Batches are written as they finish, so a
stopped build resumes at the first prompt without its g = 0 row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.replay import ReplayRequest, encode_prompts, sampling_params
from study_harness.corpus import ENGINE_NUMERICS, Corpus, load_corpus, note_skipped, noted_skipped, write_shard

CHECKPOINTS = (16, 32, 64, 128, 256, 512)
SEPARATOR = "@"


def decode_states_key(fingerprint: str, layer: int, max_tokens: int, decoding: dict,
                      checkpoints: Sequence[int] = CHECKPOINTS) -> str:
    """The cache and snapshot key of a decode-state corpus (a prefill corpus' key fields plus checkpoints)."""
    blob = json.dumps({"fp": fingerprint, "layer": layer, "M": max_tokens, "decoding": decoding,
                       "engine": ENGINE_NUMERICS, "checkpoints": [int(g) for g in checkpoints]}, sort_keys=True)
    return f"D{layer}-M{max_tokens}-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def row_id(prompt_id: str, generated: int) -> str:
    return f"{prompt_id}{SEPARATOR}{int(generated)}"


def split_ids(ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, generated counts) of decode-state row ids."""
    parts = [str(i).rsplit(SEPARATOR, 1) for i in ids]
    return (np.array([p[0] for p in parts], dtype=object),
            np.array([int(p[1]) for p in parts], dtype=np.int64))


def checkpoint_matrix(rows: Corpus, prompt_ids: Sequence[str],
                      checkpoints: Sequence[int] = CHECKPOINTS) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (len(prompt_ids), 1 + len(checkpoints)) of each prompt's g = 0 and checkpoint rows,
    -1 where a prompt has none (its output ended before g), and whether each prompt has its g = 0 row."""
    owners, generated = split_ids(rows.ids)
    column = {0: 0, **{int(g): c + 1 for c, g in enumerate(checkpoints)}}
    position = {p: i for i, p in enumerate(prompt_ids)}
    index = np.full((len(prompt_ids), 1 + len(checkpoints)), -1, dtype=np.int64)
    for k, (owner, g) in enumerate(zip(owners, generated)):
        if owner in position and int(g) in column:
            index[position[owner], column[int(g)]] = k
    return index, index[:, 0] >= 0


def missing_prompts(folder: Path, layer: int, max_tokens: int, prompt_ids: Sequence[str]) -> list[str]:
    """Prompt ids with no g = 0 row yet, leaving out those known to be too long for the engine."""
    from study_harness.snapshot import skipped_ids

    rows = load_corpus(folder, layer, max_tokens)
    done = {p for p, g in zip(*split_ids(rows.ids)) if g == 0} if len(rows) else set()
    done |= noted_skipped(folder) | skipped_ids(folder.name)
    return [p for p in prompt_ids if p not in done]


def build_decode_states(engine: Any, runtime: Any, prompts: Sequence[dict], folder: Path, max_tokens: int,
                        decoding: dict, checkpoints: Sequence[int] = CHECKPOINTS, max_prompt_tokens: int = 2048,
                        batch: int = 128, on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Record the g = 0 and checkpoint rows of every prompt not yet in `folder` (see the module doc)."""
    todo = [p for p in prompts if p["id"] in set(missing_prompts(folder, runtime.layer, max_tokens,
                                                                  [p["id"] for p in prompts]))]
    encoded, dropped = encode_prompts(engine.get_tokenizer(), todo, max_prompt_tokens)
    kept = {p["id"] for p in encoded}
    note_skipped(folder, [p["id"] for p in todo if p["id"] not in kept])
    written = 0
    for start in range(0, len(encoded), batch):
        rows = _one_batch(engine, runtime, encoded[start:start + batch], max_tokens, decoding, checkpoints)
        write_shard(folder, rows)
        written += len(rows)
        if on_progress is not None:
            on_progress(min(start + batch, len(encoded)), len(encoded))
    return {"requested": len(prompts), "cached": len(prompts) - len(todo), "rows": written,
            "dropped_too_long": dropped}


def _one_batch(engine: Any, runtime: Any, items: list[dict], max_tokens: int, decoding: dict,
               checkpoints: Sequence[int]) -> list[dict]:
    features: dict[str, np.ndarray] = {}

    def collect(row: dict) -> None:
        if row.get("feature") is not None:
            features[str(row["client_request_id"])] = np.asarray(row["feature"], dtype=np.float32)

    runtime.recorder.listeners.append(collect)
    try:
        outputs = _run(engine, [(row_id(item["id"], 0), item["prompt_token_ids"], max_tokens) for item in items],
                       decoding)
        later = [(row_id(item["id"], g), item["prompt_token_ids"] + outputs[row_id(item["id"], 0)][0][:g], 1)
                 for item in items for g in checkpoints
                 if row_id(item["id"], 0) in outputs and g < len(outputs[row_id(item["id"], 0)][0])]
        _run(engine, later, decoding)
    finally:
        runtime.recorder.listeners.remove(collect)
    rows = []
    for item in items:
        first = outputs.get(row_id(item["id"], 0))
        if first is None:
            continue
        tokens, finish = first
        for g in (0, *checkpoints):
            key = row_id(item["id"], g)
            if g >= len(tokens) or key not in features:
                continue
            rows.append({"id": key, "set": item.get("set"), "domain": item.get("domain"), "lang": item.get("lang"),
                         "prompt_tokens": len(item["prompt_token_ids"]) + g, "output_tokens": len(tokens) - g,
                         "finish_reason": finish, "feature": features[key]})
    return rows


def _run(engine: Any, requests: list[tuple[str, list[int], int]], decoding: dict) -> dict[str, tuple[list[int], str]]:
    """Queue every (id, prompt tokens, budget) at once and step to the end: id -> (output tokens, finish)."""
    for key, token_ids, budget in requests:
        engine.add_request(f"decode-{key}", {"prompt_token_ids": list(token_ids)},
                           sampling_params(ReplayRequest(id=key, prompt_token_ids=list(token_ids),
                                                         max_tokens=budget), decoding))
    finished: dict[str, tuple[list[int], str]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                finished[output.request_id.removeprefix("decode-")] = (list(completion.token_ids),
                                                                      str(completion.finish_reason))
    return finished
