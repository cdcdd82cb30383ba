"""Offline readout studies: which regression target (the paper's Table 6) and which layer (Table 7).

Both studies pick every hyper-parameter (ridge alpha, layer) on the training rows only, by 5-fold
cross-validated MAE in tokens, and then report test figures; the test rows never steer a choice.
Every test Spearman and MAE carries a 95% percentile bootstrap interval over the test rows, pooled and
per prompt set when the sets are given (`leap_core.metrics.per_set_metrics`); outputs that reached the
budget M are censored (tied at M for Spearman) and their share is reported.
The cross-validation is `leap_core.alpha` (the fit flow's too): ridge for the whole alpha grid from
one eigendecomposition per fold, the same estimator as `LinearReadout` (standardized features,
unpenalized intercept, clipped to [1, M]), only cheaper, which keeps the 30-layer study and the
17k-wide all-layers readout within a minute on one core. Every reported test figure comes from a
`LinearReadout` fitted on all training rows.
"""

from __future__ import annotations

import pathlib

import numpy as np
from numpy.typing import ArrayLike, NDArray

from evaluation.report_format import corr, flat_interval, fmt, pyplot, tokens
from evaluation.target_heads import HEADS, choose_head_alpha, make_head
from leap_core import alpha as alpha_path
from leap_core import metrics
from leap_core.intervals import bootstrap_ci
from leap_core.readout import LinearReadout

ALPHAS: tuple[float, ...] = alpha_path.ALPHAS
TARGET_ORDER = ("raw", "log", "sqrt", "rank", "softbin")
BUCKETS = ("short", "medium", "long", "all")
N_SPLITS = alpha_path.N_SPLITS
CV_SEED = alpha_path.CV_SEED
_BYTES_PER_VALUE = 4  # the plugin sends float32 features
N_BOOT = 2000
LEVEL = 0.95


# ------------------------------------------------------------------ ridge cross-validation


def cv_mae(X: ArrayLike, lengths: ArrayLike, target: str, max_tokens: int,
           alphas: ArrayLike = ALPHAS, n_splits: int = N_SPLITS, seed: int = CV_SEED) -> NDArray[np.float64]:
    """Out-of-fold MAE in tokens of the readout for each alpha (KFold, shuffled, standardized per fold)."""
    return alpha_path.cv_scores(X, lengths, target=target, max_tokens=max_tokens, alphas=alphas,
                                cv=alpha_path.kfold(n_splits, seed), scoring="mae")


def choose_alpha(X: ArrayLike, lengths: ArrayLike, target: str, max_tokens: int,
                 alphas: ArrayLike = ALPHAS) -> float:
    """The alpha of the grid with the lowest cross-validated MAE on these (training) rows."""
    return alpha_path.select_alpha(X, lengths, target=target, max_tokens=max_tokens, alphas=alphas,
                                   cv=alpha_path.kfold(), scoring="mae").alpha


# ------------------------------------------------------------------ studies


def _check_split(X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray) -> None:
    if X_train.shape[0] != y_train.shape[0] or X_test.shape[0] != y_test.shape[0]:
        raise ValueError("features and lengths must have one row per request")
    if X_train.shape[1:] != X_test.shape[1:]:
        raise ValueError(f"train and test features differ in shape: {X_train.shape[1:]} vs {X_test.shape[1:]}")
    if X_train.shape[0] < N_SPLITS:
        raise ValueError(f"need at least {N_SPLITS} training rows for {N_SPLITS}-fold CV")


def _scored(y_test: np.ndarray, pred: np.ndarray, max_tokens: int, sets: ArrayLike | None,
            censored: ArrayLike | None, n_boot: int, seed: int, per_set: bool = True) -> dict:
    """Test figures of one prediction: MAE (all rows) and censored Spearman, each with its interval.

    mae / mae_ci: MAE in tokens over every test row (as the bucket table), with its interval;
    spearman / spearman_ci: Spearman with censored rows tied at M, with its interval;
    censored_share; per_set (when asked): `metrics.per_set_metrics` (per set, pooled, within-set).
    """
    options = dict(n_boot=n_boot, seed=seed, level=LEVEL)
    values, mask = metrics.censor(y_test, max_tokens, censored)
    spearman = bootstrap_ci(metrics.spearman_batch, values, pred, vectorized=True, **options)
    figures = {
        "mae": metrics.mae(y_test, pred),
        "mae_ci": bootstrap_ci(metrics.mae_batch, y_test, pred, vectorized=True, **options),
        "spearman": spearman["value"],
        "spearman_ci": spearman,
        "censored_share": float(mask.mean()),
    }
    if per_set:
        figures["per_set"] = metrics.per_set_metrics(sets, y_test, pred, mask, max_tokens, **options)
    return figures


