"""Engine step-time overhead of LEAP (capture + predictor + scheduler) against stock vLLM FCFS.

The stock and LEAP engines replay the same requests with the same fixed lengths, all queued at once, with
the resident set equal to the decode slots so both decode the same batch every step: the only difference
is LEAP's work. A third engine is vLLM with all its defaults, what a user runs instead. All are compiled.
The order rotates every repeat so drift on a shared machine hits each alike; the figures are ratios of
the median step time and of the total wall time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from harness.replay import ReplayRequest, encode_prompts, replay
from leap_core.readout import LinearReadout
from serving.config import LeapConfig
from study_harness.experiment import open_live


def _readout_for(live) -> LinearReadout:
    """Any readout serves for timing: the predictor's cost does not depend on the weights' values."""
    dim = live.runtime.dim
    rng = np.random.default_rng(0)
    return LinearReadout.from_weights(np.zeros(dim), np.ones(dim), rng.normal(scale=0.01, size=dim), 10.0,
                                      target="sqrt", max_tokens=1024,
                                      metadata={"model_id": live.model.model_id, "layer": live.runtime.layer,
                                                "model_fingerprint": live.model.fingerprint,
                                                "version": "overhead-bench"})


KINDS = ("stock", "leap", "stock_defaults")


def _one(kind: str, prompts: list[dict], tokens: int, slots: int, model: str | None) -> dict:
    leap = LeapConfig(policy="leap", rls=False, max_resident=slots, decode_slots=slots)
    if kind == "stock_defaults":
        from harness.engine import build_default_engine
        from study_harness.experiment import LiveSetup, resolve_model

        info = resolve_model(model)
        live = LiveSetup(build_default_engine(info.path), None, info, tokens, {})
    else:
        live = open_live(model, leap, stock=(kind == "stock"))
    try:
        if live.runtime is not None:
            live.runtime.reset_readout(_readout_for(live), None)
        encoded, _ = encode_prompts(live.engine.get_tokenizer(), prompts, 1024)
        requests = [ReplayRequest(id=p["id"], prompt_token_ids=p["prompt_token_ids"], max_tokens=tokens,
                                  fixed_length=tokens) for p in encoded]
        arrivals = np.zeros(len(requests))
        replay(live.engine, requests[: min(8, len(requests))], arrivals[:8], kind, tag="warmup-")
        result = replay(live.engine, requests, arrivals, kind, runtime=live.runtime, tag=f"{kind}-")
        return {"makespan_s": result.makespan_s, "step_ms": result.step_time_mean_ms, "steps": result.steps,
                "ready_before_decode": result.ready_before_decode,
                "schedule_ms_per_step": result.schedule_overhead_ms_per_step}
    finally:
        live.close()


def bench_overhead(prompts: list[dict], tokens: int = 64, slots: int = 32, repeats: int = 2,
                   model: str | None = None, say: Callable[[str], None] = lambda m: None) -> dict:
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for repeat in range(repeats):
        for kind in KINDS[repeat % len(KINDS):] + KINDS[:repeat % len(KINDS)]:
            say(f"{kind} engine, repeat {repeat + 1}/{repeats}")
            runs[kind].append(_one(kind, prompts, tokens, slots, model))
    stock_step = statistics.median(r["step_ms"] for r in runs["stock"])
    leap_step = statistics.median(r["step_ms"] for r in runs["leap"])
    stock_wall = statistics.median(r["makespan_s"] for r in runs["stock"])
    leap_wall = statistics.median(r["makespan_s"] for r in runs["leap"])
    defaults_wall = statistics.median(r["makespan_s"] for r in runs["stock_defaults"])
    return {
        "requests": len(prompts), "tokens": tokens, "slots": slots, "repeats": repeats,
        "stock_step_ms": stock_step, "leap_step_ms": leap_step,
        "step_overhead_pct": 100.0 * (leap_step / stock_step - 1.0),
        "stock_makespan_s": stock_wall, "leap_makespan_s": leap_wall,
        "makespan_overhead_pct": 100.0 * (leap_wall / stock_wall - 1.0),
        "stock_defaults_makespan_s": defaults_wall,
        "makespan_vs_stock_defaults_pct": 100.0 * (leap_wall / defaults_wall - 1.0),
        "leap_schedule_ms_per_step": statistics.median(r["schedule_ms_per_step"] for r in runs["leap"]),
        "ready_before_decode": min((r["ready_before_decode"] or 0.0) for r in runs["leap"]),
        "runs": runs,
    }
