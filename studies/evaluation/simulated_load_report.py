"""The load study's section of docs/results.md (`leap eval load --save`) and its plot."""

from __future__ import annotations

import pathlib

import numpy as np

from evaluation.report_format import SIG, finish, flat_interval, g, interval, percent, pyplot, table
from evaluation.simulation import _REFERENCES, STOCK, TAIL_GOAL, TAIL_MEAN_GOAL


def plot_load(result: dict, path: pathlib.Path) -> None:
    """Mean PTL against load (fraction of sustained capacity), one line per policy, 95% intervals over seeds."""
    plt = pyplot()
    sweep = result["sweep"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for policy, values in sweep["mean_ptl"].items():
        values = np.asarray(values)
        error = np.vstack((values - np.asarray(sweep["mean_ptl_ci_low"][policy]),
                           np.asarray(sweep["mean_ptl_ci_high"][policy]) - values))
        ax.errorbar(sweep["multipliers"], values, yerr=error, marker="o", capsize=3,
                    label=policy, linestyle="--" if policy in (*_REFERENCES, STOCK) else "-")
    ax.set_xlabel("load (fraction of sustained FCFS capacity)")
    ax.set_ylabel("mean per-token latency (s/token)")
    ax.set_title(f"Simulated mean PTL vs load ({_workloads_in_words(result)})")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _workloads_in_words(result: dict) -> str:
    """"30 paired seeds", or "5 train/test splits x 6 paired seeds" (results saved before splits: one)."""
    seeds = f"{result['seeds']} paired seeds"
    splits = result.get("splits", 1)
    return seeds if splits == 1 else (f"{splits} train/test splits (each partitions the target anew and refits "
                                      f"every predictor) x {seeds} each")


def _interval_basis(result: dict) -> str:
    """What the intervals resample, in words."""
    return "seeds" if result.get("splits", 1) == 1 else "splits, then seeds within each"


def section_load(result: dict, image: str) -> str:
    """docs/results.md section: latency and PTL per policy at each load, and LEAP's paired ratios."""
    rows = []
    for load, policies in result["table"].items():
        for policy, f in policies.items():
            rows.append([f"{float(load):g}", policy, g(f["mean_latency_s"]), g(f["p95_latency_s"]),
                         f"{g(f['mean_ptl'])} [{g(f['mean_ptl_ci_low'])}, {g(f['mean_ptl_ci_high'])}]",
                         g(f["p95_ptl"]), g(f["long_p95_latency_s"]) if "long_p95_latency_s" in f else "n/a"])
    rho = ", ".join(f"{name} {g(value)}" for name, value in result.get("spearman", {}).items())
    ratio_rows = [[key, interval(r, SIG)] for key, r in result["ratios"].items()]
    overloads = "; ".join(f"{o['load']:g} over {o['horizon_requests']} arrivals ({g(o['horizon_s'])} s)"
                          for o in result.get("overloads", []))
    untouched = result.get("untouched")
    pool = (f"the untouched test slice ({result['n_pool']} rows: {untouched['rows']})" if untouched
            else f"a pool of {result['n_pool']} held-out prompts")
    from evaluation.selections import CHAT_TRAIN

    window = ("" if result.get("train", CHAT_TRAIN) == CHAT_TRAIN
              else f", trained on {result['train']} ({result.get('n_train', '?')} rows)")
    text = [
        ("## The final table: simulated scheduling on the untouched test slice" if untouched
         else "## Simulated scheduling under load") + window,
        "",
        f"End-to-end latency and per-token latency (PTL = latency / output tokens) of each decode policy in the "
        f"step-loop simulator at R = {result.get('max_resident', '?')}, K = {result.get('decode_slots', '?')}, with "
        f"the step-time model calibrated on the live engine at that R and K ({result.get('step_model_source', '')}"
        f"). {result['n_requests']} requests "
        f"per run drawn from {pool}, Poisson arrivals at fractions of the "
        f"sustained FCFS capacity ({_capacity(result['capacity_rps'])}; {result['capacity_measure']}); "
        f"{_workloads_in_words(result)} (every policy replays the same draw), mean PTL with its 95% bootstrap "
        f"interval over {_interval_basis(result)}. Overloads (queues grow without bound, so figures depend on the "
        f"horizon): "
        f"{overloads or 'none'}. The oracle is countdown on the true lengths"
        + (f"; predictor Spearman on the pool{'' if result.get('splits', 1) == 1 else 's (mean over splits)'}: "
           f"{rho}." if rho else "."),
        "",
        table(["load", "policy", "mean latency (s)", "P95 latency (s)", "mean PTL (s/token) [95% CI]",
                "P95 PTL (s/token)", "long-request P95 latency (s)"], rows),
        "",
        f"LEAP's mean PTL over each reference at {result['headline_load']:g} of capacity, paired by seed "
        f"(best baseline: {result.get('best_baseline')}), with 95% bootstrap intervals over "
        f"{_interval_basis(result)}:",
        "",
        table(["ratio", "value [95% CI]"], ratio_rows),
    ]
    text += (_stock_lines(result) + _best_baseline_lines(result) + _ratios_by_load_lines(result)
             + _tail_lines(result))
    if result.get("bursty"):
        bursty = {**result["bursty"], "headline_load": result["headline_load"], "splits": result.get("splits", 1)}
        text += ["", "With bursty arrivals (the Azure conversation trace's gaps, windows rescaled to the load), "
                     "LEAP's mean PTL over each reference:", "",
                 *[f"- {key}: {interval(r, SIG)}" for key, r in bursty["ratios"].items()], *_tail_lines(bursty)]
    if result.get("long_p95_over_fcfs"):
        goals = result.get("tail_goal", {})
        rows = [[name, interval(r, SIG), *((interval(goals[name]["mean_ptl_over_fcfs"], SIG),
                                        "yes" if goals[name]["meets_goal"] else "no") if name in goals else ())]
                for name, r in result["long_p95_over_fcfs"].items()]
        text += ["", f"Long requests (true length >= {g(result['long_requests']['min_tokens'])} tokens, the pool's "
                     f"top decile): P95 latency over FCFS's at {result['headline_load']:g}, paired by seed (the tail "
                     f"goal: <= {TAIL_GOAL:g} while mean PTL <= {TAIL_MEAN_GOAL:g} x FCFS's):", "",
                 table(["policy", "long-request P95 / FCFS [95% CI]",
                         *(("mean PTL / FCFS [95% CI]", "meets the tail goal") if goals else ())], rows)]
    text += _guard_lines(result)
    return finish(text, result, "Mean PTL vs load", image)


def _capacity(capacity: float | dict) -> str:
    """A capacity figure: a bare number (results saved before the engine measurement) or {value, ci_low,
    ci_high, source}."""
    if not isinstance(capacity, dict):
        return f"{g(capacity)} requests/s"
    interval = (f" [{g(capacity['ci_low'])}, {g(capacity['ci_high'])}]" if capacity.get("ci_low") is not None
                else " (no interval)")
    return f"{g(capacity['value'])}{interval} requests/s, {capacity['source']}"


def _stock_lines(result: dict) -> list[str]:
    """What the stock vLLM and adaptive-slot arms are (results saved before them have neither)."""
    if "stock_capacity_rps" not in result:
        return []
    stock, capacity = result.get("stock", {}), result["capacity_rps"]
    capacity = capacity["value"] if isinstance(capacity, dict) else capacity
    lines = ["", f"`stock` is stock vLLM at its CPU defaults on the same step model: {stock.get('how', '')} "
                 f"(max_num_seqs {stock.get('max_num_seqs')}, max_num_batched_tokens "
                 f"{stock.get('max_num_batched_tokens')}); its own sustained capacity on the pool is "
                 f"{g(result['stock_capacity_rps'])} requests/s against the {g(capacity)} the loads are fractions "
                 f"of. `*_over_stock_latency` rows divide mean latency, the others mean PTL."]
    rule = result.get("adaptive_slots")
    if rule:
        lines[-1] += (f" `leap-adaptive` is LEAP's countdown decoding, each step, the fewest of at most "
                      f"{rule['max_slots']} (at least {rule['min_slots']}) requests whose service rate stays "
                      f"{percent(rule['margin'])} ahead of the demand (arriving predicted tokens a second, "
                      f"{g(rule['demand_tau_s'])} s kernel, plus the resident backlog over {g(rule['drain_s'])} s) "
                      f"on the step model's curve, or all of them where no such number keeps up or holding out "
                      f"saves under {percent(rule['flat_tolerance'])} of a step (`leap_core.decode_slots`).")
    return lines


def _guard_lines(result: dict) -> list[str]:
    """What the Gittins order ranks by and which tail guard each guarded order runs (chosen on training rows)."""
    gittins = result.get("gittins", {})
    guards = result.get("tail_guards") or ({"leap-gittins-guard": result["tail_guard"]} if result.get("tail_guard")
                                           else {})
    if not guards:
        return []
    lines = ["", f"`leap-gittins` ranks by the Gittins index of the remaining length under LEAP's error distribution "
                 f"({gittins.get('bins')} bins of predicted length from {gittins.get('validation_pairs')} "
                 f"{gittins.get('fitted_on')}), weight 1/length. A guarded order adds the tail guard chosen on the "
                 f"training rows (cross-fitted predictions): its waiting cap and its wait aging (priority x "
                 f"exp(-wait_aging x steps waited / predicted remaining), HRRN-style):", ""]
    for name, guard in guards.items():
        validation = guard.get("validation")
        seen = (f"; there long P95 {g(validation['long_p95_over_fcfs']['value'])} x FCFS's at mean PTL "
                f"{g(validation['mean_ptl_over_fcfs']['value'])} x" if validation else "")
        verdict = ("the cheapest knob meeting the goal there" if guard["met_on_validation"]
                   else "none met the goal there; the lowest tail that keeps the mean goal" if validation
                   else "none met the goal there; the cap with the lowest tail")  # chosen by the cap alone
        lines.append(f"- `{name}`: cap {guard['waiting_cap']}, wait aging {g(guard.get('wait_aging', 0.0))} "
                     f"({guard['seeds']} seeds of {guard['n_requests']} requests at {guard['load']:g}; {verdict}"
                     f"{seen}).")
    return lines


def _best_baseline_lines(result: dict) -> list[str]:
    """Where the best baseline was chosen, and each baseline's validation figures when it was on validation."""
    chosen_on = result.get("best_baseline_chosen_on")
    if not chosen_on:
        return []
    if chosen_on != "validation":
        return ["", f"The best baseline ({result['best_baseline']}) was chosen on these test seeds "
                    f"(the least mean PTL at {result['headline_load']:g}), which flatters it."]
    setup = result.get("validation", {})
    by_split = [row["best_baseline"] for row in result.get("validation_by_split", [])]
    per_split = ([f"Each of the {len(by_split)} splits chose on its own stream rows: "
                  + ", ".join(f"{name} on {by_split.count(name)}" for name in dict.fromkeys(by_split))
                  + "; the table is the first split's."] if len(by_split) > 1 else [])
    rows = [[name, f"{g(v['mean_ptl'])} [{g(v['mean_ptl_ci_low'])}, {g(v['mean_ptl_ci_high'])}]",
             g(v["spearman"])] for name, v in result.get("baseline_validation", {}).items()]
    return ["", f"The best baseline ({result['best_baseline']}) was chosen on validation rows, never on the test "
                f"pool: the {result.get('n_validation', '?')} feedback-stream rows of the target (which no "
                f"baseline was fitted on and the pool does not hold), each baseline's countdown replayed at "
                f"{g(setup.get('load'))} of their capacity, {setup.get('n_requests', '?')} requests x "
                f"{setup.get('seeds', '?')} seeds; the least mean PTL wins (FCFS there: "
                f"{g(setup.get('fcfs', {}).get('mean_ptl'))} s/token):", "",
            table(["baseline", "validation mean PTL (s/token) [95% CI]", "validation Spearman"], rows),
            *([""] + per_split if per_split else [])]


def _ratios_by_load_lines(result: dict) -> list[str]:
    """The paired ratios at every load, one column a load (nothing when the headline is the only load)."""
    by_load = result.get("ratios_by_load")
    if not by_load or len(by_load) < 2:
        return []
    loads = list(by_load)
    keys = list(dict.fromkeys(key for ratios in by_load.values() for key in ratios))
    rows = [[key, *(interval(by_load[m][key], SIG) if key in by_load[m] else "n/a" for m in loads)] for key in keys]
    return ["", f"The same ratios at every load (paired by seed, 95% intervals over {_interval_basis(result)}):", "",
            table(["ratio", *(f"{float(m):g}" for m in loads)], rows)]


def _tail_lines(result: dict) -> list[str]:
    """Each policy's tail at the headline load: latency and PTL quantiles, longest waits, long requests."""
    tail = result.get("tail")
    if not tail:
        return []
    head = str(result["headline_load"])
    figures = ("p50_latency_s", "p95_latency_s", "p99_latency_s", "p95_ptl", "p99_ptl", "max_wait_s",
               "max_held_out_steps", "long_p95_latency_s", "long_p99_latency_s")

    def cell(row: dict, name: str) -> str:  # intervals on the P95 and P99 figures, to keep the table short
        return flat_interval(row, name) if "p95" in name or "p99" in name else g(row[name])

    rows = [[policy, *(cell(by_load[head], f) for f in figures)] for policy, by_load in tail.items() if head in by_load]
    return ["", f"Tail at {result['headline_load']:g} of capacity ({result.get('arrivals', 'poisson')} arrivals), "
                f"mean over the seeds [95% CI over {_interval_basis(result)}]: latency (s) and "
                f"PTL (s/token) quantiles; the longest wait from arrival to admission (s); the most consecutive "
                f"steps a resident request was held out of decoding; long requests' P95 and P99 latency (s):", "",
            table(["policy", "P50 lat", "P95 lat", "P99 lat", "P95 PTL", "P99 PTL", "max wait", "max held out",
                    "long P95 lat", "long P99 lat"], rows)]