def readout_predictions(X_train: ArrayLike, y_train: ArrayLike, X_test: ArrayLike, alpha: float, target: str,
                        max_tokens: int) -> NDArray[np.float64]:
    """Test predictions of `LinearReadout(alpha, target, max_tokens)` fitted on the training rows."""
    return LinearReadout(alpha=alpha, target=target, max_tokens=max_tokens).fit(X_train, y_train).predict(X_test)


def run_targets(X_train: ArrayLike, y_train: ArrayLike, X_test: ArrayLike, y_test: ArrayLike,
                max_tokens: int, alpha: float | None = None, *, sets_test: ArrayLike | None = None,
                censored_test: ArrayLike | None = None, n_boot: int = N_BOOT, seed: int = 0,
                heads: tuple[str, ...] | None = None) -> dict:
    """Table 6: the readout fitted on every target of `leap_core.targets` (raw, log, sqrt and the fitted rank
    and softbin), scored in tokens and by rank; `heads` (`evaluation.target_heads.HEADS`): also the soft-bin
    classification head with its outputs clipped, scored the same way.

    alpha=None chooses alpha per target by 5-fold CV on the training rows over `ALPHAS`.
    sets_test: the prompt set of each test row, for per-set figures (None: pooled only).
    censored_test: finish_reason == "length" per test row (None: a length >= max_tokens is censored).
    """
    X_train, X_test = np.asarray(X_train), np.asarray(X_test)
    y_train = np.asarray(y_train, dtype=np.float64).reshape(-1)
    y_test = np.asarray(y_test, dtype=np.float64).reshape(-1)
    _check_split(X_train, y_train, X_test, y_test)
    per_target = {}
    for target in (*TARGET_ORDER, *(heads or ())):
        chosen = (float(alpha) if alpha is not None
                  else choose_head_alpha(target, X_train, y_train, max_tokens, ALPHAS, N_SPLITS, CV_SEED)
                  if target in HEADS else choose_alpha(X_train, y_train, target, max_tokens))
        pred = (make_head(target, chosen, max_tokens).fit(X_train, y_train).predict(X_test) if target in HEADS
                else readout_predictions(X_train, y_train, X_test, chosen, target, max_tokens))
        scored = _scored(y_test, pred, max_tokens, sets_test, censored_test, n_boot, seed)
        per_target[target] = {
            "alpha": chosen,
            "mae": scored.pop("mae"),
            "mae_by_bucket": metrics.mae_by_bucket(y_test, pred, max_tokens),
            "spearman": scored.pop("spearman"),
            "kendall": metrics.kendall(y_test, pred),
            **scored,
        }
    return {
        "n_train": int(y_train.size),
        "n_test": int(y_test.size),
        "max_tokens": int(max_tokens),
        "censored_share": metrics.censored_share(y_test, max_tokens, censored_test),
        "bootstrap": {"n_boot": int(n_boot), "level": LEVEL, "seed": int(seed), "resampled": "test rows"},
        "alpha_grid": None if alpha is not None else list(ALPHAS),
        "targets": per_target,
        "best_overall": min(per_target, key=lambda name: per_target[name]["mae"]),
    }


