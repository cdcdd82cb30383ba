"""Benchmark of the predictor service end to end: queue, batching, matrix product, callback.

Pinned to one core with one BLAS thread, as it runs beside the engine. Two figures:
saturation throughput (everything submitted at once) and the P95 latency from `submit` to callback at
an offered rate (items released on a 1 ms clock, the producer sleeping in between as the engine does).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from threadpoolctl import threadpool_limits

from leap_core.readout import LinearReadout
from serving.readout.predictor import PredictorService


def _random_readout(dim: int, seed: int) -> LinearReadout:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(4 * dim, dim)).astype(np.float32)
    lengths = rng.integers(1, 2048, size=4 * dim)
    readout = LinearReadout(alpha=1.0, target="sqrt", max_tokens=2048).fit(X, lengths)
    readout.metadata["version"] = "bench"
    return readout


def bench_predictor(dim: int = 576, n_saturation: int = 200_000, rate: float = 10_000.0,
                    duration_s: float = 3.0, seed: int = 0) -> dict:
    """Return predictions_per_s at saturation and the P95/P50 ms latency at `rate` predictions/s."""
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    except (AttributeError, OSError):
        pass
    readout = _random_readout(dim, seed)
    features = np.random.default_rng(seed + 1).normal(size=(1024, dim)).astype(np.float32)

    with threadpool_limits(limits=1):
        # Saturation: submit everything, wait for the last callback.
        done = threading.Event()
        counted = [0]

        def count(ids, preds, version, enqueued):
            counted[0] += len(ids)
            if counted[0] >= n_saturation:
                done.set()

        with PredictorService(readout, count) as service:
            start = time.perf_counter()
            for i in range(n_saturation):
                service.submit(str(i), features[i & 1023])
            done.wait(120)
            saturation_s = time.perf_counter() - start

        # Offered load: `rate` items a second released on a 1 ms clock.
        latencies: list[np.ndarray] = []

        def record(ids, preds, version, enqueued):
            latencies.append(time.perf_counter() - enqueued)

        per_tick = max(1, int(round(rate / 1000.0)))
        ticks = int(duration_s * 1000)
        with PredictorService(readout, record) as service:
            start = time.perf_counter()
            sent = 0
            for tick in range(ticks):
                for _ in range(per_tick):
                    service.submit(str(sent), features[sent & 1023])
                    sent += 1
                next_tick = start + (tick + 1) / 1000.0
                delay = next_tick - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            service.flush(10)
            offered_s = time.perf_counter() - start
    lat_ms = np.concatenate(latencies) * 1000.0 if latencies else np.array([np.nan])
    return {
        "dim": dim,
        "predictions_per_s": n_saturation / saturation_s,
        "p95_ms_at_10k": float(np.percentile(lat_ms, 95)),
        "p50_ms_at_10k": float(np.percentile(lat_ms, 50)),
        "offered_rate": rate,
        "achieved_rate": sent / offered_s,
        "n_offered": sent,
    }
