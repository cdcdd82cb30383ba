"""prefect.yaml against the code it names, and deployed on a real Prefect server.

Each deployment's entrypoint must load the flow, its parameters must be the flow's, its pool and
schedule the ones the fleet stack registers in code, and the retrain's trigger must expect the very event
and labels the drift watch emits (`flows.events`). Deployed with `prefect deploy --all` on a real server,
a by-event drift announcement starts exactly one retrain run through the trigger, and a by-watch one none.
"""

from __future__ import annotations

import inspect
import subprocess
import time
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("prefect")

from prefect.flows import Flow, load_flow_from_entrypoint

from flows.events import DRIFT_EVENT, RETRAIN_LABEL, announce_drift, drift_resource
from flows.settings import PipelineSettings
from ops.servers import program
from ops.stack_fleet import POOL, RETRAIN_CRON, RETRAIN_DEPLOYMENT, ensure_pool
from tests.prefect_server_fixtures import prefect_server

pytestmark = pytest.mark.pipeline
REPO = Path(__file__).resolve().parents[1]
MODEL = "leap-readout-smol-yaml-L9"


@pytest.fixture(scope="module")
def declared() -> dict[str, dict]:
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {deployment["name"]: deployment for deployment in config["deployments"]}


def _flow(deployment: dict) -> Flow:
    flow = load_flow_from_entrypoint(deployment["entrypoint"], use_placeholder_flow=False)
    assert isinstance(flow, Flow), deployment["entrypoint"]
    return flow


def test_every_entrypoint_loads_its_flow_with_the_parameters_given(declared):
    assert set(declared) == {RETRAIN_DEPLOYMENT, "drift"}
    names = {}
    for name, deployment in declared.items():
        flow = _flow(deployment)
        names[name] = flow.name
        accepted = set(inspect.signature(flow.fn).parameters)
        assert set(deployment.get("parameters") or {}) <= accepted, (name, accepted)
        assert deployment["work_pool"]["name"] == POOL
    assert names == {RETRAIN_DEPLOYMENT: "leap-retrain", "drift": "leap-drift-watch"}


def test_the_schedules_are_the_ones_the_stack_registers_in_code(declared):
    retrain, drift = declared[RETRAIN_DEPLOYMENT], declared["drift"]
    assert retrain["schedules"] == [{"cron": RETRAIN_CRON}] and retrain["concurrency_limit"] == 1
    assert drift["schedules"] == [{"interval": PipelineSettings.model_fields["drift_interval_s"].default}]
    assert drift["parameters"] == {"retrain_by_event": True}  # the watch leaves the retrain to the trigger


def test_the_retrain_trigger_expects_the_event_and_labels_the_watch_emits(declared):
    [trigger] = declared[RETRAIN_DEPLOYMENT]["triggers"]
    assert trigger["type"] == "event" and trigger["enabled"] and trigger["posture"] == "Reactive"
    assert trigger["expect"] == [DRIFT_EVENT]
    by_event, by_watch = drift_resource(MODEL, by_event=True), drift_resource(MODEL, by_event=False)
    for label, pattern in trigger["match"].items():
        assert fnmatch(by_event[label], pattern), (label, pattern, by_event[label])
    assert not fnmatch(by_watch[RETRAIN_LABEL], trigger["match"][RETRAIN_LABEL])


def test_deployed_on_a_real_server_a_drift_event_starts_one_retrain(tmp_path, declared):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with prefect_server(tmp_path) as server:
        ensure_pool(server.api_url)
        deployed = subprocess.run([program("prefect"), "--no-prompt", "deploy", "--all"], cwd=REPO, env=server.env(),
                                  capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
        api = httpx.Client(base_url=server.api_url, timeout=30)
        deployments = {d["name"]: d for d in api.post("/deployments/filter", json={}).json()}
        assert set(deployments) == set(declared)
        retrain = deployments[RETRAIN_DEPLOYMENT]
        assert retrain["global_concurrency_limit"]["limit"] == 1 and retrain["work_pool_name"] == POOL
        assert [s["schedule"]["cron"] for s in retrain["schedules"]] == [RETRAIN_CRON]
        assert deployments["drift"]["parameters"] == {"retrain_by_event": True}

        with temporary_settings({PREFECT_API_URL: server.api_url}):
            watched = announce_drift(MODEL, {"replica": "http://r0", "domain": "all", "reason": "drift"}, False)
            announced = announce_drift(MODEL, {"replica": "http://r0", "domain": "all", "reason": "drift"}, True)
        assert watched and announced

        def triggered() -> list[dict]:
            runs = api.post("/flow_runs/filter", json={}).json()
            return [r for r in runs if (r.get("created_by") or {}).get("type") == "AUTOMATION"]

        deadline = time.monotonic() + 60
        while not triggered() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # a second run (from the by-watch event) would come as soon
        runs = triggered()
        assert len(runs) == 1, runs
        assert runs[0]["deployment_id"] == retrain["id"] and runs[0]["state_type"] == "SCHEDULED"
