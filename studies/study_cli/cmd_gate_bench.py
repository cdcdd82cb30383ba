"""`leap bench gate`: the promotion gate's error rates on a worse, a better and an equal challenger.

Figures, not pass/fail: the goals are worse promoted <= 5%, better promoted >= 80%, equal called "no
difference" >= 90%, each over >= 20 trials (studies/experiments/bench/gate.py).
"""

from __future__ import annotations

from typing import Annotated

import typer

from leap_cli.output import emit
from study_cli.apps import bench_app


@bench_app.command("gate")
def bench_gate(
    trials: Annotated[int, typer.Option(help="Trials of each case, each its own requests and arrivals.")] = 20,
    quick: Annotated[bool, typer.Option(help="Prompts of at most 64 tokens, recorded lengths divided by 48 (the "
                                             "same order), 96 requests a trial: minutes, not hours.")] = False,
    slice_size: Annotated[int | None, typer.Option("--slice", help="Requests one trial replays (as the gate's "
                                                                  "replay_slice; default 64, 96 with --quick).")] = None,
    repeats: Annotated[int, typer.Option(help="Replays of each arm per trial (counterbalanced).")] = 2,
    blocks: Annotated[int | None, typer.Option(help="Disjoint blocks of --slice requests a trial replays, one a "
                                                    "repeat (as the gate's gate_blocks; default the most, up to "
                                                    "2, that divide --repeats); must divide --repeats.")] = None,
    load: Annotated[float, typer.Option(help="Arrivals as a fraction of the FCFS capacity.")] = 1.2,
    better_bar: Annotated[str, typer.Option(help="The better case's bar: fcfs (a first promotion, no champion "
                                                 "yet) or small (a first champion fitted on 16 rows).")] = "fcfs",
    seed: int = 0,
    model: Annotated[str | None, typer.Option(help="HF model folder (default: the prepared SmolLM2).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Promoted rates (with Wilson intervals) of a worse, a better and an equal challenger, and the gate's time."""
    from experiments.bench.gate import BETTER_BARS
    from experiments.bench.gate import bench_gate as run

    if trials < 1 or (slice_size is not None and slice_size < 4) or repeats < 1 or load <= 0:
        raise typer.BadParameter("--trials and --repeats at least 1, --slice at least 4, --load positive")
    if blocks is not None and (blocks < 1 or repeats % blocks):
        raise typer.BadParameter("--blocks must be at least 1 and divide --repeats")
    if better_bar not in BETTER_BARS:
        raise typer.BadParameter(f"--better-bar is one of {', '.join(BETTER_BARS)}")

    emit(run(trials=trials, quick=quick, slice_size=slice_size, repeats=repeats, blocks=blocks, load=load, seed=seed,
             model_path=model, better_bar=better_bar, on_progress=lambda message: typer.echo(message, err=True)),
         as_json, title="gate error rates")
