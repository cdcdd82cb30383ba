"""The fleet's variables for every `leap` command: `$LEAP_HOME/stack/fleet.env`, applied while the fleet runs.

`leap stack up --fleet` records the fleet's layout and writes the variables its flows need
(`ops.stack_fleet`); the `leap` command applies them at every start, before it knows which command
runs. So this module reads the state folder from the settings (`leap_io.settings`), two files and one pid
file, and imports nothing else: not the flows, not an HTTP client.
"""

from __future__ import annotations

import os
from pathlib import Path

from leap_io.pidfiles import service_pid
from leap_io.settings import STACK_FOLDER, LeapSettings

LAYOUT_FILE = "fleet.json"
ENV_FILE = "fleet.env"


def read_environment(env_file: Path) -> dict[str, str]:
    """The variables of a `fleet.env` file (empty when there is none); lines that are not KEY=VALUE are skipped."""
    try:
        text = Path(env_file).read_text()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs if key.strip()}


def apply_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """While the fleet of `$LEAP_HOME` runs, set its variables where `environ` (default os.environ) has
    none; returns what was set. A stopped or absent fleet changes nothing."""
    environ = os.environ if environ is None else environ
    stack_dir = LeapSettings.from_environ(environ).home / STACK_FOLDER
    if not (stack_dir / LAYOUT_FILE).exists() or service_pid(stack_dir, "postgres") is None:
        return {}
    applied = {key: value for key, value in read_environment(stack_dir / ENV_FILE).items() if key not in environ}
    environ.update(applied)
    return applied
