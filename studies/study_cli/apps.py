"""The studies' Typer applications: `leap bench`, `leap eval` and `leap corpus`, plus the top-level study
commands (`leap demo`, `leap replay`, `leap simulate`), added to the product's `leap` by `register`."""

import importlib

import typer

bench_app = typer.Typer(help="Benchmarks that print figures (never pass/fail).", no_args_is_help=True)
corpus_app = typer.Typer(help="Build the length corpus from the serving model.", no_args_is_help=True)
eval_app = typer.Typer(help="Studies that regenerate docs/results.md.", no_args_is_help=True)
# top-level commands of the studies, added to the product's app one by one
commands = typer.Typer()

_COMMAND_MODULES = ("cmd_core", "cmd_core_rls", "cmd_core_sim", "cmd_eval", "cmd_faults", "cmd_gate_bench",
                    "cmd_ingest_growth_bench", "cmd_pipeline_bench", "cmd_engine", "cmd_demo")


def register(app: typer.Typer) -> None:
    """The `leap.commands` entry point: import the command modules and add their commands to `app` (once)."""
    if any(group.typer_instance is eval_app for group in app.registered_groups):
        return
    for name in _COMMAND_MODULES:
        importlib.import_module(f"study_cli.{name}")
    app.add_typer(bench_app, name="bench")
    app.add_typer(corpus_app, name="corpus")
    app.add_typer(eval_app, name="eval")
    app.registered_commands.extend(commands.registered_commands)
