"""What a gate run shows a person in MLflow: the paired per-request table and the verdict in words.

The gate's run (`RunsMixin.log_gate`) carries the verdict and each arm's figures; these add the table of
per-request PTL of the bar and the challenger side by side (each request of each repeat, with their
ratio), a latency CDF of the arms (`registry.plots.latency_cdf`), and one paragraph for the challenger
version's description, so the model-version page states the outcome and its interval (and, where the
challenger was held in shadow on live traffic, its paired figures there: `shadow_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

PAIRED_TABLE_FILE = "paired_ptl.json"
CDF_FILE = "ptl_cdf.png"
DESCRIPTION_MARK = "Gate:"


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


def verdict_paragraph(verdict: Mapping[str, Any], champion_version: str | None) -> str | None:
    """The verdict in one paragraph (None for a verdict without an outcome: it failed before comparing)."""
    outcome = verdict.get("outcome")
    if not outcome:
        return None
    bar = verdict.get("bar", "the bar")
    against = f"champion v{champion_version}" if bar == "champion" and champion_version else str(bar)
    level = float(verdict.get("level", 0.95))
    return (f"{DESCRIPTION_MARK} {outcome} against {against}. Mean PTL x{verdict['mean_ptl_ratio']:.3f} of "
            f"{bar}'s ({level:.0%} interval x{verdict['ci_low']:.3f} to x{verdict['ci_high']:.3f}; "
            f"{verdict.get('n_requests')} requests, each replayed {verdict.get('repeats')}x a policy on the step "
            f"clock); "
            f"longest-quartile P95 PTL x{verdict['long_p95_ratio']:.3f}{_long_interval(verdict)}. "
            f"{_shadow_sentence(verdict.get('shadow'))}"
            f"{'Passed' if verdict.get('passed') else 'Not passed'} under the rule "
            f"'{verdict.get('on_no_difference', 'keep')}' on no difference.")


def _long_interval(verdict: Mapping[str, Any]) -> str:
    """The long-request guard's interval and bound, where the verdict has them."""
    if "long_p95_ci_low" not in verdict:
        return ""
    return (f" (interval x{verdict['long_p95_ci_low']:.3f} to x{verdict['long_p95_ci_high']:.3f}; worse above "
            f"x{verdict.get('p95_bound', float('nan')):.3f})")


def _shadow_sentence(shadow: Mapping[str, Any] | None) -> str:
    """What the challenger did in shadow on live traffic, or nothing when it was not held there."""
    if not shadow:
        return ""
    spearman = shadow.get("spearman", {})
    difference = spearman.get("difference", {})
    return (f"In shadow on {shadow.get('n')} live requests: Spearman {spearman.get('shadow', float('nan')):.3f} "
            f"against the champion's {spearman.get('served', float('nan')):.3f} (difference "
            f"{difference.get('value', float('nan')):+.3f}, interval {difference.get('ci_low', float('nan')):+.3f} "
            f"to {difference.get('ci_high', float('nan')):+.3f}); "
            + (f"worse on {', '.join(shadow.get('worse_on', []))}. " if shadow.get("shadow_worse") else "not worse. "))


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


def with_verdict(description: str | None, paragraph: str) -> str:
    """`description` with its gate paragraph (if any) replaced by `paragraph`."""
    kept = [part for part in (description or "").split("\n\n") if part and not part.startswith(DESCRIPTION_MARK)]
    return "\n\n".join([*kept, paragraph])