def run_layers(F_train: ArrayLike, y_train: ArrayLike, F_test: ArrayLike, y_test: ArrayLike,
               max_tokens: int, default_layer: int, alpha: float | None = None, *,
               sets_test: ArrayLike | None = None, censored_test: ArrayLike | None = None,
               n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """Table 7: a sqrt readout on each decoder layer's state, and one on all layers concatenated.

    F_* have shape (n, L, d). The layer is chosen by 5-fold CV MAE on the training rows; alpha=None
    chooses one alpha for every single layer by CV on the default layer, and a separate one for the
    concatenated features. Test MAE and Spearman, with their bootstrap intervals, are reported for
    every layer; the default, chosen and all-layers readouts also per prompt set (`sets_test`).
    """
    F_train, F_test = np.asarray(F_train), np.asarray(F_test)
    y_train = np.asarray(y_train, dtype=np.float64).reshape(-1)
    y_test = np.asarray(y_test, dtype=np.float64).reshape(-1)
    if F_train.ndim != 3:
        raise ValueError(f"layer features must have shape (n, L, d), got {F_train.shape}")
    _check_split(F_train, y_train, F_test, y_test)
    n_train, num_layers, dim = F_train.shape
    if not -num_layers <= default_layer < num_layers:
        raise ValueError(f"default_layer {default_layer} out of range for {num_layers} layers")
    default_layer %= num_layers

    layer_alpha = (float(alpha) if alpha is not None
                   else choose_alpha(F_train[:, default_layer], y_train, "sqrt", max_tokens))
    layers, predictions = [], []
    for layer in range(num_layers):
        pred = readout_predictions(F_train[:, layer], y_train, F_test[:, layer], layer_alpha, "sqrt", max_tokens)
        scored = _scored(y_test, pred, max_tokens, sets_test, censored_test, n_boot, seed, per_set=False)
        predictions.append(pred)
        layers.append({
            "layer": layer,
            "cv_mae": float(cv_mae(F_train[:, layer], y_train, "sqrt", max_tokens, [layer_alpha])[0]),
            "mae": scored["mae"],
            "spearman": scored["spearman"],
            "mae_ci": scored["mae_ci"],
            "spearman_ci": scored["spearman_ci"],
        })
    chosen_layer = min(layers, key=lambda row: row["cv_mae"])["layer"]

    def summary(layer: int) -> dict:
        figures = {key: layers[layer][key] for key in ("mae", "spearman", "mae_ci", "spearman_ci")}
        figures["per_set"] = metrics.per_set_metrics(sets_test, y_test, predictions[layer], censored_test,
                                                     max_tokens, n_boot=n_boot, seed=seed, level=LEVEL)
        return figures

    flat_train = F_train.reshape(n_train, num_layers * dim)
    flat_test = F_test.reshape(F_test.shape[0], num_layers * dim)
    all_alpha = float(alpha) if alpha is not None else choose_alpha(flat_train, y_train, "sqrt", max_tokens)
    all_pred = readout_predictions(flat_train, y_train, flat_test, all_alpha, "sqrt", max_tokens)
    all_layers = {
        "alpha": all_alpha,
        **_scored(y_test, all_pred, max_tokens, sets_test, censored_test, n_boot, seed),
        "kib_per_request": num_layers * dim * _BYTES_PER_VALUE / 1024,
    }
    all_layers.pop("censored_share")
    default = summary(default_layer)
    return {
        "n_train": int(n_train),
        "n_test": int(y_test.size),
        "num_layers": int(num_layers),
        "dim": int(dim),
        "max_tokens": int(max_tokens),
        "censored_share": metrics.censored_share(y_test, max_tokens, censored_test),
        "bootstrap": {"n_boot": int(n_boot), "level": LEVEL, "seed": int(seed), "resampled": "test rows"},
        "alpha": layer_alpha,
        "default_layer": int(default_layer),
        "chosen_layer": int(chosen_layer),
        "layers": layers,
        "default": default,
        "chosen": default if chosen_layer == default_layer else summary(chosen_layer),
        "all_layers": all_layers,
        "one_layer_kib_per_request": dim * _BYTES_PER_VALUE / 1024,
        "all_vs_default_mae_change": (all_layers["mae"] - default["mae"]) / default["mae"],
    }


# ------------------------------------------------------------------ figures


def plot_targets(result: dict, path: pathlib.Path) -> None:
    """Grouped bars: test MAE per length bucket, one bar per regression target."""
    plt = pyplot()
    names = list(result["targets"])
    x = np.arange(len(BUCKETS))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for i, name in enumerate(names):
        values = [result["targets"][name]["mae_by_bucket"][bucket] for bucket in BUCKETS]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, values, width, label=name)
    low, high = metrics.bucket_edges(result["max_tokens"])
    ax.set_xticks(x, [f"short\n<{low:g}", f"medium\n{low:g}-{high:g}", f"long\n≥{high:g}", "all"])
    ax.set_xlabel("true output length bucket (tokens)")
    ax.set_ylabel("test MAE (tokens)")
    ax.set_title("Readout target: test MAE by length bucket")
    ax.legend(title="target")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_layers(result: dict, path: pathlib.Path) -> None:
    """Test MAE (left axis) and Spearman (right axis) per layer with their bootstrap bands, all-layers as
    horizontal lines."""
    plt = pyplot()
    layer = [row["layer"] for row in result["layers"]]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    right = ax.twinx()
    mae_color, rank_color = "tab:blue", "tab:orange"
    ax.plot(layer, [row["mae"] for row in result["layers"]], "o-", color=mae_color, label="test MAE")
    ax.axhline(result["all_layers"]["mae"], color=mae_color, linestyle="--", label="all layers: MAE")
    right.plot(layer, [row["spearman"] for row in result["layers"]], "s-", color=rank_color,
               label="test Spearman")
    right.axhline(result["all_layers"]["spearman"], color=rank_color, linestyle="--",
                  label="all layers: Spearman")
    for axis, key, color in ((ax, "mae_ci", mae_color), (right, "spearman_ci", rank_color)):
        if all(row.get(key) for row in result["layers"]):  # 95% bootstrap band, when the result has one
            low = [np.nan if row[key]["ci_low"] is None else row[key]["ci_low"] for row in result["layers"]]
            high = [np.nan if row[key]["ci_high"] is None else row[key]["ci_high"] for row in result["layers"]]
            axis.fill_between(layer, np.asarray(low, dtype=float), np.asarray(high, dtype=float), color=color,
                              alpha=0.15, linewidth=0)
    ax.axvline(result["chosen_layer"], color="gray", linestyle=":", label=f"chosen layer {result['chosen_layer']}")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("test MAE (tokens)", color=mae_color)
    right.set_ylabel("test Spearman", color=rank_color)
    ax.set_title("Readout quality per decoder layer")
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = right.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, fontsize="small", loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------ markdown


