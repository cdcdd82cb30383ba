"""The promotion gate's own error rates: how often it promotes a worse, a better and an equal challenger.

Three cases, each a (bar, challenger) pair of readouts fitted on the committed corpus snapshot of the
serving model, on its chat rows (the first 60% of a seeded order train, the rest is the pool the
trials replay); the training rows are cut into two disjoint halves, A and B:

- **worse**: the bar is the readout fitted on half A; the challenger has the same weights in a shuffled
  order (a readout whose ranking is unrelated to, here against, the lengths).
- **better**: the challenger is half A's readout against a bar that ranks clearly worse. By default
  (`better_bar="fcfs"`) the bar of a first promotion, when no champion exists yet: FCFS, which orders by
  arrival, blind to length. With `better_bar="small"`, a first champion fitted on a small slice
  (SMALL_SLICE training rows drawn from half B), whose gain is a few percent (below).
- **equal**: a refit of the same size on a disjoint sample: half A's readout as the bar, half B's as the
  challenger. Their quality differs only by the sample, so the gate should find no difference; the same
  weights twice would replay identically on the step clock and could not test anything.

Each trial draws its own requests from the pool (with their recorded true lengths), `blocks` disjoint
blocks of `slice_size`, and its own arrival seed, and replays them as the flows' gate does
(`harness.gate_replay`: one engine, the step clock calibrated on it, arrivals at a load of its FCFS
capacity, counterbalanced repeats, repeat r on block r % blocks). A trial replays the four readouts the
cases use (A, shuffled, FCFS or small, B) in one counterbalanced run (ABCD DCBA ...), and each case's
verdict (`leap_core.gate_verdict`, the bar as the champion) compares its two arms from it: the pairs are
paired within the trial, as the flows' two arms are, and the cases of one trial share their requests and
arrivals. The figures are the share of trials promoted per case (and, for the equal case, called "no
difference"), each with its Wilson 95% interval; the seconds of one gate run as the flows make it (engine
start, step-clock calibration and the two arms' replays, `gate_seconds_median`); and the step clock's
error against the wall clock over each arm.

`quick` keeps the schedule's questions and shrinks the work so that 20 trials fit in minutes on two
CPU cores: the pool is the prompts of at most QUICK["max_prompt_tokens"] tokens, every recorded length
is divided by QUICK["length_divisor"] (at least 1 token; the same predictions and the same order of true
lengths), and a block holds QUICK["slice"] requests. The full run replays the recorded lengths of every
pool prompt, 64 a block. Prefill is most of a short request's cost here, so at a fixed replay time many
short requests (a long queue, where the order matters) resolve more than fewer long ones. Two quick runs
(2 blocks of 96, 2 repeats, load 1.2; 736-745 s each) gave the same counts: worse promoted 0 of 20
(called worse in 15 and 16), equal called no difference in 19 of 20, better against FCFS promoted in 19
of 20 (x0.83 and x0.81 of FCFS's mean PTL at the median). Earlier shapes of the same bench promoted against FCFS 14 of 20 (one block of 96 replayed twice,
two runs) and 10 of 20 (32 requests, lengths / 16). Gains of a few percent stay out of reach: per-request
PTL is heavy-tailed (a request of a few tokens that waited has a PTL of its whole wait), and against the
small-slice bar (`better_bar="small"`, one quick run) the challenger, x0.93 of its mean PTL at the
median, was promoted in 8 of 20 trials; 100 simulated trials of the quick shape (the calibrated step
model) promoted it 35 times, and 19 with one block replayed twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from leap_core.intervals import wilson_interval

CASES = ("worse", "better", "equal")
QUICK = {"length_divisor": 48, "max_prompt_tokens": 64, "slice": 96}
FULL_SLICE = 64
SMALL_SLICE = 16  # training rows of the better case's first champion


def _readouts(model: Any, max_tokens: int, seed: int) -> tuple[dict[str, tuple[Any, Any]], list[dict], dict]:
    """The readouts of the three cases, the pool prompts (id, prompt, length) and the readouts' test Spearman."""
    from harness.replay import DEFAULT_DECODING
    from leap_core.layers import default_layer
    from leap_core.metrics import spearman
    from leap_core.readout import LinearReadout
    from leap_core.recipes import RECIPE_VERSION, Recipe
    from leap_core.rls import fit_readout_with_anchor
    from study_harness.corpus import corpus_dir, corpus_key, load_corpus
    from study_harness.snapshot import stored_texts

    layer = default_layer(model.num_layers)
    rows = load_corpus(corpus_dir(corpus_key(model.fingerprint, layer, max_tokens, DEFAULT_DECODING)), layer,
                       max_tokens)
    texts = stored_texts()
    chat = rows.subset(np.flatnonzero(rows.domains == "chat"))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(chat))
    n_train = int(0.6 * len(chat))
    half = n_train // 2
    part_a, part_b = chat.subset(np.sort(order[:half])), chat.subset(np.sort(order[half:n_train]))
    small = part_b.subset(np.sort(rng.choice(len(part_b), SMALL_SLICE, replace=False)))
    pool = chat.subset(np.sort(order[n_train:]))

    def fit(part: Any, version: str) -> tuple[Any, Any]:
        metadata = dict(model_id=model.model_id, model_fingerprint=model.fingerprint, layer=layer,
                        recipe=str(Recipe.last(layer)), recipe_version=RECIPE_VERSION, version=version,
                        n_train=len(part))
        readout, _ = fit_readout_with_anchor(part.features, part.output_tokens, alpha=1000.0,
                                             max_tokens=max_tokens, metadata=metadata)
        return readout, None  # the gate replays without online correction

    good = fit(part_a, "bench-a")[0]
    shuffled = LinearReadout.from_weights(good.mean_, good.scale_,
                                          np.random.default_rng(seed + 1).permutation(good.coef_),
                                          good.intercept_, target=good.target, max_tokens=good.max_tokens,
                                          metadata={**good.metadata, "version": "bench-shuffled"})
    readouts = {"a": (good, None), "b": fit(part_b, "bench-b"), "small": fit(small, "bench-small"),
                "shuffled": (shuffled, None)}
    quality = {name: spearman(pool.output_tokens, pair[0].predict(pool.features)) for name, pair in readouts.items()}
    prompts = [{"id": str(i), "prompt": texts[str(i)], "length": int(n), "prompt_tokens": int(p)}
               for i, n, p in zip(pool.ids, pool.output_tokens, pool.prompt_tokens) if texts.get(str(i))]
    return readouts, prompts, quality


