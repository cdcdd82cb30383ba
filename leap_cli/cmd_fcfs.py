"""`leap fcfs on|off`: the kill switch, every replica to first-come-first-served at once, and back."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from leap_cli.apps import app
from leap_cli.output import emit


@app.command("fcfs")
def fcfs_command(
    state: Annotated[Literal["on", "off"], typer.Argument(help="on: every replica decodes FCFS; off: by its policy")],
    reason: Annotated[str, typer.Option(help="why (recorded in the registry's history and on /leap/health)")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Switch every replica (LEAP_ENDPOINTS) to FCFS or back; exits 1 when a replica was not switched."""
    from flows.kill_switch import switch_fleet

    report = switch_fleet(state == "on", reason)
    emit(report, as_json, title="kill switch")
    if report["failed"]:
        raise typer.Exit(1)
