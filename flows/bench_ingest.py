"""Ingest throughput: rows per second from complete feedback segments into a fresh log store."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flows.ingest import ingest_folder, totals
from flows.store import LogStore
from serving.feedback_schema import (
    META_DIM,
    META_LAYER,
    META_MODEL_FINGERPRINT,
    META_MODEL_ID,
    META_SCHEMA_VERSION,
    SCHEMA_VERSION,
    feedback_schema,
)


def _write_clean_segment(path: Path, first_row: int, n: int, dim: int, rng: np.random.Generator) -> None:
    schema = feedback_schema(dim).with_metadata(
        {
            META_SCHEMA_VERSION: SCHEMA_VERSION.encode(),
            META_DIM: str(dim).encode(),
            META_LAYER: b"20",
            META_MODEL_ID: b"bench-model",
            META_MODEL_FINGERPRINT: b"bench-fingerprint",
        }
    )
    arrival = 1_700_000_000.0 + first_row + np.arange(n, dtype=np.float64)
    output_tokens = rng.integers(1, 4096, n, dtype=np.int32)
    columns = {
        "request_id": pa.array([f"bench-{first_row + i:09d}" for i in range(n)]),
        "model_id": pa.array(["bench-model"] * n),
        "model_fingerprint": pa.array(["bench-fingerprint"] * n),
        "layer": pa.array(np.full(n, 20, dtype=np.int32)),
        "policy": pa.array(["leap"] * n),
        "arrival_time": pa.array(arrival),
        "first_token_time": pa.array(arrival + 0.1),
        "finish_time": pa.array(arrival + 5.0),
        "prompt_tokens": pa.array(rng.integers(1, 2048, n, dtype=np.int32)),
        "output_tokens": pa.array(output_tokens),
        "finish_reason": pa.array(["stop"] * n),
        "max_tokens": pa.array(np.full(n, 4096, dtype=np.int32)),
        "decoding": pa.array(['{"temperature": 0.0}'] * n),
        "domain": pa.array(["chat"] * n),
        "tenant": pa.array(["bench"] * n),
        "predicted_at_admission": pa.array(output_tokens.astype(np.float32)),
        "predicted_latest": pa.array(output_tokens.astype(np.float32)),
        "readout_version": pa.array(["bench"] * n),
        "feature": pa.FixedSizeListArray.from_arrays(
            pa.array(rng.standard_normal(n * dim, dtype=np.float32)), dim
        ),
    }
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(columns, schema=schema), temporary)
    temporary.replace(path)


def bench_ingest(
    rows: int = 100_000,
    dim: int = 576,
    tmp_dir: str | Path | None = None,
    *,
    segment_rows: int = 10_000,
    seed: int = 0,
) -> dict[str, float | int]:
    """Write `rows` clean rows as segments of `segment_rows`, then time `ingest_folder` on a new store.

    The time covers reading, checksumming, validating, the per-segment commits and the final
    checkpoint when the connection closes; writing the segments is not timed. `cpu_seconds` (this
    process, DuckDB's threads included) next to the wall time shows how much of it was waiting for
    the disk or for a shared CPU.
    """
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(dir=tmp_dir) as scratch:
        folder = Path(scratch) / "feedback"
        folder.mkdir()
        for index, first_row in enumerate(range(0, rows, segment_rows)):
            n = min(segment_rows, rows - first_row)
            _write_clean_segment(folder / f"segment-{index:05d}.parquet", first_row, n, dim, rng)
        store = LogStore(Path(scratch) / "bench.duckdb")
        with store.connect():
            pass  # create the schema outside the timed region
        start, start_cpu = time.perf_counter(), time.process_time()
        reports = ingest_folder(store, folder)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        summary = totals(reports)
        if summary["accepted"] != rows:
            raise RuntimeError(f"expected {rows} accepted rows, got {summary}")
    return {
        "ingest_rows_per_s": rows / seconds,
        "rows": rows,
        "dim": dim,
        "segments": summary["segments"],
        "segment_rows": segment_rows,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }
