"""Typer applications shared by the command modules, so each module registers its own commands."""

import typer

app = typer.Typer(help="LEAP: length-aware scheduling for LLM serving.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)
bench_app = typer.Typer(help="Benchmarks that print figures (never pass/fail).", no_args_is_help=True)
model_app = typer.Typer(help="Prepare the serving model.", no_args_is_help=True)
corpus_app = typer.Typer(help="Build the length corpus from the serving model.", no_args_is_help=True)
eval_app = typer.Typer(help="Studies that regenerate docs/results.md.", no_args_is_help=True)
stack_app = typer.Typer(help="Start and stop the local MLflow, Prefect and serving processes.",
                        no_args_is_help=True)
keys_app = typer.Typer(help="Keys that sign champion publications.", no_args_is_help=True)

app.add_typer(bench_app, name="bench")
app.add_typer(model_app, name="model")
app.add_typer(corpus_app, name="corpus")
app.add_typer(eval_app, name="eval")
app.add_typer(stack_app, name="stack")
app.add_typer(keys_app, name="keys")
