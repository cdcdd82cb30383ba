"""Each study end to end: choose prompts, read (or build) their corpora, fit on training rows only, run.

The CLI (`leap eval ...`) is a thin shell over these; each returns the JSON-able result that
`docs/results.md` is rendered from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evaluation import offline
from evaluation.baseline_fits import fit_cached, hyperparameters, make_predictor, measure_cost, pinned
from evaluation.baselines import LeapReadoutPredictor, LengthData
from evaluation.corpora import load_or_build, model_info
from evaluation.data import length_data
from evaluation.offline import choose_alpha
from evaluation.selections import CHAT_TEST, CHAT_TRAIN, REFRESH_POOL, UNTOUCHED, UNTOUCHED_SPEC, refresh_pool, select
from evaluation.simulated_load import Split, choose_baseline, choose_tail_guard, run_load_over_splits
from evaluation.simulated_refresh import run_refresh
from evaluation.simulated_tail import run_tail
from evaluation.simulation import HEADLINE_LOAD, EngineCapacity, Order
from evaluation.transfer import FEEDBACK_COUNTS, domain_predictions, fit_leap, run_transfer, stream_predictions
from harness.datasets import trace_gaps
from leap_core.cross_fit import FOLDS as GITTINS_FOLDS
from leap_core.cross_fit import cross_fitted_distribution
from leap_core.metrics import spearman as offline_spearman
from leap_core.simulator import StepTimeModel
from leap_io.paths import sub_dir

BASELINES = ("prompt_length", "minilm_ridge", "minilm_finetuned", "minilm_ltr", "trail_mlp")
Say = Callable[[str], None]
SHAREGPT_SPEARMAN_GOAL = 0.70  # held-out ShareGPT Spearman of the serving readout (sqrt target)


def _quiet(message: str) -> None:
    return None


def datasets(specs: Sequence[str], max_tokens: int, model: str | None, say: Say,
             limit: int | None = None, build: bool = True) -> list[LengthData]:
    """LengthData per selection spec; later specs never repeat an earlier one's prompts."""
    lists: list[list[dict]] = []
    seen: set[str] = set()
    for spec in specs:
        prompts = select(spec, limit, exclude=seen)
        seen.update(p["id"] for p in prompts)
        lists.append(prompts)
    corpora = load_or_build(lists, max_tokens, model, say=say, build=build)
    return [length_data(corpus, prompts) for corpus, prompts in zip(corpora, lists)]


def fitted_baselines(train: LengthData, names: Sequence[str], say: Say) -> dict[str, Any]:
    """Each baseline fitted on the training rows (cached by rows and hyper-parameters)."""
    fitted = {}
    for name in names:
        say(f"training {name} on {len(train)} prompts (cached)")
        fitted[name] = fit_cached(make_predictor(name), train, sub_dir("baselines"))
    return fitted


def transfer_study(train_spec: str, test_specs: Sequence[str], limit: int | None, baselines: Sequence[str],
                   counts: Sequence[int] = FEEDBACK_COUNTS, max_tokens: int = 1024, model: str | None = None,
                   say: Say = _quiet, build: bool = True) -> dict:
    train, target = datasets([train_spec, ",".join(test_specs)], max_tokens, model, say, limit, build)
    result = run_transfer(train, target, fitted_baselines(train, baselines, say), counts)
    result.update(train=train_spec, test=list(test_specs), max_tokens=max_tokens)
    return result


def chat_split(max_tokens: int, model: str | None, say: Say) -> tuple[LengthData, LengthData]:
    train, test = datasets([CHAT_TRAIN, CHAT_TEST], max_tokens, model, say)
    return train, test


