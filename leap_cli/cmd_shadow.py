"""`leap shadow on|off`: hold a registered version in shadow on every replica, and let it go."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from leap_cli.apps import app
from leap_cli.output import emit


@app.command("shadow")
def shadow_command(
    state: Annotated[Literal["on", "off"], typer.Argument(help="on: hold --version in shadow; off: let it go")],
    version: Annotated[str | None, typer.Option(help="the registered version to hold (on)")] = None,
    name: Annotated[str | None, typer.Option(help="registered model (default: the latest feedback's)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Hold a challenger in shadow on every replica (LEAP_ENDPOINTS): each predicts every request from the
    same captured vector and its feedback rows carry both predictions; it never schedules. Exits 1 when a
    replica did not follow."""
    from flows.pipeline import model_name_for
    from flows.settings import PipelineSettings
    from flows.shadow import hold_fleet

    if state == "on" and not version:
        raise typer.BadParameter("--version is required with 'on'", param_hint="--version")
    settings = PipelineSettings()
    report = hold_fleet(model_name_for(settings, name), version if state == "on" else None, settings)
    emit(report, as_json, title="shadow")
    if report["failed"]:
        raise typer.Exit(1)
