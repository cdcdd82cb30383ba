"""Ingest throughput: rows per second from complete feedback segments into a fresh log store.

The segments are synthetic but shaped like the serving process's (same schema, metadata and zstd
compression), and their lengths follow the features through a planted linear rule in sqrt space,
so a readout fitted on them (`experiments.bench.pipeline`) has something real to find.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from leap_io.durable import write_durably
from leap_io.feedback_schema import feedback_schema, parquet_options, segment_metadata, segment_table
from store.duckdb import LogStore
from store.ingest import complete_segments, deal_segments, ingest_folder, ingest_segments, totals

BENCH_MODEL_ID = "bench-model"
BENCH_FINGERPRINT = "bench-fingerprint"
BENCH_LAYER = 20
BENCH_DOMAINS = ("chat", "code", "math")


def write_synthetic_segment(path: str | Path, first_row: int, n: int, weights: np.ndarray,
                            rng: np.random.Generator, *, max_tokens: int = 2048,
                            abort_fraction: float = 0.0, start_time: float = 1_700_000_000.0,
                            seconds_per_row: float = 0.05) -> None:
    """Write rows first_row .. first_row + n - 1 as one complete segment (durably: `leap_io.durable`).

    Features are standard normal; sqrt(output length) = 18 + 8 * feature @ weights + N(0, 4),
    clipped to [1, sqrt(max_tokens)]. Aborted rows keep a random prefix of their length.
    """
    path = Path(path)
    dim = int(weights.shape[0])
    features = rng.standard_normal((n, dim), dtype=np.float32)
    root = 18.0 + 8.0 * (features @ weights) + rng.normal(0.0, 4.0, n)
    output_tokens = np.clip(np.rint(np.square(np.clip(root, 1.0, np.sqrt(max_tokens)))), 1, max_tokens)
    finish_reason = np.where(output_tokens >= max_tokens, "length", "stop").astype(object)
    aborted = rng.random(n) < abort_fraction
    output_tokens[aborted] = np.ceil(output_tokens[aborted] * rng.random(int(aborted.sum()))).clip(1)
    finish_reason[aborted] = "abort"
    output_tokens = output_tokens.astype(np.int32)

    arrival = start_time + seconds_per_row * (first_row + np.arange(n, dtype=np.float64))
    numbers = pa.array(np.arange(first_row, first_row + n, dtype=np.int64)).cast(pa.string())
    schema = feedback_schema(dim).with_metadata(
        segment_metadata(dim, BENCH_LAYER, BENCH_MODEL_ID, BENCH_FINGERPRINT))

    def repeat(value: str) -> pa.Array:
        return pa.array([value] * n, pa.string())

    columns = {
        "request_id": pc.binary_join_element_wise("bench-", pc.utf8_lpad(numbers, 9, "0"), ""),
        "client_request_id": pc.binary_join_element_wise("client-", numbers, ""),
        "model_id": repeat(BENCH_MODEL_ID),
        "model_fingerprint": repeat(BENCH_FINGERPRINT),
        "layer": pa.array(np.full(n, BENCH_LAYER, dtype=np.int32)),
        "policy": repeat("leap"),
        "arrival_time": pa.array(arrival),
        "first_token_time": pa.array(arrival + 0.1),
        "finish_time": pa.array(arrival + 0.1 + 0.02 * output_tokens),
        "prompt_tokens": pa.array(rng.integers(1, 2048, n, dtype=np.int32)),
        "output_tokens": pa.array(output_tokens),
        "finish_reason": pa.array(finish_reason, pa.string()),
        "max_tokens": pa.array(np.full(n, max_tokens, dtype=np.int32)),
        "decoding": repeat('{"temperature": 0.0}'),
        "domain": pa.array(np.asarray(BENCH_DOMAINS, dtype=object)[rng.integers(0, len(BENCH_DOMAINS), n)],
                           pa.string()),
        "tenant": repeat("bench"),
        "predicted_at_admission": pa.nulls(n, pa.float32()),
        "predicted_latest": pa.nulls(n, pa.float32()),
        "readout_version": pa.nulls(n, pa.string()),
        "shadow_predicted": pa.nulls(n, pa.float32()),
        "shadow_version": pa.nulls(n, pa.string()),
        "client_arrival_time": pa.nulls(n, pa.float64()),
        "feature": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), dim),
    }
    table = segment_table(pa.table(columns, schema=schema))
    write_durably(path, lambda partial: pq.write_table(table, partial, **parquet_options()))


def write_synthetic_feedback(folder: str | Path, rows: int, dim: int, *, segment_rows: int = 10_000,
                             seed: int = 0, abort_fraction: float = 0.0, max_tokens: int = 2048) -> np.ndarray:
    """Write `rows` rows as segments of `segment_rows` into `folder`; returns the planted weights."""
    if rows < 1 or dim < 1 or segment_rows < 1:
        raise ValueError("rows, dim and segment_rows must be positive")
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(dim)
    weights /= np.linalg.norm(weights)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for index, first_row in enumerate(range(0, rows, segment_rows)):
        write_synthetic_segment(folder / f"segment-{index:05d}.parquet", first_row,
                                min(segment_rows, rows - first_row), weights, rng,
                                max_tokens=max_tokens, abort_fraction=abort_fraction)
    return weights


def timed_ingest(store: LogStore, folder: str | Path, expected_rows: int, *,
                 transaction_rows: int = 0, workers: int = 1) -> dict[str, float | int]:
    """Ingest `folder` into `store` (schema created beforehand, outside the clock) and time it.

    `workers` > 1 deals the segments into that many batches ingested by threads at once, as the
    ingest flow's mapped tasks do (`flows.pipeline.ingest_flow`); `store` may be a `PostgresStore`.
    Before the clock starts, the file system writes back what the setup wrote (the segments): an
    ingest reads segments written long before, and a disk still busy writing the setup's bytes
    would slow the ingest's own flushes of what it stores.
    """
    with store.connect():
        pass
    os.sync()
    start, start_cpu = time.perf_counter(), time.process_time()
    if workers > 1:
        batches = deal_segments(complete_segments(folder), workers)
        with ThreadPoolExecutor(max_workers=len(batches) or 1, thread_name_prefix="leap-bench-ingest") as pool:
            reports = [report for batch in pool.map(
                lambda sources: ingest_segments(store, sources, transaction_rows=transaction_rows), batches)
                for report in batch]
    else:
        reports = ingest_folder(store, folder, transaction_rows=transaction_rows)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    summary = totals(reports)
    if summary["rows_read"] != expected_rows or summary["quarantined"] or summary["duplicates"]:
        raise RuntimeError(f"expected {expected_rows} clean rows, got {summary}")
    return {
        "ingest_rows_per_s": expected_rows / seconds,
        "ingest_s": seconds,
        "ingest_cpu_s": cpu_seconds,
        "segments": summary["segments"],
    }


def bench_ingest(
    rows: int = 100_000,
    dim: int = 576,
    tmp_dir: str | Path | None = None,
    *,
    segment_rows: int = 10_000,
    seed: int = 0,
    transaction_rows: int = 0,
) -> dict[str, float | int]:
    """Write `rows` clean rows as segments of `segment_rows`, then time `ingest_folder` on a new store.

    The time covers reading, checksumming, validating, the commits and the final checkpoint when the
    connection closes; writing the segments is not timed. `ingest_cpu_s` (this process, DuckDB's
    threads included) next to the wall time shows how much of it was waiting for the disk or for a
    shared CPU.
    """
    with tempfile.TemporaryDirectory(dir=tmp_dir) as scratch:
        folder = Path(scratch) / "feedback"
        write_synthetic_feedback(folder, rows, dim, segment_rows=segment_rows, seed=seed)
        timing = timed_ingest(LogStore(Path(scratch) / "bench.duckdb"), folder, rows,
                              transaction_rows=transaction_rows)
    return {
        "ingest_rows_per_s": timing["ingest_rows_per_s"],
        "rows": rows,
        "dim": dim,
        "segments": timing["segments"],
        "segment_rows": segment_rows,
        "transaction_rows": transaction_rows,
        "seconds": timing["ingest_s"],
        "cpu_seconds": timing["ingest_cpu_s"],
    }
