"""The retraining pipeline's data path end to end: segments -> log store -> training window -> readout.

Times ingest and, separately, what the fit flow does with the store (select the window, split it
by arrival, fit with alpha="auto", anchor RLS), on synthetic segments with a planted length rule.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from experiments.bench.ingest import (
    BENCH_FINGERPRINT,
    BENCH_LAYER,
    BENCH_MODEL_ID,
    timed_ingest,
    write_synthetic_feedback,
)
from store.duckdb import LogStore
from training.fit import fit_readout, select_window, time_split


def bench_pipeline(
    rows: int = 100_000,
    dim: int = 576,
    tmp_dir: str | Path | None = None,
    *,
    segment_rows: int = 10_000,
    seed: int = 0,
    test_fraction: float = 0.2,
    abort_fraction: float = 0.01,
    store_url: str | None = None,
    workers: int = 1,
) -> dict[str, float | int | str]:
    """Ingest `rows` synthetic rows of dim `dim`, then fit a readout on all of them.

    `fit_s` covers select_window + time_split + fit_readout (reading the rows back from the store
    included); writing the segments is not timed. `spearman` on the newest rows shows that the fit
    found the planted rule, so a fast but broken fit cannot pass for a fast one. `store_url`: a
    PostgreSQL server (`postgresql+psycopg://`) on which a fresh database is created for the run and
    dropped after, instead of a fresh DuckDB file; `workers`: segments ingested at once.
    """
    with tempfile.TemporaryDirectory(dir=tmp_dir) as scratch, ExitStack() as stack:
        folder = Path(scratch) / "feedback"
        write_synthetic_feedback(folder, rows, dim, segment_rows=segment_rows, seed=seed,
                                 abort_fraction=abort_fraction)
        if store_url is None:
            store = LogStore(Path(scratch) / "bench.duckdb")
        else:
            from store.postgres import PostgresStore
            from study_harness.servers import scratch_database

            store = PostgresStore(stack.enter_context(scratch_database(store_url)))
        ingest = timed_ingest(store, folder, rows, workers=workers)

        start = time.perf_counter()
        frame = select_window(store, model_fingerprint=BENCH_FINGERPRINT, layer=BENCH_LAYER)
        selected = time.perf_counter()
        train, test = time_split(frame, test_fraction)
        result = fit_readout(train, test, alpha="auto", model_id=BENCH_MODEL_ID,
                             model_fingerprint=BENCH_FINGERPRINT, layer=BENCH_LAYER, version="bench")
        fitted = time.perf_counter()
    return {
        "ingest_rows_per_s": ingest["ingest_rows_per_s"],
        "fit_s": fitted - start,
        "rows": rows,
        "dim": dim,
        "ingest_s": ingest["ingest_s"],
        "ingest_cpu_s": ingest["ingest_cpu_s"],
        "store": "duckdb" if store_url is None else "postgresql",
        "workers": workers,
        "segments": ingest["segments"],
        "select_s": selected - start,
        "fit_only_s": fitted - selected,
        "n_train": int(result.params["n_train"]),
        "n_test": int(result.params["n_test"]),
        "alpha": float(result.params["alpha"]),
        "spearman": float(result.metrics["spearman"]),
        "mae": float(result.metrics["mae"]),
        "features_mb": float(np.float32().nbytes * rows * dim / 1e6),
    }
