"""Study commands on the engine: `leap corpus build`, `leap replay`, `leap bench overhead|serving|recipes`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from leap_cli.output import console, emit
from study_cli.apps import bench_app, corpus_app
from study_cli.apps import commands as app
from study_cli.saving import clean_tree, stamped


def progress_bar(disabled: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=disabled, transient=True)


def _prompts(prompts: Path | None, limit: int | None, offset: int = 0, seed: int | None = None) -> list[dict]:
    """Prompts of a file (default ShareGPT) in file order, or in a seeded order spread over the whole file."""
    from harness.datasets import available_prompts, load_prompts, sample_prompts

    if prompts is not None:
        items = load_prompts(prompts)
    else:
        items = available_prompts(None, sets=["sharegpt"])
    items = sample_prompts(items, None, seed)
    end = None if limit is None else offset + limit
    return items[offset:end]


@corpus_app.command("build")
def corpus_build(
    prompts: list[Path] | None = typer.Option(
        None, help="JSONL in the shared schema (default: ShareGPT); repeat for several files"),
    limit: int | None = typer.Option(None, help="prompts per file"),
    max_tokens: int = typer.Option(1024, help="output budget M"),
    layers: str | None = typer.Option(None, "--layers", "--layer",
                                         help="decoder layer L (default: the model's), or 'all' for the layer study"),
    sample_seed: int | None = typer.Option(None, "--sample-seed",
                                              help="take --limit prompts in this seeded order instead of file order"),
    model: str | None = typer.Option(None),
    snapshot: bool = typer.Option(
        False, "--snapshot", help="build the committed snapshot's prompts, every-layer subset and the refresh study's decode "
                    "states (or only --select), and rewrite corpus/"),
    select: str | None = typer.Option(
        None, help="with --snapshot: selection NAME[:N],... to add (default: the snapshot's own)"),
    build: bool = typer.Option(True, "--build/--no-build",
                               help="with --snapshot: --no-build rewrites the snapshot from the rows already "
                                    "recorded (after an interrupted build) without starting the engine"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run prompts through the engine; record true lengths and layer-L features (cached, resumable)."""
    from serving.config import LeapConfig
    from study_harness.corpus import length_report
    from study_harness.experiment import corpus_for, open_live

    if snapshot:
        from evaluation.corpora import build_snapshot
        from study_harness import snapshot as snap

        manifest = build_snapshot(select or snap.SELECTION, "" if select else snap.ALL_LAYERS_SELECTION,
                                  max_tokens, model, say=lambda m: console.print(f"[bold]corpus[/]: {m}"),
                                  build=build, decode_states=not select)
        emit({"corpus_hash": manifest["corpus_hash"], "folder": str(snap.snapshot_files.ROOT),
              "corpora": {k: {n: v for n, v in e.items() if n != "ids"} for k, e in manifest["corpora"].items()}},
             as_json, "corpus")
        return

    every = layers is not None and layers.lower() == "all"
    layer = None if layers is None or every else int(layers)
    items = [item for path in (prompts or [None]) for item in _prompts(path, limit, seed=sample_seed)]
    live = open_live(model, LeapConfig(policy="fcfs", rls=False, layer=layer, capture_all_layers=every,
                                       max_resident=256), max_tokens=max_tokens)
    try:
        with progress_bar(as_json) as bar:
            task = bar.add_task("corpus", total=len(items))
            corpus = corpus_for(live, items, lambda done, total: bar.update(task, completed=done, total=total))
    finally:
        live.close()
    emit({"n": len(corpus), "requested": len(items), "layer": "all" if every else corpus.layer,
          "max_tokens": max_tokens, "decoding": live.decoding, "folder": str(live.corpus_folder()),
          "per_set": length_report(corpus)}, as_json, "corpus")


@app.command("replay")
def replay_command(
    policy: list[str] = typer.Option(["fcfs", "leap"], help="repeat for several policies in one run"),
    prompts: Path | None = typer.Option(None, help="JSONL in the shared schema (default: ShareGPT)"),
    limit: int = typer.Option(300, help="requests replayed"),
    rate: float | None = typer.Option(None, help="Poisson arrivals per second"),
    trace: Path | None = typer.Option(None, help="Azure trace CSV: use its arrival timestamps"),
    rate_scale: float = typer.Option(1.0, help="compress trace time by this factor"),
    fixed_lengths: str | None = typer.Option(
        "corpus", help="'corpus' (recorded lengths of this model), a JSONL {id, output_tokens}, or 'none'"),
    readout: Path | None = typer.Option(None, help="readout for leap (default: fit on training prompts)"),
    rls_state: Path | None = typer.Option(None),
    train_limit: int = typer.Option(400, help="training prompts (taken after the replayed slice)"),
    max_tokens: int = typer.Option(1024), max_resident: int = typer.Option(512),
    decode_slots: int = typer.Option(64), waiting_cap: int = typer.Option(128),
    seed: int = typer.Option(0), model: str | None = typer.Option(None),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per policy, one per line"),
) -> None:
    """Replay real prompts through the real engine under each policy; print latency after scheduling."""
    from study_harness.replay_command import run_replay

    results = run_replay(policies=policy, prompts=_prompts(prompts, limit),
                         train_prompts=_prompts(prompts, train_limit, offset=limit), rate=rate, trace=trace,
                         rate_scale=rate_scale, fixed_lengths=fixed_lengths, readout_path=readout,
                         rls_state_path=rls_state, max_tokens=max_tokens, max_resident=max_resident,
                         decode_slots=decode_slots, waiting_cap=waiting_cap, seed=seed, model=model,
                         progress=None if as_json else progress_bar())
    for result in results:
        emit(result, as_json, f"replay: {result['policy']}")


