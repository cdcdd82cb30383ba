"""Domain transfer: a readout trained on one domain, scored on another frozen, after RLS feedback, refitted.

The target rows are split once into a feedback stream and evaluation rows. RLS consumes the stream in
batches of 8 (as the serving learner publishes), starting from the training anchor, and is scored on the
evaluation rows after each requested number of feedbacks. The refitted readout sees the whole stream and
nothing from the training domain: the ceiling RLS is measured against. Baselines are fitted on the training
rows only, like the frozen readout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from evaluation.baselines import LengthData
from evaluation.data import split_stream
from evaluation.offline import choose_alpha
from leap_core.metrics import spearman
from leap_core.readout import LinearReadout
from leap_core.rls import RLS

FEEDBACK_COUNTS = (100, 500, 1000)
RLS_BATCH = 8


def fit_leap(data: LengthData, alpha: float | None = None) -> LinearReadout:
    """LEAP's sqrt-target readout on these rows (alpha chosen on them when not given)."""
    if alpha is None:
        alpha = choose_alpha(data.features, data.lengths, "sqrt", data.max_tokens)
    return LinearReadout(alpha=alpha, target="sqrt", max_tokens=data.max_tokens).fit(data.features, data.lengths)


def rls_curve(readout: LinearReadout, train: LengthData, stream: LengthData, evaluation: LengthData,
              counts: Sequence[int], batch: int = RLS_BATCH) -> dict[str, float]:
    """Spearman on `evaluation` after each count of stream rows fed to RLS in batches of `batch`."""
    rls = RLS.from_readout(readout, train.features)
    curve: dict[str, float] = {}
    fed = 0
    for count in sorted(c for c in counts if c <= len(stream)):
        while fed < count:
            end = min(fed + batch, count)
            rls.partial_fit(stream.features[fed:end], stream.lengths[fed:end])
            fed = end
        curve[str(count)] = spearman(evaluation.lengths, rls.readout().predict(evaluation.features))
    return curve


def run_transfer(train: LengthData, target: LengthData, baselines: Mapping[str, Any],
                 counts: Sequence[int] = FEEDBACK_COUNTS, alpha: float | None = None, seed: int = 0) -> dict:
    """Spearman on the target's evaluation rows: frozen, RLS by feedback count, refitted, and each baseline.

    `baselines` maps a name to a predictor already fitted on `train` (anything with `predict(LengthData)`).
    """
    readout = fit_leap(train, alpha)
    stream_rows, eval_rows = split_stream(len(target), counts, seed=seed)
    stream, evaluation = target.subset(stream_rows), target.subset(eval_rows)
    truth = evaluation.lengths
    frozen = spearman(truth, readout.predict(evaluation.features))
    curve = rls_curve(readout, train, stream, evaluation, counts)
    refit = spearman(truth, fit_leap(stream).predict(evaluation.features)) if len(stream) >= 20 else float("nan")
    scores = {name: spearman(truth, predictor.predict(evaluation)) for name, predictor in baselines.items()}
    result = {
        "n_train": len(train), "n_feedback_pool": len(stream), "n_eval": len(evaluation), "alpha": readout.alpha,
        "spearman_frozen": frozen, "spearman_rls": curve, "spearman_refit": refit,
        "spearman_baselines": scores, "per_set_frozen": _per_set(evaluation, readout),
    }
    if curve and np.isfinite(refit) and refit > frozen:
        best_count = max(curve, key=int)
        result["gap_closed"] = {"feedback": int(best_count),
                                "fraction": float((curve[best_count] - frozen) / (refit - frozen))}
    return result


