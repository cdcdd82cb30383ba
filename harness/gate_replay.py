"""The promotion gate's replays: the same requests under FCFS, the champion and the challenger on one engine.

All arms replay the same requests at the same planned arrivals on one in-process engine, so only the
schedule differs. Time is the step clock (`harness.replay`), fitted on this engine just before the arms,
so a machine that slows down between arms moves no verdict. Repeats alternate the arm order and replay
disjoint blocks of requests, since the verdict's interval (`leap_core.gate_verdict`) resamples requests.
The engine decodes few slots a step and arrivals come at a load relative to its FCFS capacity, so a
slice of dozens of requests queues as real traffic does, on a slow or a fast machine. Parameters:
docs/serving.md ("The promotion gate").
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from leap_io.settings import GATE_BLOCKS

POLICY_ORDER = ("fcfs", "champion", "challenger")
WARMUP_REQUESTS = 4
CALIBRATION_TOKENS = 64  # the calibration run's lengths are capped: the step shapes are what the fit needs
DECODE_SLOTS = 8  # K of the gate's engine: a slice of dozens of requests must queue for slots, as 512 do for 64
BLOCKS = GATE_BLOCKS  # disjoint request blocks, one a repeat (the gate's default of 2 repeats)
MIN_BLOCK = 4  # requests a block holds at least: fewer requests make fewer blocks


def _arm_summary(replays: Sequence[Any], clock: Any, wall_s: float = float("nan"), blocks: int = 1) -> dict[str, Any]:
    """One arm's replays (one per repeat) as plain JSON: per-request `ptl` and `output_tokens` of the
    repeats one after another (entry i is request i % the number of distinct requests, since the repeats
    cycle through the `blocks`), `repeats`: how many times each request was replayed, their overall
    `mean_ptl`, each repeat's summary, how the step clock's seconds compared with the wall clock's over the
    arm's steps (`modeled_over_wall`), and the wall seconds the arm's replays took (`wall_s`)."""
    ptl = np.concatenate([r.per_request["ptl"] for r in replays])
    tokens = np.concatenate([r.per_request["output_tokens"] for r in replays])
    modeled = wall = 0.0
    for r in replays:
        shapes, seconds = r.per_step["shapes"], r.per_step["seconds"]
        if len(seconds):
            modeled += float(np.sum(clock.shape_seconds(shapes)))
            wall += float(np.sum(seconds))
    per_repeat = [{key: (value.item() if hasattr(value, "item") else value) for key, value in r.summary().items()}
                  for r in replays]
    return {"mean_ptl": float(ptl.mean()), "repeats": len(replays) // blocks, "blocks": blocks,
            "per_repeat": per_repeat,
            "modeled_over_wall": modeled / wall if wall > 0 else float("nan"), "wall_s": float(wall_s),
            "ptl": [float(v) for v in ptl], "output_tokens": [int(v) for v in tokens]}


def calibrate_step_clock(engine: Any, runtime: Any, requests: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """A step-time model fitted on a saturated FCFS run of `requests` (lengths capped at
    CALIBRATION_TOKENS) on this engine, and how well it fits the measured steps."""
    from harness.replay import replay
    from leap_core.step_time import StepTimeModel

    runtime.reset_readout(None, None)
    runtime.configure(policy="fcfs", rls=False)
    capped = [replace(r, max_tokens=min(r.max_tokens, CALIBRATION_TOKENS),
                      fixed_length=min(r.fixed_length or CALIBRATION_TOKENS, CALIBRATION_TOKENS)) for r in requests]
    result = replay(engine, capped, np.zeros(len(capped)), "calibration", runtime=runtime, tag="calib-")
    shapes, seconds = result.per_step["shapes"], result.per_step["seconds"]
    model = StepTimeModel.fit_shapes(shapes, seconds)
    modeled = model.shape_seconds(shapes)
    return model, {"steps": int(seconds.size), **asdict(model),
                   "median_abs_rel_error": float(np.median(np.abs(modeled - seconds) / seconds)),
                   "total_modeled_over_measured": float(modeled.sum() / seconds.sum())}


def arm_order(policies: Sequence[str], repeat: int) -> list[str]:
    """ABC, CBA, ABC, ...: each arm is early in one repeat and late in the next."""
    return list(policies) if repeat % 2 == 0 else list(reversed(policies))


def gate_config(recipe: str, decode_slots: int) -> Any:
    """The LEAP configuration a gate engine runs: every arm's recipe captured, `decode_slots` K."""
    from serving.config import LeapConfig

    return LeapConfig(policy="fcfs", rls=False, recipe=str(recipe), decode_slots=decode_slots)


