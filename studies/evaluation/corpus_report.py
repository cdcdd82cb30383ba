"""The length corpus itself: how long the serving model's answers are per prompt set, and how often the
output budget cuts them (the budget M is chosen so that at most 10% of chat outputs reach it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from evaluation.corpora import load_or_build
from evaluation.selections import DOMAINS, select
from leap_core.intervals import bounds, mean_ci
from study_harness.corpus import length_report
from study_harness.snapshot import SELECTION

CHAT_BUDGET_GOAL = 0.10
STUDY_SELECTIONS = (SELECTION,)  # the committed snapshot's prompts: every study reads a subset of them


def corpus_study(specs: Sequence[str], max_tokens: int = 1024, model: str | None = None, say=print,
                 build: bool = True) -> dict:
    """Per-set length distribution of the given selections (built where the cache lacks them)."""
    prompts: list[dict] = []
    for spec in specs:  # one corpus over every selection, so a set named by two of them is counted once
        prompts.extend(select(spec, exclude={p["id"] for p in prompts}))
    corpus = load_or_build([prompts], max_tokens, model, say=say, build=build)[0]
    per_set = length_report(corpus)
    chat_capped, chat_n = 0.0, 0
    for name, row in per_set.items():
        if name in DOMAINS["chat"]:
            chat_capped += row["capped_fraction"] * row["n"]
            chat_n += row["n"]
        lengths = corpus.output_tokens[corpus.sets == name]
        capped = (corpus.finish_reasons[corpus.sets == name] == "length").astype(np.float64)
        row["mean_ci"] = bounds(mean_ci(lengths.astype(np.float64)))
        row["capped_fraction_ci"] = bounds(mean_ci(capped))
        row["histogram"] = np.histogram(lengths, bins=16, range=(0, max_tokens))[0].tolist()
    capped = chat_capped / chat_n if chat_n else float("nan")
    return {"selections": list(specs), "max_tokens": max_tokens, "n": int(sum(r["n"] for r in per_set.values())),
            "per_set": per_set, "chat_capped_fraction": capped,
            "goals": {"chat_capped_fraction": {"target": f"<= {CHAT_BUDGET_GOAL}", "measured": capped,
                                               "met": bool(capped <= CHAT_BUDGET_GOAL)}}}


def plot_corpus(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["per_set"])
    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    p10 = [result["per_set"][n]["p10"] for n in names]
    p50 = [result["per_set"][n]["p50"] for n in names]
    p90 = [result["per_set"][n]["p90"] for n in names]
    x = np.arange(len(names))
    ax.vlines(x, p10, p90, color="tab:blue", linewidth=6, alpha=0.4, label="p10-p90")
    ax.plot(x, p50, "o", color="tab:blue", label="median")
    ax.axhline(result["max_tokens"], color="gray", linestyle="--", label="budget M")
    ax.set_xticks(x, names, rotation=35, ha="right")
    ax.set_ylabel("output tokens")
    ax.set_title("Output length of SmolLM2-135M-Instruct per prompt set")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_corpus(result: dict, image: str) -> str:
    rows = ["| set | n | mean [95% CI] | p10 | median | p90 | reached M [95% CI] |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in result["per_set"].items():
        mean_ci = " [{:.0f}, {:.0f}]".format(*row["mean_ci"]) if "mean_ci" in row else ""
        capped_ci = (" [{:.1f}%, {:.1f}%]".format(*(100 * v for v in row["capped_fraction_ci"]))
                     if "capped_fraction_ci" in row else "")
        rows.append(f"| {name} | {row['n']} | {row['mean']:.0f}{mean_ci} | {row['p10']:.0f} | {row['p50']:.0f} | "
                    f"{row['p90']:.0f} | {100 * row['capped_fraction']:.1f}%{capped_ci} |")
    goal = result["goals"]["chat_capped_fraction"]
    return "\n".join([
        "## The length corpus",
        "",
        f"True output lengths of the serving model for {result['n']} prompts, budget M = {result['max_tokens']}. "
        f"Chat outputs reaching M: {100 * goal['measured']:.1f}% (goal {goal['target']}: "
        f"{'met' if goal['met'] else 'not met'}).",
        "",
        *rows,
        "",
        f"![output lengths per set]({image})",
        "",
        f"Regenerate: `{result['command']}`" if "command" in result else "",
    ])
