"""The Prefect event the drift watch emits when it decides to retrain, and who answers it.

The watch (`flows.drift`) emits `DRIFT_EVENT` for the registered model whose live error drifted. A watch
that starts the retrain itself (the default) labels the event `by-watch`, so it is only a record; one
run with `retrain_by_event` labels it `by-event` and leaves the retrain to the deployment trigger that
prefect.yaml declares on exactly that event and label, so a drift starts one retrain either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DRIFT_EVENT = "leap.drift.detected"
RESOURCE_PREFIX = "leap.registered-model."
RETRAIN_LABEL = "leap.retrain"
BY_EVENT, BY_WATCH = "by-event", "by-watch"


def drift_resource(name: str, by_event: bool) -> dict[str, str]:
    """The event's resource: the registered model, and whether the watch leaves the retrain to a trigger."""
    return {"prefect.resource.id": f"{RESOURCE_PREFIX}{name}", "prefect.resource.name": name,
            RETRAIN_LABEL: BY_EVENT if by_event else BY_WATCH}


def announce_drift(name: str, decision: Mapping[str, Any], by_event: bool) -> str | None:
    """Send `DRIFT_EVENT` for one retrain decision of the watch to the Prefect API the settings name now, and
    wait until it is sent; the event's id, or None when no Prefect server takes events (a watch run outside
    any). Its own client, not Prefect's process-wide event worker: that worker keeps the API it first met
    and sends later, so a short `leap watch` process could exit, or a process that moved to another server
    could send, before the retrain trigger ever saw the event."""
    from prefect.client.orchestration import get_client
    from prefect.events import Event
    from prefect.events.clients import get_events_client
    from prefect.events.related import related_resources_from_run_context
    from prefect.events.worker import emit_events_to_cloud, should_emit_events_to_running_server
    from prefect.utilities.asyncutils import run_coro_as_sync

    if not (emit_events_to_cloud() or should_emit_events_to_running_server()):
        return None
    payload = {key: decision[key] for key in ("replica", "domain", "reason", "validation_mae") if key in decision}
    event = Event(event=DRIFT_EVENT, resource=drift_resource(name, by_event), payload=payload)

    async def send() -> None:
        async with get_client() as orchestration:  # the flow run it came from, where there is one
            event.related += await related_resources_from_run_context(orchestration)
        async with get_events_client() as client:
            await client.emit(event)

    run_coro_as_sync(send())
    return str(event.id)
