"""Printing results: one JSON object on stdout for machines, a rich table for people."""

import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return _clean(value.item())
    return value


def emit(result: dict[str, Any], as_json: bool, title: str = "") -> None:
    """Print `result` as one JSON line (`--json`) or as a two-column table."""
    if as_json:
        print(json.dumps(_clean(result)), flush=True)
        return
    table = Table(title=title or None, show_header=False)
    for key, value in result.items():
        table.add_row(str(key), json.dumps(_clean(value)) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)
