"""Offline readout studies: which regression target (the paper's Table 6) and which layer (Table 7).

Both studies pick every hyper-parameter (ridge alpha, layer) on the training rows only, by 5-fold
cross-validated MAE in tokens, and then report test figures; the test rows never steer a choice.
The cross-validation fits ridge for the whole alpha grid from one eigendecomposition per fold: the
same estimator as `LinearReadout` (standardized features, unpenalized intercept, clipped to [1, M]),
only cheaper, which keeps the 30-layer study and the 17k-wide all-layers readout within a minute on
one core. Every reported test figure comes from a `LinearReadout` fitted on all training rows.
"""

from __future__ import annotations

import pathlib

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.model_selection import KFold

from leap_core import metrics, targets
from leap_core.readout import LinearReadout, Standardizer

ALPHAS: tuple[float, ...] = tuple(float(a) for a in np.logspace(0, 6, 7))
TARGET_ORDER = ("raw", "log", "sqrt")
BUCKETS = ("short", "medium", "long", "all")
N_SPLITS = 5
CV_SEED = 0
_BYTES_PER_VALUE = 4  # the plugin sends float32 features


# ------------------------------------------------------------------ ridge cross-validation


def _ridge_path(Z: NDArray[np.float64], y: NDArray[np.float64], Z_held: NDArray[np.float64],
                alphas: NDArray[np.float64]) -> NDArray[np.float64]:
    """Held-out predictions (target space, one column per alpha) of ridge with an unpenalized intercept.

    Z is standardized on its own rows, so its columns have mean zero and the intercept is mean(y).
    One eigendecomposition of the smaller Gram matrix serves every alpha: Z Z^T (dual form) when
    there are fewer rows than features, as with all layers concatenated, else Z^T Z.
    """
    y_mean = float(y.mean())
    centered = y - y_mean
    if Z.shape[0] < Z.shape[1]:  # held predictions Z_held Z^T (Z Z^T + alpha I)^-1 y
        eigval, Q = np.linalg.eigh(Z @ Z.T)
        left, right = (Z_held @ Z.T) @ Q, Q.T @ centered
    else:  # held predictions Z_held (Z^T Z + alpha I)^-1 Z^T y
        eigval, Q = np.linalg.eigh(Z.T @ Z)
        left, right = Z_held @ Q, Q.T @ (Z.T @ centered)
    eigval = np.maximum(eigval, 0.0)  # round-off can leave tiny negative eigenvalues
    return left @ (right[:, None] / (eigval[:, None] + alphas[None, :])) + y_mean


def cv_mae(X: ArrayLike, lengths: ArrayLike, target: str, max_tokens: int,
           alphas: ArrayLike = ALPHAS, n_splits: int = N_SPLITS, seed: int = CV_SEED) -> NDArray[np.float64]:
    """Out-of-fold MAE in tokens of the readout for each alpha (KFold, shuffled, standardized per fold)."""
    X = np.asarray(X)
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    if not (alphas > 0).all():
        raise ValueError("cross-validation needs every alpha > 0")
    y = targets.transform(lengths, target)
    abs_error = np.zeros(alphas.size)
    for fit_rows, held_rows in KFold(n_splits, shuffle=True, random_state=seed).split(X):
        scaler = Standardizer().fit(X[fit_rows])
        pred = _ridge_path(scaler.transform(X[fit_rows]), y[fit_rows], scaler.transform(X[held_rows]), alphas)
        pred_lengths = targets.to_lengths(pred, target, max_tokens)
        abs_error += np.abs(pred_lengths - lengths[held_rows, None]).sum(axis=0)
    return abs_error / lengths.size


def choose_alpha(X: ArrayLike, lengths: ArrayLike, target: str, max_tokens: int,
                 alphas: ArrayLike = ALPHAS) -> float:
    """The alpha of the grid with the lowest cross-validated MAE on these (training) rows."""
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    return float(alphas[int(np.argmin(cv_mae(X, lengths, target, max_tokens, alphas)))])