def domain_predictions(train: LengthData, target: LengthData, baselines: Mapping[str, Any],
                       counts: Sequence[int] = FEEDBACK_COUNTS, alpha: float | None = None,
                       seed: int = 0) -> tuple[LengthData, dict[str, np.ndarray]]:
    """The target's evaluation rows and every predictor's lengths for them (for the scheduling simulations):
    frozen LEAP, LEAP after RLS on the whole feedback stream, and each baseline fitted on `train`."""
    readout = fit_leap(train, alpha)
    stream_rows, eval_rows = split_stream(len(target), counts, seed=seed)
    stream, evaluation = target.subset(stream_rows), target.subset(eval_rows)
    rls = RLS.from_readout(readout, train.features)
    for start in range(0, len(stream), RLS_BATCH):
        rls.partial_fit(stream.features[start:start + RLS_BATCH], stream.lengths[start:start + RLS_BATCH])
    predictions = {"leap": readout.predict(evaluation.features), "leap-rls": rls.readout().predict(evaluation.features)}
    predictions.update({name: np.asarray(p.predict(evaluation), dtype=np.float64) for name, p in baselines.items()})
    return evaluation, predictions


def _per_set(evaluation: LengthData, readout: LinearReadout) -> dict[str, float]:
    if evaluation.sets is None:
        return {}
    sets = evaluation.sets
    predicted = readout.predict(evaluation.features)
    return {name: spearman(evaluation.lengths[sets == name], predicted[sets == name])
            for name in sorted(set(sets.tolist())) if int((sets == name).sum()) >= 10}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.3f}"


def plot_transfer(results: list[dict], path) -> None:
    """Spearman per target domain: frozen, RLS after each feedback count, refit, and every baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["_name"].removeprefix("transfer-") if "_name" in r else str(i) for i, r in enumerate(results)]
    methods = ["frozen", *[f"rls@{c}" for c in sorted({int(k) for r in results for k in r["spearman_rls"]})],
               "refit", *sorted({b for r in results for b in r["spearman_baselines"]})]
    fig, ax = plt.subplots(figsize=(9, 4), dpi=120)
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        values = []
        for r in results:
            if method == "frozen":
                values.append(r["spearman_frozen"])
            elif method == "refit":
                values.append(r["spearman_refit"])
            elif method.startswith("rls@"):
                values.append(r["spearman_rls"].get(method[4:], np.nan))
            else:
                values.append(r["spearman_baselines"].get(method, np.nan))
        ax.bar(np.arange(len(results)) + m * width, np.asarray(values, dtype=float), width, label=method)
    ax.set_xticks(np.arange(len(results)) + 0.4 - width / 2, names)
    ax.set_ylabel("Spearman (true vs predicted length)")
    ax.set_title("Transfer from chat: LEAP frozen, with RLS, refitted, and baselines")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_transfer(results: list[dict], image: str) -> str:
    counts = sorted({int(k) for r in results for k in r["spearman_rls"]})
    baselines = sorted({b for r in results for b in r["spearman_baselines"]})
    head = ["target", "n eval", "frozen", *[f"RLS@{c}" for c in counts], "refit", "gap closed", *baselines]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        gap = r.get("gap_closed")
        cells = [r.get("_name", "").removeprefix("transfer-"), str(r["n_eval"]), _fmt(r["spearman_frozen"]),
                 *[_fmt(r["spearman_rls"].get(str(c))) for c in counts], _fmt(r["spearman_refit"]),
                 f"{100 * gap['fraction']:.0f}% @{gap['feedback']}" if gap else "n/a",
                 *[_fmt(r["spearman_baselines"].get(b)) for b in baselines]]
        rows.append("| " + " | ".join(cells) + " |")
    commands = [f"- `{r['command']}`" for r in results if "command" in r]
    multilingual = [r for r in results if "multilingual" in r.get("_name", "") and r.get("gap_closed")]
    goal = ""
    if multilingual:
        g = multilingual[0]["gap_closed"]
        goal = (f"Goal: on multilingual, RLS closes at least 60% of the frozen-to-refit gap within 1,000 "
                f"feedbacks. Measured {100 * g['fraction']:.0f}% after {g['feedback']}: "
                f"{'met' if g['fraction'] >= 0.6 else 'not met'}.")
    return "\n".join([
        "## Transfer across domains",
        "",
        "Readout and baselines trained on chat prompts only; each target's prompts are split once into a "
        "feedback stream (RLS, batches of 8, and the refitted readout) and evaluation rows (all Spearman "
        "figures). Gap closed = (RLS - frozen) / (refit - frozen).",
        "",
        *rows,
        "",
        goal,
        "",
        f"![transfer]({image})",
        "",
        "Regenerate:",
        *commands,
    ])
