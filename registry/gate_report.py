"""What a gate shows a person: the paired per-request table and the verdict as one short report.

The gate's run (`RunsMixin.log_gate`) carries the verdict and each arm's figures; these add the table of
per-request PTL of the bar and the challenger side by side, a latency CDF of the arms
(`registry.plots.latency_cdf`), and the verdict report (`verdict_report`): a markdown table of the
outcome, ratio, interval, bar, shadow figures and step-model error, with the same figures as tags and
metrics. One renderer feeds the challenger version's MLflow page (`registry.gate_publish`) and the gate
flow's Prefect artifacts (`flows.gate_artifacts`), so both say the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PAIRED_TABLE_FILE = "paired_ptl.json"
CDF_FILE = "ptl_cdf.png"
DESCRIPTION_MARK = "Gate:"
"""The first words of the gate's section of a version's description (always its last section)."""
TAG_PREFIX = "leap.gate."
"""Version tags `leap.gate.<figure>`, so versions sort and filter by their verdict's figures."""
METRIC_PREFIX = "gate."
"""Metrics `gate.<figure>` on the version's logged model."""
NO_OUTCOME = "none"


def paired_table(results: Mapping[str, Mapping[str, Any]], bar: str) -> Any:
    """Per (request, repeat): output tokens, the bar's and the challenger's PTL and their ratio; None when
    the two arms' figures do not pair."""
    import pandas as pd

    if bar not in results or "challenger" not in results:
        return None
    bar_ptl = np.asarray(results[bar].get("ptl", []), dtype=float)
    ch_ptl = np.asarray(results["challenger"].get("ptl", []), dtype=float)
    tokens = np.asarray(results["challenger"].get("output_tokens", []), dtype=float)
    repeats = int(results["challenger"].get("repeats", 1) or 1)
    if bar_ptl.size == 0 or bar_ptl.shape != ch_ptl.shape or tokens.shape != ch_ptl.shape or ch_ptl.size % repeats:
        return None
    n = ch_ptl.size // repeats
    index = np.arange(ch_ptl.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = ch_ptl / bar_ptl
    return pd.DataFrame({"request": index % n, "repeat": index // n, "output_tokens": tokens.astype(int),
                         f"{bar}_ptl": bar_ptl, "challenger_ptl": ch_ptl, "ratio": ratio})


def shadow_metrics(shadow: Mapping[str, Any] | None) -> dict[str, float]:
    """The shadow figures as MLflow metrics: `shadow.<figure>.served|shadow|difference[.ci_low|.ci_high]`,
    `shadow.n` and `shadow.worse` (none when the challenger was not held in shadow)."""
    if not shadow:
        return {}
    metrics = {"shadow.n": float(shadow.get("n", 0)), "shadow.worse": float(bool(shadow.get("shadow_worse")))}
    for figure in ("spearman", "mae", "order_accuracy"):
        values = shadow.get(figure) or {}
        for arm in ("served", "shadow"):
            if arm in values:
                metrics[f"shadow.{figure}.{arm}"] = float(values[arm])
        difference = values.get("difference") or {}
        for key, suffix in (("value", ""), ("ci_low", ".ci_low"), ("ci_high", ".ci_high")):
            if key in difference:
                metrics[f"shadow.{figure}.difference{suffix}"] = float(difference[key])
    return {key: value for key, value in metrics.items() if np.isfinite(value)}




@dataclass(frozen=True)
class VerdictReport:
    """One verdict as a person reads it: a title, (figure, value) rows, and its figures as tags and metrics."""

    title: str
    rows: list[dict[str, str]]
    figures: dict[str, float | str] = field(default_factory=dict)
    shadow: dict[str, float] = field(default_factory=dict)

    def markdown(self, heading: str = "") -> str:
        """The title (after `heading`, e.g. "### ") and the rows as a markdown table."""
        lines = [f"{heading}{self.title}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {_cell(row['figure'])} | {_cell(row['value'])} |" for row in self.rows]
        return "\n".join(lines)

    def summary(self) -> str:
        """The title and, where there is one, the ratio with its interval: one line for a list of verdicts."""
        if "ratio" not in self.figures:
            return self.title
        return (f"{self.title}: mean PTL x{self.figures['ratio']:.3f} of the bar's (interval "
                f"x{self.figures.get('ratio_low', float('nan')):.3f} to x{self.figures.get('ratio_high', float('nan')):.3f})")

    def tags(self) -> dict[str, str]:
        """`leap.gate.<figure>`: numbers with four decimals (ratios under 10 sort as text too), `passed` as
        true or false, words as they are."""
        return {f"{TAG_PREFIX}{key}": value if isinstance(value, str)
                else str(bool(value)).lower() if key == "passed" else f"{value:.4f}"
                for key, value in self.figures.items()}

    def metrics(self) -> dict[str, float]:
        """`gate.<figure>` for every number, and the shadow figures (`shadow_metrics`)."""
        numbers = {f"{METRIC_PREFIX}{key}": float(value) for key, value in self.figures.items()
                   if not isinstance(value, str)}
        return {**numbers, **{f"{METRIC_PREFIX}{key}": value for key, value in self.shadow.items()}}


def verdict_report(verdict: Mapping[str, Any], champion_version: str | None = None,
                   subject: str | None = None) -> VerdictReport:
    """The report of `verdict` (`leap_core.gate_verdict`, with `step_model` and `shadow_evidence` where the
    gate flow adds them); `champion_version` names the bar, `subject` (e.g. "<model> v7") the challenger."""
    outcome = verdict.get("outcome") or NO_OUTCOME
    passed = bool(verdict.get("passed"))
    bar = str(verdict.get("bar", "the bar"))
    against = f"champion v{champion_version}" if bar == "champion" and champion_version else bar
    verdict_word = "passed" if passed else "not passed"
    rows = [] if subject is None else [{"figure": "challenger", "value": subject}]
    rows.append({"figure": "outcome", "value": f"{outcome}, {verdict_word}"
                 + (f" (rule on no difference: {verdict.get('on_no_difference', 'keep')})" if outcome != NO_OUTCOME
                    else f": {verdict.get('reason', 'the gate did not compare')}")})
    rows.append({"figure": "bar", "value": against})
    figures: dict[str, float | str] = {"outcome": outcome, "passed": float(passed), "bar": bar}
    if outcome != NO_OUTCOME:
        level = float(verdict.get("level", 0.95))
        figures.update(ratio=_number(verdict.get("mean_ptl_ratio")), ratio_low=_number(verdict.get("ci_low")),
                       ratio_high=_number(verdict.get("ci_high")),
                       long_p95_ratio=_number(verdict.get("long_p95_ratio")))
        margin = float(verdict.get("margin", 0.0))
        rows += [
            {"figure": "mean PTL ratio", "value": f"x{figures['ratio']:.3f} of the {bar}'s (challenger over bar)"},
            {"figure": f"{level:.0%} interval", "value": f"x{figures['ratio_low']:.3f} to x{figures['ratio_high']:.3f}"
                                                         f" (better: below x1 and the ratio at most x{1 - margin:.3f})"},
            {"figure": "longest-quartile P95 PTL", "value": f"x{figures['long_p95_ratio']:.3f}{_long_interval(verdict)}"},
            {"figure": "replay", "value": f"{verdict.get('n_requests')} requests, each replayed "
                                          f"{verdict.get('repeats')}x a policy on the step clock"},
        ]
    rows += _shadow_rows(verdict, figures)
    rows.append({"figure": "step-model error", "value": _step_model_error(verdict.get("step_model"), figures)})
    title = f"{DESCRIPTION_MARK} {outcome if outcome != NO_OUTCOME else 'no outcome'} against {against}, {verdict_word}"
    finite = {k: v for k, v in figures.items() if isinstance(v, str) or np.isfinite(v)}
    return VerdictReport(title, rows, finite, shadow_metrics(verdict.get("shadow")))


def with_verdict(description: str | None, section: str) -> str:
    """`description` with its gate section (from the first paragraph starting `DESCRIPTION_MARK` to the end)
    replaced by `section`."""
    kept: list[str] = []
    for part in (description or "").split("\n\n"):
        if part.startswith(DESCRIPTION_MARK):
            break
        if part:
            kept.append(part)
    return "\n\n".join([*kept, section])


def _cell(text: str) -> str:
    """A markdown table cell: no line breaks, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _shadow_rows(verdict: Mapping[str, Any], figures: dict[str, float | str]) -> list[dict[str, str]]:
    """Spearman and MAE of the challenger in shadow against the champion's on the same live requests."""
    shadow = verdict.get("shadow")
    if not shadow:
        evidence = verdict.get("shadow_evidence") or {}
        return [{"figure": "shadow", "value": f"not held in shadow ({evidence.get('reason', 'no live figures')})"}]
    rows = [{"figure": "shadow", "value": f"{shadow.get('n')} live requests; "
                                          + (f"worse on {', '.join(shadow.get('worse_on', []))}"
                                             if shadow.get("shadow_worse") else "not worse")}]
    for name, label in (("spearman", "Spearman"), ("mae", "MAE")):
        values = shadow.get(name) or {}
        if "shadow" not in values:
            continue
        difference = values.get("difference") or {}
        figures[name] = _number(values["shadow"])
        figures[f"{name}_difference"] = _number(difference.get("value"))
        rows.append({"figure": f"shadow {label}", "value":
                     f"{figures[name]:.3f} against the champion's {_number(values.get('served')):.3f} (difference "
                     f"{figures[f'{name}_difference']:+.3f}, interval {_number(difference.get('ci_low')):+.3f} to "
                     f"{_number(difference.get('ci_high')):+.3f})"})
    return rows


def _step_model_error(step_model: Mapping[str, Any] | None, figures: dict[str, float | str]) -> str:
    """How far the step clock the replays ran on was from the wall clock: its fit, and over the arms."""
    if not step_model:
        return "not recorded"
    fit, arms = _number(step_model.get("median_abs_rel_error")), _number(step_model.get("arm_error_median"))
    figures["step_model_error"] = arms if np.isfinite(arms) else fit
    parts = [f"{fit:.1%} median per calibration step" if np.isfinite(fit) else "",
             f"{arms:.1%} median per arm against the wall clock" if np.isfinite(arms) else ""]
    return "; ".join(part for part in parts if part) or "not recorded"


def _long_interval(verdict: Mapping[str, Any]) -> str:
    """The long-request guard's interval and bound, where the verdict has them."""
    if "long_p95_ci_low" not in verdict:
        return ""
    return (f" (interval x{_number(verdict['long_p95_ci_low']):.3f} to x{_number(verdict.get('long_p95_ci_high')):.3f};"
            f" worse above x{_number(verdict.get('p95_bound')):.3f})")
