"""`leap replay`: one engine, one slice of real prompts, several policies replayed back to back.

The readout for `leap` is read from a file, or fitted on training prompts that are disjoint from the
replayed slice. With fixed lengths every policy decodes the same number of tokens per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.replay import ReplayRequest, encode_prompts, planned_arrivals, replay
from leap_core.readout_format import from_bytes
from serving.config import LeapConfig
from study_harness.experiment import corpus_for, fit_on_corpus, fixed_length_requests, open_live

POLICIES = ("fcfs", "leap", "leap-rls", "oracle")


def _engine_policy(name: str) -> tuple[str, bool]:
    """(runtime policy, online learning) for a replay policy name."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
    return {"fcfs": ("fcfs", False), "leap": ("leap", False), "leap-rls": ("leap", True),
            "oracle": ("oracle", False)}[name]


def _lengths_file(path: Path) -> dict[str, int]:
    lengths = {}
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "id" not in row or "output_tokens" not in row:
                raise ValueError(f"{path}:{number}: expected {{'id', 'output_tokens'}}")
            lengths[str(row["id"])] = int(row["output_tokens"])
    return lengths


def run_replay(policies: Sequence[str], prompts: list[dict], train_prompts: list[dict], rate: float | None,
               trace: Path | None, rate_scale: float, fixed_lengths: str | None, readout_path: Path | None,
               rls_state_path: Path | None, max_tokens: int, max_resident: int, decode_slots: int,
               waiting_cap: int, seed: int, model: str | None, progress: Any = None) -> list[dict]:
    for name in policies:
        _engine_policy(name)
    leap = LeapConfig(policy="fcfs", rls=False, max_resident=max_resident, decode_slots=decode_slots,
                      waiting_cap=waiting_cap)
    if readout_path is not None:
        leap.readout_path = str(readout_path)
    live = open_live(model, leap, max_tokens=max_tokens)
    runtime = live.runtime
    try:
        needs_readout = any(p.startswith("leap") for p in policies)
        fixed = (fixed_lengths or "none").lower()
        corpus = None
        if fixed == "corpus":
            corpus = _with_progress(progress, "lengths", len(prompts), lambda cb: corpus_for(live, prompts, cb))
            requests = fixed_length_requests(live, prompts, corpus)
        else:
            lengths = _lengths_file(Path(fixed_lengths)) if fixed != "none" else {}
            encoded, _ = encode_prompts(live.engine.get_tokenizer(), prompts,
                                        live.engine.vllm_config.model_config.max_model_len - max_tokens - 1)
            requests = [ReplayRequest(id=p["id"], prompt_token_ids=p["prompt_token_ids"], max_tokens=max_tokens,
                                      fixed_length=lengths.get(p["id"]), domain=p.get("domain"))
                        for p in encoded]
        readout = rls_state = None
        if needs_readout:
            if readout_path is not None:
                readout = from_bytes(readout_path.read_bytes())
                if rls_state_path is not None:
                    with np.load(rls_state_path) as npz:
                        rls_state = {k: npz[k] for k in npz.files}
            else:
                train = _with_progress(progress, "training corpus", len(train_prompts),
                                       lambda cb: corpus_for(live, train_prompts, cb))
                readout, rls_state = fit_on_corpus(train, live.model, version="replay-train")
        arrivals = _arrivals(len(requests), rate, trace, rate_scale, seed)
        results = []
        for name in policies:
            policy, rls = _engine_policy(name)
            runtime.configure(policy=policy, rls=rls)  # before the reset, which anchors RLS only if it is on
            if policy == "leap":
                runtime.reset_readout(readout, rls_state)
            result = _with_progress(progress, f"replay {name}", len(requests),
                                    lambda cb, name=name: replay(live.engine, requests, arrivals, name,
                                                                 runtime=runtime, on_progress=cb, tag=f"{name}-"))
            summary = result.summary()
            if policy != "leap":
                summary["ready_before_decode"] = None
            summary.update(rate=rate, trace=str(trace) if trace else None, readout_version=(
                readout.metadata.get("version") if readout is not None and policy == "leap" else None))
            results.append(summary)
        return results
    finally:
        live.close()


def _arrivals(n: int, rate: float | None, trace: Path | None, rate_scale: float, seed: int) -> np.ndarray:
    trace_arrivals = None
    if trace is not None:
        from harness.datasets import load_trace

        trace_arrivals = load_trace(trace, limit=n)["arrival"] / rate_scale
    return planned_arrivals(n, rate, trace_arrivals, seed)


def _with_progress(progress: Any, label: str, total: int, work):
    if progress is None:
        return work(None)
    with progress:
        task = progress.add_task(label, total=total)
        return work(lambda done, all_: progress.update(task, completed=done, total=all_))