def targets_study(max_tokens: int = 1024, model: str | None = None, say: Say = _quiet) -> dict:
    train, test = chat_split(max_tokens, model, say)
    from evaluation.target_heads import HEADS

    result = offline.run_targets(train.features, train.lengths, test.features, test.lengths, max_tokens,
                                 sets_test=test.sets, heads=HEADS)
    result.update(train=CHAT_TRAIN, test=CHAT_TEST)
    sqrt = result["targets"]["sqrt"]
    result["goals"] = {"sharegpt_heldout_spearman": {
        "target": f">= {SHAREGPT_SPEARMAN_GOAL}", "measured": sqrt["spearman"],
        "ci": [sqrt["spearman_ci"]["ci_low"], sqrt["spearman_ci"]["ci_high"]],
        "met": bool(sqrt["spearman"] >= SHAREGPT_SPEARMAN_GOAL)}}
    return result


def layers_study(n_prompts: int = 400, test_fraction: float = 0.3, max_tokens: int = 1024,
                 model: str | None = None, say: Say = _quiet) -> dict:
    """Every layer's state for ShareGPT prompts, split once into training and test rows."""
    from leap_core.layers import default_layer

    prompts = select(f"sharegpt:{n_prompts}")
    corpus = load_or_build([prompts], max_tokens, model, all_layers=True, say=say)[0]
    data = length_data(corpus, prompts)
    info = model_info(model)
    features = data.features.reshape(len(data), info.num_layers, info.hidden_size)
    order = np.random.default_rng(0).permutation(len(data))
    n_test = int(round(test_fraction * len(data)))
    test, train = order[:n_test], order[n_test:]
    result = offline.run_layers(features[train], data.lengths[train], features[test], data.lengths[test],
                                max_tokens, default_layer(info.num_layers),
                                sets_test=None if data.sets is None else data.sets[test])
    result.update(prompts=f"sharegpt:{n_prompts}")
    return result


FIDELITY_RESULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "fidelity.json"
# The engine shape every simulation runs at, the live study's: on 2 CPU cores a step costs about the same
# per decoded request at any K (calibrated at K=64: 0.75 ms a step plus 1.6 ms per decode), so requests
# wait for decode slots only when K is small; 64 slots, as on a GPU, would never fill below capacity.
SIM_SHAPE = {"decode_slots": 8, "max_resident": 512}


def step_model_from(path: Path | None, max_tokens: int, model: str | None, say: Say,
                    decode_slots: int = SIM_SHAPE["decode_slots"],
                    max_resident: int = SIM_SHAPE["max_resident"]) -> tuple[StepTimeModel, str]:
    """The step-time model the simulations at this K and R price steps with: the one a saved full fidelity
    study (`path`, default docs/results/fidelity.json) fitted on the engine's saturated runs and checked
    against the wall clock on other requests; without one at this K and R, calibrated now on a saturated
    FCFS run (unchecked, and said so in the source). A model calibrated at one K is never used at another;
    each study records the model it used in its own result."""
    path = path or FIDELITY_RESULT
    saved = json.loads(path.read_text()) if path.exists() else {}
    settings = saved.get("settings", {})
    shape = f"K{decode_slots}-R{max_resident}"
    if (saved.get("study") == "fidelity" and not saved.get("quick") and settings.get("decode_slots") == decode_slots
            and settings.get("max_resident") == max_resident and "step_model" in saved):
        fit = saved.get("step_model_fit", {})
        return StepTimeModel(**saved["step_model"]), (
            f"{path.name} (commit {str(saved.get('commit'))[:12]}) at {shape}: fitted on {fit.get('steps')} steps of "
            f"saturated runs, median per-request error against the wall clock "
            f"{100 * saved['request_error_wall']['median']:.1f}% on other requests")
    from evaluation.live import calibrated_step_model

    say(f"calibrating the step-time model on the live engine at {shape}")
    steps, _ = calibrated_step_model(decode_slots, max_resident, max_tokens, model)
    return steps, f"calibrated now at {shape} on a saturated FCFS run (not checked against the wall clock)"