def _tokens_ci(figures: dict) -> str:
    return flat_interval(figures, "mae", ".1f", ".0f")


def _corr_ci(figures: dict) -> str:
    return flat_interval(figures, "spearman", ".3f", ".2f")


def _within_set_note(figures: dict) -> list[str]:
    """A line per set (n, censored share, Spearman and uncensored MAE with intervals) when sets were given."""
    per_set = (figures.get("per_set") or {})
    if not per_set.get("per_set"):
        return []
    lines = ["| Set | n | censored | Spearman | MAE (uncensored) |", "|---|---|---|---|---|"]
    for name, row in [*per_set["per_set"].items(), ("pooled", per_set["pooled"])]:
        flat = {"spearman": row["spearman"]["value"], "spearman_ci": row["spearman"],
                "mae": row["mae"]["value"], "mae_ci": row["mae"]}
        lines.append(f"| {name} | {row['n']} | {fmt(row['censored_share'], '.1%')} | {_corr_ci(flat)} | "
                     f"{_tokens_ci(flat)} |")
    within = per_set.get("within_set_spearman")
    if within:
        flat = {"spearman": within["value"], "spearman_ci": within}
        lines.append(f"| within-set mean | | | {_corr_ci(flat)} | |")
    return lines + [""]


def _interval_note(result: dict) -> str:
    boot = result.get("bootstrap")
    if not boot:
        return ""
    return (f"Brackets: {boot['level']:.0%} percentile bootstrap interval over the {result['n_test']} test rows "
            f"({boot['n_boot']} resamples). Censored (reached M) test rows: "
            f"{fmt(result.get('censored_share'), '.1%')}; they tie at M for Spearman.")


def _footer(result: dict, title: str, image: str) -> list[str]:
    """Goals (when present), the figure and the command that regenerates it."""
    lines = []
    for name, goal in result.get("goals", {}).items():
        verdict = "met" if goal["met"] else "not met"
        interval = (f" [{fmt(goal['ci'][0], '.3g')}, {fmt(goal['ci'][1], '.3g')}]" if goal.get("ci") else "")
        lines.append(f"Goal {name}: {goal['target']}; measured {fmt(goal['measured'], '.3g')}{interval}: "
                     f"**{verdict}**.")
    if lines:
        lines.append("")
    lines.append(f"![{title}]({image})")
    if "command" in result:
        lines += ["", f"Regenerate: `{result['command']}`"]
    return lines


