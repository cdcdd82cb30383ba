"""PNG figures attached to MLflow runs: how a readout ranks lengths, and how policies compare.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so plotting never touches a
global backend or window and is safe inside flows and worker threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike


def available() -> bool:
    """Whether matplotlib is installed; plots are optional for logging a run."""
    try:
        import matplotlib  # noqa: F401  (only whether it is installed)
    except ImportError:
        return False
    return True


def _figure(width: float = 5.5, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, folder: str | Path, file_name: str) -> Path:
    path = Path(folder) / file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def prediction_scatter(true: ArrayLike, pred: ArrayLike, folder: str | Path,
                       file_name: str = "pred_vs_true.png", max_tokens: int | None = None) -> Path:
    """Predicted against true output length on log axes, where a ranking error is visible at any scale."""
    true_lengths = np.maximum(np.asarray(true, dtype=float), 1.0)
    pred_lengths = np.maximum(np.asarray(pred, dtype=float), 1.0)
    figure = _figure()
    axes = figure.add_subplot()
    axes.scatter(true_lengths, pred_lengths, s=6, alpha=0.35, linewidths=0)
    upper = float(max(true_lengths.max(initial=1.0), pred_lengths.max(initial=1.0), max_tokens or 1))
    axes.plot([1.0, upper], [1.0, upper], color="black", linewidth=0.8, label="prediction = truth")
    if max_tokens:
        axes.axhline(max_tokens, color="grey", linestyle=":", linewidth=0.8, label="token budget")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("true output length (tokens)")
    axes.set_ylabel("predicted output length (tokens)")
    axes.set_title(f"Predicted vs true length (n={true_lengths.size})")
    axes.legend(loc="upper left", fontsize="small")
    return _save(figure, folder, file_name)


def bucket_bar_chart(values: Mapping[str, float], folder: str | Path,
                     file_name: str = "mae_by_bucket.png", ylabel: str = "mean absolute error (tokens)",
                     title: str = "MAE by true-length bucket") -> Path:
    """One bar per length bucket, in the order given (short to long)."""
    labels = [str(label) for label in values]
    heights = [float(value) for value in values.values()]
    figure = _figure(width=max(5.0, 0.7 * len(labels) + 2.0))
    axes = figure.add_subplot()
    bars = axes.bar(range(len(labels)), heights)
    axes.bar_label(bars, labels=[f"{h:.0f}" if np.isfinite(h) else "" for h in heights], fontsize="small")
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axes.set_xlabel("true output length bucket (tokens)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    return _save(figure, folder, file_name)


def latency_cdf(latencies: Mapping[str, ArrayLike], folder: str | Path,
                file_name: str = "latency_cdf.png", xlabel: str = "latency (s)") -> Path:
    """Empirical CDF of request latency, one line per policy, on a log x axis to show the tail."""
    figure = _figure()
    axes = figure.add_subplot()
    for policy, values in latencies.items():
        samples = np.sort(np.asarray(values, dtype=float))
        samples = samples[np.isfinite(samples)]
        if samples.size == 0:
            continue
        fraction = np.arange(1, samples.size + 1) / samples.size
        axes.step(samples, fraction, where="post", label=f"{policy} (n={samples.size})")
    axes.set_xscale("log")
    axes.set_ylim(0.0, 1.0)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("fraction of requests")
    axes.set_title("Latency CDF by policy")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    return _save(figure, folder, file_name)


def readout_plots(true: ArrayLike, pred: ArrayLike, max_tokens: int, folder: str | Path) -> dict[str, Path]:
    """The two figures logged with every readout: the scatter and the MAE-by-bucket chart."""
    from leap_core.metrics import bucket_edges, mae_by_bucket

    low, high = (round(edge) for edge in bucket_edges(max_tokens))
    labels = {"short": f"short (<{low})", "medium": f"medium ({low}-{high - 1})",
              "long": f"long (>={high})", "all": "all"}
    buckets = mae_by_bucket(true, pred, max_tokens)
    return {
        "pred_vs_true": prediction_scatter(true, pred, folder, max_tokens=max_tokens),
        "mae_by_bucket": bucket_bar_chart({labels.get(k, k): v for k, v in buckets.items()}, folder),
    }
