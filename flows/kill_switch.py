"""The fleet's kill switch: every replica to FCFS at once (`leap fcfs on`), and back (`leap fcfs off`).

Each replica gets `POST /leap/fcfs` (serving/fcfs_fallback.py, through `leap_io.admin_client`) in turn;
one that does not answer does not hold up the others (in an incident, FCFS on most replicas beats FCFS on
none) and is tried again, with backoff, until it answers or `kill_switch_deadline_s` passes; the ones that
never did are reported. A replica keeps the switch across its own restarts (its state folder). The switch and what every replica answered are recorded in the registry's history
(`registry.operations`); a registry that cannot be reached is reported, never a reason not to switch.
"""

from __future__ import annotations

import time
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
    deadline = time.monotonic() + settings.kill_switch_deadline_s
    replicas: dict[str, dict[str, Any]] = {}
    attempts = dict.fromkeys(settings.endpoints, 0)
    waiting, pause = list(settings.endpoints), 0.5
    while waiting:
        for endpoint in waiting:
            attempts[endpoint] += 1
            replicas[endpoint] = switch_replica(endpoint, token, on, reason, settings.push_timeout_s)
        waiting = [endpoint for endpoint in waiting if "error" in replicas[endpoint]]
        if not waiting or time.monotonic() + pause > deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, 10.0)
    failed = sorted(waiting)
    report: dict[str, Any] = {"status": "switched" if not failed else "partial", "on": on, "reason": reason,
                              "replicas": replicas, "failed": failed, "attempts": attempts,
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
