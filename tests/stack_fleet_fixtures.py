"""The fleet stack for tests: `leap stack up --fleet --replicas 0` in a temporary home, and a small flow
the fleet's Prefect workers import (this module is on their PYTHONPATH through the repository root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from prefect import flow

from ops.servers import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


@flow(name="leap-hold")
def hold_flow(log_path: str, tag: str, partner: str, wait_s: float) -> bool:
    """Record its start, wait up to `wait_s` for `partner` to be running at the same time (started, not
    ended), then record its end with whether it met the partner; returns that.

    A rendezvous rather than a fixed sleep: two runs that execute at once always meet, however late the
    second one's process starts on a busy machine, and two that never overlap never do."""
    def record(event: str, **extra: object) -> None:
        with open(log_path, "a") as log:
            log.write(json.dumps({"tag": tag, "event": event, "t": time.time(), **extra}) + "\n")

    def partner_running() -> bool:
        try:
            events = [json.loads(line) for line in Path(log_path).read_text().splitlines()]
        except FileNotFoundError:
            return False
        seen = {event["event"] for event in events if event["tag"] == partner}
        return "start" in seen and "end" not in seen

    record("start")
    deadline = time.monotonic() + wait_s
    met = partner_running()
    while not met and time.monotonic() < deadline:
        time.sleep(0.2)
        met = partner_running()
    if met:
        time.sleep(0.5)  # stay running a moment, so the partner sees this run too
    record("end", met=met)
    return met


def leap(env: dict, *args: str, timeout: float = 300) -> tuple[int, dict]:
    """Run `leap <args>` and return its exit code and its last JSON line."""
    done = subprocess.run([sys.executable, "-m", "leap_cli.main", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from leap {' '.join(args)}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(lines[-1])


@pytest.fixture(scope="session")
def fleet_stack():
    """A fleet without serving replicas (PostgreSQL, S3, MLflow, Prefect, two workers), stopped after.

    Its home is outside pytest's temporary root: every pytest session resets that root to mode 0700,
    which would cut PostgreSQL, running as its own unprivileged user, off from its data folder."""
    home = Path(tempfile.mkdtemp(prefix="leap-fleet-"))
    env = {**os.environ, "LEAP_HOME": str(home), "LEAP_MLFLOW_PORT": str(free_port()),
           "LEAP_PREFECT_PORT": str(free_port()), "PREFECT_WORKER_QUERY_SECONDS": "1",
           # a run held for the deployment's slot is retried after this long (30 s by default)
           "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2"}
    for key in ("PREFECT_API_URL", "LEAP_MLFLOW_TRACKING_URI", "LEAP_STORE_URL", "LEAP_FEEDBACK_URL",
                "LEAP_S3_ENDPOINT_URL", "LEAP_ENDPOINTS"):
        env.pop(key, None)
    started = time.monotonic()
    code, up = leap(env, "stack", "up", "--fleet", "--replicas", "0", "--json")
    try:
        assert code == 0, up
        yield {"env": env, "home": home, "up": up, "up_s": time.monotonic() - started}
    finally:
        from flows.settings import PipelineSettings
        from ops import stack

        stack.down(PipelineSettings(home=home, mlflow_port=int(env["LEAP_MLFLOW_PORT"]),
                                    prefect_port=int(env["LEAP_PREFECT_PORT"])), grace_s=10.0)
        shutil.rmtree(home, ignore_errors=True)
