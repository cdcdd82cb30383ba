"""`leap bench faults`: the fault suite against real `leap serve` processes and the pipeline's own faults.

Figures, not pass/fail: one JSON object (`--json`) or a table with one line per scenario. See
studies/experiments/faults/suite.py for what each scenario does and what it counts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from leap_cli.output import console
from leap_io.jsonable import dumps
from study_cli.apps import bench_app


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (this process's prints and its children's) to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@bench_app.command("faults")
def bench_faults(
    quick: Annotated[bool, typer.Option(help="Smaller sizes: 1,000 aborts, shorter replays, no 30 s stalled body.")] = False,
    aborts: Annotated[int | None, typer.Option(help="Aborted requests in abort_storm (default 10,000; 1,000 with --quick).")] = None,
    abort_concurrency: Annotated[int, typer.Option(help="Aborted requests open at once.")] = 64,
    abort_budget: Annotated[float | None, typer.Option(help="Seconds the abort storm may take; it reports how many ran.")] = None,
    only: Annotated[list[str] | None, typer.Option(help="Run only these scenarios (repeat); pipeline ones as flows:<name>.")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Keep logs, feedback and state here instead of a temporary folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Hostile clients, hostile pushes, aborts, SIGKILL, a full disk, MLflow down: what survives and what is lost."""
    from experiments.faults.suite import run_suite

    if aborts is not None and aborts < 0:
        raise typer.BadParameter("--aborts must be >= 0")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    def say(message: str) -> None:
        console.print(f"[bold]faults[/]: {message}")

    try:
        with _stdout_to_stderr():  # MLflow's client prints run links; stdout carries only the result
            summary = run_suite(quick=quick, aborts=aborts, only=only, workdir=workdir,
                                abort_concurrency=abort_concurrency, abort_budget_s=abort_budget, say=say)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if as_json:
        print(dumps(summary), flush=True)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"leap bench faults: {summary['survived']}/{summary['scenarios']} survived")
    for column in ("scenario", "survived", "seconds", "detail"):
        table.add_column(column, overflow="fold")
    for entry in summary["results"]:
        table.add_row(str(entry.get("scenario")), "yes" if entry.get("survived") else "[red]NO[/]",
                      f"{float(entry.get('seconds') or 0):.1f}", str(entry.get("detail", "")))
    out = Console()
    out.print(table)
    state = summary["per_request_state_after_aborts"]
    aborts_line = ("abort storm not run" if state.get("ran") is False else
                   f"per-request state back to baseline after {state.get('aborts_run')} aborts: "
                   f"{state.get('back_to_baseline')}")
    out.print(f"requests lost: {summary['requests_lost']}; feedback rows lost: {summary['feedback_rows_lost']}; "
              f"ingest rows lost or duplicated: {summary['ingest_rows_lost_or_duplicated']}; {aborts_line}")
