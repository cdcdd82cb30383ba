"""`leap bench ingest-growth`: whether an ingest run costs what is new or all the history before it.

Figures, not pass/fail: the goal is `last_over_first` <= 1.3 over 10 runs of 50,000 new rows beside a
history of a million.
"""

from __future__ import annotations

from typing import Annotated

import typer

from leap_cli.output import emit
from study_cli.apps import bench_app


@bench_app.command("ingest-growth")
def bench_ingest_growth(
    history_rows: Annotated[int, typer.Option(help="Rows stored before the timed runs.")] = 1_000_000,
    runs: Annotated[int, typer.Option(help="Timed ingest runs.")] = 10,
    rows_per_run: Annotated[int, typer.Option(help="New rows each run adds.")] = 50_000,
    dim: Annotated[int, typer.Option(help="Feature dim of the synthetic rows.")] = 64,
    segment_rows: Annotated[int, typer.Option(help="Rows per feedback segment.")] = 10_000,
    registry_dim: Annotated[int, typer.Option(help="Dim at which the bytes of one registered version are "
                                                   "measured (4096: Qwen3-8B).")] = 4096,
    compare_full_read: Annotated[bool, typer.Option(
        help="After each run, time a run that reads every segment again (as before stamps were recorded).")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Per-run ingest time as history grows, and the bytes one registered version stores."""
    if history_rows < 1 or runs < 2 or rows_per_run < 1 or dim < 1 or segment_rows < 1 or registry_dim < 1:
        raise typer.BadParameter("sizes must be positive and --runs at least 2")
    from experiments.bench.ingest_growth import bench_ingest_growth as run

    emit(run(history_rows=history_rows, runs=runs, rows_per_run=rows_per_run, dim=dim, segment_rows=segment_rows,
             registry_dim=registry_dim, compare_full_read=compare_full_read, progress=lambda message: typer.echo(message, err=True)),
         as_json, title="ingest growth")
