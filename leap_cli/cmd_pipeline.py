"""Pipeline commands: `leap ingest|fit|gate|push|rollback|retrain|merge|reconcile`, `leap stack up|down|status`,
`leap deploy`.

Each flow command runs one Prefect flow and prints its summary; a failure (MLflow down after its
retries, a refused push, a promotion that had to be undone) prints {"status": "failed", "error"}
and exits 1. While the local stack's Prefect
server runs (and PREFECT_API_URL is unset), runs are recorded there and show in its UI; otherwise
Prefect starts a temporary server for the run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import typer

from leap_cli.apps import app, stack_app
from leap_cli.output import console, emit, json_stdout

_SERVICES_HELP = ("comma-separated subset of mlflow,prefect,serving (a fleet: postgres,s3,mlflow,prefect,"
                  "worker-0,worker-1,serving-0,...)")


def _settings():
    from flows.settings import PipelineSettings

    return PipelineSettings()


@contextlib.contextmanager
def _prefect_api(settings) -> Iterator[None]:
    """Point Prefect at the stack's server while it runs, unless PREFECT_API_URL says otherwise."""
    from leap_io.pidfiles import service_pid

    if os.environ.get("PREFECT_API_URL") or service_pid(settings.stack_dir, "prefect") is None:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    os.environ["PREFECT_API_URL"] = settings.prefect_api_url  # for flow-run subprocesses too
    try:
        with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
            yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)


def _deployment_api_url() -> str:
    """The Prefect server a deployment registers on: PREFECT_API_URL, else the stack's; exported, since the
    runner's flow-run processes read it from the environment."""
    api_url = os.environ.get("PREFECT_API_URL") or _settings().prefect_api_url
    os.environ["PREFECT_API_URL"] = api_url
    return api_url


def serve_deployment(flow, name: str, api_url: str, schedule: str, **when: Any) -> None:
    """Serve `flow` as deployment `name` from this process on the Prefect server at `api_url`, on the
    schedule `when` (cron= or interval=) described by `schedule`, until Ctrl-C."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    console.print(f"serving deployment {flow.name}/{name} ({schedule}); Ctrl-C stops")
    with temporary_settings({PREFECT_API_URL: api_url}):
        flow.serve(name=name, print_starting_message=False, **when)


def _require_prefect(api_url: str) -> None:
    """LookupError unless a Prefect server answers at `api_url`."""
    from ops.stack import answers

    if not answers(f"{api_url}/health"):
        raise LookupError(f"no Prefect server answers at {api_url}; run `leap stack up` first")


def _run(run: Callable[[], dict[str, Any]], as_json: bool, title: str, fail_unhealthy: bool = True) -> None:
    """Run a flow or stack action; a failure prints {"status": "failed", "error"} and exits 1, and so
    does an unhealthy stack when `fail_unhealthy`."""
    from flows.promotion import PromotionFailed
    from flows.push import PushFailed
    from ops.stack import StackError
    from registry.client import AliasLockTimeout, RegistryUnavailable
    from store.duckdb import StoreBusyError

    try:
        with json_stdout(as_json):
            result = run()
    except PromotionFailed as exc:
        emit({"status": "failed", "error": str(exc), "restored": exc.restored}, as_json, title)
        raise typer.Exit(1) from exc
    except (PushFailed, StackError, LookupError, ValueError, RegistryUnavailable, AliasLockTimeout,
            StoreBusyError) as exc:
        emit({"status": "failed", "error": f"{type(exc).__name__}: {exc}"}, as_json, title)
        raise typer.Exit(1) from exc
    emit(result, as_json, title)
    if fail_unhealthy and result.get("healthy") is False:
        raise typer.Exit(1)


def _flow(flow_name: str, /, **kwargs: Any) -> Callable[[], dict[str, Any]]:
    # positional-only: the flows take a `name` (the registered model) of their own
    def run() -> dict[str, Any]:
        from flows import pipeline

        settings = _settings()
        with _prefect_api(settings):
            return getattr(pipeline, flow_name)(**kwargs)

    return run


def _timestamp(text: str | None, option: str) -> float | None:
    """Unix seconds from a number or an ISO date/time (local time unless it says otherwise)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r} is neither unix seconds nor an ISO date", param_hint=option) from exc


