"""`leap s3 policies`: the IAM policy documents of the fleet's S3 principals (`ops.s3_access`)."""

from __future__ import annotations

from pathlib import Path

import typer

from leap_cli.apps import app
from leap_cli.output import emit

s3_app = typer.Typer(help="Least-privilege S3 access of the replicas and the workers.", no_args_is_help=True)
app.add_typer(s3_app, name="s3")


@s3_app.command("policies")
def policies_command(
    feedback_url: str = typer.Option(..., "--feedback-url", help="s3://bucket/prefix the replicas ship under "
                                     "(LEAP_FEEDBACK_URL)"),
    champion_url: str = typer.Option(..., "--champion-url", help="s3://bucket/prefix of the champion publication "
                                     "(LEAP_CHAMPION_URL)"),
    replicas: list[str] = typer.Option(..., "--replica", help="a replica id (LEAP_REPLICA_ID); repeat per replica"),
    artifacts_url: str | None = typer.Option(None, "--artifacts-url", help="s3://bucket[/prefix] of MLflow's "
                                             "artifacts (its --artifacts-destination): adds the `mlflow` principal"),
    out: Path | None = typer.Option(None, "--out", help="folder for one <principal>.json per principal (mode 0600)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Print the policy of each replica (`replica-<id>`: write its own feedback folder, read the champion),
    of the workers (`worker`: list, read and delete segments, publish the champion) and, with
    --artifacts-url, of MLflow (`mlflow`: its artifacts only); with --out also write them, one file per
    principal, for `mc admin policy create` or IAM."""
    from leap_io.durable import write_text_durably
    from ops.s3_access import fleet_policies, policy_file_name, render

    try:
        policies = fleet_policies(feedback_url, champion_url, replicas, artifacts_url)
    except ValueError as exc:
        emit({"status": "failed", "error": str(exc)}, as_json, "s3 policies")
        raise typer.Exit(1) from exc
    files: dict[str, str] = {}
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            for principal, policy in policies.items():
                path = out / policy_file_name(principal)
                write_text_durably(path, render(policy), mode=0o600)  # 0600 from the file's first byte
                files[principal] = str(path)
        except OSError as exc:
            emit({"status": "failed", "error": f"writing {out}: {exc}", "files": files}, as_json, "s3 policies")
            raise typer.Exit(1) from exc
    emit({"status": "ok", "policies": policies, "files": files}, as_json, "s3 policies")