@bench_app.command("overhead")
def bench_overhead_command(
    n: int = typer.Option(96, help="requests replayed per engine"),
    tokens: int = typer.Option(64, help="fixed output tokens per request"),
    slots: int = typer.Option(32, help="resident = decode slots for both engines"),
    repeats: int = typer.Option(2, help="alternating stock/leap pairs"),
    model: str | None = typer.Option(None),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Step-time overhead of hook + predictor + scheduler against stock vLLM FCFS (same replay)."""
    from experiments.bench.overhead import bench_overhead

    say = (lambda m: None) if as_json else (lambda m: console.print(f"[bold]overhead[/]: {m}"))
    result = bench_overhead(_prompts(None, n), tokens=tokens, slots=slots, repeats=repeats, model=model, say=say)
    if as_json:
        emit(result, True)
    else:
        emit({k: v for k, v in result.items() if k != "runs"}, False, "LEAP overhead against stock FCFS")


@bench_app.command("serving")
def bench_serving_command(
    requests: int = typer.Option(200, help="requests in the Poisson trace (ShareGPT prompts)"),
    train: int = typer.Option(300, help="other ShareGPT prompts the LEAP readout is fitted on"),
    repeats: int = typer.Option(2, help="stock/LEAP pairs, order alternated"),
    load: float = typer.Option(3.0, help="arrival rate as a multiple of the measured capacity (3x: stock's "
                                         "slots fill and arrivals wait)"),
    rate: float | None = typer.Option(None, help="arrival rate in requests/s (overrides --load)"),
    max_tokens: int = typer.Option(1024, help="output budget M of the recorded lengths"),
    seed: int = typer.Option(0, help="arrival seed"),
    via: str = typer.Option("engine", help="engine: in-process engines; http: the OpenAI servers and a client"),
    shadow: bool = typer.Option(False, help="a third arm: LEAP holding a challenger in shadow in alternating "
                                            "blocks of steps (its throughput with the shadow over without under "
                                            "'shadow'; --via engine)"),
    shadow_block_steps: int = typer.Option(4, min=1, help="engine steps in each block of the shadow arm"),
    shadow_control_ms: float = typer.Option(0.0, min=0.0, max=1000.0,
                                            help="a positive control: each shadow prediction busy-waits this "
                                                 "long more, a known cost the figure must find"),
    model: str | None = typer.Option(None),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Stock vLLM with its defaults against LEAP with its defaults: tok/s and mean latency on one trace."""
    if via not in ("engine", "http"):
        raise typer.BadParameter("--via is engine or http")
    from experiments.bench.serving import bench_serving

    result = bench_serving(_prompts(None, requests + train, seed=0), n_requests=requests, n_train=train,
                           repeats=repeats, load=load, rate=rate, model=model, max_tokens=max_tokens, seed=seed,
                           via=via, shadow=shadow, shadow_block_steps=shadow_block_steps,
                           shadow_control_ms=shadow_control_ms,
                           say=lambda m: console.print(f"[bold]bench serving[/]: {m}"))
    emit(result if as_json else {k: v for k, v in result.items() if k != "runs"}, as_json,
         "stock vLLM against LEAP, each with its defaults")


# the last-token recipe (reference), the cheapest pooled recipe, the study's choice on the snapshot, and the
# widest (entropy pooling runs the model's logits over every prompt token)
DEFAULT_BENCH_RECIPES = ("last@22,last@17+mean@17,last@14+last@17+last@22+mean@17+mean@22+prompt,"
                         "last@14+last@17+last@22+mean@17+mean@22+entropy@17+prompt+decoding")


@bench_app.command("recipes")
def bench_recipes_command(
    recipes: str = typer.Option(DEFAULT_BENCH_RECIPES, help="recipes to run, comma-separated; the first is the "
                                                            "reference (the last-token recipe)"),
    n: int = typer.Option(96, help="requests replayed per engine (ShareGPT)"),
    tokens: int = typer.Option(64, help="fixed output tokens per request"),
    slots: int = typer.Option(32, help="resident = decode slots"),
    repeats: int = typer.Option(2, help="rounds, each recipe once per round in rotating order"),
    model: str | None = typer.Option(None),
    save: bool = typer.Option(False, "--save", callback=clean_tree,
                              help="write docs/results/recipe-costs.json for `leap eval recipes` (from a clean "
                                   "checkout: it records the commit and corpus snapshot)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Each recipe's engine cost: throughput against the last-token recipe, capture ms per request (and per
    block), predictions ready before the first decode."""
    from study_harness.recipe_bench import bench_recipes

    say = (lambda m: None) if as_json else (lambda m: console.print(f"[bold]bench recipes[/]: {m}"))
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    result = bench_recipes(_prompts(None, n, seed=0), names, tokens=tokens, slots=slots, repeats=repeats,
                           model=model, say=say)
    if save:
        from evaluation.recipes import COSTS
        from leap_io.jsonable import dumps

        COSTS.parent.mkdir(parents=True, exist_ok=True)
        result = stamped(result)
        COSTS.write_text(dumps(result, indent=1) + "\n")
        say(f"saved {COSTS}")
    emit(result if as_json else {k: v for k, v in result.items() if k != "runs"}, as_json,
         "feature recipes: engine cost")
