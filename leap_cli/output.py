"""Printing results: one JSON object on stdout for machines, a rich table for people."""

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

from leap_io.jsonable import to_jsonable

console = Console(stderr=True)

_clean = to_jsonable
"""Results as strict JSON values (NaN and infinities become null): `leap_io.jsonable.to_jsonable`."""


_json_streams: list = []  # where `emit` writes while `json_stdout` sends library prints to stderr


@contextlib.contextmanager
def json_stdout(as_json: bool) -> Iterator[None]:
    """While a `--json` command works, what libraries print on stdout (MLflow prints a link per run logged to
    a tracking server) goes to stderr, so stdout carries the one JSON object `emit` writes."""
    if not as_json:
        yield
        return
    _json_streams.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_streams.pop()


def emit(result: dict[str, Any], as_json: bool, title: str = "") -> None:
    """Print `result` as one JSON line (`--json`) or as a two-column table."""
    if as_json:
        print(json.dumps(_clean(result)), file=_json_streams[-1] if _json_streams else sys.stdout, flush=True)
        return
    table = Table(title=title or None, show_header=False)
    for key, value in result.items():
        table.add_row(str(key), json.dumps(_clean(value)) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)