@app.command("ingest")
def ingest_command(
    feedback_dir: str | None = typer.Option(None, help="segments folder or s3://bucket/prefix (default "
                                                         "$LEAP_FEEDBACK_URL, else $LEAP_HOME/feedback)"),
    retry_failed: bool = typer.Option(False, help="try segments quarantined as failed again (after a fix)"),
    workers: int | None = typer.Option(None, min=1, help="segments ingested at once into a PostgreSQL store "
                                                             "(default $LEAP_INGEST_WORKERS; DuckDB: one)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Ingest complete feedback segments into the log store (segments seen before are skipped; a
    segment that fails is quarantined with its reason, and the others are ingested); `rows_per_s`."""
    _run(_flow("ingest_flow", feedback_dir=feedback_dir or None, retry_failed=retry_failed,
               workers=workers), as_json, "ingest")


@app.command("fit")
def fit_command(
    since: str | None = typer.Option(None, help="window start: unix seconds or ISO date"),
    until: str | None = typer.Option(None, help="window end (exclusive): unix seconds or ISO date"),
    alpha: str | None = typer.Option(None, help="ridge penalty or 'auto' (default $LEAP_ALPHA or auto)"),
    anchor: str | None = typer.Option(None, help="'champion': correct the champion's RLS state with the "
                                                    "window (default $LEAP_FIT_ANCHOR or none)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Fit a readout on a feedback window, register it and make it the challenger."""
    _run(_flow("fit_flow", since=_timestamp(since, "--since"), until=_timestamp(until, "--until"), alpha=alpha,
               anchor=anchor), as_json, "fit")


@app.command("gate")
def gate_command(
    version: str | None = typer.Option(None, help="version to gate (default: the challenger)"),
    name: str | None = typer.Option(None, help="registered model (default: the latest feedback's)"),
    force: bool = typer.Option(False, help="replay again even if a verdict is recorded"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay one slice with recorded lengths under FCFS, champion and challenger; record the verdict."""
    _run(_flow("gate_flow", version=version, name=name, force=force), as_json, "gate")


@app.command("push")
def push_command(
    version: str | None = typer.Option(None, help="version to push (default: champion, or the "
                                                     "challenger with --promote)"),
    name: str | None = typer.Option(None, help="registered model (default: the latest feedback's)"),
    promote: bool = typer.Option(False, help="make a challenger whose recorded gate passed the champion on "
                                             "every replica and in the registry, all or nothing"),
    canary: int = typer.Option(0, min=0, help="with --promote: serve it on N replicas first and promote or "
                                              "roll them back by their live figures against the rest's"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Push a readout to every serving replica ($LEAP_ENDPOINTS) and verify the version each reports."""
    if canary and not promote:
        raise typer.BadParameter("--canary goes with --promote", param_hint="--canary")
    _run(_flow("push_flow", version=version, name=name, promote=promote, canary=canary), as_json, "push")


@app.command("rollback")
def rollback_command(
    name: str | None = typer.Option(None, help="registered model (default: the latest feedback's)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Make previous-champion the champion again: move the aliases AND push it to every replica, all or
    nothing (the demoted version becomes previous-champion, so one more rollback undoes it)."""
    _run(_flow("rollback_flow", name=name), as_json, "rollback")


@app.command("retrain")
def retrain_command(
    force_gate: bool = typer.Option(False, help="replay the gate even if a verdict is recorded"),
    canary: int = typer.Option(0, min=0, help="promote on N replicas first, judged by their live figures"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Ingest, fit, gate, and push and promote the challenger when it passes."""
    _run(_flow("retrain_flow", force_gate=force_gate, canary=canary), as_json, "retrain")


def _fleet_flow(flow_name: str, /, **kwargs: Any) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        from flows import fleet

        with _prefect_api(_settings()):
            return getattr(fleet, flow_name)(**kwargs)

    return run


@app.command("merge")
def merge_command(
    name: str | None = typer.Option(None, help="registered model (default: the replicas' readout's)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Merge every replica's RLS state into one exact anchored solve over their common anchor, register
    it, make it the champion on every replica that answers, and bring the others to the champion."""
    _run(_fleet_flow("merge_flow", name=name), as_json, "merge")


@app.command("reconcile")
def reconcile_command(
    name: str | None = typer.Option(None, help="registered model (default: the latest feedback's)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Push the champion to every replica ($LEAP_ENDPOINTS) that does not serve it, each push verified."""
    _run(_fleet_flow("reconcile_flow", name=name), as_json, "reconcile")


def _service_names(services: str | None) -> list[str] | None:
    if services is None:
        return None
    return [name.strip() for name in services.split(",") if name.strip()]


@stack_app.command("up")
def stack_up(
    services: str | None = typer.Option(None, help=_SERVICES_HELP),
    wait: bool = typer.Option(True, help="wait until every service answers its health check"),
    timeout: float | None = typer.Option(None, help="seconds to wait per service"),
    fleet: bool = typer.Option(False, "--fleet", help="the fleet: PostgreSQL, S3 (moto), MLflow and Prefect on "
                                                      "them, two Prefect process workers, --replicas replicas"),
    replicas: int | None = typer.Option(None, min=0, help="serving replicas of the fleet (default: the "
                                                               "recorded fleet's, else $LEAP_REPLICAS, 1)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Start MLflow, Prefect and the serving process on loopback (running ones are left alone); with
    --fleet, the fleet, whose variables (`$LEAP_HOME/stack/fleet.env`) every `leap` command then uses."""
    from ops import stack

    def run() -> dict[str, Any]:
        from ops.stack_fleet import read_layout

        settings = _settings()
        recorded = read_layout(settings)
        count = replicas if replicas is not None else recorded.replicas if recorded else settings.replicas
        return stack.up(settings, _service_names(services), wait=wait, timeout_s=timeout,
                        fleet=count if fleet else None)

    _run(run, as_json, "stack", fail_unhealthy=wait)


@stack_app.command("status")
def stack_status(
    services: str | None = typer.Option(None, help=_SERVICES_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Health, URL and pid of each service, and each replica's readout version and live rolling Spearman and
    MAE; exits 1 unless all of them are healthy."""
    from ops import stack

    _run(lambda: stack.status(_settings(), _service_names(services)), as_json, "stack")


@stack_app.command("down")
def stack_down(
    services: str | None = typer.Option(None, help=_SERVICES_HELP),
    grace: float = typer.Option(15.0, help="seconds between SIGTERM and SIGKILL"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Stop the services the stack started and remove their pid files."""
    from ops import stack

    def run() -> dict[str, Any]:
        result = stack.down(_settings(), _service_names(services), grace_s=grace)
        return {"stopped": result["stopped"], "services": result["services"]}

    _run(run, as_json, "stack")


@app.command("deploy")
def deploy_command(
    cron: str = typer.Option("0 * * * *", help="schedule of the retrain flow (cron, server time zone)"),
    name: str = typer.Option("hourly", help="deployment name"),
    serve: bool = typer.Option(True, help="keep running and execute the scheduled runs (Ctrl-C stops); "
                                          "--no-serve only registers the deployment"),
    pool: str | None = typer.Option(None, help="register on this process work pool instead (created if "
                                                  "missing; its workers run the runs, one at a time)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Register the retrain flow with a cron schedule on the stack's Prefect server (PREFECT_API_URL);
    with --pool, on a work pool whose workers execute it, at most one run at a time."""
    api_url = _deployment_api_url()

    def register() -> dict[str, Any]:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.pipeline import retrain_flow

        _require_prefect(api_url)
        if pool is not None:
            from ops.stack_fleet import ensure_pool, register_deployment

            ensure_pool(api_url, pool)
            deployment_id = register_deployment(api_url, retrain_flow, name, pool, cron=cron, concurrency_limit=1)
            return {"status": "registered", "deployment": f"{retrain_flow.name}/{name}", "id": deployment_id,
                    "cron": cron, "api_url": api_url, "pool": pool, "concurrency_limit": 1}
        os.chdir(Path(__file__).resolve().parents[1])  # the deployment's entrypoint is relative to here
        with temporary_settings({PREFECT_API_URL: api_url}):
            deployment = retrain_flow.to_deployment(name=name, cron=cron)
            deployment_id = deployment.apply()
        return {"status": "registered", "deployment": f"{retrain_flow.name}/{name}", "id": str(deployment_id),
                "cron": cron, "api_url": api_url, "entrypoint": deployment.entrypoint}

    _run(register, as_json, "deploy")
    if not serve or pool is not None:
        return
    from flows.pipeline import retrain_flow

    serve_deployment(retrain_flow, name, api_url, cron, cron=cron)
