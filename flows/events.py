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
    """Emit `DRIFT_EVENT` for one retrain decision of the watch; the event's id, or None when no Prefect
    API takes events (a watch run outside any server)."""
    from prefect.events import emit_event

    payload = {key: decision[key] for key in ("replica", "domain", "reason", "validation_mae") if key in decision}
    event = emit_event(event=DRIFT_EVENT, resource=drift_resource(name, by_event), payload=payload)
    return None if event is None else str(event.id)
