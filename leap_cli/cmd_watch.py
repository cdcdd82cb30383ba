"""`leap watch`: the drift watch (flows.drift) once, every `--every` seconds, or as a scheduled deployment.

One pass scrapes every replica ($LEAP_ENDPOINTS), records what it saw in the watch's state file and
retrains, resets or rolls back as the figures call for; it prints the pass's summary (`drift_events`,
`retrains`, `resets`, `rollbacks`, each decision with its reason). Without `--once` it repeats until
interrupted, one JSON line per pass with `--json`. `--deploy` registers the watch on the stack's
Prefect server with an interval schedule, beside the retrain deployment of `leap deploy`, and serves it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer

from leap_cli.apps import app
from leap_cli.cmd_pipeline import (
    _deployment_api_url,
    _prefect_api,
    _require_prefect,
    _run,
    _settings,
    serve_deployment,
)


def _watch(name: str | None, act: bool):
    def run() -> dict[str, Any]:
        from flows.drift import drift_flow

        with _prefect_api(_settings()):
            return drift_flow(name=name, act=act)

    return run


def _deploy(every: float, deployment: str, serve: bool, as_json: bool) -> None:
    api_url = _deployment_api_url()

    def register() -> dict[str, Any]:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.drift import drift_flow

        _require_prefect(api_url)
        os.chdir(Path(__file__).resolve().parents[1])  # the deployment's entrypoint is relative to here
        with temporary_settings({PREFECT_API_URL: api_url}):
            deployment_id = drift_flow.to_deployment(name=deployment, interval=every).apply()
        return {"status": "registered", "deployment": f"{drift_flow.name}/{deployment}", "id": str(deployment_id),
                "interval_s": every, "api_url": api_url}

    _run(register, as_json, "watch")
    if not serve:
        return
    from flows.drift import drift_flow

    serve_deployment(drift_flow, deployment, api_url, f"every {every:g}s", interval=every)


@app.command("watch")
def watch_command(
    once: bool = typer.Option(False, "--once", help="one pass, then exit"),
    every: float | None = typer.Option(None, help="seconds between passes (default $LEAP_DRIFT_INTERVAL_S)"),
    name: str | None = typer.Option(None, help="registered model (default: the one the replicas serve)"),
    act: bool = typer.Option(True, help="--no-act only reports what it would do"),
    deploy: bool = typer.Option(False, "--deploy", help="register the watch on the stack's Prefect server with "
                                                        "an interval schedule (and serve it, unless --no-serve)"),
    deployment: str = typer.Option("drift", help="deployment name (with --deploy)"),
    serve: bool = typer.Option(True, help="with --deploy: keep running and execute the scheduled runs"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object per pass"),
) -> None:
    """Watch every replica's live prediction quality: retrain on drift, reset RLS or roll back when it hurts."""
    if every is not None and every <= 0:
        raise typer.BadParameter("must be positive", param_hint="--every")
    interval = every if every is not None else _settings().drift_interval_s
    if deploy:
        _deploy(interval, deployment, serve, as_json)
        return
    while True:
        _run(_watch(name, act), as_json, "drift watch")
        if once:
            return
        time.sleep(interval)
