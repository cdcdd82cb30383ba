"""A switchback experiment inside one engine run: something (a shadow readout) on and off in alternating blocks
of steps, and the throughput with it over without, paired by neighbouring blocks.

Whole engine runs in separate processes differ by several percent on a shared machine (the serving bench's
stock/LEAP pairs), so a cost of 1% cannot be seen between them. Within one run, neighbouring blocks of a
few steps see the same machine, the same batch shapes and the same backlog, so their difference is the
cost itself. Blocks run in ABBA order (on, off, off, on, on, off, ...) so that a drift across a pair lands
on both sides alike, and blocks (2j, 2j + 1) form pair j.

A block's throughput is the tokens its steps generated over the seconds its engine steps took: the time
outside the steps (arrivals, the replay's own loop, the switch itself) is the same whether the thing is on
or off, so leaving it out makes the measured cost a fraction of less time, i.e. larger, never smaller.
"""

from __future__ import annotations

import numpy as np


def block_is_on(step: int, block_steps: int) -> bool:
    """Whether step `step` (from 0) falls in an 'on' block, blocks in ABBA order."""
    return (step // block_steps) % 4 in (0, 3)


def blocks(on: np.ndarray, tokens: np.ndarray, seconds: np.ndarray, block_steps: int) -> dict[str, list]:
    """Per-step records (on, generated tokens, step seconds) summed into blocks of `block_steps` steps; a last
    block shorter than the others is left out."""
    on, tokens, seconds = np.asarray(on, bool), np.asarray(tokens, np.float64), np.asarray(seconds, np.float64)
    if not on.size == tokens.size == seconds.size:
        raise ValueError(f"per-step records disagree in length: {on.size}, {tokens.size}, {seconds.size}")
    whole = on.size // block_steps
    if whole == 0:
        return {"on": [], "tokens": [], "seconds": []}
    shape = (whole, block_steps)
    block_on = on[: whole * block_steps].reshape(shape)
    if not (block_on.all(axis=1) | ~block_on.any(axis=1)).all():
        raise ValueError("a block mixes steps on and off")
    return {"on": block_on[:, 0].tolist(), "tokens": tokens[: whole * block_steps].reshape(shape).sum(1).tolist(),
            "seconds": seconds[: whole * block_steps].reshape(shape).sum(1).tolist()}


def throughput_ratio(records: list[dict[str, list]], confidence: float = 0.95, seed: int = 0) -> dict:
    """Throughput on over off, pooled over every pair of every run, with a bootstrap interval over pairs.

    Each record is one run's `blocks`; pair j of a run is its blocks 2j and 2j + 1 (one on, one off).
    The statistic is (sum of tokens on / sum of seconds on) / (sum of tokens off / sum of seconds off).
    """
    from scipy.stats import bootstrap

    columns: dict[str, list[float]] = {"tok_on": [], "s_on": [], "tok_off": [], "s_off": []}
    for record in records:
        for j in range(len(record["on"]) // 2):
            pair = (2 * j, 2 * j + 1)
            if record["on"][pair[0]] == record["on"][pair[1]]:
                raise ValueError(f"pair {j} is not one block on and one off")
            on_index, off_index = pair if record["on"][pair[0]] else pair[::-1]
            columns["tok_on"].append(record["tokens"][on_index])
            columns["s_on"].append(record["seconds"][on_index])
            columns["tok_off"].append(record["tokens"][off_index])
            columns["s_off"].append(record["seconds"][off_index])
    data = [np.asarray(columns[k]) for k in ("tok_on", "s_on", "tok_off", "s_off")]
    pairs = int(data[0].size)
    if pairs == 0:
        return {"ratio": None, "ci_low": None, "ci_high": None, "pairs": 0, "confidence": confidence}

    def ratio(tok_on, s_on, tok_off, s_off, axis=-1):
        return (np.sum(tok_on, axis) / np.sum(s_on, axis)) / (np.sum(tok_off, axis) / np.sum(s_off, axis))

    value = float(ratio(*data))
    low = high = None
    if pairs > 1:
        result = bootstrap(data, ratio, paired=True, vectorized=True, n_resamples=4000,
                           confidence_level=confidence, random_state=np.random.default_rng(seed),
                           method="percentile")
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return {"ratio": value, "ci_low": low, "ci_high": high, "pairs": pairs, "confidence": confidence}
