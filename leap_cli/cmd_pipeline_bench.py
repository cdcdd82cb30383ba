"""`leap bench pipeline`: ingest throughput and fit time on synthetic feedback segments.

Figures, not pass/fail: the goals are >= 100k rows/s into DuckDB and a fit under a minute on 100k
rows at the serving model's hidden size, and both depend on the machine's disk and free cores.
"""

from __future__ import annotations

from typing import Annotated

import typer

from leap_cli.apps import bench_app
from leap_cli.output import console, emit


@bench_app.command("pipeline")
def bench_pipeline(
    rows: Annotated[int, typer.Option(help="Feedback rows written, ingested and fitted on.")] = 100_000,
    dim: Annotated[int, typer.Option(help="Feature dim (576: SmolLM2, 4096: Qwen3-8B).")] = 576,
    segment_rows: Annotated[int, typer.Option(help="Rows per feedback segment.")] = 10_000,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Ingest rows/s into a fresh DuckDB store, then seconds to select, split and fit (alpha=auto)."""
    if rows < 10 or dim < 1 or segment_rows < 1:
        raise typer.BadParameter("--rows must be at least 10, --dim and --segment-rows positive")
    from flows.bench_pipeline import bench_pipeline as run

    if not as_json:
        console.print(f"writing {rows} rows of dim {dim}, ingesting them, fitting a readout ...")
    emit(run(rows=rows, dim=dim, segment_rows=segment_rows), as_json, title="pipeline")
