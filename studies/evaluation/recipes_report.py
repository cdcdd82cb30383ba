"""The recipe study's section of docs/results.md: accuracy per set, cost, bytes per row, the choice, RLS."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from evaluation.report_format import corr, fmt, interval, pyplot, tokens


def plot_recipes(result: dict, path: Path) -> None:
    """Held-out ShareGPT and pooled Spearman per recipe, with intervals."""
    plt = pyplot()
    names = list(result["recipes"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    y = np.arange(len(names))
    for offset, key, label in ((-0.18, "sharegpt", "ShareGPT (held out)"), (0.18, "pooled", "all held-out sets")):
        figs = [result["recipes"][n]["spearman"].get(key) or {} for n in names]
        values = np.array([f.get("value") if f.get("value") is not None else np.nan for f in figs], dtype=float)
        low = np.array([f.get("ci_low") if f.get("ci_low") is not None else np.nan for f in figs], dtype=float)
        high = np.array([f.get("ci_high") if f.get("ci_high") is not None else np.nan for f in figs], dtype=float)
        ax.errorbar(values, y + offset, xerr=[values - low, high - values], fmt="o", capsize=3, label=label)
    ax.set_yticks(y, [f"{n}{'  (chosen)' if n == result['chosen'] else ''}" for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("held-out Spearman (95% bootstrap interval)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _target_choice(result: dict) -> str:
    return f" with the `{result['chosen_target']}` target" if result.get("chosen_target") else ""


def _choice_sentence(result: dict) -> str:
    """How the choice was made and the noise it was made in (studies saved before the rule carry none)."""
    choice = result.get("choice")
    if not choice:
        return " The rule then: the highest validation Spearman."
    return (f" The rule: {choice['rule']}. The chosen pair's validation Spearman {corr(choice['spearman'])} trails "
            f"the best ({corr(choice['best_spearman'])}) by {choice['gap']:.3f} [{choice['gap_ci_low']:.3f}, "
            f"{choice['gap_ci_high']:.3f}] (standard error {choice['gap_se']:.3f}).")


def _target_lines(result: dict) -> list[str]:
    """Per recipe and regression target: the validation Spearman and the held-out Spearman on ShareGPT
    (greedy and sampled labels) with intervals, and the paired difference from the sqrt target."""
    by_target = result.get("targets") or {}
    if not by_target:
        return []
    sets = result.get("target_sets", [])
    lines = ["", "Regression targets, validated with each recipe (the fit flow chooses the pair): validation "
             "Spearman, held-out Spearman and its paired difference from the same recipe's sqrt target:", "",
             "| Recipe | target | validation Spearman | " + " | ".join(f"{s} Spearman" for s in sets) + " | "
             + " | ".join(f"{s} minus sqrt" for s in sets) + " |", "|---|---|---|" + "---|" * (2 * len(sets))]
    for name, per in by_target.items():
        for target, fig in per.items():
            chosen = name == result["chosen"] and target == result.get("chosen_target")
            lines.append(f"| `{name}`{' (chosen)' if chosen else ''} | {target} | {corr(fig['validation_spearman'])} | "
                         + " | ".join(interval(fig["spearman"].get(s), bound=".2f") for s in sets) + " | "
                         + " | ".join(interval(fig["spearman_vs_sqrt"].get(s), "+.3f", "+.3f") for s in sets) + " |")
    return lines


def section_recipes(result: dict, image: str) -> str:
    recipes = result["recipes"]
    sets = [s for s in result["sets_held_out"]]
    lines = [
        "## Feature recipes",
        "",
        f"`leap eval recipes{' --quick' if result.get('quick') else ''}` compares {len(recipes)} recipes read from "
        f"one prefill by serving's own capture (corpus recipe `{result['wide_recipe']}`, plus prompt length, "
        f"decoding settings and domain columns). Every recipe is fitted on the chat training window "
        f"({result['n_train']} rows, greedy and sampled labels) with the penalty its validation chose, and "
        f"scored on held-out rows per set. The fit flow's choice, by {result['validation_split']}: "
        f"**`{result['chosen']}`**{_target_choice(result)} (today's recipe: `{result['default']}`)."
        + _choice_sentence(result),
        "",
        "| Recipe | dim | bytes / feedback row | cost ms / request (capture + predict) | validation Spearman | "
        "ShareGPT Spearman | pooled Spearman | pooled MAE (uncensored) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, fig in recipes.items():
        cost = fig.get("cost_ms")
        mark = " (chosen)" if name == result["chosen"] else " (today)" if name == result["default"] else ""
        lines.append(f"| `{name}`{mark} | {fig['dim']} | {fig['bytes_per_row']:,} | "
                     f"{fmt(cost, '.3f') if cost is not None else 'not measured'} | "
                     f"{corr(fig['validation_spearman'])} | {interval(fig['spearman'].get('sharegpt'), bound='.2f')} | "
                     f"{interval(fig['spearman'].get('pooled'), bound='.2f')} | "
                     f"{interval(fig['mae'].get('pooled'), '.1f', '.0f')} |")
    lines += ["", f"![recipes]({image})", "", "Held-out Spearman per set (n rows):", "",
              "| Recipe | " + " | ".join(f"{s} ({result['n_held_out'].get(s, '?')})" for s in sets) + " |",
              "|---|" + "---|" * len(sets)]
    for name, fig in recipes.items():
        lines.append(f"| `{name}` | " + " | ".join(corr((fig["spearman"].get(s) or {}).get("value"))
                                                   for s in sets) + " |")
    base = result.get("baselines") or {}
    if base:
        lines += ["", "Baselines on the same held-out rows (fitted on the window's greedy rows), Spearman per set:",
                  "", "| Baseline | " + " | ".join([*sets, "pooled"]) + " |", "|---|" + "---|" * (len(sets) + 1)]
        for name, fig in base.items():
            lines.append(f"| {name} | " + " | ".join(interval(fig["spearman"].get(s), bound=".2f")
                                                   for s in [*sets, "pooled"]) + " |")
        lines += ["", "Where a baseline ranks better than a recipe (point estimates, per held-out set):", ""]
        for recipe, fig_recipe in recipes.items():
            mine = fig_recipe["spearman"]
            behind = [f"{name} on {s}" for name, fig in base.items() for s in [*sets, "pooled"]
                      if (fig["spearman"].get(s) or {}).get("value") is not None
                      and (mine.get(s) or {}).get("value") is not None
                      and fig["spearman"][s]["value"] > mine[s]["value"]]
            lines.append(f"- `{recipe}`: " + (", ".join(behind) if behind else "none") + ".")
    gain = recipes[result["chosen"]].get("spearman_vs_default")
    if gain and result["chosen"] != result["default"]:
        lines += ["", f"Held-out Spearman of the chosen `{result['chosen']}` minus today's `{result['default']}` on "
                  "the same rows (paired bootstrap interval):", "",
                  "| " + " | ".join([*sets, "pooled"]) + " |", "|" + "---|" * (len(sets) + 1),
                  "| " + " | ".join(interval(gain.get(s), "+.3f", "+.2f") for s in [*sets, "pooled"]) + " |"]
    lines += _target_lines(result)
    rls = result.get("rls") or {}
    if rls:
        domains = sorted({d for per in rls.values() for d in per})
        lines += ["", "Anchored RLS on one mixed feedback stream (half of each other domain's held-out rows, "
                  "interleaved), scored per domain on the other half: within-domain Spearman, frozen -> "
                  "corrected, and MAE in tokens:", "",
                  "| Recipe | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
        for name, per in rls.items():
            cells = []
            for d in domains:
                f = per.get(d)
                cells.append("n/a" if f is None else
                             f"{corr(f['frozen']['spearman'])} -> {corr(f['rls']['spearman'])}; "
                             f"MAE {tokens(f['frozen']['mae'])} -> {tokens(f['rls']['mae'])}")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    from evaluation.recipes import recorded_costs

    bench = recorded_costs()
    if bench.get("recipes"):
        lines += ["", f"Engine cost (`leap bench recipes`: {bench['requests']} requests x {bench['tokens']} fixed tokens, "
                  f"{bench['slots']} slots, one compiled engine per recipe, {bench['repeats']} rounds in rotating "
                  f"order; throughput is each round's ratio to `{bench['reference']}`, median and range):", "",
                  "| Recipe | throughput / last-token | generated tok/s | capture ms / request | ready before first decode |",
                  "|---|---|---|---|---|"]
        for name, row in bench["recipes"].items():
            ratio = row["throughput_vs_last"]
            lines.append(f"| `{name}` | {interval(ratio, '.3f', '.2f')} (n = {ratio['n']}) | "
                         f"{fmt(row['tokens_per_s'], '.0f')} | "
                         f"{fmt(row['capture_ms_per_request'], '.3f')} | {fmt(row['ready_before_decode'], '.1%')} |")
    lines += ["", f"Costs: {result.get('cost_source')}. Bytes per row: the float32 feature vector a feedback row "
              f"stores for that recipe. Brackets: 95% bootstrap intervals over the held-out rows "
              f"({result['bootstrap']['n_boot']} resamples); outputs that reached M tie at M."]
    return "\n".join(lines)
