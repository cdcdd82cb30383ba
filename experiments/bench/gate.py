"""The promotion gate's own error rates: how often it promotes a worse, a better and an equal challenger.

Three cases, each a (bar, challenger) pair of readouts fitted on the committed corpus snapshot of the
serving model, on its chat rows (the first 60% of a seeded order train, the rest is the pool the
trials replay):

- **worse**: the bar is the readout fitted on every training row; the challenger has the same weights
  in a shuffled order (a readout that ranks at random).
- **better**: the bar is fitted on another domain's rows (math), the challenger on the chat rows.
- **equal**: both are the chat readout (same weights, another version).

Each trial draws its own slice of pool requests (with their recorded true lengths) and its own arrival
seed and runs the gate as the flows do (`harness.gate_replay`: one engine, the step clock calibrated on
it, arrivals at a load of its FCFS capacity, counterbalanced repeats; `leap_core.gate_verdict`), the
bar as the champion. The figures are the share of trials promoted per case (and, for the equal case,
called "no difference"), each with its Wilson 95% interval, the median seconds of one trial, and the
step clock's error against the wall clock.

`quick` divides every recorded length by 4 (at least 1 token): the schedule sees the same predictions
and the same order of true lengths, with a quarter of the decoding work, so the bench fits in minutes on
two CPU cores. The full run replays the recorded lengths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

CASES = ("worse", "better", "equal")
QUICK_LENGTH_DIVISOR = 4


def _rate_ci(hits: int, trials: int) -> dict[str, float | int]:
    from scipy.stats import binomtest

    if trials == 0:
        return {"rate": float("nan"), "ci_low": float("nan"), "ci_high": float("nan")}
    interval = binomtest(hits, trials).proportion_ci(confidence_level=0.95, method="wilson")
    return {"rate": hits / trials, "ci_low": float(interval.low), "ci_high": float(interval.high)}


def _readouts(model: Any, max_tokens: int, seed: int) -> tuple[dict[str, tuple[Any, Any]], list[dict], dict]:
    """The readouts of the three cases, the pool prompts (id, prompt, length) and the readouts' test Spearman."""
    from harness.corpus import corpus_dir, corpus_key, load_corpus
    from harness.replay import DEFAULT_DECODING
    from harness.snapshot import stored_texts
    from leap_core.layers import default_layer
    from leap_core.metrics import spearman
    from leap_core.readout import LinearReadout
    from leap_core.recipes import RECIPE_VERSION, Recipe
    from leap_core.rls import fit_readout_with_anchor

    layer = default_layer(model.num_layers)
    rows = load_corpus(corpus_dir(corpus_key(model.fingerprint, layer, max_tokens, DEFAULT_DECODING)), layer,
                       max_tokens)
    texts = stored_texts()
    chat = rows.subset(np.flatnonzero(rows.domains == "chat"))
    other = rows.subset(np.flatnonzero(rows.domains == "math"))
    order = np.random.default_rng(seed).permutation(len(chat))
    n_train = int(0.6 * len(chat))
    train, pool = chat.subset(np.sort(order[:n_train])), chat.subset(np.sort(order[n_train:]))

    def fit(part: Any, version: str) -> tuple[Any, Any]:
        metadata = dict(model_id=model.model_id, model_fingerprint=model.fingerprint, layer=layer,
                        recipe=str(Recipe.last(layer)), recipe_version=RECIPE_VERSION, version=version,
                        n_train=len(part))
        readout, _ = fit_readout_with_anchor(part.features, part.output_tokens, alpha=1000.0,
                                             max_tokens=max_tokens, metadata=metadata)
        return readout, None  # the gate replays without online correction

    chat_fit, other_fit = fit(train, "bench-chat"), fit(other, "bench-math")
    good = chat_fit[0]
    shuffled = LinearReadout.from_weights(good.mean_, good.scale_,
                                          np.random.default_rng(seed + 1).permutation(good.coef_),
                                          good.intercept_, target=good.target, max_tokens=good.max_tokens,
                                          metadata={**good.metadata, "version": "bench-shuffled"})
    same = LinearReadout.from_weights(good.mean_, good.scale_, good.coef_, good.intercept_, target=good.target,
                                      max_tokens=good.max_tokens, metadata={**good.metadata, "version": "bench-same"})
    readouts = {"chat": chat_fit, "math": other_fit, "shuffled": (shuffled, None), "same": (same, None)}
    quality = {name: spearman(pool.output_tokens, pair[0].predict(pool.features)) for name, pair in readouts.items()}
    prompts = [{"id": str(i), "prompt": texts[str(i)], "length": int(n)}
               for i, n in zip(pool.ids, pool.output_tokens) if texts.get(str(i))]
    return readouts, prompts, quality


PAIRS = {"worse": ("chat", "shuffled"), "better": ("math", "chat"), "equal": ("chat", "same")}