def engine_capacity(step_model: StepTimeModel, path: Path | None = None, **config: Any) -> EngineCapacity:
    """The engine's measured capacity over what the simulator (this step model, the SimConfig knobs
    `config`) gives for the same requests, from the saved full fidelity study (`leap eval fidelity
    --save`); without one at this K and R, the simulator's own capacity (`EngineCapacity()`)."""
    from evaluation.fidelity import engine_over_simulator
    from leap_core.simulator import SimConfig

    path = path or FIDELITY_RESULT
    if not path.exists():
        return EngineCapacity()
    saved = json.loads(path.read_text())
    settings = saved.get("settings", {})
    shape = {key: config.get(key, SIM_SHAPE.get(key)) for key in ("decode_slots", "max_resident")}
    if saved.get("quick") or any(settings.get(key) != value for key, value in shape.items()):
        return EngineCapacity(source=f"simulator: {path.name} was measured at another engine shape")
    runs = saved["capacity"]["runs"]
    factor = engine_over_simulator(runs, SimConfig(step_model=step_model, **config))
    return EngineCapacity(
        scale=factor["value"], ci_low=factor["ci_low"], ci_high=factor["ci_high"],
        source=(f"measured on the engine ({path.name}, commit {str(saved.get('commit'))[:12]}): the engine's "
                f"steady FCFS rate over this step model's on {len(runs)} saturated runs of held-out requests, "
                f"{factor['value']:.3f} [{factor['ci_low']:.3f}, {factor['ci_high']:.3f}], x the pool's simulated "
                "capacity"))


LOAD_SPLITS = 5  # train/test splits the load study refits its predictors on
LOAD_WORKLOADS = 30  # paired workloads a load gets over all the splits (6 seeds a split for 5)
QUICK_LOAD_WORKLOADS = 20  # the same for `leap eval load --quick` (4 seeds a split for 5)
TRAIN_SHARE = 0.9  # of the training rows, each split after the first refits on (a seeded subsample)


