"""`leap eval ...`: the studies behind docs/results.md, each printing its result (`--json`) and, with
`--save`, writing it to docs/results/ for `leap eval report`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from evaluation.selections import CHAT_TRAIN
from leap_cli.output import console, emit
from leap_io.jsonable import dumps
from study_cli.apps import eval_app
from study_cli.saving import SAVE, stamped

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"

JSON = typer.Option(False, "--json", help="one JSON object on stdout")


BUILD = typer.Option(True, "--build/--no-build",
                     help="run prompts missing from the corpus (--no-build: leave them out)")
MODEL = typer.Option(None, help="HF model folder (default: the prepared SmolLM2)")
MAX_TOKENS = typer.Option(1024, help="output budget M (at most 10% of chat outputs reach it)")
STEP_MODEL = typer.Option(None, help="a saved full `leap eval fidelity` result whose step model (fitted on the "
                                     "engine, checked against the wall clock) prices the steps (default "
                                     "docs/results/fidelity.json); calibrated on the engine at K=8, R=512 when it "
                                     "has none at that shape")


def _say(as_json: bool):
    return lambda message: console.print(f"[bold]eval[/]: {message}")


def _finish(result: dict, study: str, name: str, as_json: bool, save: bool) -> None:
    result = stamped({"study": study, **result})
    if save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{name}.json"
        path.write_text(dumps(result, indent=1) + "\n")
        console.print(f"[bold]eval[/]: saved {path}")
    emit(result if as_json else {k: v for k, v in result.items() if k not in ("policies", "rows")},
         as_json, study)


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@eval_app.command("transfer")
def transfer(
    train: str = typer.Option(CHAT_TRAIN, help="training sets: NAME_OR_FILE[:N],..."),
    test: list[str] = typer.Option(..., help="target prompts: a JSONL in the shared schema or a set name; repeat"),
    limit: int | None = typer.Option(300, help="prompts per test file (a seeded sample; 0 = all)"),
    feedback: str = typer.Option("100,500,1000", help="RLS feedback counts scored"),
    baselines: str = typer.Option("prompt_length,minilm_ridge,minilm_finetuned,minilm_ltr,trail_mlp"),
    name: str | None = typer.Option(None, help="result name under docs/results/ (default from --test)"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """Train on one domain, score another: frozen LEAP, LEAP + RLS by feedback count, a refit, baselines."""
    from evaluation.studies import transfer_study

    result = transfer_study(train, test, limit or None, _names(baselines), [int(c) for c in _names(feedback)],
                            max_tokens, model, _say(as_json), build)
    _finish(result, "transfer", name or "transfer-" + "-".join(Path(t).stem for t in test), as_json, save)


@eval_app.command("live")
def live(
    quick: bool = typer.Option(False, "--quick",
                               help="32 requests, 1 repeat, baselines that train in seconds"),
    requests: int | None = typer.Option(None, help="replayed requests (default 60; 32 with --quick)"),
    repeats: int | None = typer.Option(None, help="repeats (default 2; 1 with --quick)"),
    load: float = typer.Option(1.2, help="arrival rate as a multiple of the engine's sustained FCFS capacity: "
                                         "above 1 a short replay builds the queues that make policies differ "
                                         "(an overload over the replay's horizon; stable loads are the "
                                         "simulated study's)"),
    decode_slots: int | None = typer.Option(
        None, help="K, requests decoded per step (default 8): scaled so that requests queue for slots on "
                   "2 CPU cores, as 512 do for 64 on a GPU"),
    gittins: bool = typer.Option(False, "--gittins", help="countdown against the Gittins order (leap-gittins) on "
                                                          "one engine: 64 requests x 4 repeats by default, "
                                                          "`gittins_over_countdown` paired by repeat, then "
                                                          "request, and long requests' latency"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
) -> None:
    """Replay held-out requests through the real engine (step clock) under FCFS, baselines, LEAP, LEAP + RLS
    and the oracle (--gittins: countdown against the Gittins order); paired ratios with intervals and the
    simulator's fidelity on the same workloads."""
    from evaluation.studies import live_study

    result = live_study(quick, requests, repeats, load, decode_slots, max_tokens, model, _say(as_json),
                        gittins=gittins)
    study = "live-gittins" if gittins else "live"
    _finish(result, study, study if gittins else "live-quick" if quick else "live", as_json, save)


