"""Entry point of the `leap` console command; importing a module registers its commands, and each installed
`leap.commands` entry point (the studies: `leap eval`, `leap bench`, ...) adds its own."""

import importlib
import os
from importlib.metadata import entry_points

from leap_cli.apps import app


@app.callback()
def _before_every_command() -> None:
    """Run when a command runs, not when this module is imported: machine-facing commands print JSON on
    stdout, so engine and server logs go to stderr; and while `leap stack up --fleet` runs in $LEAP_HOME, its
    store, bucket, replicas and servers are the defaults of every command (variables already set win)."""
    from ops.fleet_env import apply_environment

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    apply_environment()

_COMMAND_MODULES = (
    "leap_cli.cmd_serving",
    "leap_cli.cmd_pipeline",
    "leap_cli.cmd_watch",
    "leap_cli.cmd_keys",
    "leap_cli.cmd_s3",
    "leap_cli.cmd_fcfs",
    "leap_cli.cmd_shadow",
)

for _name in _COMMAND_MODULES:
    importlib.import_module(_name)

for _entry in entry_points(group="leap.commands"):
    _entry.load()(app)

if __name__ == "__main__":
    app()
