"""Domain transfer: a readout trained on one domain, scored on another frozen, after RLS feedback, refitted.

The target rows are split once into a feedback stream and evaluation rows. RLS consumes the stream in
batches of 8 (as the serving learner publishes), starting from the training anchor, and is scored on the
evaluation rows after each requested number of feedbacks. The refitted readout sees the whole stream and
nothing from the training domain: the ceiling RLS is measured against. Baselines are fitted on the training
rows only, like the frozen readout.

The evaluation rows are few (tens to hundreds), so every figure carries a bootstrap interval over them
(`leap_core.metrics.per_set_metrics`), and so does the share of the frozen-to-refit gap RLS closes. A
target made of several prompt sets is also scored within each set (`within_set_spearman`): pooled across
sets whose lengths differ, Spearman mostly rewards telling the sets apart, which prompt length alone does.
Outputs that reached the budget are censored: tied at M for Spearman and left out of the MAE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from evaluation.baseline_fits import hyperparameters
from evaluation.baselines import LengthData
from evaluation.data import split_stream
from evaluation.offline import choose_alpha
from evaluation.report_format import corr, interval
from leap_core import metrics
from leap_core.readout import LinearReadout
from leap_core.rls import RLS, fit_readout_with_anchor

FEEDBACK_COUNTS = (100, 500, 1000)
RLS_BATCH = 8
N_BOOT = 2000
LEVEL = 0.95


def _leap_alpha(data: LengthData, alpha: float | None) -> float:
    return choose_alpha(data.features, data.lengths, "sqrt", data.max_tokens) if alpha is None else float(alpha)


def fit_leap(data: LengthData, alpha: float | None = None) -> LinearReadout:
    """LEAP's sqrt-target readout on these rows (alpha chosen on them when not given)."""
    return LinearReadout(alpha=_leap_alpha(data, alpha), target="sqrt",
                         max_tokens=data.max_tokens).fit(data.features, data.lengths)


def fit_leap_anchored(data: LengthData, alpha: float | None = None) -> tuple[LinearReadout, RLS]:
    """`fit_leap` and the RLS anchored at the same rows (`leap_core.rls.fit_readout_with_anchor`)."""
    return fit_readout_with_anchor(data.features, data.lengths, alpha=_leap_alpha(data, alpha),
                                   max_tokens=data.max_tokens)


def rls_predictions(rls: RLS, stream: LengthData, evaluation: LengthData, counts: Sequence[int],
                    batch: int = RLS_BATCH) -> dict[str, np.ndarray]:
    """Predicted lengths of `evaluation` after each count of stream rows fed to `rls` in batches of `batch`.

    `rls` is updated in place; counts above the stream's length are skipped.
    """
    predictions: dict[str, np.ndarray] = {}
    fed = 0
    for count in sorted(c for c in counts if c <= len(stream)):
        while fed < count:
            end = min(fed + batch, count)
            rls.partial_fit(stream.features[fed:end], stream.lengths[fed:end])
            fed = end
        predictions[str(count)] = rls.readout().predict(evaluation.features)
    return predictions


def _censored(evaluation: LengthData) -> np.ndarray:
    """Rows that reached the budget (a LengthData keeps no finish reason; a length of M is one)."""
    return np.asarray(evaluation.lengths) >= evaluation.max_tokens


