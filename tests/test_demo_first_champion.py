"""What serves before the demo's first fit: FCFS by default, capturing the candidate recipes it can."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner


def test_a_first_deployment_captures_the_candidate_recipes_only_where_the_model_has_their_layers():
    from experiments.demo import DEMO_RECIPES, capture_candidates

    assert capture_candidates(SimpleNamespace(num_layers=30)) == DEMO_RECIPES
    assert capture_candidates(SimpleNamespace(num_layers=22)) is None  # last@22 reads a layer it lacks
    assert capture_candidates(SimpleNamespace(num_layers=23), ("last@22",)) == ("last@22",)


@pytest.mark.parametrize("value", ["fcfs", "", "Snapshot"])
def test_an_unknown_first_champion_is_refused_before_anything_starts(value, tmp_path, monkeypatch):
    from leap_cli.main import app

    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    outcome = CliRunner().invoke(app, ["demo", "--first-champion", value, "--json"])
    assert outcome.exit_code == 2
    assert "--first-champion" in outcome.output
    assert not any(tmp_path.iterdir())  # nothing prepared, nothing served


def test_run_demo_refuses_an_unknown_first_champion_too():
    from experiments.demo import run_demo

    with pytest.raises(ValueError, match="first_champion"):
        run_demo(first_champion="small")


def test_the_cli_offers_exactly_the_first_champions_the_demo_runs():
    import typing

    from experiments.demo import FIRST_CHAMPIONS
    from study_cli.cmd_demo import demo_command

    offered = typing.get_args(typing.get_type_hints(demo_command)["first_champion"])
    assert offered == FIRST_CHAMPIONS
