"""Printing results: one JSON object on stdout for machines, a rich table for people."""

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from leap_io.jsonable import to_jsonable

console = Console(stderr=True)

_clean = to_jsonable
"""Results as strict JSON values (NaN and infinities become null): `leap_io.jsonable.to_jsonable`."""


def emit(result: dict[str, Any], as_json: bool, title: str = "") -> None:
    """Print `result` as one JSON line (`--json`) or as a two-column table."""
    if as_json:
        print(json.dumps(_clean(result)), flush=True)
        return
    table = Table(title=title or None, show_header=False)
    for key, value in result.items():
        table.add_row(str(key), json.dumps(_clean(value)) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)
