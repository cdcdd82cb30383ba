"""Ingest as history grows: does a run cost what is new, or all that came before?

A store is filled with `history_rows` rows of synthetic feedback (`experiments.bench.ingest`), then
`runs` runs each add `rows_per_run` new rows as new segments beside all the old ones and time
`ingest_folder` over the whole folder, as the scheduled ingest flow does. `last_over_first` is the
last run's time over the first's: near 1 when a run's cost follows the new rows, growing with the
history when it does not. `full_read_s` is, after each run, a run with nothing new that reads and hashes
every segment (the segments' stamps cleared first), as every run did before stamps were recorded: the
cost the stamps save. `registry_bytes_per_version` is what one registered version stores at
`registry_dim` (the readout file and its RLS state, packed as `registry.rls_file` stores it).
"""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from experiments.bench.ingest import write_synthetic_segment
from store.duckdb import LogStore
from store.ingest import ingest_folder, totals


def registry_bytes_per_version(dim: int, seed: int = 0) -> dict[str, int]:
    """Bytes of the readout file and of the saved RLS state (`np.savez` of `RLS.state_arrays`) at `dim`."""
    from leap_core.readout import LinearReadout
    from leap_core.readout_format import to_bytes
    from leap_core.rls import RLS
    from registry import rls_file

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((64, dim)).astype(np.float32)
    readout = LinearReadout(max_tokens=2048).fit(X, rng.integers(1, 2048, 64))
    state = io.BytesIO()
    rls_file.save(state, RLS.from_readout(readout, X).state_arrays())  # as `registry.runs` stores it
    readout_bytes = len(to_bytes(readout))
    return {"readout_bytes": readout_bytes, "rls_state_bytes": state.tell(),
            "total": readout_bytes + state.tell()}


def bench_ingest_growth(history_rows: int = 1_000_000, runs: int = 10, rows_per_run: int = 50_000, *,
                        dim: int = 64, segment_rows: int = 10_000, registry_dim: int = 4096, seed: int = 0,
                        compare_full_read: bool = True,
                        tmp_dir: str | Path | None = None,
                        progress: Callable[[str], None] | None = None) -> dict:
    """Time `runs` ingest runs of `rows_per_run` new rows each over a growing history (module docstring)."""
    if history_rows < 1 or runs < 2 or rows_per_run < 1 or dim < 1 or segment_rows < 1:
        raise ValueError("history_rows, rows_per_run, dim and segment_rows must be positive and runs at least 2")
    say = progress or (lambda message: None)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(dim)
    weights /= np.linalg.norm(weights)
    per_run_s: list[float] = []
    per_run_rows: list[int] = []
    full_read_s: list[float] = []
    with tempfile.TemporaryDirectory(dir=tmp_dir) as scratch:
        folder, store = Path(scratch) / "feedback", LogStore(Path(scratch) / "log.duckdb")
        folder.mkdir()
        written = 0

        def add(rows: int) -> None:
            nonlocal written
            for first in range(written, written + rows, segment_rows):
                n = min(segment_rows, written + rows - first)
                write_synthetic_segment(folder / f"segment-{first // segment_rows:07d}.parquet", first, n, weights,
                                        rng)
            written += rows

        say(f"writing and ingesting a history of {history_rows} rows (dim {dim}) ...")
        add(history_rows)
        start = time.perf_counter()
        history = totals(ingest_folder(store, folder))
        history_s = time.perf_counter() - start
        if history["accepted"] != history_rows:
            raise RuntimeError(f"the history ingested {history['accepted']} of {history_rows} rows")
        for run in range(runs):
            add(rows_per_run)
            start = time.perf_counter()
            summary = totals(ingest_folder(store, folder))
            per_run_s.append(time.perf_counter() - start)
            per_run_rows.append(int(summary["accepted"]))
            if summary["accepted"] != rows_per_run or summary["quarantined"] or summary["duplicates"]:
                raise RuntimeError(f"run {run + 1} expected {rows_per_run} new clean rows, got {summary}")
            if compare_full_read:
                with store.connect() as con:
                    con.execute("DELETE FROM segment_stamps")
                start = time.perf_counter()
                recheck = totals(ingest_folder(store, folder))
                full_read_s.append(time.perf_counter() - start)
                if recheck["accepted"] or recheck["skipped"] != recheck["segments"]:
                    raise RuntimeError(f"a run with nothing new wrote something: {recheck}")
            say(f"run {run + 1}/{runs}: {rows_per_run} new rows beside {written - rows_per_run} in "
                f"{per_run_s[-1]:.2f} s" + (f" (reading every segment: {full_read_s[-1]:.2f} s)" if full_read_s else ""))
        stored = store.counts()["requests"]
    say(f"measuring what one registered version stores at dim {registry_dim} ...")
    registry = registry_bytes_per_version(registry_dim)
    seconds = np.asarray(per_run_s)
    return {
        "history_rows": history_rows,
        "rows_per_run": rows_per_run,
        "runs": runs,
        "dim": dim,
        "segment_rows": segment_rows,
        "history_ingest_s": round(history_s, 3),
        "per_run_s": [round(value, 3) for value in per_run_s],
        "per_run_rows_per_s": [round(rows / value) for rows, value in zip(per_run_rows, per_run_s)],
        "last_over_first": round(float(seconds[-1] / seconds[0]), 3),
        "late_over_early_median": round(float(np.median(seconds[-(runs // 2):]) / np.median(seconds[:runs // 2])), 3),
        "full_read_s": [round(value, 3) for value in full_read_s],
        "rows_stored": int(stored),
        "registry_dim": registry_dim,
        "registry_bytes_per_version": registry["total"],
        "registry_bytes": registry,
    }
