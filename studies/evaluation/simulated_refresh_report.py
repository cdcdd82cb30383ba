"""The refresh study's section of docs/results.md (`leap eval refresh --save`) and its plot."""

from __future__ import annotations

import pathlib

import numpy as np

from evaluation.report_format import SIG, finish, g, interval, pyplot, table


def plot_refresh(result: dict, path: pathlib.Path) -> None:
    """MAE of the held remaining-length estimate at each captured point, countdown against refresh."""
    plt = pyplot()
    points = result["life_error"]["per_point"]
    x = np.array([max(p["generated"], 1) for p in points], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for arm, marker in (("countdown", "o"), ("refresh", "s")):
        values = np.array([p[f"{arm}_mae"]["value"] for p in points])
        error = np.vstack((values - [p[f"{arm}_mae"]["ci_low"] for p in points],
                           np.array([p[f"{arm}_mae"]["ci_high"] for p in points]) - values))
        ax.errorbar(x, values, yerr=error, marker=marker, capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generated tokens (0 plotted at 1)")
    ax.set_ylabel("MAE of the remaining-length estimate (tokens)")
    ax.set_title("Estimate held by the scheduler over each request's life (95% CI)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _agreement(result: dict) -> str:
    agreement = result.get("length_agreement") or {}
    if not agreement.get("n"):
        return ""
    return (f" The decode-state pass regenerated each output: {100 * agreement['equal_share']:.0f}% of "
            f"{agreement['n']} have the corpus' exact length (greedy both times; batching moves bf16 numerics), "
            f"median relative difference {100 * agreement['median_relative_difference']:.1f}%.")


def section_refresh(result: dict, image: str) -> str:
    """docs/results.md section: the measured refresh against countdown, latency and error, with intervals."""
    rows = [[arm, g(f["mean_latency_s"]), g(f["p95_latency_s"]),
             f"{g(f['mean_ptl'])} [{g(f['mean_ptl_ci_low'])}, {g(f['mean_ptl_ci_high'])}]"]
            for arm, f in result["table"].items()]
    life = result["life_error"]
    error_rows = [[str(p["generated"]), str(p["n"]), interval(p["countdown_mae"], SIG), interval(p["refresh_mae"], SIG)]
                  for p in life["per_point"]]
    error_rows.append(["over life", str(result.get("n_pool", "")), interval(life["over_life"]["countdown"], SIG),
                       interval(life["over_life"]["refresh"], SIG)])
    readout = result.get("refresh_readout", {})
    verdict = ("refresh wins: the interval of its PTL ratio lies below 1, so serving offers it"
               if result["refresh_wins"] else
               "refresh does not win: the interval of its PTL ratio does not lie below 1, so serving keeps "
               "countdown")
    text = [
        "## Refreshing predictions vs countdown (measured)",
        "",
        f"Countdown predicts once at prefill and schedules by predicted minus generated. Refresh re-estimates "
        f"the remaining length at generated = {', '.join(str(p) for p in result['refresh_at'])} with a readout "
        f"of the layer-{readout.get('layer', '?')} state the engine computed at that point "
        f"({readout.get('how', '')}), and pays {g(1e3 * result['refresh_cost_s'])} ms per refreshed request "
        f"(the readout's measured cost). Both arms are measured: {result['n_pool']} held-out ShareGPT prompts, "
        f"the refresh readout cross-fitted by prompt ({readout.get('folds', '?')} folds, "
        f"{readout.get('train_rows', '?')} training rows a fold). Simulated at {result['load']:g} of the sustained "
        f"FCFS capacity, R = {result.get('max_resident', '?')}, K = {result.get('decode_slots', '?')}, "
        f"{result['n_requests']} requests, {result['seeds']} paired seeds." + _agreement(result),
        "",
        table(["arm", "mean latency (s)", "P95 latency (s)", "mean PTL (s/token) [95% CI]"], rows),
        "",
        f"Refresh / countdown, paired by seed: mean PTL {interval(result['ratios']['refresh_over_countdown'], SIG)}, "
        f"mean latency {interval(result['ratios']['refresh_over_countdown_latency'], SIG)}; {verdict}.",
        "",
        "MAE (tokens) of the remaining-length estimate each arm holds, at each point a request reaches, with "
        "95% bootstrap intervals over requests:",
        "",
        table(["generated", "requests", "countdown MAE", "refresh MAE"], error_rows),
    ]
    return finish(text, result, "Countdown vs refresh", image)
