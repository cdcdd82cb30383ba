"""`leap serve` itself, as a user runs it: vLLM's OpenAI server with LEAP on the prepared model.

With no readout arguments and no variable, the replica serves the champion of the registry under
$LEAP_HOME (a non-default layer's) and captures that layer; given a replica's saved readout.bin and rls.npz,
it serves them with their RLS anchor. `/leap/health` says which readout serves and where it came from.
Each test stops the server's whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from leap_core.readout_format import to_bytes
from leap_io.feedback_schema import read_segment_file
from serving.caller_tenant import key_digest
from tests.test_serve_start import LAYER, champion, register

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str, token: str | None = None) -> dict | None:
    try:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())
    except OSError:
        return None


def _serve_until(home: Path, model, log: Path, settled, *args: str, env_extra: dict | None = None,
                 while_up=None) -> tuple[dict, dict]:
    """Run `leap serve` until `/leap/health` satisfies `settled`, then `while_up(port, admin, token)`;
    (health, /leap/readout); always stopped."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("LEAP_", "MLFLOW_"))}
    env["LEAP_HOME"] = str(home)
    env.update(env_extra or {})
    port, admin = _free_port(), _free_port()
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "leap_cli.main", "serve", "--model", model.path,
                                   "--port", str(port), "--admin-port", str(admin), "--max-model-len", "1024",
                                   "--max-resident", "8", "--decode-slots", "8", *args,
                                   "--", "--enforce-eager"],  # what starts, not how fast: 13 s less a start
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 540
        health = None
        while time.monotonic() < deadline and server.poll() is None:
            health = _get(f"http://127.0.0.1:{admin}/leap/health")
            if health is not None and settled(health):
                break
            time.sleep(1.0)
        assert server.poll() is None, f"leap serve exited {server.returncode}: {log.read_text()[-3000:]}"
        assert health is not None and settled(health), f"never settled: {health}\n{log.read_text()[-3000:]}"
        token = (home / "admin.token").read_text().strip()
        if while_up is not None:
            while_up(port, admin, token)
        return health, _get(f"http://127.0.0.1:{admin}/leap/readout", token) or {}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)


def test_a_plain_leap_serve_serves_the_registry_champion_at_its_layer(tmp_path):
    pytest.importorskip("mlflow")
    from harness.model_prep import prepare_model

    model = prepare_model()
    home = tmp_path / "home"
    readout, rls = champion(model)
    name = register(f"sqlite:///{home}/mlflow/mlflow.db", readout, rls)
    health, described = _serve_until(home, model, tmp_path / "serve.log",
                                      lambda h: h["readout"]["source"] != "none")
    assert health["readout"] == {"version": readout.metadata["version"], "source": "registry",
                                 "recipe": f"last@{LAYER}", "capture_recipe": f"last@{LAYER}", "layer": LAYER}
    assert described["registry"] == {"state": "loaded", "model": name}, described
    assert described["layer"] == LAYER
    assert described["rls"]["active"] and described["rls"]["dim"] == model.hidden_size  # anchored on its RLS state


def test_leap_serve_serves_a_replicas_saved_files(tmp_path):
    from harness.model_prep import prepare_model
    from serving.readout.saved_state import ReadoutState

    model = prepare_model()
    readout, rls = champion(model)
    folder = tmp_path / "saved"
    ReadoutState(folder).save(to_bytes(readout), rls.state_arrays(), readout.metadata["version"])
    keys = tmp_path / "tenant-keys.json"
    keys.write_text(json.dumps({key_digest("key-of-acme"): "acme"}))
    sent = {}

    def ask_as_acme_claiming_another_tenant(port: int, admin: int, token: str) -> None:
        deadline = time.monotonic() + 300  # the admin API answers before the OpenAI server is up
        while True:
            try:
                served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the OpenAI server never answered"
                time.sleep(1.0)
        body = {"model": served, "prompt": "Say hello.", "max_tokens": 4,
                "vllm_xargs": {"leap_tenant": "mallory", "leap_request_id": "tenant-check"}}
        sent["answer"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120,
                                    headers={"authorization": "Bearer key-of-acme"})
        time.sleep(1.0)  # the row is written at the next step or idle settle
        sent["flush"] = httpx.post(f"http://127.0.0.1:{admin}/leap/feedback/flush", timeout=60,
                                   headers={"authorization": f"Bearer {token}"})

    health, described = _serve_until(tmp_path / "home", model, tmp_path / "serve.log",
                                     lambda h: h["readout"]["source"] != "none",
                                     "--readout", str(folder / "readout.bin"), "--rls-state", str(folder / "rls.npz"),
                                     env_extra={"LEAP_TENANT_KEYS_FILE": str(keys)},
                                     while_up=ask_as_acme_claiming_another_tenant)
    assert sent["answer"].status_code == 200 and sent["flush"].status_code == 200, (sent, sent["answer"].text)
    rows = [row for path in sorted((tmp_path / "home" / "feedback").rglob("*.parquet"))
            for row in read_segment_file(path).to_pylist()]
    assert [(row["client_request_id"], row["tenant"]) for row in rows] == [("tenant-check", "acme")]
    assert (health["readout"]["source"], health["readout"]["version"]) == ("config", readout.metadata["version"])
    assert health["readout"]["layer"] == LAYER
    assert described["rls"]["active"] and described["rls"]["dim"] == model.hidden_size  # rls.npz anchors it
    assert described["registry"] == {"state": "off"}  # the home has no registry, and the files came first