def section_targets(result: dict, image: str) -> str:
    """Markdown section for the target ablation (Table 6)."""
    title = "Readout target ablation"
    low, high = metrics.bucket_edges(result["max_tokens"])
    alpha_note = ("alpha chosen per target by 5-fold CV on the training rows"
                  if result.get("alpha_grid") is not None else "alpha fixed")
    lines = [
        f"## {title}",
        "",
        f"The same linear readout fitted on each target of leap_core/targets.py ({alpha_note}), "
        f"scored on {result['n_test']} test requests ({result['n_train']} training). MAE is in tokens, "
        f"by true length bucket: short < {low:g} <= medium < {high:g} <= long (M = {result['max_tokens']})."
        + (" rank: the normal score of the length's mid-rank among the training lengths; softbin: the "
           "expected bin center under Gaussian soft labels of the log length (16 bins at the training quantiles, "
           "width 0.5), which is the soft-bin classification head decoded to its expected value without "
           "clipping its outputs. Both maps are fitted on the training lengths and carried in the readout file, "
           "so both are serving targets and RLS corrects them exactly."
           if "rank" in result["targets"] else "")
        + (" softbin_clipped: the same head with its outputs clipped at 0 and renormalized, as a classifier's "
           "probabilities (studies/evaluation/target_heads.py); not linear in its weights, so not served."
           if any(name in HEADS for name in result["targets"]) else ""),
        "",
        "| Target | alpha | MAE | MAE short | MAE medium | MAE long | Spearman | Kendall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["targets"].items():
        buckets = row["mae_by_bucket"]
        label = f"**{name}**" if name == result["best_overall"] else name
        lines.append(f"| {label} | {row['alpha']:g} | {_tokens_ci(row)} | {tokens(buckets['short'])} | "
                     f"{tokens(buckets['medium'])} | {tokens(buckets['long'])} | {_corr_ci(row)} | "
                     f"{corr(row['kendall'])} |")
    lines += ["", f"Lowest overall MAE: {result['best_overall']}.", ""]
    note = _interval_note(result)
    if note:
        lines += [note, ""]
    best = result["targets"][result["best_overall"]]
    if _within_set_note(best):
        lines += [f"Per prompt set ({result['best_overall']} target):", "", *_within_set_note(best)]
    return "\n".join(lines + _footer(result, title, image)) + "\n"


def section_layers(result: dict, image: str) -> str:
    """Markdown section for the layer study (Table 7)."""
    title = "Readout layer study"
    chosen, default = result["chosen_layer"], result["default_layer"]
    lines = [
        f"## {title}",
        "",
        f"A sqrt-target readout on each of the {result['num_layers']} decoder layers' state at the last prompt "
        f"token (d = {result['dim']}, alpha = {result['alpha']:g}), and one on all layers concatenated "
        f"(alpha = {result['all_layers']['alpha']:g}). The layer is chosen by 5-fold CV MAE on the "
        f"{result['n_train']} training requests; MAE (tokens) and Spearman are on {result['n_test']} "
        "test requests.",
        "",
        "| Readout | Features sent (KiB/request) | Test MAE | Test Spearman |",
        "|---|---|---|---|",
        f"| default layer {default} | {result['one_layer_kib_per_request']:g} | "
        f"{_tokens_ci(result['default'])} | {_corr_ci(result['default'])} |",
        f"| chosen layer {chosen} | {result['one_layer_kib_per_request']:g} | "
        f"{_tokens_ci(result['chosen'])} | {_corr_ci(result['chosen'])} |",
        f"| all layers | {result['all_layers']['kib_per_request']:g} | "
        f"{_tokens_ci(result['all_layers'])} | {_corr_ci(result['all_layers'])} |",
        "",
        f"All layers vs the default layer: test MAE change {result['all_vs_default_mae_change']:+.1%} "
        "(negative = better).",
        "",
        "| Layer | CV MAE (train) | Test MAE | Test Spearman |",
        "|---|---|---|---|",
    ]
    for row in result["layers"]:
        notes = [word for word, layer in (("default", default), ("chosen", chosen)) if row["layer"] == layer]
        label = f"{row['layer']} ({', '.join(notes)})" if notes else str(row["layer"])
        lines.append(f"| {label} | {tokens(row['cv_mae'])} | {_tokens_ci(row)} | {_corr_ci(row)} |")
    lines.append("")
    note = _interval_note(result)
    if note:
        lines += [note, ""]
    lines += _within_set_note(result["chosen"])
    return "\n".join(lines + _footer(result, title, image)) + "\n"