def gate_requests(engine: Any, prompts: Sequence[Mapping[str, Any]], fixed_lengths: Mapping[str, int],
                  max_model_len: int) -> tuple[list[Any], int]:
    """The replay requests of `prompts` with their recorded lengths, and how many were dropped because
    their chat-encoded prompt plus recorded output would not fit the context."""
    from harness.replay import ReplayRequest, encode_prompts

    candidates = [p for p in prompts if p["id"] in fixed_lengths]
    encoded, dropped = encode_prompts(engine.get_tokenizer(), candidates, max_model_len)
    requests = []
    for item in encoded:
        length = int(fixed_lengths[item["id"]])
        if len(item["prompt_token_ids"]) + length > max_model_len:
            dropped += 1
            continue
        requests.append(ReplayRequest(id=item["id"], prompt_token_ids=item["prompt_token_ids"],
                                      max_tokens=length, fixed_length=length, domain=item.get("domain")))
    return requests, dropped


def load_rate(engine: Any, clock: Any, requests: Sequence[Any], load: float) -> tuple[float, float]:
    """(arrival rate, FCFS capacity) in requests per second: `load` x what this engine sustains under FCFS
    on these requests' prompt and output lengths, priced by the step clock (`fcfs_capacity`)."""
    from leap_core.simulator import SimConfig, fcfs_capacity

    config = engine.vllm_config.scheduler_config
    leap = gate_runtime(engine).config
    sim = SimConfig(max_resident=leap.max_resident, decode_slots=leap.decode_slots, waiting_cap=leap.waiting_cap,
                    step_model=clock, max_prefill_tokens_per_step=int(config.max_num_batched_tokens))
    capacity = fcfs_capacity(np.array([len(r.prompt_token_ids) for r in requests]),
                             np.array([int(r.fixed_length) for r in requests]), sim)
    return load * capacity, capacity


def gate_runtime(engine: Any) -> Any:
    from harness.engine import leap_scheduler

    return leap_scheduler(engine).leap


