"""The fleet's kill switch: every replica to FCFS at once (`leap fcfs on`), and back (`leap fcfs off`).

Each replica gets `POST /leap/fcfs` (serving/fcfs_fallback.py, through `leap_io.admin_client`) in turn;
one that does not answer is reported and the others are switched all the same: in an incident, FCFS on
most replicas beats FCFS on none. The switch and what every replica answered are recorded in the registry's history
(`registry.operations`); a registry that cannot be reached is reported, never a reason not to switch.
"""

from __future__ import annotations

from typing import Any

import httpx

from flows.settings import PipelineSettings
from leap_io.admin_client import AdminClient, AdminToken


def switch_replica(endpoint: str, token: AdminToken, on: bool, reason: str, timeout: float) -> dict[str, Any]:
    """One replica's answer to the switch, or `error`."""
    try:
        answer = AdminClient(endpoint, token, timeout).switch_fcfs(on, reason)
        answer.raise_for_status()
        state = answer.json()
        if not isinstance(state, dict) or state.get("on") is not on:
            return {"error": f"the replica answered {str(state)[:200]}"}
        return state
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def switch_fleet(on: bool, reason: str = "", settings: PipelineSettings | None = None) -> dict[str, Any]:
    """Switch every replica of `settings.endpoints`; the outcome per replica and where it was recorded."""
    settings = settings or PipelineSettings()
    token = settings.admin_tokens()
    replicas = {endpoint: switch_replica(endpoint, token, on, reason, settings.push_timeout_s)
                for endpoint in settings.endpoints}
    failed = sorted(endpoint for endpoint, state in replicas.items() if "error" in state)
    report: dict[str, Any] = {"status": "switched" if not failed else "partial", "on": on, "reason": reason,
                              "replicas": replicas, "failed": failed,
                              "replicas_switched": len(replicas) - len(failed)}
    try:
        from registry.client import ReadoutRegistry

        registry = ReadoutRegistry(settings.mlflow_tracking_uri, retries=settings.mlflow_retries,
                                   backoff_s=settings.mlflow_backoff_s)
        report["recorded_run_id"] = registry.log_operation(
            "fcfs-on" if on else "fcfs-off", reason,
            {"replicas_switched": report["replicas_switched"], "failed": len(failed), "report": report})
    except Exception as exc:
        report["record_error"] = f"{type(exc).__name__}: {exc}"
    return report
