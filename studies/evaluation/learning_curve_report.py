"""The learning-curve section of docs/results.md (`leap eval curve --save`) and its plot."""

from __future__ import annotations

import math
import pathlib

from evaluation.report_format import interval, pyplot

ROWS_SHOWN = 10_000_000  # beyond this an extrapolated row count says only that it is beyond


def _rows(value: float) -> str:
    if not math.isfinite(value):
        return "never (slope <= 0)"
    return f"more than {ROWS_SHOWN:,}" if value > ROWS_SHOWN else f"{value:,.0f}"


def plot_learning_curve(result: dict, path: pathlib.Path) -> None:
    """Spearman against training rows (log scale) per target, with the intervals as bands."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for target, figures in result["targets"].items():
        rows = [p["rows"] for p in figures["points"]]
        value = [p["spearman"]["value"] for p in figures["points"]]
        ax.plot(rows, value, marker="o", label=f"{target} target")
        ax.fill_between(rows, [p["spearman"]["ci_low"] for p in figures["points"]],
                        [p["spearman"]["ci_high"] for p in figures["points"]], alpha=0.2)
    ax.axhline(result["goal"], color="tab:gray", linestyle="--", linewidth=1, label=f"goal {result['goal']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ShareGPT training rows")
    ax.set_ylabel(f"Spearman on {result['n_test']} held-out prompts")
    ax.set_title("Learning curve of the readout (95% intervals: test prompts and training draws)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_learning_curve(result: dict, image: str) -> str:
    title = "Learning curve"
    targets = list(result["targets"])
    lines = [
        f"## {title}",
        "",
        f"The readout (layer {result['layer']}, alpha by 5-fold CV on its own training rows, as the fit flow "
        f"fits it) trained on growing subsamples of a pool of {result['n_pool']:,} ShareGPT rows "
        f"({result['pool']}), {result['draws']} seeded draws per size (the whole pool once), scored on "
        f"{result['n_test']} held-out prompts ({result['test']}). Intervals: {result['n_boot']} replicates, "
        "each resampling the test prompts and picking one training draw per size, so they carry both the "
        "prompts' and the training rows' variance; the draw spread is the lowest and highest draw's Spearman.",
        "",
        "| training rows | " + " | ".join(f"{t} Spearman [95%] | {t} draw spread" for t in targets) + " |",
        "|---:|" + "---|---|" * len(targets),
    ]
    for i, size in enumerate(result["sizes"]):
        cells = []
        for target in targets:
            point = result["targets"][target]["points"][i]
            low, high = point["draw_spread"]
            cells += [interval(point["spearman"]), f"{low:.3f} to {high:.3f}" if point["draws"] > 1 else "one fit"]
        lines.append(f"| {size:,} | " + " | ".join(cells) + " |")
    lines.append("")
    for target in targets:
        figures = result["targets"][target]
        slope, reach = figures.get("slope_per_doubling"), figures.get("rows_for_goal")
        if slope is None:
            continue
        text = (f"{target}: {slope['value']:+.3f} [{slope['ci_low']:+.3f}, {slope['ci_high']:+.3f}] Spearman per "
                f"doubling of the rows (least squares over {', '.join(f'{r:,}' for r in slope['over_rows'])})")
        if reach is not None:
            text += (f"; a straight line in log2(rows) reaches {reach['goal']} at {_rows(reach['value'])} rows "
                     f"[{_rows(reach['ci_low'])}, {_rows(reach['ci_high'])}] (an extrapolation from "
                     f"{reach['extrapolated_from']:,})")
        lines.append(f"- {text}.")
    lines += ["", f"![{title}]({image})"]
    if "command" in result:
        lines += ["", f"Regenerate: `{result['command']}`"]
    return "\n".join(lines) + "\n"
