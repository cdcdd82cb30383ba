"""`leap eval ...`: the studies behind docs/results.md, each printing its result (`--json`) and, with
`--save`, writing it to docs/results/ for `leap eval report`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from evaluation.selections import CHAT_TRAIN
from leap_cli.apps import eval_app
from leap_cli.output import _clean, console, emit

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
LIVE_RESULT = RESULTS / "live.json"

JSON = typer.Option(False, "--json", help="one JSON object on stdout")
SAVE = typer.Option(False, "--save", help="also write the result to docs/results/ for `leap eval report`")
BUILD = typer.Option(True, "--build/--no-build",
                     help="run prompts missing from the corpus (--no-build: leave them out)")
MODEL = typer.Option(None, help="HF model folder (default: the prepared SmolLM2)")
MAX_TOKENS = typer.Option(1024, help="output budget M (at most 10% of chat outputs reach it)")
STEP_MODEL = typer.Option(LIVE_RESULT, help="JSON holding a `step_model` (default: the live study's); "
                                            "calibrated on the engine when missing")


def _say(as_json: bool):
    return lambda message: console.print(f"[bold]eval[/]: {message}")


def _finish(result: dict, study: str, name: str, as_json: bool, save: bool) -> None:
    result = {"study": study, **result, "command": "leap " + shlex.join(sys.argv[1:])}
    if save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{name}.json"
        path.write_text(json.dumps(_clean(result), indent=1) + "\n")
        console.print(f"[bold]eval[/]: saved {path}")
    emit(result if as_json else {k: v for k, v in result.items() if k not in ("policies", "rows")},
         as_json, study)


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@eval_app.command("transfer")
def transfer(
    train: str = typer.Option(CHAT_TRAIN, help="training sets: NAME_OR_FILE[:N],..."),
    test: list[str] = typer.Option(..., help="target prompts: a JSONL in the shared schema or a set name; repeat"),
    limit: Optional[int] = typer.Option(300, help="prompts per test file (a seeded sample; 0 = all)"),
    feedback: str = typer.Option("100,500,1000", help="RLS feedback counts scored"),
    baselines: str = typer.Option("prompt_length,minilm_ridge,minilm_finetuned,minilm_ltr,trail_mlp"),
    name: Optional[str] = typer.Option(None, help="result name under docs/results/ (default from --test)"),
    max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL, as_json: bool = JSON, save: bool = SAVE,
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
                               help="12 requests, 4 decode slots, 1 repeat, baselines that train in seconds"),
    requests: Optional[int] = typer.Option(None, help="replayed requests (default 20; 12 with --quick)"),
    repeats: Optional[int] = typer.Option(None, help="repeats (default 3; 1 with --quick)"),
    load: float = typer.Option(1.5, help="arrival rate as a multiple of the engine's FCFS capacity"),
    decode_slots: Optional[int] = typer.Option(
        None, help="K, requests decoded per step (default 8; 4 with --quick): scaled so that a few dozen "
                   "requests queue for slots on 2 CPU cores, as 512 do for 64 on a GPU"),
    max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL, as_json: bool = JSON, save: bool = SAVE,
) -> None:
    """Replay the same real requests through the real engine under FCFS, each baseline, LEAP, LEAP + RLS, oracle."""
    from evaluation.studies import live_study

    result = live_study(quick, requests, repeats, load, decode_slots, max_tokens, model, _say(as_json))
    _finish(result, "live", "live-quick" if quick else "live", as_json, save)


@eval_app.command("corpus")
def corpus(
    select: Optional[list[str]] = typer.Option(None, help="selections NAME_OR_FILE[:N],... (default: every study's)"),
    max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """Output-length distribution per prompt set and how often the budget M is reached."""
    from evaluation.corpus_report import STUDY_SELECTIONS, corpus_study

    result = corpus_study(select or STUDY_SELECTIONS, max_tokens, model, _say(as_json), build)
    _finish(result, "corpus", "corpus", as_json, save)


@eval_app.command("targets")
def targets(max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL, as_json: bool = JSON,
            save: bool = SAVE) -> None:
    """Regression target ablation (raw / log / sqrt): MAE by length bucket on chat."""
    from evaluation.studies import targets_study

    _finish(targets_study(max_tokens, model, _say(as_json)), "targets", "targets", as_json, save)


@eval_app.command("layers")
def layers(prompts: int = typer.Option(500, help="ShareGPT prompts with every layer captured"),
           max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL, as_json: bool = JSON,
           save: bool = SAVE) -> None:
    """One layer against all layers concatenated, and a sweep over layers chosen on training rows only."""
    from evaluation.studies import layers_study

    _finish(layers_study(prompts, max_tokens=max_tokens, model=model, say=_say(as_json)), "layers", "layers",
            as_json, save)


@eval_app.command("load")
def load(
    train: str = typer.Option(CHAT_TRAIN),
    test: list[str] = typer.Option(..., help="target prompts (JSONL or set name); repeat"),
    limit: Optional[int] = typer.Option(300), name: Optional[str] = typer.Option(None),
    baselines: str = typer.Option("prompt_length,minilm_ridge,minilm_finetuned,minilm_ltr,trail_mlp"),
    step_model: Path = STEP_MODEL, n_requests: int = typer.Option(2000), repeats: int = typer.Option(3),
    max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL, as_json: bool = JSON, save: bool = SAVE,
    build: bool = BUILD,
) -> None:
    """Simulated replay at 1.0, 1.5 and 2.0 times FCFS capacity and a load sweep, per predictor."""
    from evaluation.studies import load_study, step_model_from

    say = _say(as_json)
    steps, source = step_model_from(step_model, max_tokens, model, say)
    result = load_study(train, test, limit or None, _names(baselines), steps, max_tokens, model, say, build,
                        n_requests=n_requests, repeats=repeats)
    result["step_model_source"] = source
    _finish(result, "load", name or "load-" + "-".join(Path(t).stem for t in test), as_json, save)


def _simulated_study(study: str, step_model: Path, max_tokens: int, model: Optional[str], as_json: bool,
                     save: bool) -> None:
    from evaluation import studies

    say = _say(as_json)
    steps, source = studies.step_model_from(step_model, max_tokens, model, say)
    result = getattr(studies, f"{study}_study")(steps, max_tokens, model, say)
    result["step_model_source"] = source
    _finish(result, study, study, as_json, save)


@eval_app.command("refresh")
def refresh(step_model: Path = STEP_MODEL, max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL,
            as_json: bool = JSON, save: bool = SAVE) -> None:
    """Refreshing predictions during decode against countdown, for LEAP and the hidden-state MLP."""
    _simulated_study("refresh", step_model, max_tokens, model, as_json, save)


@eval_app.command("tail")
def tail(step_model: Path = STEP_MODEL, max_tokens: int = MAX_TOKENS, model: Optional[str] = MODEL,
         as_json: bool = JSON, save: bool = SAVE) -> None:
    """Long-request P95 latency against the waiting cap and the aging strength."""
    _simulated_study("tail", step_model, max_tokens, model, as_json, save)


@eval_app.command("report")
def report(results: Path = typer.Option(RESULTS, help="folder of saved study results"),
           out: Path = typer.Option(RESULTS.parent / "results.md", help="markdown written"),
           as_json: bool = JSON) -> None:
    """Render docs/results.md and its plots from the saved study results."""
    from evaluation.report import render_report

    emit(render_report(results, out), as_json, "report")
