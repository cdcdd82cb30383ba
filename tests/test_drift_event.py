"""The drift watch as prefect.yaml deploys it: on drift it emits `leap.drift.detected` to the Prefect server,
labelled by-event, and starts no retrain itself (the deployment trigger does: tests/test_prefect_yaml.py).

The same real parts as tests/test_drift_serving.py: a serving replica's runtime and admin server fed the
snapshot's features of a prompt set its champion was not fitted on, and a temporary Prefect server.
"""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("prefect")

from flows.drift import RETRAIN, drift_flow
from flows.events import BY_EVENT, DRIFT_EVENT, RETRAIN_LABEL, drift_resource
from tests.flow_fixtures import pipeline_home
from tests.test_drift_serving import domains, prefect_server, replica, watch_env  # noqa: F401 (fixtures)

pytestmark = pytest.mark.pipeline


def _server_events(name: str, timeout_s: float = 30.0) -> list[dict]:
    """The `name` events the Prefect server has stored (they arrive a moment after they are emitted)."""
    from prefect.settings import PREFECT_API_URL

    deadline = time.monotonic() + timeout_s
    while True:
        answer = httpx.post(f"{PREFECT_API_URL.value()}/events/filter",
                            json={"filter": {"event": {"name": [name]}}, "limit": 50}, timeout=30)
        answer.raise_for_status()
        events = answer.json()["events"]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def test_the_deployed_watch_announces_drift_and_leaves_the_retrain_to_the_trigger(replica):
    home, start = replica
    r = start(rls=False)
    with pipeline_home(home, **watch_env(home, r["url"])):
        r["traffic"].serve(r["shifted"].part(0, 48))
        first = drift_flow(retrain_by_event=True)
        r["traffic"].serve(r["shifted"].part(48, 96))
        second = drift_flow(retrain_by_event=True)
    assert first["retrains"] == 0 and first["drift_events"] == 0  # one observation is not a window
    [retrain] = [d for d in second["decisions"] if d["action"] == RETRAIN and d["acted"]]
    assert retrain["outcome"] == {"started": "event", "event": DRIFT_EVENT} and second["retrains"] == 1
    [event] = _server_events(DRIFT_EVENT)
    assert event["id"] == retrain["event_id"]
    assert event["resource"] == drift_resource(r["name"], by_event=True)
    assert event["resource"][RETRAIN_LABEL] == BY_EVENT
    assert event["payload"]["reason"] == retrain["reason"] and event["payload"]["replica"] == r["url"]
