"""The wall-clock section of docs/results.md (`leap eval versus-stock --save`): LEAP over stock vLLM per load
and arrival pattern, each with its interval over runs, the simulated ratio beside it, and the goals."""

from __future__ import annotations

import math
import pathlib

from evaluation.report_format import interval, pyplot, table
from evaluation.versus_stock import EXTRA_ARMS

ROWS = (("mean latency", "mean_latency"), ("P50 latency", "p50_latency"), ("P90 latency", "p90_latency"),
        ("P99 latency", "p99_latency"), ("mean per-token latency", "mean_ptl"), ("mean TTFT", "mean_ttft"),
        ("P99 TTFT", "p99_ttft"), ("throughput", "throughput"), ("longest quartile's P95 latency", "long_p95_latency"))


def plot_versus_stock(result: dict, path: pathlib.Path) -> None:
    """LEAP over stock, mean latency and mean per-token latency, per segment, with intervals over runs."""
    plt = pyplot()
    names = list(result["segments"])
    fig, ax = plt.subplots(figsize=(8, 3.8), dpi=120)
    for offset, (label, key, color) in enumerate((("mean latency", "mean_latency", "tab:blue"),
                                                  ("mean per-token latency", "mean_ptl", "tab:orange"))):
        xs = [i + 0.2 * (offset - 0.5) for i in range(len(names))]
        figs = [result["segments"][n]["leap_over_stock"][key] for n in names]
        values = [f["value"] for f in figs]
        low = [f["value"] - f["ci_low"] if f.get("ci_low") is not None and math.isfinite(f["ci_low"]) else 0
               for f in figs]
        high = [f["ci_high"] - f["value"] if f.get("ci_high") is not None and math.isfinite(f["ci_high"]) else 0
                for f in figs]
        ax.errorbar(xs, values, yerr=[low, high], fmt="o", color=color, capsize=3, label=f"LEAP / stock, {label}")
        sim = [(result.get("simulated", {}).get("segments", {}).get(n, {}).get(key) or {}).get("simulated")
               for n in names]
        ax.plot(xs, [v if v is not None else float("nan") for v in sim], "x", color=color, label=f"simulated, {label}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("LEAP over stock vLLM")
    ax.set_title("Wall clock, through the OpenAI API (intervals over runs)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_versus_stock(result: dict, image: str) -> str:
    settings = result.get("settings", {})
    capacity = result.get("capacity", {})
    cost = result.get("cost", {})
    segments = result["segments"]
    names = list(segments)
    arms = [a for a in ("leap", "oracle", *EXTRA_ARMS) if any(f"{a}_over_stock" in segments[n] for n in names)]
    title = "LEAP against stock vLLM on the wall clock" + (" (quick)" if result.get("quick") else "")
    text = [
        f"## {title}", "",
        f"`leap eval versus-stock{' --quick' if result.get('quick') else ''} --save`: stock vLLM's OpenAI server "
        f"and `leap serve`, each at its defaults, a fresh server per run, one streaming client; "
        f"{settings.get('requests')} held-out ShareGPT requests per segment and run, sampled at temperature "
        f"{result.get('decoding', {}).get('temperature')} with a seed per request (the same in every arm), "
        f"natural end of sequence within {settings.get('max_tokens')} tokens, prompts of at most "
        f"{settings.get('max_prompt_tokens')} tokens; {settings.get('repeats')} runs of each arm, arms alternating. "
        f"Loads are fractions of stock's sustained capacity on this request mix, "
        f"{capacity.get('rps', float('nan')):.3f} requests/s ({capacity.get('generated_tok_s', float('nan')):.0f} "
        f"generated tok/s while at least half of {capacity.get('requests')} requests released at once ran, "
        f"{capacity.get('mean_output_tokens', float('nan')):.0f} tokens a request). Every cell is LEAP over stock, the "
        f"geometric mean of the runs' ratios with a 95% t-interval over runs. Simulated: the same segments "
        f"replayed through the simulator's stock arm and LEAP at R 512, K 64 "
        f"({result.get('simulated', {}).get('step_model_source', 'no step model recorded')}).", "",
        f"![LEAP over stock]({image})", ""]
    rows = []
    for label, key in ROWS:
        rows.append([label, *(interval(segments[n]["leap_over_stock"].get(key)) for n in names)])
    for arm in arms[1:]:
        rows.append([f"{arm}: mean latency", *(interval(segments[n].get(f"{arm}_over_stock", {}).get("mean_latency"))
                                                for n in names)])
    sim = result.get("simulated", {}).get("segments", {})
    for label, key in (("simulated mean latency", "mean_latency"), ("simulated mean per-token latency", "mean_ptl")):
        cells = []
        for n in names:
            s = sim.get(n, {}).get(key)
            cells.append("n/a" if not s else f"{s['simulated']:.3f}" + ("" if s.get("inside") is None
                                                                       else " (inside)" if s["inside"] else " (outside)"))
        rows.append([label, *cells])
    rows.append(["lengths matched stock's", *(f"{segments[n]['lengths_matched']}/{segments[n]['lengths_compared']}"
                                              for n in names)])
    text.append(table(["LEAP / stock", *names], rows))
    stats = [run[arm].get("leap_stats") or {} for run in result.get("runs", []) for arm in ("leap",) if arm in run]
    held, steps = sum(st.get("held_steps") or 0 for st in stats), sum(st.get("steps") or 0 for st in stats)
    text += ["", f"LEAP held decode candidates out in {held:,} of its {steps:,} steps over {len(stats)} runs"
             + (": the decode order never acted, so no difference in this table is an ordering gain."
                if stats and held == 0 else ".")]
    goals = result.get("goals", {})
    missed = [f"{k} {g['value']:.3f}" + (f" [{g['ci'][0]:.3f}, {g['ci'][1]:.3f}]" if None not in g["ci"] else "")
              for k, g in goals.items() if not g["met"]]
    text += ["", f"Goals met: {sum(g['met'] for g in goals.values())} of {len(goals)}"
             + (f"; missed: {'; '.join(missed)}." if missed else "."),
             "", "What a run costs here: " + "; ".join(f"{arm} {c['start_s']:.0f} s to start, {c['run_s']:.0f} s in all"
                                                       for arm, c in cost.items())
             + f"; the whole study {result.get('study_s', float('nan')) / 60:.0f} min."]
    return "\n".join(text)