@eval_app.command("fidelity")
def fidelity(
    quick: bool = typer.Option(False, "--quick", help="24 requests, prompts of at most 256 tokens, recorded lengths "
                                                       "divided by 8: minutes on two CPU cores"),
    requests: int | None = typer.Option(None, help="replayed requests (default 30; 24 with --quick)"),
    repeats: int | None = typer.Option(None, help="counterbalanced repeats per load (default 6)"),
    baseline: str = typer.Option("trail_mlp", help="the baseline replayed beside FCFS, LEAP and the oracle"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
) -> None:
    """The simulator checked against the wall clock: capacity measured on the engine, the step model fitted on
    other requests, FCFS, LEAP, a baseline and the oracle replayed at 0.7 and 0.9 of that capacity and simulated."""
    from evaluation.studies import fidelity_study

    result = fidelity_study(quick, baseline, max_tokens, model, _say(as_json), n_requests=requests, repeats=repeats)
    _finish(result, "fidelity", "fidelity-quick" if quick else "fidelity", as_json, save)


@eval_app.command("corpus")
def corpus(
    select: list[str] | None = typer.Option(None, help="selections NAME_OR_FILE[:N],... (default: every study's)"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """Output-length distribution per prompt set and how often the budget M is reached."""
    from evaluation.corpus_report import STUDY_SELECTIONS, corpus_study

    result = corpus_study(select or STUDY_SELECTIONS, max_tokens, model, _say(as_json), build)
    _finish(result, "corpus", "corpus", as_json, save)


@eval_app.command("ceiling")
def ceiling(max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
            build: bool = BUILD,
            n_boot: int = typer.Option(2000, "--n-boot", min=100, help="bootstrap replicates per interval")) -> None:
    """The label ceiling on held-out ShareGPT: Spearman between two greedy runs in other batch compositions
    and between independent sampled draws, the predictor ceilings they imply, and the readout beside them."""
    from evaluation.ceiling import ceiling_study

    _finish(ceiling_study(max_tokens, model, _say(as_json), build, n_boot), "ceiling", "ceiling", as_json, save)


@eval_app.command("curve")
def curve(
    pool: int | None = typer.Option(None, min=100, help="the first N ShareGPT prompts form the training pool, less "
                                                           "the test slice (default: the snapshot's ShareGPT prompts)"),
    draws: int = typer.Option(5, min=1, help="seeded training subsamples per size"),
    n_boot: int = typer.Option(2000, "--n-boot", min=100, help="bootstrap replicates per interval"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """The learning curve: held-out ShareGPT Spearman of the readout (sqrt and log targets) against its training
    rows, intervals over test prompts and training draws, and the slope per doubling of the rows."""
    from evaluation.learning_curve import learning_curve_study

    result = learning_curve_study(pool, max_tokens, model, _say(as_json), build, draws, n_boot)
    _finish(result, "curve", "curve", as_json, save)


@eval_app.command("targets")
def targets(max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON,
            save: bool = SAVE) -> None:
    """Regression target ablation (raw / log / sqrt): MAE by length bucket on chat."""
    from evaluation.studies import targets_study

    _finish(targets_study(max_tokens, model, _say(as_json)), "targets", "targets", as_json, save)


@eval_app.command("layers")
def layers(prompts: int = typer.Option(400, help="ShareGPT prompts with every layer captured"),
           max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON,
           save: bool = SAVE) -> None:
    """One layer against all layers concatenated, and a sweep over layers chosen on training rows only."""
    from evaluation.studies import layers_study

    _finish(layers_study(prompts, max_tokens=max_tokens, model=model, say=_say(as_json)), "layers", "layers",
            as_json, save)


@eval_app.command("load")
def load(
    quick: bool = typer.Option(False, "--quick", help="loads 0.5, 0.8, 0.9 and 0.95 only, no overload, baselines that "
                                                       "train in seconds, 1,000 requests a run, 20 paired workloads "
                                                       "a load over the splits"),
    train: str = typer.Option(CHAT_TRAIN),
    test: list[str] | None = typer.Option(None, help="target prompts (JSONL or set name; default sharegpt, "
                                                        "held out from --train); repeat"),
    limit: int | None = typer.Option(1200, help="target prompts per test set: half feed RLS, half are the pool"),
    name: str | None = typer.Option(None),
    baselines: str | None = typer.Option(None, help="default: every baseline (--quick: prompt_length,trail_mlp)"),
    step_model: Path | None = STEP_MODEL,
    n_requests: int | None = typer.Option(None, help="requests per run (default 2000; 1000 with --quick)"),
    splits: int = typer.Option(5, help="train/test splits: each partitions the target anew and refits every "
                                       "predictor; intervals resample the splits, then the seeds within each"),
    seeds: int | None = typer.Option(None, help="paired workloads (request draw + arrivals) per split and load "
                                                   "(default 30 over the splits: 6 each for 5; --quick 20: 4 "
                                                   "each)"),
    decode_slots: int = typer.Option(
        8, help="K, requests decoded per step: 8, as in the live study that validates the simulator (on 2 CPU "
                "cores a step costs about the same per decoded request at any K, so decode slots are scarce "
                "only at small K; K=64 queues on a GPU, where a step's cost is mostly fixed)"),
    max_resident: int = typer.Option(512, help="R, requests resident"),
    untouched: bool = typer.Option(False, "--untouched", help="the final table: the pool is the untouched test "
                                                              "slice (600 ShareGPT prompts no choice was made on); "
                                                              "the --test rows still feed RLS and choose the "
                                                              "baseline"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """Simulated replay at 0.7-0.95 of sustained capacity (and an overload) on several train/test splits, paired
    seeds, ratios with intervals over splits and seeds; countdown beside the uncertainty-aware order (leap-gittins)
    and the tail guard on each (leap-guard, leap-gittins-guard), with every policy's `tail_goal`."""
    from dataclasses import asdict

    from evaluation.simulated_load import QUICK_LOADS
    from evaluation.studies import BASELINES, LOAD_WORKLOADS, QUICK_LOAD_WORKLOADS, load_study, step_model_from

    say = _say(as_json)
    steps, source = step_model_from(step_model, max_tokens, model, say, decode_slots, max_resident)
    chosen = _names(baselines) if baselines else (["prompt_length", "trail_mlp"] if quick else list(BASELINES))
    options = dict(loads=QUICK_LOADS, overloads=()) if quick else {}
    tests = test or ["sharegpt"]
    seeds = seeds or -(-(QUICK_LOAD_WORKLOADS if quick else LOAD_WORKLOADS) // splits)
    result = load_study(train, tests, limit or None, chosen, steps, max_tokens, model, say, build, splits=splits,
                        n_requests=n_requests or (1000 if quick else 2000), seeds=seeds,
                        decode_slots=decode_slots, max_resident=max_resident, untouched=untouched, **options)
    result.update(step_model_source=source, step_model=asdict(steps), quick=quick,
                  decode_slots=decode_slots, max_resident=max_resident)
    default = ("load-untouched" + ("-quick" if quick else "") if untouched
               else "load-quick" if quick else "load-" + "-".join(Path(t).stem for t in tests))
    _finish(result, "load", name or default, as_json, save)


def _simulated_study(study: str, step_model: Path | None, max_tokens: int, model: str | None, as_json: bool,
                     save: bool, **options) -> None:
    from dataclasses import asdict

    from evaluation import studies

    say = _say(as_json)
    steps, source = studies.step_model_from(step_model, max_tokens, model, say)
    result = getattr(studies, f"{study}_study")(steps, max_tokens, model, say, **options)
    result.update(step_model_source=source, step_model=asdict(steps), **studies.SIM_SHAPE)
    _finish(result, study, study, as_json, save)


@eval_app.command("refresh")
def refresh(step_model: Path | None = STEP_MODEL, max_tokens: int = MAX_TOKENS, model: str | None = MODEL,
            as_json: bool = JSON, save: bool = SAVE) -> None:
    """Refreshing the length estimate during decode against countdown, simulated (serving does not refresh)."""
    _simulated_study("refresh", step_model, max_tokens, model, as_json, save)


@eval_app.command("tail")
def tail(step_model: Path | None = STEP_MODEL, max_tokens: int = MAX_TOKENS, model: str | None = MODEL,
         as_json: bool = JSON, save: bool = SAVE) -> None:
    """Long-request P95 latency against the waiting cap, the aging strength and the wait aging (the tail guard)."""
    _simulated_study("tail", step_model, max_tokens, model, as_json, save)


@eval_app.command("report")
def report(results: Path = typer.Option(RESULTS, help="folder of saved study results"),
           out: Path = typer.Option(RESULTS.parent / "results.md", help="markdown written"),
           rerun: bool = typer.Option(False, "--rerun", help="first rerun every study on the committed snapshot "
                                                            "and save its result (hours on 2 CPU cores)"),
           as_json: bool = JSON) -> None:
    """Render docs/results.md and its plots from the saved study results (--rerun: regenerate them first)."""
    from evaluation.report import render_report, rerun_all

    outcomes = rerun_all(_say(as_json)) if rerun else None
    rendered = render_report(results, out)
    if outcomes is not None:
        rendered["reruns"] = outcomes
    emit(rendered, as_json, "report")
    if rendered["stale"] or rendered["dirty"]:  # the page still renders, naming them in its header
        print(f"results not from the snapshot's corpus: {rendered['stale'] or 'none'}; from a dirty or unknown "
              f"commit: {rendered['dirty'] or 'none'}", file=sys.stderr)
        raise typer.Exit(1)
    if outcomes is not None and any(o["rc"] for o in outcomes):
        raise typer.Exit(1)


@eval_app.command("recipes")
def recipes(
    quick: bool = typer.Option(False, "--quick", help="8 recipes and 500 bootstrap draws (under 10 minutes "
                                                      "from the committed corpus)"),
    candidates: str | None = typer.Option(None, help="recipes to compare, comma-separated "
                                                        "(default: the study's list; every one must be covered "
                                                        "by the corpus' wide recipe)"),
    baselines: str | None = typer.Option(None, help="baselines scored on the same held-out rows, "
                                                       "comma-separated (default prompt_length,minilm_ridge,"
                                                       "trail_mlp; none with --quick; '' for none)"),
    max_tokens: int = MAX_TOKENS, model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """Feature recipes side by side: held-out Spearman and MAE per set (greedy and sampled traffic) with
    intervals, cost per request and bytes per feedback row, and the recipe the fit flow would choose."""
    from evaluation.recipes import recipe_study

    result = recipe_study(quick, _names(candidates) if candidates else None, max_tokens, model, _say(as_json), build,
                          None if baselines is None else _names(baselines))
    _finish(result, "recipes", "recipes-quick" if quick else "recipes", as_json, save)


@eval_app.command("versus-stock")
def versus_stock(
    quick: bool = typer.Option(False, "--quick", help="24 requests a segment, 3 repeats, outputs cut at M/4, no "
                                                      "oracle arm: under 30 minutes here"),
    repeats: int | None = typer.Option(None, help="runs of each arm (default 6; --quick 3)"),
    requests: int | None = typer.Option(None, help="requests per segment, one pattern at one load (default 48; "
                                                      "--quick 24)"),
    loads: str = typer.Option("0.5,0.8,0.95", help="fractions of stock's sustained capacity"),
    patterns: str = typer.Option("poisson,bursty", help="poisson and/or bursty (the Azure conversation trace's gaps)"),
    oracle: bool | None = typer.Option(None, "--oracle/--no-oracle", help="the oracle arm (default: on; "
                                                                              "--quick: off)"),
    arm: list[str] | None = typer.Option(None, "--arm", help="an extra arm, reported as <arm>_over_stock; repeat: "
                                                                "stock-r512 (--max-num-seqs 512), stock-scheduler "
                                                                "(LEAP's scheduler class, FCFS), leap-fcfs"),
    temperature: float = typer.Option(0.7, help="sampling temperature (a seed per request, the same in every arm)"),
    max_tokens: int | None = typer.Option(None, help="output budget (default M = 1024; --quick 256)"),
    name: str | None = typer.Option(None, help="result name under docs/results/ (default versus-stock[-quick])"),
    progress: Path | None = typer.Option(None, help="keep each finished repeat in this file and resume after the "
                                                    "last one kept (a full run takes hours: play it over sessions)"),
    repeats_now: int | None = typer.Option(None, min=1, help="play at most this many repeats now (with --progress)"),
    model: str | None = MODEL, as_json: bool = JSON, save: bool = SAVE,
) -> None:
    """Stock vLLM's OpenAI server against `leap serve`, each at its defaults, on the wall clock: fresh servers,
    one streaming client, sampled held-out ShareGPT requests at 0.5 / 0.8 / 0.95 of stock's capacity, Poisson
    and bursty; every figure LEAP over stock with its interval over runs, and `goals_met`."""
    if repeats_now is not None and progress is None:
        raise typer.BadParameter("--repeats-now plays part of a study: name its --progress file", param_hint="--repeats-now")
    from dataclasses import replace

    from evaluation.versus_stock import VersusStockSettings, prepare_workload, run_study
    from harness.engine import engine_environment

    settings = VersusStockSettings.quick() if quick else VersusStockSettings()
    chosen_patterns = tuple(_names(patterns))
    if not chosen_patterns or any(p not in ("poisson", "bursty") for p in chosen_patterns):
        raise typer.BadParameter("expected poisson and/or bursty", param_hint="--patterns")
    try:
        chosen_loads = tuple(float(v) for v in _names(loads))
    except ValueError:
        raise typer.BadParameter("expected fractions such as 0.5,0.8", param_hint="--loads") from None
    if not chosen_loads or any(not 0.0 < v <= 3.0 for v in chosen_loads):
        raise typer.BadParameter("each load must be in (0, 3]", param_hint="--loads")
    if not 0.0 <= temperature <= 2.0:
        raise typer.BadParameter("expected a temperature in [0, 2]", param_hint="--temperature")
    from evaluation.versus_stock import EXTRA_ARMS

    extra_arms = tuple(dict.fromkeys(arm or ()))
    if any(a not in EXTRA_ARMS for a in extra_arms):
        raise typer.BadParameter(f"expected one of {', '.join(EXTRA_ARMS)}", param_hint="--arm")
    changes = {"loads": chosen_loads, "patterns": chosen_patterns, "temperature": temperature,
               "extra_arms": extra_arms}
    for key, value in (("repeats", repeats), ("requests", requests), ("oracle", oracle), ("max_tokens", max_tokens)):
        if value is not None:
            changes[key] = value
    settings = replace(settings, **changes)
    if settings.repeats < 1 or settings.requests < 4:
        raise typer.BadParameter("need at least 1 repeat and 4 requests a segment")
    engine_environment()  # the same KV-cache size, caches and logging for both servers
    say = _say(as_json)
    work = prepare_workload(settings, model, say)
    try:
        result = {"quick": quick, **run_study(work, settings, say, progress, repeats_now)}
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--progress") from None
    if save and not result["complete"]:
        console.print(f"[bold]eval[/]: {result['repeats_played']} of {settings.repeats} repeats played; the progress "
                      f"file holds them, the result is saved once every repeat is played")
        save = False
    _finish(result, "versus-stock", name or ("versus-stock-quick" if quick else "versus-stock"), as_json, save)
