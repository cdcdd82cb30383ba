"""A fleet without engines: real runtimes (admin server, readout service, RLS learner) on loopback, a
real MLflow sqlite registry, and a champion with its RLS anchor promoted to every replica."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from leap_core.rls import fit_readout_with_anchor
from tests.runtime_fixtures import DIM, LAYER, MODEL

TOKEN = "fleet-test-token"
MAX_TOKENS = 4096


def rows(rng: np.random.Generator, n: int, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Captured float32 vectors and learnable output lengths."""
    X = (rng.normal(size=(n, DIM)) * np.linspace(0.5, 3.0, DIM) + shift).astype(np.float32)
    lengths = np.clip(np.round((12.0 + X.astype(np.float64) @ np.linspace(1.0, -1.0, DIM)
                                + rng.normal(size=n)) ** 2), 1, MAX_TOKENS)
    return X, lengths


def champion_readout(version: str, rng: np.random.Generator, n: int = 200):
    """A readout of the runtime fixtures' model and layer with its RLS anchor, and its training rows."""
    X, lengths = rows(rng, n)
    readout, rls = fit_readout_with_anchor(X, lengths, alpha=1.0, max_tokens=MAX_TOKENS,
                                           metadata={"model_id": MODEL, "layer": LAYER, "version": version})
    return readout, rls, X, lengths


def replica(build, folder: Path, **leap):
    """A runtime that learns online (an RLS batch every 4 rows) behind a real admin server."""
    settings = {"policy": "leap", "rls": True, "rls_every": 4, "admin_port": 0, "admin_token": TOKEN,
                "state_dir": str(folder), "champion_url": "", **leap}
    runtime = build(**settings)
    return runtime, f"http://127.0.0.1:{runtime.admin.port}"


def feed(runtime, X: np.ndarray, lengths: np.ndarray) -> None:
    """Finished requests into the replica's RLS, as `on_finished` hands them over; waits until learned."""
    for feature, length in zip(X, lengths):
        runtime.readouts.observe(feature, int(length))
    assert runtime.readouts.learner.wait_idle(10.0)