BETTER_BARS = ("small", "fcfs")


def case_pairs(better_bar: str = "fcfs") -> dict[str, tuple[str, str]]:
    """(bar, challenger) arms of each case."""
    if better_bar not in BETTER_BARS:
        raise ValueError(f"better_bar is one of {BETTER_BARS}, not {better_bar!r}")
    return {"worse": ("a", "shuffled"), "better": (better_bar, "a"), "equal": ("a", "b")}


def bench_gate(trials: int = 20, quick: bool = False, slice_size: int | None = None, repeats: int = 2,
               blocks: int | None = None,
               load: float = 1.2, margin: float | None = None, p95_bound: float | None = None, seed: int = 0,
               model_path: str | None = None, max_tokens: int = 1024, better_bar: str = "fcfs",
               calibration_requests: int = 64,
               on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `trials` gate trials of each case (module docstring); the error rates and timings. The step
    clock is calibrated on `calibration_requests` pool requests at their recorded lengths."""
    from harness.engine import EngineSettings, build_engine
    from harness.gate_replay import (
        BLOCKS,
        DECODE_SLOTS,
        block_count,
        calibrate_step_clock,
        gate_config,
        gate_requests,
        gate_runtime,
        load_rate,
        replay_arms,
        warm_up,
    )
    from leap_core.gate_verdict import MARGIN, NO_DIFFERENCE, P95_BOUND, gate_verdict
    from leap_core.recipes import readout_recipe
    from study_harness.experiment import resolve_model

    say = on_progress or (lambda message: None)
    margin = MARGIN if margin is None else margin
    if blocks is None:
        blocks = block_count(BLOCKS, repeats)
    elif blocks < 1 or block_count(blocks, repeats) != blocks:
        raise ValueError(f"blocks must be at least 1 and divide the repeats ({repeats}), not {blocks}")
    p95_bound = P95_BOUND if p95_bound is None else p95_bound
    started = time.perf_counter()
    slice_size = slice_size or (QUICK["slice"] if quick else FULL_SLICE)
    divisor = QUICK["length_divisor"] if quick else 1
    model = resolve_model(model_path)
    readouts, prompts, quality = _readouts(model, max_tokens, seed)
    if quick:
        prompts = [p for p in prompts if p["prompt_tokens"] <= QUICK["max_prompt_tokens"]]
    pairs = case_pairs(better_bar)
    arms = list(dict.fromkeys(name for pair in pairs.values() for name in pair))  # a, shuffled, fcfs/small, b
    settings = EngineSettings(model=model.path, max_model_len=4096, seed=seed)
    begun = time.perf_counter()
    engine = build_engine(settings, gate_config(str(readout_recipe(readouts["a"][0].metadata)), DECODE_SLOTS))
    try:
        lengths = {p["id"]: max(1, p["length"] // divisor) for p in prompts}
        pool, dropped = gate_requests(engine, prompts, lengths, settings.max_model_len)
        if len(pool) < slice_size * blocks:
            raise ValueError(f"the pool holds {len(pool)} requests, fewer than a trial's {blocks} blocks of "
                             f"{slice_size}")
        rng = np.random.default_rng(seed)
        warm_up(engine, pool)
        calibration_size = min(len(pool), calibration_requests)
        say(f"calibrating the step clock on {calibration_size} pool requests")
        # at their recorded lengths (the calibration caps them): divided ones end within a few steps, too few
        # decode shapes to fit the model's per-decode cost (one quick run fitted 33 steps and 0 s a decode)
        recorded = {p["id"]: p["length"] for p in prompts}
        calibrating = [replace(pool[i], fixed_length=recorded[pool[i].id], max_tokens=recorded[pool[i].id])
                       for i in rng.choice(len(pool), calibration_size, replace=False)]
        clock, calibration = calibrate_step_clock(engine, gate_runtime(engine), calibrating)
        setup_s = time.perf_counter() - begun  # what a gate run pays before its arms: engine, warm-up, clock
        cases: dict[str, dict[str, Any]] = {case: {"trials": 0, "promoted": 0, "no_difference": 0, "runs": []}
                                            for case in CASES}
        seconds, errors, trial_seconds = [], [], []
        for trial in range(trials):
            drawn = rng.choice(len(pool), slice_size * blocks, replace=False)  # each block sorted by pool order
            chosen = [pool[i] for part in np.array_split(drawn, blocks) for i in np.sort(part)]
            chosen = [replace(r, id=f"t{trial}-{r.id}") for r in chosen]
            trial_begun = time.perf_counter()
            rate, _ = load_rate(engine, clock, chosen, load)
            arm_readouts = {name: readouts[name] for name in arms if name != "fcfs"}
            results = replay_arms(engine, chosen, arm_readouts, arms, rate, seed + 1000 * trial, repeats, clock,
                                  blocks)
            trial_seconds.append(time.perf_counter() - trial_begun)
            errors.extend(abs(r["modeled_over_wall"] - 1.0) for r in results.values())
            for case in CASES:
                bar, challenger = pairs[case]
                verdict = gate_verdict({"fcfs" if bar == "fcfs" else "champion": results[bar],
                                        "challenger": results[challenger]}, margin, p95_bound, seed=trial)
                seconds.append(setup_s + results[bar]["wall_s"] + results[challenger]["wall_s"])
                record = cases[case]
                record["trials"] += 1
                record["promoted"] += bool(verdict["passed"])
                record["no_difference"] += verdict["outcome"] == NO_DIFFERENCE
                record["runs"].append({"outcome": verdict["outcome"], "ratio": verdict["mean_ptl_ratio"],
                                       "ci_low": verdict["ci_low"], "ci_high": verdict["ci_high"],
                                       "long_p95_ratio": verdict["long_p95_ratio"],
                                       "long_p95_ci": [verdict["long_p95_ci_low"], verdict["long_p95_ci_high"]]})
                say(f"trial {trial + 1}/{trials} {case}: {verdict['outcome']} x{verdict['mean_ptl_ratio']:.3f} "
                    f"[{verdict['ci_low']:.3f}, {verdict['ci_high']:.3f}]")
            say(f"trial {trial + 1}/{trials}: {len(arms)} arms x {repeats} repeats in {trial_seconds[-1]:.0f} s")
    finally:
        engine.engine_core.shutdown()
        del engine
    summary: dict[str, Any] = {}
    for case, record in cases.items():
        promoted = wilson_interval(record["promoted"], record["trials"])
        summary[case] = {"trials": record["trials"], "promoted_rate": promoted["value"],
                         "promoted_ci": [promoted["ci_low"], promoted["ci_high"]], "runs": record["runs"]}
        if case == "equal":
            same = wilson_interval(record["no_difference"], record["trials"])
            summary[case].update(no_difference_rate=same["value"], no_difference_ci=[same["ci_low"], same["ci_high"]])
    goals = {"worse_promoted_at_most": 0.05, "better_promoted_at_least": 0.80, "equal_no_difference_at_least": 0.90,
             "trials_at_least": 20, "gate_seconds_at_most": 300.0}
    met = {"worse": summary["worse"]["promoted_rate"] <= goals["worse_promoted_at_most"],
           "better": summary["better"]["promoted_rate"] >= goals["better_promoted_at_least"],
           "equal": summary["equal"]["no_difference_rate"] >= goals["equal_no_difference_at_least"],
           "trials": trials >= goals["trials_at_least"],
           "gate_seconds": bool(seconds) and float(np.median(seconds)) <= goals["gate_seconds_at_most"]}
    return {"cases": summary, "gate_seconds_median": float(np.median(seconds)) if seconds else float("nan"),
            "gate_setup_seconds": setup_s, "trial_seconds_median": float(np.median(trial_seconds)),
            "step_model_error_median": float(np.median(errors)) if errors else float("nan"),
            "step_model_fit": calibration, "readout_test_spearman": quality, "goals": goals, "goals_met": met,
            "pairs": {case: {"bar": bar, "challenger": challenger} for case, (bar, challenger) in pairs.items()},
            "better_bar": better_bar, "quick": quick, "length_divisor": divisor,
            "max_prompt_tokens": QUICK["max_prompt_tokens"] if quick else None, "slice": slice_size,
            "repeats": repeats, "blocks": blocks, "load": load, "margin": margin, "p95_bound": p95_bound, "decode_slots": DECODE_SLOTS, "pool": len(pool), "pool_dropped": dropped,
            "model": model.model_id, "seconds": round(time.perf_counter() - started, 1)}
