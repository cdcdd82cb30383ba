"""`leap simulate`: replay an Azure trace through the step-loop simulator under one decode policy."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path

import numpy as np
import typer

from leap_cli.output import emit
from study_cli.apps import commands as app


class SimPolicy(StrEnum):
    fcfs = "fcfs"
    countdown = "countdown"
    oracle = "oracle"


def _read_predictions(path: Path, n: int) -> np.ndarray:
    predicted = np.loadtxt(path, dtype=np.float64, ndmin=1)
    if predicted.shape[0] < n:
        raise typer.BadParameter(f"{path} has {predicted.shape[0]} predictions for {n} requests",
                                 param_hint="--predictions")
    return predicted[:n]


@app.command("simulate")
def simulate_command(
    trace: Path | None = typer.Option(None, "--trace", exists=True, dir_okay=False,
                               help="Azure trace CSV; default: the shared conv trace."),
    policy: SimPolicy = typer.Option(SimPolicy.countdown, "--policy",
                                     help="fcfs, countdown (on --predictions or noisy ones) or oracle "
                                          "(countdown on the true lengths)."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", min=1e-6,
                                     help="Arrival speed-up: 1.0 replays the real timestamps, 2.0 twice as "
                                          "fast. Raise it until the engine queues: ordering only matters then."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Use the first N requests of the trace."),
    predictions: Path | None = typer.Option(None, "--predictions", exists=True, dir_okay=False,
                                     help="Predicted output length per request, one per line, in trace order."),
    noise_spearman: float | None = typer.Option(None, "--noise-spearman", min=0.0, max=1.0,
                                         help="Without --predictions, countdown uses the true lengths with "
                                              "log-normal noise of this Spearman (default 0.7)."),
    max_resident: int = typer.Option(512, "--max-resident", min=1),
    decode_slots: int = typer.Option(64, "--decode-slots", min=1),
    waiting_cap: int = typer.Option(128, "--waiting-cap", min=0),
    aging: float = typer.Option(0.0, "--aging", min=0.0),
    seed: int = typer.Option(0, "--seed", help="Seed of the prediction noise."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Mean and tail per-token latency, TTFT and throughput of a trace under one policy.

    The default step model stands for a small model on two CPU cores; `--rate-scale` compresses the
    trace's time so the engine saturates.
    """
    from scipy.stats import spearmanr

    from harness.datasets import load_trace, trace_path
    from leap_core.simulator import SimConfig, simulate
    from study_harness.noise import noisy_predictions

    if policy is not SimPolicy.countdown and (predictions is not None or noise_spearman is not None):
        raise typer.BadParameter("only --policy countdown reads predictions", param_hint="--predictions")
    if predictions is not None and noise_spearman is not None:
        raise typer.BadParameter("give --predictions or --noise-spearman, not both", param_hint="--noise-spearman")

    requests = load_trace(trace or trace_path("conv"), limit=limit)
    arrival = requests["arrival"] / rate_scale
    true_lengths = requests["output_tokens"]
    n = arrival.shape[0]

    spearman = None
    if policy is SimPolicy.oracle:
        predicted = true_lengths.astype(np.float64)
        spearman = 1.0
    elif policy is SimPolicy.countdown:
        if predictions is not None:
            predicted = _read_predictions(predictions, n)
        else:
            target = 0.7 if noise_spearman is None else noise_spearman
            try:
                predicted = noisy_predictions(true_lengths, target, seed=seed)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--noise-spearman") from None
        spearman = float(spearmanr(predicted, true_lengths).statistic)
    else:
        predicted = true_lengths.astype(np.float64)  # not read by FCFS

    config = SimConfig(max_resident=max_resident, decode_slots=decode_slots, waiting_cap=waiting_cap,
                       aging=aging, policy="fcfs" if policy is SimPolicy.fcfs else "countdown")
    started = time.perf_counter()
    result = simulate(arrival, requests["prompt_tokens"], true_lengths, predicted, config)
    elapsed = time.perf_counter() - started

    span = float(arrival.max() - arrival.min()) if n > 1 else 0.0
    summary = {"policy": policy.value, "rate_scale": rate_scale, "spearman_of_predictions": spearman,
               "offered_rate": n / span if span > 0 else None}
    summary.update(result.aggregates())
    summary.update({"steps": result.steps, "sim_seconds": round(elapsed, 3)})
    emit(summary, as_json, title=f"simulate {policy.value}")
