"""What each feature recipe costs the engine: throughput against the last-token recipe, capture time per request.

Each recipe gets its own compiled LEAP engine (a recipe decides which aux layers the compiled graph returns),
serving a readout of its own dimension; all replay the same requests with the same fixed lengths, all
queued at once, resident set equal to the decode slots, so the only difference is the capture's work. The
order rotates every repeat so drift on a shared machine hits each alike. Per engine:

- `tokens_per_s`: generated tokens over the replay's wall time; its ratio to the last-token recipe's
  (`throughput_vs_last`, per repeat, then the median and range) is the goal's figure;
- `capture_ms_per_request`: host time of the capture's step work per captured request, and its parts per
  block (`block_ms_per_request`; on a CPU engine the work itself);
- `ready_before_decode`: the share of requests whose prediction was ready before their first decode.

`capture_ms_per_block` (the widest recipe's parts, per request) plus `capture_ms_base` (the step work every
recipe does: the reference recipe's capture time less its blocks) is what `leap eval recipes` sums for
recipes that were not benchmarked themselves.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import numpy as np

from harness.replay import ReplayRequest, encode_prompts, replay
from leap_core.readout import LinearReadout
from leap_core.recipes import Recipe
from serving.config import LeapConfig
from study_harness.experiment import open_live


def _readout_for(live, recipe: Recipe) -> LinearReadout:
    """Any readout of the recipe's dimension serves for timing: the cost does not depend on the weights."""
    dim = recipe.dim(live.runtime.dim)
    rng = np.random.default_rng(0)
    return LinearReadout.from_weights(np.zeros(dim), np.ones(dim), rng.normal(scale=0.01, size=dim), 10.0,
                                      target="sqrt", max_tokens=1024,
                                      metadata={"model_id": live.model.model_id, "layer": live.runtime.layer,
                                                "recipe": str(recipe), "model_fingerprint": live.model.fingerprint,
                                                "version": "recipe-bench"})


def _one(recipe: Recipe, prompts: list[dict], tokens: int, slots: int, model: str | None) -> dict:
    from serving.vllm_compat import in_process_worker

    live = open_live(model, LeapConfig(policy="leap", rls=False, recipe=str(recipe), max_resident=slots,
                                       decode_slots=slots))
    try:
        live.runtime.reset_readout(_readout_for(live, recipe), None)
        encoded, _ = encode_prompts(live.engine.get_tokenizer(), prompts, 1024)
        requests = [ReplayRequest(id=p["id"], prompt_token_ids=p["prompt_token_ids"], max_tokens=tokens,
                                  fixed_length=tokens) for p in encoded]
        arrivals = np.zeros(len(requests))
        replay(live.engine, requests[: min(8, len(requests))], arrivals[:8], str(recipe), tag="warmup-")
        capture = in_process_worker(live.engine).leap_capture
        seconds, blocks = capture.seconds, capture.block_seconds()
        captured = capture.captured
        result = replay(live.engine, requests, arrivals, str(recipe), runtime=live.runtime, tag="bench-")
        n = max(capture.captured - captured, 1)
        block_ms = {name: 1e3 * (value - blocks.get(name, 0.0)) / n for name, value in capture.block_seconds().items()}
        return {"makespan_s": result.makespan_s, "tokens_per_s": len(requests) * tokens / result.makespan_s,
                "step_ms": result.step_time_mean_ms, "ready_before_decode": result.ready_before_decode,
                "capture_ms_per_request": 1e3 * (capture.seconds - seconds) / n, "block_ms_per_request": block_ms,
                "captured": n}
    finally:
        live.close()


def _interval(values: Sequence[float]) -> dict:
    return {"value": statistics.median(values), "ci_low": min(values), "ci_high": max(values), "n": len(values)}


def bench_recipes(prompts: list[dict], recipes: Sequence[str], tokens: int = 64, slots: int = 32, repeats: int = 2,
                  model: str | None = None, say: Callable[[str], None] = lambda m: None) -> dict:
    """Every recipe's engine `repeats` times in rotating order; the first recipe is the reference."""
    parsed = [Recipe.parse(r) for r in recipes]
    names = [str(r) for r in parsed]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(repeats):
        order = parsed[repeat % len(parsed):] + parsed[:repeat % len(parsed)]
        for recipe in order:
            say(f"{recipe} engine, repeat {repeat + 1}/{repeats}")
            runs[str(recipe)].append(_one(recipe, prompts, tokens, slots, model))
    reference = names[0]
    summary = {}
    for name in names:
        ratios = [run["tokens_per_s"] / ref["tokens_per_s"] for run, ref in zip(runs[name], runs[reference])]
        summary[name] = {
            "throughput_vs_last": _interval(ratios),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[name]),
            "capture_ms_per_request": statistics.median(r["capture_ms_per_request"] for r in runs[name]),
            "ready_before_decode": min((r["ready_before_decode"] or 0.0) for r in runs[name]),
        }
    widest = max(parsed, key=lambda r: (len(r.blocks), r.dim(1)))
    per_block = {}
    for name, ms in ((n, statistics.median(r["block_ms_per_request"].get(n, 0.0) for r in runs[str(widest)]))
                     for n in runs[str(widest)][0]["block_ms_per_request"]):
        per_block[name] = ms
    costs = _by_kind(per_block)
    reference_blocks = sum(costs.get(block_cost_key(b), 0.0) for b in parsed[0].blocks)
    base = summary[reference]["capture_ms_per_request"] - reference_blocks
    return {
        "requests": len(prompts), "tokens": tokens, "slots": slots, "repeats": repeats, "reference": reference,
        "recipes": summary, "capture_ms_per_block": costs, "capture_ms_base": max(base, 0.0),
        "measured_on": str(widest), "runs": runs,
        "source": f"leap bench recipes: {len(prompts)} requests x {tokens} tokens, {repeats} repeats per recipe",
    }


def block_cost_key(block) -> str:
    """The key of a block in `capture_ms_per_block`: `last` for any last@L, the kind for request columns,
    the block's name for pools."""
    return block.kind if block.kind in ("prompt", "decoding", "domain", "last") else block.name


def _by_kind(per_block: dict[str, float]) -> dict[str, float]:
    """Block costs as `leap eval recipes` sums them: `last` (the mean of the last@L blocks, one gather each),
    each pooled block by name with the shared entropy logits added to every entropy block, and the
    request-column kinds by name."""
    out: dict[str, float] = {}
    lasts = [v for k, v in per_block.items() if k.startswith("last@")]
    if lasts:
        out["last"] = float(np.mean(lasts))
    logits = per_block.get("entropy_logits", 0.0)
    for name, value in per_block.items():
        if name.startswith(("mean@", "entropy@")):
            out[name] = value + (logits if name.startswith("entropy@") else 0.0)
        elif name in ("prompt", "decoding") or name.startswith("domain"):
            out[name.split("=")[0]] = value
    return out