def run_transfer(train: LengthData, target: LengthData, baselines: Mapping[str, Any],
                 counts: Sequence[int] = FEEDBACK_COUNTS, alpha: float | None = None, seed: int = 0,
                 n_boot: int = N_BOOT, level: float = LEVEL) -> dict:
    """Spearman on the target's evaluation rows: frozen, RLS by feedback count, refitted, and each baseline.

    `baselines` maps a name to a predictor already fitted on `train` (anything with `predict(LengthData)`).
    The flat `spearman_*` figures are pooled point values (as before); `metrics` holds, for every
    predictor, `per_set_metrics` (Spearman and MAE with `level` bootstrap intervals, per set and pooled,
    the censored share, and the within-set Spearman when the target has several sets).
    """
    readout, rls = fit_leap_anchored(train, alpha)
    stream, evaluation = _stream_and_evaluation(target, counts, seed)
    truth, budget, censored = evaluation.lengths, evaluation.max_tokens, _censored(evaluation)
    frozen_pred = readout.predict(evaluation.features)
    rls_pred = rls_predictions(rls, stream, evaluation, counts)
    refit_pred = fit_leap(stream).predict(evaluation.features) if len(stream) >= 20 else None
    baseline_pred = _baseline_predictions(baselines, evaluation)

    def scored(pred: np.ndarray) -> dict[str, Any]:
        return metrics.per_set_metrics(evaluation.sets, truth, pred, censored, budget, n_boot=n_boot, seed=seed,
                                       level=level)

    figures = {"frozen": scored(frozen_pred), "rls": {k: scored(v) for k, v in rls_pred.items()},
               "refit": scored(refit_pred) if refit_pred is not None else None,
               "baselines": {name: scored(pred) for name, pred in baseline_pred.items()}}

    def pooled(entry: dict | None) -> float:
        return float("nan") if entry is None else entry["pooled"]["spearman"]["value"]

    frozen, refit = pooled(figures["frozen"]), pooled(figures["refit"])
    curve = {k: pooled(v) for k, v in figures["rls"].items()}
    result = {
        "n_train": len(train), "n_feedback_pool": len(stream), "n_eval": len(evaluation), "alpha": readout.alpha,
        "spearman_frozen": frozen, "spearman_rls": curve, "spearman_refit": refit,
        "spearman_baselines": {name: pooled(entry) for name, entry in figures["baselines"].items()},
        "baseline_hyperparameters": {name: hyperparameters(p) for name, p in baselines.items()},
        "per_set_frozen": _per_set(figures["frozen"]),
        "censored_share": metrics.censored_share(truth, budget, censored),
        "bootstrap": {"n_boot": int(n_boot), "level": float(level), "seed": int(seed), "resampled": "evaluation rows"},
        "metrics": figures,
    }
    if curve and refit_pred is not None and np.isfinite(refit) and refit > frozen:
        by_count = {count: metrics.gap_closed(truth, frozen_pred, rls_pred[count], refit_pred, budget, censored,
                                              n_boot=n_boot, seed=seed, level=level)
                    for count in curve}
        best_count = max(curve, key=int)
        best = by_count[best_count]
        result["gap_closed"] = {"feedback": int(best_count), "fraction": best["value"], "ci_low": best["ci_low"],
                                "ci_high": best["ci_high"], "by_count": by_count}
        if figures["frozen"]["within_set_spearman"] is not None:
            result["gap_closed"]["within_set"] = {
                count: metrics.gap_closed(truth, frozen_pred, rls_pred[count], refit_pred, budget, censored,
                                          evaluation.sets, n_boot=n_boot, seed=seed, level=level)
                for count in curve}
    return result


def domain_predictions(train: LengthData, target: LengthData, baselines: Mapping[str, Any],
                       counts: Sequence[int] = FEEDBACK_COUNTS, alpha: float | None = None,
                       seed: int = 0, pool: LengthData | None = None) -> tuple[LengthData, dict[str, np.ndarray]]:
    """The target's evaluation rows and every predictor's lengths for them (for the scheduling simulations):
    frozen LEAP, LEAP after RLS on the whole feedback stream, and each baseline fitted on `train`. `pool`:
    rows to predict instead of the target's evaluation half (the stream is the target's either way)."""
    readout, rls = fit_leap_anchored(train, alpha)
    stream, evaluation = _stream_and_evaluation(target, counts, seed)
    evaluation = evaluation if pool is None else pool
    for start in range(0, len(stream), RLS_BATCH):
        rls.partial_fit(stream.features[start:start + RLS_BATCH], stream.lengths[start:start + RLS_BATCH])
    predictions = {"leap": readout.predict(evaluation.features), "leap-rls": rls.readout().predict(evaluation.features)}
    predictions.update(_baseline_predictions(baselines, evaluation))
    return evaluation, predictions


def stream_predictions(target: LengthData, baselines: Mapping[str, Any], counts: Sequence[int] = FEEDBACK_COUNTS,
                       seed: int = 0) -> tuple[LengthData, dict[str, np.ndarray]]:
    """The target's feedback-stream rows (the split `domain_predictions` makes) and each baseline's lengths
    for them: rows no baseline was fitted on and the evaluation rows never hold, so a validation pool for
    choosing among the baselines without looking at the evaluation rows."""
    stream, _ = _stream_and_evaluation(target, counts, seed)
    return stream, _baseline_predictions(baselines, stream)


