"""Typer applications shared by the command modules, so each module registers its own commands."""

import typer

app = typer.Typer(help="LEAP: length-aware scheduling for LLM serving.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
model_app = typer.Typer(help="Prepare the serving model.", no_args_is_help=True)
stack_app = typer.Typer(help="Start and stop the local MLflow, Prefect and serving processes.",
                        no_args_is_help=True)
keys_app = typer.Typer(help="Keys that sign champion publications.", no_args_is_help=True)

app.add_typer(model_app, name="model")
app.add_typer(stack_app, name="stack")
app.add_typer(keys_app, name="keys")
