"""A real S3 endpoint for the object-storage feedback tests (moto's server, ops/servers.py), a bucket of
their own per test, feedback rows that ingest accepts, and a poll."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from leap_io.object_store import ObjectStore
from ops.servers import s3_environment
from study_harness.servers import running_s3

DIM, LAYER = 8, 3  # last@3 with a hidden size of 8


@pytest.fixture(scope="session")
def s3_endpoint():
    """One moto S3 server for the session; yields its endpoint URL."""
    with running_s3() as endpoint:
        yield endpoint


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """The endpoint and credentials in the environment, as a replica or a flow gets them; yields the endpoint."""
    for key, value in s3_environment(s3_endpoint).items():
        monkeypatch.setenv(key, value)
    return s3_endpoint


@pytest.fixture
def bucket(s3_env) -> str:
    """A new, empty bucket on the session's server."""
    name = f"leap-{uuid.uuid4().hex[:12]}"
    ObjectStore(s3_env).ensure_bucket(name)
    return name


def feedback_row(i: int, dim: int = DIM, prefix: str = "req") -> dict:
    """A finished request's feedback row that ingest accepts; its id orders rows as they were written."""
    return {
        "request_id": f"{prefix}-{i:06d}", "model_id": "m", "model_fingerprint": "fp", "layer": LAYER,
        "policy": "leap", "arrival_time": 1_750_000_000.0 + i, "first_token_time": 1_750_000_000.5 + i,
        "finish_time": 1_750_000_001.0 + i, "prompt_tokens": 10, "output_tokens": 5 + i % 50,
        "finish_reason": "stop", "max_tokens": 512, "decoding": "{}", "domain": "chat", "tenant": None,
        "predicted_at_admission": 12.0, "predicted_latest": 13.0, "readout_version": "v1",
        "feature": np.random.default_rng(i).standard_normal(dim).astype(np.float32),
    }


def eventually(condition, timeout: float = 15.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())