def _stream_and_evaluation(target: LengthData, counts: Sequence[int], seed: int) -> tuple[LengthData, LengthData]:
    """The target's rows split once (`split_stream`) into the feedback stream and the evaluation rows."""
    stream_rows, eval_rows = split_stream(len(target), counts, seed=seed)
    return target.subset(stream_rows), target.subset(eval_rows)


def _baseline_predictions(baselines: Mapping[str, Any], data: LengthData) -> dict[str, np.ndarray]:
    """Each fitted baseline's predicted lengths for `data`."""
    return {name: np.asarray(p.predict(data), dtype=np.float64) for name, p in baselines.items()}


def _per_set(figures: dict) -> dict[str, float]:
    """Per-set Spearman point values of sets with at least `metrics.MIN_SET_ROWS` rows (the former layout)."""
    return {name: entry["spearman"]["value"] for name, entry in figures["per_set"].items()
            if entry["n"] >= metrics.MIN_SET_ROWS}


def _method_figures(result: dict, method: str) -> dict | None:
    """The `per_set_metrics` of one method ("frozen", "refit", "rls@<count>" or a baseline's name), if saved."""
    figures = result.get("metrics")
    if not figures:
        return None
    if method in ("frozen", "refit"):
        return figures.get(method)
    if method.startswith("rls@"):
        return figures.get("rls", {}).get(method[4:])
    return figures.get("baselines", {}).get(method)


def _interval(entry: dict | None) -> tuple[float, float, float]:
    """(value, low, high) of a {value, ci_low, ci_high} entry; NaN for a missing one or a saved null."""
    if not entry:
        return (np.nan, np.nan, np.nan)
    return tuple(np.nan if entry.get(key) is None else float(entry[key])  # type: ignore[return-value]
                 for key in ("value", "ci_low", "ci_high"))


def _with_ci(entry: dict | None, point: float | None = None) -> str:
    """"0.612 [0.55, 0.67]"; the point value alone when no interval was saved."""
    return corr(point) if entry is None else interval(entry, ".3f", ".2f")


def _spearman_of(result: dict, method: str) -> float | None:
    if method == "frozen":
        return result["spearman_frozen"]
    if method == "refit":
        return result["spearman_refit"]
    if method.startswith("rls@"):
        return result["spearman_rls"].get(method[4:])
    return result["spearman_baselines"].get(method)


def _methods(results: list[dict]) -> list[str]:
    return ["frozen", *[f"rls@{c}" for c in sorted({int(k) for r in results for k in r["spearman_rls"]})],
            "refit", *sorted({b for r in results for b in r["spearman_baselines"]})]


