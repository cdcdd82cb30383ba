"""`leap keys generate`: the Ed25519 key pair that signs champion publications (`leap_io.signing`)."""

from __future__ import annotations

from pathlib import Path

import typer

from leap_cli.apps import keys_app
from leap_cli.output import emit


@keys_app.command("generate")
def generate_command(
    out: Path = typer.Option(..., "--out", help="folder for <name>.key (private, mode 0600) and <name>.pub"),
    name: str = typer.Option("champion", help="file name of the pair"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Make a signing key pair. The promotion flow signs with the private key (LEAP_CHAMPION_SIGNING_KEY);
    replicas given the public key (LEAP_CHAMPION_PUBLIC_KEY) serve only publications it verifies."""
    from leap_io.signing import PUBLIC_KEY_ENV, SIGNING_KEY_ENV, generate_key_pair

    try:
        paths = generate_key_pair(out, name)
    except FileExistsError as exc:
        emit({"status": "failed", "error": str(exc)}, as_json, "keys")
        raise typer.Exit(1) from exc
    emit({"status": "ok", **paths, "publisher_env": SIGNING_KEY_ENV, "replica_env": PUBLIC_KEY_ENV}, as_json, "keys")
