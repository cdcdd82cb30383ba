"""A real Prometheus scraping a real `leap serve` on its serving port: every dashboard panel and every alert.

One replica (vLLM's OpenAI server with LEAP's scheduler, capture, middleware and admin API) serves a
readout pushed through its admin API and a few real requests; Prometheus scrapes the serving port's
`/metrics` every second with infra/prometheus/alerts.yml loaded. Then each query of
infra/grafana/leap-dashboard.json must answer data through Prometheus's HTTP API, each alert rule must
evaluate without error, each metric an alert reads must be scraped or be one the serving code exports
(the fleet-only ones: shipping, champion), and the kill switch, switched on, must raise its alert.
Needs the Debian package `prometheus` (/usr/bin/prometheus, /usr/bin/promtool).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from leap_io.admin_client import AdminClient

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "infra" / "grafana" / "leap-dashboard.json"
ALERTS = REPO / "infra" / "prometheus" / "alerts.yml"
LOOPBACK = "127.0.0.1"
TOKEN = "prometheus-test-token"
START_TIMEOUT_S = 480.0
METRIC = re.compile(r"\b(?:leap|vllm):[a-z_:]+")


def _tools() -> tuple[str, str]:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        pytest.fail("Prometheus is not installed: apt-get install -y --no-install-recommends prometheus "
                    "(Debian's package gives /usr/bin/prometheus and /usr/bin/promtool)")
    return prometheus, promtool


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # its own session: vLLM's engine-core child goes with it
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _wait(what: str, ready, timeout_s: float, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not answer within {timeout_s:.0f}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """(serving URL, admin client) of one `leap serve` with a readout of its feature space serving."""
    _tools()
    work = tmp_path_factory.mktemp("replica")
    port, admin_port = _free_port(), _free_port()
    env = {key: value for key, value in os.environ.items()
           if key not in ("LEAP_REGISTRY_URI", "LEAP_MLFLOW_TRACKING_URI", "LEAP_READOUT_PATH", "LEAP_FEEDBACK_URL",
                          "LEAP_RLS_STATE_PATH", "LEAP_FEEDBACK_DIR", "LEAP_REPLICA_ID")}
    env.update({"LEAP_HOME": str(work / "home"),  # not the checkout's .leap, where `make demo` leaves a champion
                "LEAP_ADMIN_TOKEN": TOKEN, "LEAP_STATE_DIR": str(work / "state"),
                "LEAP_CHAMPION_URL": str(work / "champion"), "PYTHONUNBUFFERED": "1"})
    log = work / "serve.log"
    argv = [sys.executable, "-m", "leap_cli.main", "serve", "--host", LOOPBACK, "--port", str(port),
            "--admin-port", str(admin_port), "--feedback-dir", str(work / "feedback"), "--max-model-len", "1024",
            "--", "--enforce-eager"]  # the metrics, not the speed: uncompiled starts 13 s sooner
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    url = f"http://{LOOPBACK}:{port}"
    admin = AdminClient(f"http://{LOOPBACK}:{admin_port}", TOKEN)
    try:
        _wait("leap serve", lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200
              and admin.health().status_code == 200, START_TIMEOUT_S, process, log)
        pushed = admin.push(_bundle(admin.readout().json()))
        assert pushed.status_code == 200, pushed.text
        yield url, admin
    finally:
        _stop(process)


def _bundle(described: dict) -> bytes:
    """A push bundle of a readout fitted on random vectors of the replica's dim, under its identity."""
    from leap_core.readout_format import to_bytes
    from leap_core.rls import fit_readout_with_anchor
    from leap_io.push_bundle import make_bundle

    rng = np.random.default_rng(0)
    features = rng.normal(size=(256, int(described["dim"]))).astype(np.float32)
    lengths = np.clip(np.exp(3.0 + 0.4 * features[:, 0]), 1, 256).round()
    metadata = {"model_id": described.get("model_id"), "model_fingerprint": described.get("model_fingerprint") or "",
                "layer": int(described["layer"]), "version": "prometheus-1"}
    readout, rls = fit_readout_with_anchor(features, lengths, alpha=1.0, max_tokens=256, metadata=metadata)
    return make_bundle(to_bytes(readout), rls.state_arrays())


