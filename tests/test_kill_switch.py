"""The kill switch: a replica orders decodes FCFS at once, by command or by itself when its ranking
collapses, says so, and goes back; `leap fcfs` reaches every replica and is recorded in the registry.

Real parts: LEAP runtimes driven through their scheduler hooks with real vLLM requests and the real
capture channel (no engine, as in tests/test_runtime_hardening.py), their admin servers over HTTP, and a
sqlite MLflow registry.
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from serving.capture.hidden_states import FeatureSender
from tests.runtime_fixtures import DIM, build, eventually, first_value_readout  # noqa: F401  (pytest fixtures, used by name)

TOKEN = "kill-switch-token"


def request(rid: str, max_tokens: int = 500) -> Request:
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens), None, arrival_time=time.time())


def decode(r: Request, tokens: int = 1) -> Request:
    r.num_computed_tokens = r.num_prompt_tokens + tokens - 1
    r.append_output_token_ids([7] * tokens)
    return r


def features(*firsts: float) -> np.ndarray:
    vectors = np.random.default_rng(0).normal(size=(len(firsts), DIM)).astype(np.float32)
    vectors[:, 0] = firsts
    return vectors


def predicted(runtime, sender: FeatureSender, requests: list[Request], firsts: list[float], step: int) -> None:
    runtime.before_schedule(requests, step)
    sender.send([r.request_id for r in requests], features(*firsts))
    assert eventually(lambda: all(r.request_id in runtime.tracker.predictions for r in requests))


def test_the_switch_orders_decodes_fcfs_from_the_next_step_and_back(build):
    runtime = build(policy="leap", decode_slots=1, admin_port=0, admin_token=TOKEN)
    runtime.reset_readout(first_value_readout(), None)
    early, late = request("early-00000001"), request("late-00000001")  # early arrived first, predicted longer
    late.arrival_time = early.arrival_time + 1.0
    sender = FeatureSender(runtime.config.channel)
    predicted(runtime, sender, [early, late], [100.0, 5.0], 0)
    runtime.before_schedule([decode(early), decode(late)], 1)
    assert runtime.steps.last_held == {early.request_id}  # shortest predicted first
    url, auth = f"http://127.0.0.1:{runtime.admin.port}", {"Authorization": f"Bearer {TOKEN}"}

    answer = httpx.post(f"{url}/leap/fcfs", json={"on": True, "reason": "incident 42"}, headers=auth, timeout=10)
    assert answer.status_code == 200 and answer.json()["on"] and answer.json()["source"] == "command"
    runtime.before_schedule([decode(early, 2), decode(late, 2)], 2)
    assert runtime.steps.last_held == {late.request_id}  # first come, first served
    health = httpx.get(f"{url}/leap/health", timeout=10).json()
    assert health["fcfs_fallback"]["on"] and health["fcfs_fallback"]["reason"] == "incident 42"
    assert runtime.metrics_registry.get_sample_value("leap:kill_switch") == 1.0

    assert httpx.post(f"{url}/leap/fcfs", json={"on": False}, headers=auth, timeout=10).json()["on"] is False
    runtime.before_schedule([decode(early, 3), decode(late, 3)], 3)
    assert runtime.steps.last_held == {early.request_id}
    assert runtime.metrics_registry.get_sample_value("leap:kill_switch") == 0.0


def test_the_switch_route_needs_the_token_and_a_well_formed_body(build):
    runtime = build(policy="leap", admin_port=0, admin_token=TOKEN)
    url, auth = f"http://127.0.0.1:{runtime.admin.port}/leap/fcfs", {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(url, json={"on": True}, timeout=10).status_code == 401
    for body in (b"not json", b'{"on": "yes"}', b"[true]", b'{"on": true, "reason": 5}'):
        answer = httpx.post(url, content=body, headers=auth, timeout=10)
        assert answer.status_code == 400, (body, answer.text)
    assert httpx.post(url, content=b"{" + b" " * 5000 + b"}", headers=auth, timeout=10).status_code == 413
    assert not runtime.fallback.on


def test_a_collapsed_live_ranking_falls_back_by_itself_until_a_new_readout_serves(build):
    runtime = build(policy="leap", fcfs_below_spearman=0.0, fcfs_min_rows=16)
    runtime.reset_readout(first_value_readout("inverted"), None)
    sender = FeatureSender(runtime.config.channel)
    firsts = np.linspace(10.0, 200.0, 32)
    batch = [request(f"r{i}-00000001") for i in range(32)]
    predicted(runtime, sender, batch, list(firsts), 0)
    for r, first in zip(batch, firsts):  # the longest predicted finish shortest: a ranking upside down
        decode(r, int(220 - first))
        r.status = RequestStatus.FINISHED_STOPPED
        runtime.on_finished(r)
    state = runtime.health()["fcfs_fallback"]
    assert state["on"] and state["source"] == "live-ranking" and "below 0.000" in state["reason"]
    # a new readout gets its own chance: the next finished request sees the new anchor
    runtime.reset_readout(None, None)
    runtime.reset_readout(first_value_readout("next"), None)
    again = request("after-00000001")
    predicted(runtime, sender, [again], [50.0], 1)
    decode(again, 40)
    again.status = RequestStatus.FINISHED_STOPPED
    runtime.on_finished(again)
    assert not runtime.fallback.on and runtime.fallback.switches == 2
    # one engaged by command outlasts a new readout
    runtime.set_fcfs(True, "by hand")
    runtime.fallback.new_anchor()
    assert runtime.fallback.on and runtime.fallback.engaged.source == "command"


def test_leap_fcfs_reaches_every_replica_and_is_recorded_in_the_registry(build, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from leap_cli.main import app
    from registry.client import ReadoutRegistry

    replicas = [build(policy="leap", admin_port=0, admin_token=TOKEN) for _ in range(2)]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    monkeypatch.setenv("LEAP_ENDPOINTS", ",".join(f"http://127.0.0.1:{r.admin.port}" for r in replicas))
    monkeypatch.setenv("LEAP_ADMIN_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("LEAP_MLFLOW_TRACKING_URI", uri)
    outcome = CliRunner().invoke(app, ["fcfs", "on", "--reason", "bad readout", "--json"])
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert result["status"] == "switched" and result["on"] and not result["failed"]
    assert all(r.fallback.on and r.fallback.engaged.reason == "bad readout" for r in replicas)
    off = CliRunner().invoke(app, ["fcfs", "off", "--json"])
    assert off.exit_code == 0 and not any(r.fallback.on for r in replicas)
    runs = ReadoutRegistry(uri).operations()
    assert [(run["action"], run["reason"]) for run in runs] == [("fcfs-off", ""), ("fcfs-on", "bad readout")]
    assert all(run["replicas_switched"] == "2" and run["failed"] == "0" for run in runs)  # tags are text


def test_the_switch_is_kept_across_a_restart_until_it_is_turned_off(build, tmp_path):
    state = tmp_path / "state"
    first = build(policy="leap", state_dir=str(state))
    assert first.set_fcfs(True, "bad readout")["kept_across_restart"] is True
    first.close()
    second = build(policy="leap", state_dir=str(state))
    assert second.fallback.on and "bad readout" in second.fallback.engaged.reason
    assert second.fallback.engaged.source == "command"  # only a command (or its file's removal) ends it
    second.set_fcfs(False)
    second.close()
    assert not build(policy="leap", state_dir=str(state)).fallback.on
    (state / "fcfs.json").write_text("{torn")  # what the operators asked for is unknown: FCFS, the safe order
    assert build(policy="leap", state_dir=str(state)).fallback.on


def test_leap_fcfs_retries_a_replica_until_it_answers(build, tmp_path, monkeypatch):
    import socket
    import threading

    from flows.kill_switch import switch_fleet
    from flows.settings import PipelineSettings

    up = build(policy="leap", admin_port=0, admin_token=TOKEN)
    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        late_port = probe.getsockname()[1]
    late = []
    starter = threading.Timer(1.5, lambda: late.append(build(policy="leap", admin_port=late_port, admin_token=TOKEN)))
    starter.start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    settings = PipelineSettings(home=tmp_path, admin_token_file=str(token_file), kill_switch_deadline_s=30,
                                mlflow_tracking_uri="http://127.0.0.1:9", mlflow_retries=0,  # not recorded here
                                endpoints=[f"http://127.0.0.1:{up.admin.port}", f"http://127.0.0.1:{late_port}"])
    report = switch_fleet(True, "incident", settings)
    starter.join()
    assert report["status"] == "switched" and report["failed"] == [], report
    assert report["attempts"][f"http://127.0.0.1:{up.admin.port}"] == 1
    assert report["attempts"][f"http://127.0.0.1:{late_port}"] > 1
    assert up.fallback.on and late[0].fallback.on
    settings.kill_switch_deadline_s = 0  # one try: a replica that never answers is reported, not waited for
    settings.endpoints = [f"http://127.0.0.1:{late_port + 1 if late_port < 65535 else 1}"]
    assert switch_fleet(False, "", settings)["failed"] == settings.endpoints
