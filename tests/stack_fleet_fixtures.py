"""The fleet stack for tests: `leap stack up --fleet --replicas 0` in a temporary home, and a small flow
the fleet's Prefect workers import (this module is on their PYTHONPATH through the repository root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect import flow

from flows.servers import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


@flow(name="leap-hold")
def hold_flow(log_path: str, seconds: float, tag: str) -> None:
    """Record when it starts and ends (one JSON line each, appended), holding `seconds` in between."""
    def record(event: str) -> None:
        with open(log_path, "a") as log:
            log.write(json.dumps({"tag": tag, "event": event, "t": time.time(), "pid": os.getpid()}) + "\n")

    record("start")
    time.sleep(seconds)
    record("end")


def leap(env: dict, *args: str, timeout: float = 300) -> tuple[int, dict]:
    """Run `leap <args>` and return its exit code and its last JSON line."""
    done = subprocess.run([sys.executable, "-m", "leap_cli.main", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from leap {' '.join(args)}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(lines[-1])


@pytest.fixture(scope="session")
def fleet_stack(tmp_path_factory):
    """A fleet without serving replicas (PostgreSQL, S3, MLflow, Prefect, two workers), stopped after."""
    home = tmp_path_factory.mktemp("leap-fleet")
    env = {**os.environ, "LEAP_HOME": str(home), "LEAP_MLFLOW_PORT": str(free_port()),
           "LEAP_PREFECT_PORT": str(free_port()), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    for key in ("PREFECT_API_URL", "LEAP_MLFLOW_TRACKING_URI", "LEAP_STORE_URL", "LEAP_FEEDBACK_URL",
                "LEAP_S3_ENDPOINT_URL", "LEAP_ENDPOINTS"):
        env.pop(key, None)
    started = time.monotonic()
    code, up = leap(env, "stack", "up", "--fleet", "--replicas", "0", "--json")
    try:
        assert code == 0, up
        yield {"env": env, "home": home, "up": up, "up_s": time.monotonic() - started}
    finally:
        leap(env, "stack", "down", "--grace", "10", "--json")
