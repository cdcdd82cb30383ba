"""A switchback experiment inside one engine run: something (a shadow readout) on and off in alternating blocks
of steps, and the throughput with it over without, paired by neighbouring blocks.

Whole engine runs in separate processes differ by several percent on a shared machine (the serving bench's
stock/LEAP pairs), so a cost of 1% cannot be seen between them. Within one run, neighbouring blocks of a
few steps see the same machine and nearly the same backlog, so their difference is the cost plus what
their steps' shapes differ by. Blocks run in ABBA order (on, off, off, on, on, off, ...) so that a drift
across a pair lands on both sides alike; blocks (2j, 2j + 1) form pair j.

What the steps' shapes differ by is most of the noise: on two CPU cores a step that prefills a chunk of up to
2,048 tokens takes from 0.1 to over a second, a decode-only step 0.03-0.1 s by how many it decodes. So the
comparison is made on the steps that prefill nothing (most of a run's steps), after fitting each run's step
seconds by least squares on the number of requests decoded (and an intercept): pair j gives
`delta_j = mean residual on - mean residual off` over its decode-only steps (seconds a step). What the
shadow does costs the same in any step that frees a request, whatever else the step does, so this is its
cost per step; over `base`, the mean seconds of those steps (shorter than the mean of all steps, so the
fraction is larger, never smaller), a step takes `base - delta / 2` without and `base + delta / 2` with the
thing on, and the throughput ratio, on over off on the same work, is `(base - delta / 2) / (base + delta / 2)`,
`delta` the mean over every pair of every run; its interval comes from a bootstrap over pairs. The shadow
never changes what the scheduler decides, so the steps' shapes are the same process on both sides. The
unadjusted ratio (every step's tokens over its seconds, on over off) is reported beside it.

Step seconds are the engine's `step()` calls only: the time outside them (arrivals, the replay's loop, the
switch itself) is the same whether the thing is on or off, so leaving it out makes the measured cost a
fraction of less time, i.e. larger, never smaller.
"""

from __future__ import annotations

import numpy as np

FIELDS = ("on", "tokens", "seconds", "decodes", "prefill")


def block_is_on(step: int, block_steps: int) -> bool:
    """Whether step `step` (from 0) falls in an 'on' block, blocks in ABBA order."""
    return (step // block_steps) % 4 in (0, 3)


def pair_deltas(record: dict, block_steps: int) -> tuple[np.ndarray, float, float, int]:
    """(delta_j for each whole pair of blocks with decode-only steps on both sides, their mean step seconds,
    the unadjusted tokens-per-second ratio on over off, the decode-only steps compared) of one run's
    per-step record (`FIELDS`, one list each)."""
    columns = {name: np.asarray(record[name], dtype=np.float64) for name in FIELDS}
    n = columns["on"].size
    if any(values.size != n for values in columns.values()):
        raise ValueError(f"per-step records disagree in length: {[v.size for v in columns.values()]}")
    on = columns["on"].astype(bool)
    if not np.array_equal(on, [block_is_on(k, block_steps) for k in range(n)]):
        raise ValueError("the steps' on/off flags are not the ABBA blocks of this block size")
    used = (n // (2 * block_steps)) * 2 * block_steps
    pair = np.arange(used) // (2 * block_steps)
    seconds, tokens, on = columns["seconds"][:used], columns["tokens"][:used], on[:used]
    decode_only = columns["prefill"][:used] == 0
    if used == 0 or decode_only.sum() < 3:
        return np.empty(0), float("nan"), float("nan"), 0
    design = np.column_stack([np.ones(decode_only.sum()), columns["decodes"][:used][decode_only]])
    coef, *_ = np.linalg.lstsq(design, seconds[decode_only], rcond=None)
    residual = seconds[decode_only] - design @ coef
    kept_pair, kept_on = pair[decode_only], on[decode_only]
    count = np.bincount(kept_pair * 2 + kept_on, minlength=2 * (pair[-1] + 1)).reshape(-1, 2)
    total = np.bincount(kept_pair * 2 + kept_on, weights=residual, minlength=2 * (pair[-1] + 1)).reshape(-1, 2)
    both = (count > 0).all(axis=1)
    deltas = total[both, 1] / count[both, 1] - total[both, 0] / count[both, 0]
    raw = (tokens[on].sum() / seconds[on].sum()) / (tokens[~on].sum() / seconds[~on].sum())
    return deltas, float(seconds[decode_only].mean()), float(raw), int(decode_only.sum())


def throughput_ratio(records: list[dict], block_steps: int, confidence: float = 0.95, seed: int = 0) -> dict:
    """The throughput on over off on the same work, pooled over every pair of every run (module docstring),
    with a percentile bootstrap interval over pairs."""
    deltas, bases, raws, weights = [], [], [], []
    steps = compared = 0
    for record in records:
        run_deltas, base, raw, kept = pair_deltas(record, block_steps)
        steps += len(record["on"])
        compared += kept
        if run_deltas.size:
            deltas.append(run_deltas)
            bases.append(base)
            raws.append(raw)
            weights.append(run_deltas.size)
    if not deltas:
        return {"ratio": None, "ci_low": None, "ci_high": None, "pairs": 0, "confidence": confidence,
                "unadjusted_ratio": None, "delta_ms_per_step": None, "step_ms": None, "steps": steps,
                "steps_compared": compared}
    every = np.concatenate(deltas)
    base = float(np.average(bases, weights=weights))

    def ratio(delta: np.ndarray) -> np.ndarray:
        return (base - delta / 2) / (base + delta / 2)

    value = float(ratio(every.mean()))
    low = high = None
    if every.size > 1:
        from scipy.stats import bootstrap

        result = bootstrap((every,), lambda d, axis=-1: ratio(np.mean(d, axis=axis)), vectorized=True,
                           n_resamples=4000, confidence_level=confidence, method="percentile",
                           random_state=np.random.default_rng(seed))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return {"ratio": value, "ci_low": low, "ci_high": high, "pairs": int(every.size), "confidence": confidence,
            "unadjusted_ratio": float(np.average(raws, weights=weights)),
            "delta_ms_per_step": 1000.0 * float(every.mean()), "step_ms": 1000.0 * base, "steps": steps,
            "steps_compared": compared}
