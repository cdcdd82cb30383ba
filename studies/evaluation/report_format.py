"""How the studies' sections of docs/results.md write numbers: one formatter per kind of figure.

Every section quotes figures the same way: "n/a" for a missing or NaN value, "value [low, high]" for a
figure with its interval (the value alone where the interval is missing), markdown tables, and a closing
block with the goals, the plot and the command that regenerates it. Plots draw off-screen (`pyplot`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

SIG = ".3g"
"""Three significant digits: the simulated studies' seconds and ratios, whose scale varies."""


def pyplot():
    """matplotlib.pyplot on the off-screen backend (the reports run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def fmt(value: float | None, spec: str) -> str:
    """`value` in format `spec`; 'n/a' for a missing or NaN value (an empty bucket)."""
    return format(value, spec) if _finite(value) else "n/a"


def corr(value: float | None) -> str:
    """A correlation: three decimals."""
    return fmt(value, ".3f")


def tokens(value: float | None) -> str:
    """Token counts with one decimal (3 significant digits would turn 1234 into 1.23e+03)."""
    return fmt(value, ".1f")


def g(value: float | None) -> str:
    """`value` to three significant digits (`SIG`)."""
    return fmt(value, SIG)


def percent(value: float) -> str:
    """A signed share in percent: 0.012 -> "+1.2%"."""
    return f"{100 * value:+.1f}%"


def interval(figure: Mapping[str, Any] | None, spec: str = ".3f", bound: str | None = None) -> str:
    """A {value, ci_low, ci_high} figure as "value [low, high]" (bounds in `bound`, default `spec`); the
    value alone when the interval is missing or not finite; "n/a" without a value."""
    if not figure or not _finite(figure.get("value")):
        return "n/a"
    value = fmt(figure["value"], spec)
    low, high = figure.get("ci_low"), figure.get("ci_high")
    if not (_finite(low) and _finite(high)):
        return value
    return f"{value} [{fmt(low, bound or spec)}, {fmt(high, bound or spec)}]"


def flat_interval(row: Mapping[str, Any], name: str, spec: str = SIG, bound: str | None = None) -> str:
    """`interval` of a figure saved flat: row[name] with its interval beside it in row[name + "_ci"], either
    [low, high] or {ci_low, ci_high}."""
    ci = row.get(f"{name}_ci")
    low, high = (ci.get("ci_low"), ci.get("ci_high")) if isinstance(ci, Mapping) else ci or (None, None)
    return interval({"value": row.get(name), "ci_low": low, "ci_high": high}, spec, bound)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def finish(text: list[str], result: dict, title: str, image: str) -> str:
    """A section's end: its goals (when given), the figure and the regenerate line."""
    goals = result.get("goals", {})
    if goals:
        text += ["", "Goals:"]
        text += [f"- {name}: target {goal['target']}, measured {g(goal['measured'])}"
                 + (f" [{g(goal['ci'][0])}, {g(goal['ci'][1])}]" if goal.get("ci") else "")
                 + f": {'met' if goal['met'] else 'not met'}." for name, goal in goals.items()]
    text += ["", f"![{title}]({image})"]
    if "command" in result:
        text += ["", f"Regenerate: `{result['command']}`"]
    return "\n".join(text) + "\n"
