"""`leap demo`: the main job end to end on embedded defaults (one replica, or a fleet with --replicas)."""

from __future__ import annotations

from typing import Literal

import typer

from leap_cli.output import console, emit, json_stdout
from study_cli.apps import commands as app


@app.command("demo")
def demo_command(
    prompts: int = typer.Option(240, help="real ShareGPT prompts sent as traffic"),
    max_tokens: int = typer.Option(1024, help="output budget M of the demo traffic (the snapshot's: about one "
                                              "chat output in ten reaches it)"),
    keep_serving: bool = typer.Option(False, help="leave the serving process running afterwards"),
    first_champion: Literal["none", "snapshot"] = typer.Option("none", help="what serves before the first fit: 'none' (FCFS, a first "
                                                    "deployment; the gate decides the first promotion) or "
                                                    "'snapshot' (a readout fitted on the committed corpus "
                                                    "snapshot; one replica)"),
    replicas: int = typer.Option(1, min=1, help="serving replicas; 2 or more run the fleet loop (studies/experiments/demo_fleet.py): "
                                                "feedback through S3, a PostgreSQL store, MLflow on PostgreSQL, the "
                                                "exact merge of the replicas' RLS, a replica killed and restarted, "
                                                "the drift watch"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON summary"),
) -> None:
    """The main job: serve, replay real prompts, ingest, fit, register, gate by live replay, promote, push."""
    say = (lambda message: None) if as_json else (lambda message: console.print(f"[bold]demo[/]: {message}"))
    if replicas > 1:
        from experiments.demo_fleet import run_fleet_demo

        with json_stdout(as_json):
            summary = run_fleet_demo(replicas=replicas, n_prompts=prompts, max_tokens=max_tokens,
                                     keep_serving=keep_serving, progress=say)
        emit(summary, as_json, "LEAP fleet demo")
        return
    from experiments.demo import run_demo

    with json_stdout(as_json):
        summary = run_demo(n_prompts=prompts, max_tokens=max_tokens, keep_serving=keep_serving,
                           first_champion=first_champion, progress=say)
    emit(summary, as_json, "LEAP demo")
    if not as_json:
        console.print(f"Compare readouts in the MLflow UI: [bold]{summary['mlflow_ui']}[/]")