# ------------------------------------------------------------------ studies


def _check_split(X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray) -> None:
    if X_train.shape[0] != y_train.shape[0] or X_test.shape[0] != y_test.shape[0]:
        raise ValueError("features and lengths must have one row per request")
    if X_train.shape[1:] != X_test.shape[1:]:
        raise ValueError(f"train and test features differ in shape: {X_train.shape[1:]} vs {X_test.shape[1:]}")
    if X_train.shape[0] < N_SPLITS:
        raise ValueError(f"need at least {N_SPLITS} training rows for {N_SPLITS}-fold CV")


def _fit_predict(X_train: ArrayLike, y_train: ArrayLike, X_test: ArrayLike, alpha: float, target: str,
                 max_tokens: int) -> NDArray[np.float64]:
    return LinearReadout(alpha=alpha, target=target, max_tokens=max_tokens).fit(X_train, y_train).predict(X_test)


def run_targets(X_train: ArrayLike, y_train: ArrayLike, X_test: ArrayLike, y_test: ArrayLike,
                max_tokens: int, alpha: float | None = None) -> dict:
    """Table 6: the readout fitted on raw, log and sqrt lengths, scored in tokens and by rank.

    alpha=None chooses alpha per target by 5-fold CV on the training rows over `ALPHAS`.
    """
    X_train, X_test = np.asarray(X_train), np.asarray(X_test)
    y_train = np.asarray(y_train, dtype=np.float64).reshape(-1)
    y_test = np.asarray(y_test, dtype=np.float64).reshape(-1)
    _check_split(X_train, y_train, X_test, y_test)
    per_target = {}
    for target in TARGET_ORDER:
        chosen = float(alpha) if alpha is not None else choose_alpha(X_train, y_train, target, max_tokens)
        pred = _fit_predict(X_train, y_train, X_test, chosen, target, max_tokens)
        per_target[target] = {
            "alpha": chosen,
            "mae": metrics.mae(y_test, pred),
            "mae_by_bucket": metrics.mae_by_bucket(y_test, pred, max_tokens),
            "spearman": metrics.spearman(y_test, pred),
            "kendall": metrics.kendall(y_test, pred),
        }
    return {
        "n_train": int(y_train.size),
        "n_test": int(y_test.size),
        "max_tokens": int(max_tokens),
        "alpha_grid": None if alpha is not None else list(ALPHAS),
        "targets": per_target,
        "best_overall": min(per_target, key=lambda name: per_target[name]["mae"]),
    }


