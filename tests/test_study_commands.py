"""The study commands reach `leap` through the `leap.commands` entry point, once."""

import typer

from study_cli.apps import register


def _names(app: typer.Typer) -> list[str]:
    return sorted([group.name for group in app.registered_groups]
                  + [command.name or command.callback.__name__ for command in app.registered_commands])


def test_the_installed_entry_point_adds_every_study_command_once() -> None:
    from leap_cli.main import app

    before = _names(app)
    for study in ("bench", "corpus", "eval", "demo", "replay", "simulate"):
        assert before.count(study) == 1
    register(app)  # as `python -m study_cli` does where the entry point already ran
    assert _names(app) == before


def test_register_adds_exactly_the_study_commands_to_an_app() -> None:
    fresh = typer.Typer()
    register(fresh)
    assert _names(fresh) == ["bench", "corpus", "demo", "eval", "replay", "simulate"]