def block_count(blocks: int, repeats: int, n_requests: int | None = None) -> int:
    """The most blocks, at most `blocks`, that divide `repeats` (every request replayed as often) and, given
    `n_requests`, hold MIN_BLOCK requests each (at least one block)."""
    most = blocks if n_requests is None else min(blocks, n_requests // MIN_BLOCK)
    return max(b for b in range(1, max(1, most) + 1) if repeats % b == 0)


def request_blocks(requests: Sequence[Any], blocks: int, repeats: int) -> list[list[Any]]:
    """`requests` cut into `blocks` disjoint blocks of (nearly) equal size, in their order; repeat r replays
    block r % blocks, so `repeats` must be a multiple of `blocks` (each request replayed as often)."""
    if repeats < 1:
        raise ValueError(f"repeats counts replays per arm, at least 1, not {repeats}")
    if blocks < 1 or repeats % blocks:
        raise ValueError(f"blocks must be at least 1 and divide the repeats ({repeats}), not {blocks}")
    if len(requests) < blocks:
        raise ValueError(f"{len(requests)} requests cannot make {blocks} blocks")
    return [[requests[i] for i in cut] for cut in np.array_split(np.arange(len(requests)), blocks)]


def replay_arms(engine: Any, requests: Sequence[Any], readouts: Mapping[str, tuple[Any, Any] | None],
                policies: Sequence[str], rate: float, seed: int, repeats: int, clock: Any,
                blocks: int = 1) -> dict[str, Any]:
    """Each of `policies` ("fcfs", or a key of `readouts`) replayed `repeats` times on the step clock
    `clock`, repeat r on block r % `blocks` of the requests (`request_blocks`), the same requests at the
    same arrivals within a repeat and fresh arrivals (seed + repeat) each repeat, the order reversed each
    repeat; {policy: summary} (`_arm_summary`)."""
    from harness.replay import planned_arrivals, replay

    cut = request_blocks(requests, blocks, repeats)
    runtime = gate_runtime(engine)
    replays: dict[str, list[Any]] = {policy: [] for policy in policies}
    wall_s = dict.fromkeys(policies, 0.0)
    for repeat in range(repeats):
        block = cut[repeat % blocks]
        arrivals = planned_arrivals(len(block), rate, None, seed + repeat)
        for policy in arm_order(policies, repeat):
            runtime.reset_readout(None, None)  # each readout is checked against the model alone
            if policy == "fcfs":
                runtime.configure(policy="fcfs", rls=False)
            else:
                readout, rls_state = readouts[policy]
                runtime.reset_readout(readout, rls_state)
                runtime.configure(policy="leap", rls=False)
            begun = time.perf_counter()
            replays[policy].append(replay(engine, block, arrivals, policy, runtime=runtime,
                                          tag=f"s{seed}-r{repeat}-{policy}-", clock=clock))
            wall_s[policy] += time.perf_counter() - begun
    return {policy: _arm_summary(done, clock, wall_s[policy], blocks) for policy, done in replays.items()}


def warm_up(engine: Any, requests: Sequence[Any]) -> None:
    """A few requests replayed untimed: one-time costs (first allocations, lazy kernel set-up) must not land
    on the calibration or an arm."""
    from harness.replay import replay

    runtime = gate_runtime(engine)
    runtime.reset_readout(None, None)
    runtime.configure(policy="fcfs", rls=False)
    warm = list(requests[:WARMUP_REQUESTS])
    replay(engine, warm, np.zeros(len(warm)), "warmup", runtime=runtime, tag="warmup-")


def replay_gate(engine_settings: Any, prompts: Sequence[Mapping[str, Any]], fixed_lengths: Mapping[str, int],
                readouts: Mapping[str, tuple[Any, dict[str, np.ndarray] | None] | None], rate: float | None,
                seed: int = 0, repeats: int = 2, load: float | None = None,
                decode_slots: int = DECODE_SLOTS, blocks: int = 1) -> dict[str, Any]:
    """Replay `prompts` (dicts with "id" and "prompt") with their recorded lengths under FCFS, the
    champion (when given) and the challenger on ONE in-process engine, on the step clock, `repeats`
    times in counterbalanced order, repeat r on block r % `blocks` of the requests (module docstring;
    fewer blocks when fewer requests fit); returns {"results": {policy: summary}, "request_ids": [...],
    "dropped": n, "step_model": {...}, "rate": r, "fcfs_capacity": c, "blocks": b}.

    Arrivals are Poisson at `load` x the engine's FCFS capacity on these requests when `load` is given,
    else at `rate`. The engine is shut down before returning, so the process can build another.
    """
    from harness.engine import build_engine
    from leap_core.recipes import readout_recipe, union

    if readouts.get("challenger") is None:
        raise ValueError("the gate needs a challenger readout")
    if load is None and rate is None:
        raise ValueError("the gate needs an arrival rate or a load")
    # one engine serves both readouts: it captures the recipes of both (each reads its own columns)
    recipe = union([readout_recipe(pair[0].metadata) for pair in readouts.values() if pair is not None])
    engine = build_engine(engine_settings, gate_config(str(recipe), decode_slots))
    try:
        requests, dropped = gate_requests(engine, prompts, fixed_lengths, engine_settings.max_model_len)
        if not requests:
            raise ValueError("no gate prompt fits the engine with its recorded length")
        warm_up(engine, requests)
        clock, calibration = calibrate_step_clock(engine, gate_runtime(engine), requests)
        capacity = None
        if load is not None:
            rate, capacity = load_rate(engine, clock, requests, load)
        policies = [policy for policy in POLICY_ORDER if policy == "fcfs" or readouts.get(policy) is not None]
        blocks = block_count(blocks, repeats, len(requests))
        results = replay_arms(engine, requests, readouts, policies, float(rate), seed, repeats, clock, blocks)
        errors = [abs(summary["modeled_over_wall"] - 1.0) for summary in results.values()]
        step_model = {**calibration, "repeats": repeats,
                      "arm_error_median": float(np.median(errors)) if errors else float("nan")}
        return {"results": results, "request_ids": [r.id for r in requests], "dropped": dropped,
                "step_model": step_model, "rate": float(rate), "load": load, "fcfs_capacity": capacity,
                "decode_slots": decode_slots, "blocks": blocks}
    finally:
        engine.engine_core.shutdown()
        del engine