def plot_transfer(results: list[dict], path) -> None:
    """Spearman per target domain (pooled, with its bootstrap interval): frozen, RLS after each feedback
    count, refit, and every baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["_name"].removeprefix("transfer-") if "_name" in r else str(i) for i, r in enumerate(results)]
    methods = _methods(results)
    fig, ax = plt.subplots(figsize=(9, 4), dpi=120)
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        values, errors = [], []
        for r in results:
            point = _spearman_of(r, method)
            value = np.nan if point is None else float(point)
            figures = _method_figures(r, method)
            _, low, high = _interval(figures["pooled"]["spearman"] if figures else None)
            values.append(value)
            errors.append((value - low, high - value) if np.isfinite(low) and np.isfinite(high) else (0.0, 0.0))
        ax.bar(np.arange(len(results)) + m * width, np.asarray(values, dtype=float), width, label=method,
               yerr=np.maximum(np.asarray(errors, dtype=float).T, 0.0).tolist(), capsize=2)
    ax.set_xticks(np.arange(len(results)) + 0.4 - width / 2, names)
    ax.set_ylabel("Spearman (true vs predicted length)")
    ax.set_title("Transfer from chat: LEAP frozen, with RLS, refitted, and baselines (95% bootstrap CI)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _gap_cell(gap: dict | None) -> str:
    if not gap or gap.get("fraction") is None or not np.isfinite(gap["fraction"]):
        return "n/a"
    low, high = gap.get("ci_low"), gap.get("ci_high")
    interval = (f" [{100 * low:.0f}%, {100 * high:.0f}%]"
                if low is not None and high is not None and np.isfinite(low) and np.isfinite(high) else "")
    return f"{100 * gap['fraction']:.0f}%{interval} @{gap['feedback']}"


def _gap_goal(result: dict) -> str:
    gap = result["gap_closed"]
    met = gap.get("fraction") is not None and np.isfinite(gap["fraction"]) and gap["fraction"] >= 0.6
    sure = gap.get("ci_low") is not None and np.isfinite(gap["ci_low"]) and gap["ci_low"] >= 0.6
    pool = result.get("n_feedback_pool")
    return (f"- {result.get('_name', '').removeprefix('transfer-') or 'target'}: {_gap_cell(gap)} ({pool} feedback rows available): "
            f"{'met' if met else 'not met'}" + (", interval above 60%" if sure else "")
            + ("" if gap["feedback"] >= 1000 else f"; 1,000 feedbacks not reachable on {pool} rows"))


def section_transfer(results: list[dict], image: str) -> str:
    """Markdown: pooled Spearman with 95% intervals per target, within-set Spearman where a target has sets."""
    methods = _methods(results)
    leap = [m for m in methods if m in ("frozen", "refit") or m.startswith("rls@")]  # frozen, RLS@..., refit
    others = [m for m in methods if m not in leap]
    labels = {m: f"RLS@{m[4:]}" if m.startswith("rls@") else m for m in methods}
    head = ["target", "n eval", "censored", *[labels[m] for m in leap], "gap closed", *others]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    within = ["| target | sets | " + " | ".join(labels[m] for m in methods) + " | gap closed |",
              "|" + "---|" * (len(methods) + 3)]

    def pooled(r: dict, method: str) -> str:
        figures = _method_figures(r, method)
        return _with_ci(figures["pooled"]["spearman"] if figures else None, _spearman_of(r, method))

    for r in results:
        name = r.get("_name", "").removeprefix("transfer-")
        share = r.get("censored_share")
        cells = [name, str(r["n_eval"]), "n/a" if share is None else f"{100 * share:.0f}%",
                 *[pooled(r, m) for m in leap], _gap_cell(r.get("gap_closed")), *[pooled(r, m) for m in others]]
        rows.append("| " + " | ".join(cells) + " |")
        frozen = _method_figures(r, "frozen")
        if frozen and frozen.get("within_set_spearman"):
            sets = ", ".join(frozen["within_set_spearman"].get("sets", []))
            gap = (r.get("gap_closed") or {})
            within_gap = (gap.get("within_set") or {}).get(str(gap.get("feedback")))
            gap_text = _gap_cell({**within_gap, "fraction": within_gap["value"], "feedback": gap["feedback"]}
                                 if within_gap else None)
            within.append("| " + " | ".join([name, sets, *[
                _with_ci((_method_figures(r, m) or {}).get("within_set_spearman")) for m in methods], gap_text]) + " |")
    commands = [f"- `{r['command']}`" for r in results if "command" in r]
    goal_lines = [_gap_goal(r) for r in results if r.get("gap_closed")]
    goal = "\n".join(["Goal: on each target, RLS closes at least 60% of the frozen-to-refit gap within 1,000 "
                      "feedbacks (met when the estimate at the largest count scored reaches 60%; the interval "
                      "says how sure):", "", *goal_lines]) if goal_lines else ""
    within_part = []
    if len(within) > 2:
        within_part = ["Within-set Spearman (n-weighted mean over the target's prompt sets of at least "
                       f"{metrics.MIN_SET_ROWS} rows; rows resampled within their set): pooled across sets whose "
                       "lengths differ, Spearman mostly rewards telling the sets apart.", "", *within, ""]
    return "\n".join([
        "## Transfer across domains",
        "",
        "Readout and baselines trained on chat prompts only; each target's prompts are split once into a "
        "feedback stream (RLS, batches of 8, and the refitted readout) and evaluation rows (all Spearman "
        "figures). Pooled Spearman with a 95% bootstrap interval over the evaluation rows; outputs that reached "
        "the budget (censored) tie at M. Gap closed = (RLS - frozen) / (refit - frozen), its interval from the "
        "same resampling.",
        "",
        *rows,
        "",
        *within_part,
        goal,
        "",
        f"![transfer]({image})",
        "",
        "Regenerate:",
        *commands,
    ])
