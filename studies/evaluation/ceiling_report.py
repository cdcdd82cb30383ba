"""The label-ceiling section of docs/results.md (`leap eval ceiling --save`) and its plot."""

from __future__ import annotations

import pathlib

from evaluation.report_format import interval, pyplot

ROWS = (  # (label on the page, where the figure sits in the result)
    ("two greedy runs (batch composition changed)", ("greedy_rerun_spearman",)),
    ("ceiling against one greedy run, sqrt of the above", ("ceiling", "greedy")),
    ("readout against the corpus' greedy run", ("readout", "against_greedy")),
    ("readout against the greedy rerun", ("readout", "against_rerun")),
    ("two sampled draws (mean over pairs)", ("sampled_pair_spearman",)),
    ("ceiling against one sampled draw, sqrt of the above", ("ceiling", "sampled")),
    ("readout against one sampled draw (mean over draws)", ("readout", "against_one_sample")),
    ("readout against the median of the draws", ("readout", "against_sample_median")),
)


def _figure(result: dict, path: tuple[str, ...]) -> dict | None:
    node = result
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) and "value" in node else None


def plot_ceiling(result: dict, path: pathlib.Path) -> None:
    """Horizontal bars with their intervals: the agreement between runs, the ceilings, the readout."""
    plt = pyplot()
    rows = [(label, f) for label, where in ROWS if (f := _figure(result, where)) is not None]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    y = list(range(len(rows)))[::-1]
    values = [f["value"] for _, f in rows]
    errors = [[f["value"] - f["ci_low"] for _, f in rows], [f["ci_high"] - f["value"] for _, f in rows]]
    colors = ["tab:gray" if "ceiling" in label else "tab:orange" if label.startswith("readout") else "tab:blue"
              for label, _ in rows]
    ax.barh(y, values, xerr=errors, color=colors, capsize=3)
    ax.set_yticks(y, [label for label, _ in rows], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"Spearman on {result['n']} held-out ShareGPT prompts (95% bootstrap interval)")
    ax.set_title("How well one run's length can be ranked")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_ceiling(result: dict, image: str) -> str:
    title = "The label ceiling"
    rerun = result["greedy_rerun"]
    lines = [
        f"## {title}",
        "",
        f"{result['n']} held-out ShareGPT prompts ({result['pool']}) generated again. Greedy: the corpus' length "
        f"against a second greedy run in another batch composition ({result['greedy_runs']['rerun']}); "
        f"{rerun['exact_share']:.0%} reproduce the exact length, median relative difference "
        f"{rerun['median_relative_difference']:.1%}, P90 {rerun['p90_relative_difference']:.1%}. Sampled: "
        f"{result['samples']} draws per prompt at temperature {result['sampled_decoding'].get('temperature')}, "
        f"top_p {result['sampled_decoding'].get('top_p')}, the Spearman averaged over the {result['pairs']} "
        f"pairs of draws. If a run's length is a function of the prompt plus independent noise, two runs "
        f"correlate as r and the best possible predictor reaches sqrt(r) against one run (exact for Pearson, "
        f"approximate on ranks): the ceiling rows. The readout is the serving one "
        f"(layer {result['readout_recipe']['layer']}, {result['readout_recipe']['target']} target, fitted on "
        f"{result['readout_recipe']['n_train']} rows of {result['readout_recipe']['train']}); every interval "
        f"resamples the same prompts ({result['n_boot']} replicates).",
        "",
        "| Figure | Spearman [95% interval] |",
        "|---|---|",
    ]
    for label, where in ROWS:
        figure = _figure(result, where)
        if figure is not None:
            lines.append(f"| {label} | {interval(figure)} |")
    capped = result["capped_share"]
    lines += ["", f"Share of outputs at M = {result['max_tokens']}: greedy {capped['greedy']:.1%}, sampled draws "
                  f"{capped['sampled']:.1%} (ties at M share one rank).", "", f"![{title}]({image})"]
    if "command" in result:
        lines += ["", f"Regenerate: `{result['command']}`"]
    return "\n".join(lines) + "\n"
