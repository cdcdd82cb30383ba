"""The promotion gate: replay one slice of real prompts with fixed lengths under each policy, then decide.

A challenger must beat the bar (the champion, or FCFS when there is none) on mean per-token latency by
a margin, without making the longest requests much worse: shortest-predicted-first schedules can
starve long requests, and a mean alone would hide that. All policies replay the same requests at the
same planned arrivals on one engine, so only the schedule differs between them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

POLICY_ORDER = ("fcfs", "champion", "challenger")
LONG_QUANTILE = 0.75
WARMUP_REQUESTS = 4


def _figures(summary: Mapping[str, Any]) -> tuple[float, np.ndarray, np.ndarray]:
    ptl = np.asarray(summary["ptl"], dtype=np.float64).reshape(-1)
    tokens = np.asarray(summary["output_tokens"], dtype=np.float64).reshape(-1)
    return float(summary["mean_ptl"]), ptl, tokens


def _failed(reason: str, bar: str, margin: float, p95_bound: float) -> dict[str, Any]:
    return {"passed": False, "reason": reason, "bar": bar, "margin": margin, "p95_bound": p95_bound}


def gate_verdict(results: Mapping[str, Mapping[str, Any] | None], margin: float = 0.02,
                 p95_bound: float = 1.10) -> dict[str, Any]:
    """Pass the challenger only if its mean PTL is at least `margin` below the bar's and its P95 PTL
    over the top length quartile is at most `p95_bound` times the bar's.

    `results` maps "fcfs", "champion" (None or absent when there is none) and "challenger" to replay
    summaries with `mean_ptl` and per-request `ptl` and `output_tokens` in one request order. Anything
    that makes the comparison meaningless (missing or non-finite figures, replays of different
    requests) fails the gate rather than raising: a gate fails closed.
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if not p95_bound > 0.0:
        raise ValueError(f"p95_bound must be > 0, got {p95_bound}")
    bar = "champion" if results.get("champion") is not None else "fcfs"
    if results.get("challenger") is None:
        return _failed("no challenger replay", bar, margin, p95_bound)
    if results.get(bar) is None:
        return _failed(f"no {bar} replay to compare with", bar, margin, p95_bound)

    bar_mean, bar_ptl, bar_tokens = _figures(results[bar])
    ch_mean, ch_ptl, ch_tokens = _figures(results["challenger"])
    if bar_ptl.size == 0 or bar_ptl.shape != ch_ptl.shape or not np.array_equal(bar_tokens, ch_tokens):
        return _failed(f"the {bar} and challenger replays are not the same requests with the same lengths",
                       bar, margin, p95_bound)
    values = np.concatenate([bar_ptl, ch_ptl, [bar_mean, ch_mean]])
    if not np.isfinite(values).all() or bar_mean <= 0:
        return _failed("a replay has missing or non-finite latencies", bar, margin, p95_bound)

    long = bar_tokens >= np.quantile(bar_tokens, LONG_QUANTILE)
    bar_long_p95 = float(np.percentile(bar_ptl[long], 95))
    ch_long_p95 = float(np.percentile(ch_ptl[long], 95))
    mean_ratio = ch_mean / bar_mean
    long_ratio = ch_long_p95 / bar_long_p95 if bar_long_p95 > 0 else float("inf")
    faster = mean_ratio <= 1.0 - margin
    long_ok = long_ratio <= p95_bound
    reason = (f"mean PTL {100 * (1 - mean_ratio):+.1f}% vs {bar} (needs >= {100 * margin:.1f}%); "
              f"longest-quartile P95 PTL x{long_ratio:.3f} of {bar}'s (allowed <= x{p95_bound:.3f})")
    verdict: dict[str, Any] = {
        "passed": bool(faster and long_ok),
        "reason": ("passed: " if faster and long_ok else "failed: ") + reason,
        "bar": bar,
        "margin": margin,
        "p95_bound": p95_bound,
        "mean_ptl_ratio": float(mean_ratio),
        "long_p95_ratio": float(long_ratio),
        "challenger_mean_ptl": ch_mean,
        "bar_mean_ptl": bar_mean,
        "challenger_long_p95_ptl": ch_long_p95,
        "bar_long_p95_ptl": bar_long_p95,
        "n_requests": int(bar_ptl.size),
        "n_long": int(long.sum()),
    }
    fcfs = results.get("fcfs")
    if bar != "fcfs" and fcfs is not None and float(fcfs["mean_ptl"]) > 0:
        verdict["fcfs_mean_ptl_ratio"] = ch_mean / float(fcfs["mean_ptl"])
    return verdict