def load_study(train_spec: str, test_specs: Sequence[str], limit: int | None, baselines: Sequence[str],
               step_model: StepTimeModel, max_tokens: int = 1024, model: str | None = None,
               say: Say = _quiet, build: bool = True, splits: int = LOAD_SPLITS, untouched: bool = False,
               **options: Any) -> dict:
    """Simulated scheduling of a domain's held-out rows under every predictor (Table 4, Figure 6), over
    `splits` train/test splits, so the ratios' intervals carry what refitting on other rows moves as well
    as the workload's noise (`simulated_load.run_load_over_splits`).

    Split k partitions the target's rows by seed k: half feed LEAP's RLS, the other half is the pool the
    simulator draws requests from. Its predictors are refitted: LEAP's readout (the penalty chosen on the
    whole training window) and its RLS anchor on the training rows, then the RLS on split k's stream; each
    baseline on the same training rows, narrowed to the hyper-parameters its own search chose on the first
    split (`baselines.pinned`). The first split fits on every training row; the others on a seeded
    `TRAIN_SHARE` of them. Each split's stream half also chooses the best baseline LEAP is compared against
    on that split (`validated_baseline`): the baselines never saw it, so the test pool never picks LEAP's
    opponent. The Gittins order's distribution and the tail guard's cap come from the whole training
    window, once.

    `untouched`: the final table. The simulated pool is the untouched test slice
    (`evaluation.selections.UNTOUCHED`, every split the same rows), which no choice was made on; the
    target's rows still give each split's feedback stream and the baseline's validation rows."""
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    specs = [train_spec, ",".join(test_specs), *([UNTOUCHED_SPEC] if untouched else [])]
    train, target, *final = datasets(specs, max_tokens, model, say, limit, build)
    pool = final[0] if final else None
    fitted = fitted_baselines(train, baselines, say)
    counts = (len(target) // 2,)
    shape = {k: options[k] for k in ("decode_slots", "max_resident") if k in options}
    engine = engine_capacity(step_model, **shape)
    alpha = choose_alpha(train.features, train.lengths, "sqrt", train.max_tokens)  # as fit_leap chooses it
    pools, validations = [], []
    for k in range(splits):
        rows = train if k == 0 else train.subset(_train_subsample(len(train), k))
        refitted = fitted if k == 0 else refit_pinned(fitted, rows, say)
        say(f"split {k + 1} of {splits}: {len(rows)} training rows, the target partitioned by seed {k}")
        evaluation, predictions = domain_predictions(rows, target, refitted, counts=counts, alpha=alpha, seed=k,
                                                     pool=pool)
        validation = validated_baseline(target, refitted, counts, step_model, say, engine=engine, seed=k, **options)
        pools.append(Split(evaluation.prompt_tokens, evaluation.lengths, predictions,
                                     validation.get("best_baseline")))
        validations.append(validation)
    distribution, cross_fitted = cross_fitted_distribution(train.features, train.lengths, alpha=alpha,
                                                           max_tokens=train.max_tokens)
    gittins = Order("leap", "gittins_over_countdown", overrides={"distribution": distribution})
    countdown = Order("leap", "guard_over_countdown", policy="countdown")
    guards = {}
    for name, order in (("leap-guard", countdown), ("leap-gittins-guard", gittins)):
        say(f"choosing {name}'s waiting cap and wait aging on the training rows (cross-fitted predictions)")
        guards[name] = choose_tail_guard(train.prompt_tokens, train.lengths, cross_fitted, step_model,
                                                   order, engine=engine, **shape)
    knobs = {name: {"waiting_cap": g["waiting_cap"], "wait_aging": g["wait_aging"]} for name, g in guards.items()}
    orders = {"leap-guard": Order("leap", "guard_over_countdown", policy="countdown",
                                            overrides=knobs["leap-guard"]),
              "leap-gittins": gittins,
              "leap-gittins-guard": Order("leap", "gittins_guard_over_countdown", overrides={
                  "distribution": distribution, **knobs["leap-gittins-guard"]})}
    say(f"simulating {len(pools[0].predictions) + len(orders) + 2} policies on {splits} splits' pools of "
        f"{len(pools[0].lengths)} held-out prompts")
    result = run_load_over_splits(pools, step_model, orders=orders, engine=engine, **options)
    result.update({key: value for key, value in validations[0].items() if key != "best_baseline"})
    result["validation_by_split"] = [
        {"best_baseline": v.get("best_baseline"), "n_validation": v.get("n_validation"),
         "mean_ptl": {name: figures["mean_ptl"] for name, figures in v.get("baseline_validation", {}).items()}}
        for v in validations]
    result["split_setup"] = {
        "partition": "the target's rows permuted by the split's seed (0, 1, ...): half the feedback stream and "
                     "validation rows, half the simulated pool",
        "train_share": 1.0 if splits == 1 else TRAIN_SHARE,
        "refit": "LEAP's readout and RLS anchor on the split's training rows (the whole window's penalty), RLS on "
                 "the split's stream; each baseline on the split's training rows at the hyper-parameters its "
                 "search chose on the first split (which fits on every training row)",
        "best_baseline": "chosen on each split's own stream rows"}
    if pool is not None:
        result["split_setup"]["partition"] = ("the target's rows permuted by the split's seed (0, 1, ...): half the "
                                              "feedback stream and validation rows; the pool is the untouched slice")
        result["untouched"] = {"set": UNTOUCHED, "n": len(pool),
                               "rows": "ShareGPT prompts after the snapshot's first 3,050 in the seeded order; no "
                                       "choice (window, recipe, penalty, baseline, tail cap) was made on them"}
    say("the same policies at the headline load with bursty arrivals (a real trace's gaps)")
    headline = options.get("headline", HEADLINE_LOAD)
    bursty = run_load_over_splits(pools, step_model, orders=orders, engine=engine, gaps=trace_gaps(),
                                            **{**options, "loads": (headline,), "overloads": ()})
    result["bursty"] = {key: bursty[key] for key in ("arrivals", "table", "tail", "ratios", "long_p95_over_fcfs")}
    result.update(train=train_spec, test=list(test_specs), n_train=len(train), tail_guards=guards,
                  gittins={"weight": distribution.weight, "bins": len(distribution.samples_),
                           "validation_pairs": distribution.n_, "folds": GITTINS_FOLDS,
                           "fitted_on": "cross-fitted LEAP predictions of the training rows only"})
    return result


def _train_subsample(n: int, split: int) -> np.ndarray:
    """The training rows split `split` refits on: a seeded `TRAIN_SHARE` of the `n`, in their order."""
    return np.sort(np.random.default_rng(split).choice(n, int(round(TRAIN_SHARE * n)), replace=False))


def refit_pinned(fitted: dict[str, Any], rows: LengthData, say: Say = _quiet) -> dict[str, Any]:
    """Each fitted baseline refitted on `rows` at the hyper-parameters it chose (`baselines.pinned`; cached)."""
    refitted = {}
    for name, predictor in fitted.items():
        say(f"refitting {name} on {len(rows)} prompts at its chosen hyper-parameters (cached)")
        refitted[name] = fit_cached(pinned(predictor), rows, sub_dir("baselines"))
    return refitted


def validated_baseline(target: LengthData, fitted: dict[str, Any], counts: Sequence[int], step_model: StepTimeModel,
                       say: Say = _quiet, engine: EngineCapacity = EngineCapacity(),
                       seed: int = 0, **options: Any) -> dict:
    """LEAP's opponent in the load study, chosen on validation rows: the target's feedback-stream half (no
    baseline was fitted on it, the simulated pool never holds it) of the partition seeded by `seed`, each
    baseline's countdown replayed there at the headline load with the study's engine shape and requests a
    run (`simulated_load.choose_baseline`).

    The result keys the load study reports: `best_baseline`, `baseline_validation` (each baseline's mean
    PTL with its interval, Spearman on those rows, and its hyper-parameters, with what its own search chose),
    `n_validation` (rows) and `validation` (how the choice was simulated; FCFS's mean PTL beside). No
    baselines: nothing to choose, {}."""
    if not fitted:
        return {}
    stream, predicted = stream_predictions(target, fitted, counts, seed=seed)
    say(f"choosing the best baseline on {len(stream)} feedback-stream rows (validation)")
    sim = {key: options[key] for key in ("decode_slots", "max_resident", "n_requests") if key in options}
    choice = choose_baseline(stream.prompt_tokens, stream.lengths, predicted, step_model,
                                       load=options.get("headline", HEADLINE_LOAD), engine=engine, **sim)
    setup = {key: value for key, value in choice.items() if key not in ("best_baseline", "baselines", "n_pool")}
    return {"best_baseline": choice["best_baseline"], "n_validation": choice["n_pool"],
            "baseline_validation": {name: {**figures, "hyperparameters": hyperparameters(fitted[name])}
                                    for name, figures in choice["baselines"].items()},
            "validation": {"rows": "the target's feedback-stream half", **setup}}


def chat_predictions(names: Sequence[str], max_tokens: int, model: str | None,
                     say: Say) -> tuple[LengthData, dict[str, np.ndarray], dict[str, dict]]:
    """Chat test rows, the predictions of LEAP and `names` for them, and each predictor's measured cost."""
    train, test = chat_split(max_tokens, model, say)
    readout = fit_leap(train)
    fitted = fitted_baselines(train, names, say)
    predictions = {"leap": readout.predict(test.features)}
    predictions.update({name: np.asarray(p.predict(test), dtype=np.float64) for name, p in fitted.items()})
    costs = {name: measure_cost(p, test) for name, p in fitted.items()}
    costs["leap"] = measure_cost(LeapReadoutPredictor.from_readout(readout), test)
    return test, predictions, costs


REFRESH_FOLDS = 2


def _length_agreement(prefill: Any, max_tokens: int, model: str | None) -> dict:
    """How often the decode-state pass generated as many tokens as the corpus did for the same prompt (both
    greedy; batch composition can still move bf16 numerics): share equal, and median relative difference."""
    from harness.replay import DEFAULT_DECODING
    from study_harness.corpus import corpus_dir, corpus_key, load_corpus
    from study_harness.decode_states import split_ids

    info = model_info(model)
    owners, _ = split_ids(prefill.ids)
    corpus = load_corpus(corpus_dir(corpus_key(info.fingerprint, int(prefill.layer), max_tokens, DEFAULT_DECODING)),
                         int(prefill.layer), max_tokens, ids=owners.tolist())
    by_id = dict(zip(corpus.ids.tolist(), corpus.output_tokens.tolist()))
    pairs = [(by_id[o], int(n)) for o, n in zip(owners.tolist(), prefill.output_tokens) if o in by_id]
    if not pairs:
        return {"n": 0}
    a, b = np.array(pairs, dtype=np.float64).T
    return {"n": len(pairs), "equal_share": float(np.mean(a == b)),
            "median_relative_difference": float(np.median(np.abs(a - b) / np.maximum(a, 1.0)))}


def refresh_study(step_model: StepTimeModel, max_tokens: int = 1024, model: str | None = None,
                  say: Say = _quiet, n_prompts: int = REFRESH_POOL, build: bool = True, **options: Any) -> dict:
    """Countdown against refreshing during decode, both arms measured on the same held-out prompts.

    Countdown: LEAP's readout fitted on the chat training rows, applied to each pool prompt's prefill
    state. Refresh: a second readout of the same form, fitted on decode states (study_harness.decode_states)
    to the remaining length, cross-fitted by prompt so no prompt is scored by a readout that saw it; its
    prediction cost per request is measured and charged per refresh."""
    from evaluation.corpora import load_or_build_decode_states
    from evaluation.data import length_data
    from study_harness.decode_states import CHECKPOINTS, checkpoint_matrix

    train = datasets([CHAT_TRAIN], max_tokens, model, say)[0]
    pool_prompts = refresh_pool(n_prompts)
    rows = load_or_build_decode_states(pool_prompts, max_tokens, model, say, build)
    index, has_prefill = checkpoint_matrix(rows, [p["id"] for p in pool_prompts])
    index = index[has_prefill]
    if len(index) < 2 * REFRESH_FOLDS:
        raise ValueError(f"only {len(index)} pool prompts have decode states: run `leap corpus build --snapshot`")
    prefill = rows.subset(index[:, 0])
    lengths = prefill.output_tokens.astype(np.int64)
    agreement = _length_agreement(prefill, max_tokens, model)
    countdown = fit_leap(train).predict(prefill.features)

    folds = np.random.default_rng(0).permutation(len(index)) % REFRESH_FOLDS
    refreshed = np.full((len(index), len(CHECKPOINTS)), np.nan)
    train_rows, readout = [], None
    for fold in range(REFRESH_FOLDS):
        fit_index = index[folds != fold, 1:]
        fit_rows = rows.subset(np.sort(fit_index[fit_index >= 0]))
        data = length_data(fit_rows, [{"id": i, "prompt": ""} for i in fit_rows.ids])
        readout = fit_leap(data)
        train_rows.append(len(data))
        for c in range(len(CHECKPOINTS)):
            present = (folds == fold) & (index[:, c + 1] >= 0)
            if present.any():
                refreshed[present, c] = readout.predict(rows.features[index[present, c + 1]])
    assert readout is not None
    cost = measure_cost(LeapReadoutPredictor.from_readout(readout), train)["ms_per_request"] / 1000.0
    say(f"simulating countdown and refresh on {len(index)} prompts")
    result = run_refresh(prefill.prompt_tokens, lengths, countdown, refreshed, CHECKPOINTS, step_model,
                                   cost, **{**SIM_SHAPE, **options})
    result.update(pool=f"sharegpt:{n_prompts} held out from {CHAT_TRAIN}", train=CHAT_TRAIN,
                  countdown_spearman=float(offline_spearman(lengths, countdown)),
                  refresh_readout={"layer": int(rows.layer), "folds": REFRESH_FOLDS,
                                   "train_rows": int(np.mean(train_rows)), "target": "sqrt remaining length",
                                   "how": "captured as the prefill of the prompt and the first g generated tokens",
                                   "cost_ms_per_request": cost * 1000.0},
                  decode_rows=len(rows), capped_fraction=float(np.mean(prefill.finish_reasons == "length")),
                  length_agreement=agreement)
    return result


def tail_study(step_model: StepTimeModel, max_tokens: int = 1024, model: str | None = None,
               say: Say = _quiet, **options: Any) -> dict:
    """Long-request P95 against the waiting cap and aging strength, LEAP's predictions on chat."""
    test, predictions, _ = chat_predictions([], max_tokens, model, say)
    result = run_tail(test.prompt_tokens, test.lengths, predictions["leap"], step_model,
                                **{**SIM_SHAPE, **options})
    result.update(pool=CHAT_TEST)
    return result


def live_study(quick: bool, n_requests: int | None = None, repeats: int | None = None, load: float = 1.2,
               decode_slots: int | None = None, max_tokens: int = 1024, model: str | None = None,
               say: Say = _quiet, gittins: bool = False) -> dict:
    """The live replay: `quick` is a smaller run (fewer requests, one repeat, the baselines that train in
    seconds) that finishes in minutes; the full run is the Table 3 study. `gittins`: countdown against the
    Gittins order (`evaluation.live.GITTINS_POLICIES`), 64 requests x 4 repeats unless told otherwise."""
    from evaluation.live import FULL_POLICIES, GITTINS_POLICIES, QUICK_POLICIES, LiveSettings, run_live

    train = select(CHAT_TRAIN)
    default_n, default_repeats = (64, 4) if gittins else (32, 1) if quick else (60, 2)
    replayed = select(f"sharegpt:{n_requests or default_n}", exclude={p["id"] for p in train})
    policies = GITTINS_POLICIES if gittins else QUICK_POLICIES if quick else FULL_POLICIES
    settings = LiveSettings(n_requests=len(replayed), n_train=len(train), repeats=repeats or default_repeats,
                            load=load, max_tokens=max_tokens, policies=policies,
                            calibration_requests=len(replayed), decode_slots=decode_slots or 8)
    result = run_live(train, replayed, settings, model, say)
    result.update(quick=quick, train=CHAT_TRAIN)
    return result


FIDELITY_POOL = 200  # held-out ShareGPT prompts split into the capacity samples and the replayed requests


def fidelity_study(quick: bool, baseline: str = "trail_mlp", max_tokens: int = 1024, model: str | None = None,
                   say: Say = _quiet, **overrides: Any) -> dict:
    """The simulator against the wall clock (`evaluation.fidelity`): `quick` shrinks prompts and lengths and
    replays 24 requests; the full run replays 30 with their recorded lengths."""
    from evaluation.fidelity import QUICK, FidelitySettings, run_fidelity

    train = select(CHAT_TRAIN)
    pool = select(f"sharegpt:{FIDELITY_POOL}", exclude={p["id"] for p in train})
    shape = dict(n_requests=24, capacity_requests=32, length_divisor=QUICK["length_divisor"],
                 max_prompt_tokens=QUICK["max_prompt_tokens"]) if quick else {}
    settings = FidelitySettings(baseline=baseline, max_tokens=max_tokens,
                                **{**shape, **{k: v for k, v in overrides.items() if v is not None}})
    result = run_fidelity(train, pool, settings, model, say)
    result.update(quick=quick, train=CHAT_TRAIN, pool=f"sharegpt:{FIDELITY_POOL} held out from the training window")
    return result
