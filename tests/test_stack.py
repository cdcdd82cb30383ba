"""`leap stack up|status|down` and `leap deploy` with real MLflow and Prefect servers on free ports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("prefect")

from flows.settings import PipelineSettings
from leap_io.pidfiles import service_pid
from ops import stack as local_stack

pytestmark = pytest.mark.pipeline

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = "mlflow,prefect"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _leap(env: dict, *args: str, timeout: float = 240) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "leap_cli.main", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from leap {' '.join(args)}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(lines[-1])


def _settings(stack: dict) -> PipelineSettings:
    env = stack["env"]
    return PipelineSettings(home=stack["home"], mlflow_port=int(env["LEAP_MLFLOW_PORT"]),
                            prefect_port=int(env["LEAP_PREFECT_PORT"]))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("leap-home")
    env = {**os.environ, "LEAP_HOME": str(home), "LEAP_MLFLOW_PORT": str(_free_port()),
           "LEAP_PREFECT_PORT": str(_free_port())}
    for key in ("PREFECT_API_URL", "LEAP_MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    code, started = _leap(env, "stack", "up", "--services", SERVICES, "--json")
    try:
        assert code == 0, started
        yield {"env": env, "home": home, "up": started}
    finally:
        _leap(env, "stack", "down", "--services", SERVICES, "--json")


def test_up_starts_healthy_services_and_up_again_starts_nothing(stack):
    first = stack["up"]
    assert sorted(first["started"]) == ["mlflow", "prefect"]
    assert first["healthy"] is True
    pids = {name: first["services"][name]["pid"] for name in ("mlflow", "prefect")}
    assert all(isinstance(pid, int) for pid in pids.values())

    again = local_stack.up(_settings(stack), ["mlflow", "prefect"])
    assert again["started"] == []
    assert {name: again["services"][name]["pid"] for name in pids} == pids

    code, status = _leap(stack["env"], "stack", "status", "--services", SERVICES, "--json")
    assert code == 0 and status["healthy"] is True
    assert set(status["services"]) == {"mlflow", "prefect"}
    assert all(service["healthy"] for service in status["services"].values())
    assert httpx.get(status["services"]["prefect"]["health_url"], timeout=5).json() is True


def test_mlflow_server_lists_a_registered_model_with_its_aliases(stack):
    from leap_core.readout import LinearReadout
    from registry.client import CHALLENGER, ReadoutRegistry

    url = f"http://127.0.0.1:{stack['env']['LEAP_MLFLOW_PORT']}"
    rng = np.random.default_rng(0)
    features = rng.normal(size=(60, 8)).astype(np.float32)
    lengths = np.clip(np.exp(3 + features[:, 0]), 1, 256).round()
    readout = LinearReadout(alpha=1.0, max_tokens=256).fit(features, lengths)
    readout.metadata.update(model_id="stack-model", model_fingerprint="sha256:0", layer=3, version="v1")
    registry = ReadoutRegistry(url)
    logged = registry.log_readout(readout, params={"data_hash": "x"}, metrics={"spearman": 0.4})
    registry.set_challenger(logged.name, logged.version)

    answer = httpx.get(f"{url}/api/2.0/mlflow/registered-models/get", params={"name": logged.name}, timeout=10)
    answer.raise_for_status()
    model = answer.json()["registered_model"]
    aliases = {entry["alias"]: entry["version"] for entry in model.get("aliases", [])}
    assert aliases == {CHALLENGER: logged.version}
    # the artifacts went through the server into the stack's folder
    assert registry.load_readout(logged.name, CHALLENGER).metadata["version"] == "v1"
    assert any((stack["home"] / "mlflow" / "artifacts").rglob("readout.leap"))


def test_deploy_registers_the_retrain_flow_with_its_cron(stack):
    code, deployed = _leap(stack["env"], "deploy", "--cron", "15 * * * *", "--no-serve", "--json")
    assert code == 0, deployed
    api = f"http://127.0.0.1:{stack['env']['LEAP_PREFECT_PORT']}/api"
    answer = httpx.get(f"{api}/deployments/name/{deployed['deployment']}", timeout=10)
    answer.raise_for_status()
    schedules = [entry["schedule"].get("cron") for entry in answer.json()["schedules"]]
    assert schedules == ["15 * * * *"]
    assert answer.json()["entrypoint"] == "flows/pipeline.py:retrain_flow"


def test_down_stops_both_and_removes_pid_files(stack):
    env, home = stack["env"], stack["home"]
    pids = [service_pid(home / "stack", name) for name in ("mlflow", "prefect")]
    assert all(pids)
    code, stopped = _leap(env, "stack", "down", "--services", SERVICES, "--json")
    assert code == 0
    assert set(stopped["stopped"].values()) <= {"terminated", "killed"}
    assert not any(service["healthy"] for service in stopped["services"].values())
    assert not list((home / "stack").glob("*.pid"))
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert local_stack.status(_settings(stack), ["mlflow", "prefect"])["healthy"] is False