def run_layers(F_train: ArrayLike, y_train: ArrayLike, F_test: ArrayLike, y_test: ArrayLike,
               max_tokens: int, default_layer: int, alpha: float | None = None) -> dict:
    """Table 7: a sqrt readout on each decoder layer's state, and one on all layers concatenated.

    F_* have shape (n, L, d). The layer is chosen by 5-fold CV MAE on the training rows; alpha=None
    chooses one alpha for every single layer by CV on the default layer, and a separate one for the
    concatenated features. Test MAE and Spearman are reported for every layer.
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
    layers = []
    for layer in range(num_layers):
        pred = _fit_predict(F_train[:, layer], y_train, F_test[:, layer], layer_alpha, "sqrt", max_tokens)
        layers.append({
            "layer": layer,
            "cv_mae": float(cv_mae(F_train[:, layer], y_train, "sqrt", max_tokens, [layer_alpha])[0]),
            "mae": metrics.mae(y_test, pred),
            "spearman": metrics.spearman(y_test, pred),
        })
    chosen_layer = min(layers, key=lambda row: row["cv_mae"])["layer"]

    flat_train = F_train.reshape(n_train, num_layers * dim)
    flat_test = F_test.reshape(F_test.shape[0], num_layers * dim)
    all_alpha = float(alpha) if alpha is not None else choose_alpha(flat_train, y_train, "sqrt", max_tokens)
    all_pred = _fit_predict(flat_train, y_train, flat_test, all_alpha, "sqrt", max_tokens)
    all_layers = {
        "alpha": all_alpha,
        "mae": metrics.mae(y_test, all_pred),
        "spearman": metrics.spearman(y_test, all_pred),
        "kib_per_request": num_layers * dim * _BYTES_PER_VALUE / 1024,
    }
    default = {key: layers[default_layer][key] for key in ("mae", "spearman")}
    return {
        "n_train": int(n_train),
        "n_test": int(y_test.size),
        "num_layers": int(num_layers),
        "dim": int(dim),
        "max_tokens": int(max_tokens),
        "alpha": layer_alpha,
        "default_layer": int(default_layer),
        "chosen_layer": int(chosen_layer),
        "layers": layers,
        "default": default,
        "chosen": {key: layers[chosen_layer][key] for key in ("mae", "spearman")},
        "all_layers": all_layers,
        "one_layer_kib_per_request": dim * _BYTES_PER_VALUE / 1024,
        "all_vs_default_mae_change": (all_layers["mae"] - default["mae"]) / default["mae"],
    }


# ------------------------------------------------------------------ figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_targets(result: dict, path: pathlib.Path) -> None:
    """Grouped bars: test MAE per length bucket, one bar per regression target."""
    plt = _pyplot()
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
    """Test MAE (left axis) and Spearman (right axis) per layer, all-layers as horizontal lines."""
    plt = _pyplot()
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


def _fmt(value: float | None, spec: str) -> str:
    """`value` in format `spec`; 'n/a' for a missing or NaN value (an empty bucket)."""
    if value is None or not np.isfinite(value):
        return "n/a"
    return format(value, spec)


def _tokens(value: float | None) -> str:
    """Token counts with one decimal (3 significant digits would turn 1234 into 1.23e+03)."""
    return _fmt(value, ".1f")


def _corr(value: float | None) -> str:
    return _fmt(value, ".3f")


def _footer(result: dict, title: str, image: str) -> list[str]:
    """Goals (when present), the figure and the command that regenerates it."""
    lines = []
    for name, goal in result.get("goals", {}).items():
        verdict = "met" if goal["met"] else "not met"
        lines.append(f"Goal {name}: {goal['target']}; measured {_fmt(goal['measured'], '.3g')}: **{verdict}**.")
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
        f"The same linear readout fitted on raw, log and sqrt output lengths ({alpha_note}), "
        f"scored on {result['n_test']} test requests ({result['n_train']} training). MAE is in tokens, "
        f"by true length bucket: short < {low:g} <= medium < {high:g} <= long (M = {result['max_tokens']}).",
        "",
        "| Target | alpha | MAE | MAE short | MAE medium | MAE long | Spearman | Kendall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["targets"].items():
        buckets = row["mae_by_bucket"]
        label = f"**{name}**" if name == result["best_overall"] else name
        lines.append(f"| {label} | {row['alpha']:g} | {_tokens(row['mae'])} | {_tokens(buckets['short'])} | "
                     f"{_tokens(buckets['medium'])} | {_tokens(buckets['long'])} | {_corr(row['spearman'])} | "
                     f"{_corr(row['kendall'])} |")
    lines += ["", f"Lowest overall MAE: {result['best_overall']}.", ""]
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
        f"{_tokens(result['default']['mae'])} | {_corr(result['default']['spearman'])} |",
        f"| chosen layer {chosen} | {result['one_layer_kib_per_request']:g} | "
        f"{_tokens(result['chosen']['mae'])} | {_corr(result['chosen']['spearman'])} |",
        f"| all layers | {result['all_layers']['kib_per_request']:g} | "
        f"{_tokens(result['all_layers']['mae'])} | {_corr(result['all_layers']['spearman'])} |",
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
        lines.append(f"| {label} | {_tokens(row['cv_mae'])} | {_tokens(row['mae'])} | {_corr(row['spearman'])} |")
    lines.append("")
    return "\n".join(lines + _footer(result, title, image)) + "\n"