def _jsonable_summary(result: Any) -> dict[str, Any]:
    """A ReplayResult as plain JSON values, with the per-request figures the verdict needs."""
    summary = {key: (value.item() if hasattr(value, "item") else value)
               for key, value in result.summary().items()}
    summary["ptl"] = [float(v) for v in result.per_request["ptl"]]
    summary["output_tokens"] = [int(v) for v in result.per_request["output_tokens"]]
    return summary


def replay_gate(engine_settings: Any, prompts: Sequence[Mapping[str, Any]], fixed_lengths: Mapping[str, int],
                readouts: Mapping[str, tuple[Any, dict[str, np.ndarray] | None] | None], rate: float,
                seed: int = 0) -> dict[str, Any]:
    """Replay `prompts` (dicts with "id" and "prompt") with their recorded lengths under FCFS, the
    champion (when given) and the challenger on ONE in-process engine; returns
    {"results": {policy: summary}, "request_ids": [...], "dropped": n}.

    Prompts whose chat-encoded length plus recorded output would not fit the engine's context are
    dropped first, and a few requests are replayed once untimed to warm the engine. The engine is
    shut down before returning, so the process can build another.
    """
    from harness.engine import build_engine, leap_scheduler
    from leap_core.recipes import readout_recipe, union
    from serving.config import LeapConfig
    from harness.replay import ReplayRequest, encode_prompts, planned_arrivals, replay

    if readouts.get("challenger") is None:
        raise ValueError("the gate needs a challenger readout")
    # one engine serves both readouts: it captures the recipes of both (each reads its own columns)
    recipe = union([readout_recipe(pair[0].metadata) for pair in readouts.values() if pair is not None])
    engine = build_engine(engine_settings, LeapConfig(policy="fcfs", rls=False, recipe=str(recipe)))
    try:
        runtime = leap_scheduler(engine).leap
        candidates = [p for p in prompts if p["id"] in fixed_lengths]
        encoded, dropped = encode_prompts(engine.get_tokenizer(), candidates, engine_settings.max_model_len)
        requests = []
        for item in encoded:
            length = int(fixed_lengths[item["id"]])
            if len(item["prompt_token_ids"]) + length > engine_settings.max_model_len:
                dropped += 1
                continue
            requests.append(ReplayRequest(id=item["id"], prompt_token_ids=item["prompt_token_ids"],
                                          max_tokens=length, fixed_length=length, domain=item.get("domain")))
        if not requests:
            raise ValueError("no gate prompt fits the engine with its recorded length")
        arrivals = planned_arrivals(len(requests), rate, None, seed)
        # one-time costs (first allocations, lazy kernel set-up) must not land on the first policy
        runtime.reset_readout(None, None)
        runtime.configure(policy="fcfs", rls=False)
        warm = requests[:WARMUP_REQUESTS]
        replay(engine, warm, np.zeros(len(warm)), "warmup", runtime=runtime, tag="warmup-")
        results: dict[str, Any] = {}
        for policy in POLICY_ORDER:
            if policy == "fcfs":
                runtime.reset_readout(None, None)
                runtime.configure(policy="fcfs", rls=False)
            else:
                pair = readouts.get(policy)
                if pair is None:
                    continue
                readout, rls_state = pair
                runtime.reset_readout(None, None)  # each readout is checked against the model alone
                runtime.reset_readout(readout, rls_state)
                runtime.configure(policy="leap", rls=False)
            result = replay(engine, requests, arrivals, policy, runtime=runtime, tag=f"{policy}-")
            results[policy] = _jsonable_summary(result)
        return {"results": results, "request_ids": [r.id for r in requests], "dropped": dropped}
    finally:
        engine.engine_core.shutdown()
        del engine
