"""`leap bench pipeline`: ingest throughput and fit time on synthetic feedback segments.

Figures, not pass/fail: the goals are >= 100k rows/s into DuckDB and a fit under a minute on 100k
rows at the serving model's hidden size, and both depend on the machine's disk and free cores.
`--store-url` benches the shared PostgreSQL store instead, with `--workers` segments at once.
"""

from __future__ import annotations

from typing import Annotated

import typer

from leap_cli.output import console, emit
from study_cli.apps import bench_app


@bench_app.command("pipeline")
def bench_pipeline(
    rows: Annotated[int, typer.Option(help="Feedback rows written, ingested and fitted on.")] = 100_000,
    dim: Annotated[int, typer.Option(help="Feature dim (576: SmolLM2, 4096: Qwen3-8B).")] = 576,
    segment_rows: Annotated[int, typer.Option(help="Rows per feedback segment.")] = 10_000,
    store_url: Annotated[str | None, typer.Option(
        help="A PostgreSQL server (postgresql+psycopg://user@host:port/db) to bench instead of a DuckDB file: "
             "a fresh database is created on it for the run and dropped after.")] = None,
    workers: Annotated[int, typer.Option(help="Segments ingested at once (threads, as the ingest flow's "
                                              "mapped tasks).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Ingest rows/s into a fresh DuckDB store (or PostgreSQL database), then seconds to select, split and fit."""
    if rows < 10 or dim < 1 or segment_rows < 1 or workers < 1:
        raise typer.BadParameter("--rows must be at least 10, --dim, --segment-rows and --workers positive")
    if store_url is not None:
        from store.stores import is_postgres

        if not is_postgres(store_url):
            raise typer.BadParameter(f"--store-url must be a postgresql+psycopg:// URL, not {store_url!r}")
    from experiments.bench.pipeline import bench_pipeline as run

    if not as_json:
        console.print(f"writing {rows} rows of dim {dim}, ingesting them, fitting a readout ...")
    emit(run(rows=rows, dim=dim, segment_rows=segment_rows, store_url=store_url, workers=workers), as_json,
         title="pipeline")
