"""The tail study's section of docs/results.md (`leap eval tail --save`) and its plot."""

from __future__ import annotations

import pathlib

import numpy as np

from evaluation.report_format import SIG, finish, flat_interval, interval, pyplot, table


def plot_tail(result: dict, path: pathlib.Path) -> None:
    """A column per knob (waiting cap, aging, wait aging): long-request P95 latency above, mean PTL below, FCFS's
    as dashed lines."""
    plt = pyplot()
    columns = [(key, knob, label) for key, knob, label in (
        ("cap", "waiting_cap", "waiting cap (steps held out)"),
        ("aging", "aging", f"aging rate (waiting cap {result['aging_waiting_cap']})"),
        ("wait_aging", "wait_aging", f"wait aging (waiting cap {result['aging_waiting_cap']})")) if result.get(key)]
    fig, axes = plt.subplots(2, len(columns), figsize=(4 * len(columns), 5.5), dpi=120, sharex="col", squeeze=False)
    for (key, knob, label), (top, bottom) in zip(columns, axes.T):
        rows = result[key]
        x = np.arange(len(rows))  # categorical axis: caps and agings span decades and include 0
        for ax, figure, unit in ((top, "long_p95_latency_s", "long-request P95 latency (s)"),
                                 (bottom, "mean_ptl", "mean PTL (s/token)")):
            ax.plot(x, [r[figure] for r in rows], "o-", label="countdown")
            ax.axhline(result["fcfs"][figure], color="grey", linestyle="--", label="FCFS")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
        bottom.set_xticks(x, [f"{r[knob]:g}" for r in rows])
        bottom.set_xlabel(label)
    axes[0, 0].legend(fontsize="small")
    fig.suptitle(f"Long requests (>= {result['long_threshold_tokens']:g} tokens) at {result['multiplier']:g}x load")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_tail(result: dict, image: str) -> str:
    """docs/results.md section: the waiting cap and aging against long-request tail latency and mean PTL."""
    fcfs = result["fcfs"]

    goal = result.get("goal")  # results saved before the goal columns have none

    def rows(key: str, knob: str) -> list[list[str]]:
        figures = ("long_p95_latency_s", "all_p95_latency_s", "mean_ptl")
        ratios = (lambda r: [interval(r["long_p95_over_fcfs"], SIG), interval(r["mean_ptl_over_fcfs"], SIG),
                             "yes" if r["meets_goal"] else "no"]) if goal else (lambda r: [])
        return [[f"{r[knob]:g}", *(flat_interval(r, f) for f in figures), *ratios(r)] for r in result[key]] + \
            [["FCFS", *(flat_interval(fcfs, f) for f in figures), *(["1", "1", "no"] if goal else [])]]

    columns = ["long P95 latency (s) [95% CI]", "all P95 latency (s) [95% CI]", "mean PTL (s/token) [95% CI]",
               *(["long P95 / FCFS [95% CI]", "mean PTL / FCFS [95% CI]", "meets the goal"] if goal else [])]
    text = [
        "## Long-request tail: waiting cap, aging and wait aging",
        "",
        f"P95 latency of long requests (true length >= the pool's {result['long_quantile']:g} quantile, "
        f"{result['long_threshold_tokens']:g} tokens) and of all requests, with mean PTL, under countdown at "
        f"{result['multiplier']:g} of the sustained FCFS capacity, {result['n_requests']} requests, mean over "
        f"{result['seeds']} paired seeds with 95% bootstrap intervals. The waiting cap forces a resident request into the decode batch once it "
        f"has been held out that many consecutive steps. Aging (as in leap_core/policy.py, after TIE) orders by "
        f"predicted remaining x exp(-aging x held_out), where held_out counts the consecutive steps the request "
        f"was not decoded and restarts at 0 when it is. Wait aging (the tail guard, HRRN-style) orders by "
        f"predicted remaining x exp(-w x waited / predicted remaining), where waited counts every step the "
        f"request was resident and not decoded, never reset; aging and wait-aging rows use cap "
        f"{result['aging_waiting_cap']}.",
        "",
        table(["waiting cap", *columns], rows("cap", "waiting_cap")),
        "",
        table(["aging", *columns], rows("aging", "aging")),
        *(["", table(["wait aging", *columns], rows("wait_aging", "wait_aging"))] if result.get("wait_aging")
          else []),
    ]
    if goal:
        met = ", ".join(", ".join(f"{knob} {value:g}" for knob, value in row.items()) for row in result["met_by"])
        text += ["", f"The goal: long-request P95 latency <= {goal['long_p95_over_fcfs']:g} x FCFS's while mean PTL "
                     f"stays <= {goal['mean_ptl_over_fcfs']:g} x FCFS's (point values, paired by seed): "
                     + (f"met by {met}." if met else "no cap, aging or wait aging rate meets it.")]
    return finish(text, result, "Long-request tail", image)