def bench_gate(trials: int = 20, quick: bool = False, slice_size: int = 64, repeats: int = 2, load: float = 1.2,
               margin: float = 0.02, p95_bound: float = 1.10, seed: int = 0, model_path: str | None = None,
               max_tokens: int = 1024, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run `trials` gate trials of each case (module docstring); the error rates and timings."""
    from harness.engine import EngineSettings, build_engine
    from harness.experiment import resolve_model
    from harness.gate_replay import (DECODE_SLOTS, calibrate_step_clock, gate_config, gate_requests, gate_runtime,
                                     load_rate, replay_arms, warm_up)
    from leap_core.gate_verdict import NO_DIFFERENCE, gate_verdict
    from leap_core.recipes import readout_recipe

    say = on_progress or (lambda message: None)
    started = time.perf_counter()
    model = resolve_model(model_path)
    readouts, prompts, quality = _readouts(model, max_tokens, seed)
    settings = EngineSettings(model=model.path, max_model_len=4096, seed=seed)
    engine = build_engine(settings, gate_config(str(readout_recipe(readouts["chat"][0].metadata)), DECODE_SLOTS))
    try:
        lengths = {p["id"]: max(1, p["length"] // QUICK_LENGTH_DIVISOR) if quick else p["length"] for p in prompts}
        pool, dropped = gate_requests(engine, prompts, lengths, settings.max_model_len)
        rng = np.random.default_rng(seed)
        warm_up(engine, pool)
        say(f"calibrating the step clock on {min(len(pool), 64)} pool requests")
        clock, calibration = calibrate_step_clock(engine, gate_runtime(engine),
                                                  [pool[i] for i in rng.choice(len(pool), min(len(pool), 64),
                                                                               replace=False)])
        cases: dict[str, dict[str, Any]] = {case: {"trials": 0, "promoted": 0, "no_difference": 0, "runs": []}
                                            for case in CASES}
        seconds, errors = [], []
        for trial in range(trials):
            for case in CASES:  # the cases alternate, so a slow spell of the machine hits each alike
                bar, challenger = PAIRS[case]
                chosen = [pool[i] for i in np.sort(rng.choice(len(pool), slice_size, replace=False))]
                chosen = [replace(r, id=f"t{trial}-{r.id}") for r in chosen]
                begun = time.perf_counter()
                rate, _ = load_rate(engine, clock, chosen, load)
                results = replay_arms(engine, chosen, {"champion": readouts[bar], "challenger": readouts[challenger]},
                                      ["champion", "challenger"], rate, seed + 1000 * trial + CASES.index(case),
                                      repeats, clock)
                verdict = gate_verdict(results, margin, p95_bound, seed=trial)
                seconds.append(time.perf_counter() - begun)
                errors.extend(abs(r["modeled_over_wall"] - 1.0) for r in results.values())
                record = cases[case]
                record["trials"] += 1
                record["promoted"] += bool(verdict["passed"])
                record["no_difference"] += verdict["outcome"] == NO_DIFFERENCE
                record["runs"].append({"outcome": verdict["outcome"], "ratio": verdict["mean_ptl_ratio"],
                                       "ci_low": verdict["ci_low"], "ci_high": verdict["ci_high"]})
                say(f"trial {trial + 1}/{trials} {case}: {verdict['outcome']} x{verdict['mean_ptl_ratio']:.3f} "
                    f"[{verdict['ci_low']:.3f}, {verdict['ci_high']:.3f}] in {seconds[-1]:.0f} s")
    finally:
        engine.engine_core.shutdown()
        del engine
    summary: dict[str, Any] = {}
    for case, record in cases.items():
        promoted = _rate_ci(record["promoted"], record["trials"])
        summary[case] = {"trials": record["trials"], "promoted_rate": promoted["rate"],
                         "promoted_ci": [promoted["ci_low"], promoted["ci_high"]], "runs": record["runs"]}
        if case == "equal":
            same = _rate_ci(record["no_difference"], record["trials"])
            summary[case].update(no_difference_rate=same["rate"], no_difference_ci=[same["ci_low"], same["ci_high"]])
    goals = {"worse_promoted_at_most": 0.05, "better_promoted_at_least": 0.80, "equal_no_difference_at_least": 0.90}
    met = {"worse": summary["worse"]["promoted_rate"] <= goals["worse_promoted_at_most"],
           "better": summary["better"]["promoted_rate"] >= goals["better_promoted_at_least"],
           "equal": summary["equal"]["no_difference_rate"] >= goals["equal_no_difference_at_least"]}
    return {"cases": summary, "gate_seconds_median": float(np.median(seconds)) if seconds else float("nan"),
            "step_model_error_median": float(np.median(errors)) if errors else float("nan"),
            "step_model_fit": calibration, "readout_test_spearman": quality, "goals": goals, "goals_met": met,
            "quick": quick, "length_divisor": QUICK_LENGTH_DIVISOR if quick else 1, "slice": slice_size,
            "repeats": repeats, "load": load, "decode_slots": DECODE_SLOTS, "pool": len(pool), "pool_dropped": dropped,
            "model": model.model_id, "seconds": round(time.perf_counter() - started, 1)}