@pytest.fixture(scope="module")
def prometheus(replica, tmp_path_factory):
    """The base URL of a Prometheus scraping the replica's serving port every second, with the alert rules."""
    binary, _ = _tools()
    url, _ = replica
    work = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(ALERTS)],
              "scrape_configs": [{"job_name": "leap", "static_configs": [{"targets": [url.removeprefix("http://")]}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = work / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address={LOOPBACK}:{port}"],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{LOOPBACK}:{port}"
    try:
        _wait("prometheus", lambda: httpx.get(f"{base}/-/ready", timeout=5).status_code == 200, 60, process, log)
        yield base
    finally:
        _stop(process)


def _query(base: str, expr: str) -> list:
    answer = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert answer["status"] == "success", f"{expr}: {answer}"
    return answer["data"]["result"]


def _eventually(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f}s"
        time.sleep(1.0)
    return found


@pytest.fixture(scope="module")
def scraped(replica, prometheus):
    """Prometheus's base URL once it has scraped the replica before, during and after real requests."""
    url, admin = replica
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = ["Say hello.", "List three prime numbers.", "Why is the sky blue?", "Name a famous painter.",
               "Write one sentence about the sea.", "What is 17 times 23?"]

    def complete(i: int) -> int:
        body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": 8 + 6 * (i % 7), "temperature": 0.0,
                "vllm_xargs": {"leap_domain": "chat" if i % 2 else "math"}}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code

    _eventually(lambda: _query(prometheus, 'up{job="leap"} == 1'), 60, "the first scrape")
    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(complete, range(24))) == {200}
    _eventually(lambda: _query(prometheus, "leap:finished_requests_total >= 24"), 60, "the finished requests scraped")
    time.sleep(3)  # a few more scrapes after the last request: every rate window holds two points
    return prometheus


def _dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 15
    return [e.replace("$__rate_interval", "1m").replace("$instance", ".*") for e in exprs]


def test_every_dashboard_query_answers_data(replica, scraped):
    empty = [expr for expr in _dashboard_queries() if not _query(scraped, expr)]
    assert not empty, f"queries with no data: {empty}"
    version = replica[1].serving_version()
    assert version.startswith("prometheus-1")
    served = _query(scraped, "leap:readout_info")
    assert [s["metric"]["version"] for s in served] == [version] and served[0]["metric"]["source"] != "none"
    def value(expr: str) -> float:
        return float(_query(scraped, expr)[0]["value"][1])

    # every request finished; those whose prediction was ready by their finish are the labelled ones
    assert value("leap:finished_requests_total") == 24
    labelled = value("leap:actual_generation_tokens_count")
    assert value("leap:predicted_generation_tokens_count") == labelled >= 12, labelled
    finished = {r["metric"]["domain"]: float(r["value"][1]) for r in _query(scraped, "leap:rolling_requests")}
    assert finished["all"] == labelled and finished["chat"] + finished["math"] == labelled, finished
    variable = json.loads(DASHBOARD.read_text())["templating"]["list"][1]["query"]
    metric = re.fullmatch(r"label_values\(([^,]+), instance\)", variable).group(1)
    assert _query(scraped, metric)


def test_every_alert_rule_evaluates_over_metrics_the_replica_exports(scraped):
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    source = "\n".join(p.read_text() for p in (REPO / "serving").rglob("*.py"))
    for rule in rules:
        _query(scraped, rule["expr"])
        for name in set(METRIC.findall(rule["expr"])):
            if _query(scraped, f'count({{__name__="{name}"}})'):
                continue
            family = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert f'"{family}"' in source, f"{rule['alert']} reads {name}, which no replica exports"
    loaded = httpx.get(f"{scraped}/api/v1/rules", timeout=30).json()["data"]["groups"]
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in loaded for r in g["rules"]}
    assert set(health) == {rule["alert"] for rule in rules}
    assert all(state == ("ok", "") for state in health.values()), health


def test_the_kill_switch_raises_its_alert(replica, scraped):
    _, admin = replica
    assert admin.switch_fcfs(True, "alert test").status_code == 200
    try:
        alerts = _eventually(lambda: [a for a in httpx.get(f"{scraped}/api/v1/alerts", timeout=30).json()["data"]["alerts"]
                                      if a["labels"]["alertname"] == "LeapKillSwitchOn"], 30, "LeapKillSwitchOn")
        assert alerts[0]["state"] in ("pending", "firing")
    finally:
        assert admin.switch_fcfs(False, "alert test over").status_code == 200


def test_promtool_accepts_the_rules_and_the_dashboard_is_current():
    _, promtool = _tools()
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    current = subprocess.run([sys.executable, str(DASHBOARD.with_name("build_dashboard.py")), "--check"],
                             capture_output=True, text=True, timeout=120)
    assert current.returncode == 0, current.stdout + current.stderr
