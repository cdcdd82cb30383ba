"""`--json` commands print one JSON object on stdout, whatever the libraries they call print."""

from __future__ import annotations

import json

from leap_cli.output import emit, json_stdout


def test_library_prints_go_to_stderr_while_a_json_command_works(capsys) -> None:
    with json_stdout(True):
        print("View run fit-1 at: http://127.0.0.1:5000/#/experiments/1/runs/abc")  # what MLflow prints
        emit({"status": "ok"}, True)
    captured = capsys.readouterr()
    assert [json.loads(line) for line in captured.out.splitlines()] == [{"status": "ok"}]
    assert "View run" in captured.err

    with json_stdout(False):  # people's output is left alone
        print("a table")
    assert capsys.readouterr().out == "a table\n"
