"""The simulator checked against the wall clock: the same workloads replayed on the real engine and simulated.

Every simulated study (`leap eval load`, `tail`, `refresh`) prices steps with a step-time model and
quotes loads as fractions of a capacity. This study checks both against real time, on requests that
neither chose:

1. **Capacity on the engine.** Saturated FCFS runs (every request waiting at t = 0) of `capacity_runs`
   disjoint samples of held-out prompts, on the wall clock; each run's sustained rate is counted between
   the 25th and the 75th percentile of its completions (as `fcfs_capacity` counts the simulator's).
2. **The step model**, fitted on the steps of those runs only (each step's loop period: the step and the
   serving loop's work around it): the requests it is validated on below never entered its fit. Each
   run is also simulated; the engine's rate over the simulator's, averaged over the runs with a t
   interval (`engine_over_simulator`), carries the engine's capacity to any pool's length mix: the
   replayed requests' capacity is that factor x their simulated FCFS capacity (a small sample's mix moves
   the engine's and the simulator's rate alike, so the factor varies far less than either rate).
3. **Wall-clock replays** of other held-out requests with their recorded lengths at each load (a fraction
   of the measured capacity) under FCFS, LEAP, the baseline and the oracle, `repeats` times with fresh
   Poisson arrivals, the policies in the reverse order every other repeat.
4. **The same runs simulated**: the same arrivals, lengths and predictions through `leap_core.simulator`
   with that step model.

Figures: the per-request latency error of simulator against wall clock (median, P90), and for every
policy ratio at every load (mean PTL of a policy over FCFS's, LEAP over the oracle and over the
baseline) the live value with a 95% bootstrap interval (over repeats, then requests within each, both
arms paired) beside the simulated value, and whether the simulated value lies inside the live interval.

`quick` keeps the questions and shrinks the work to minutes on two CPU cores: prompts of at most
QUICK["max_prompt_tokens"] tokens and recorded lengths divided by QUICK["length_divisor"] (at least one
token; the predictions stay the readout's, as the engine sees them), for the capacity runs and the
replays alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from leap_core.intervals import hierarchical_bootstrap_ci, mean_over_runs, ratio_of_means

QUICK = {"length_divisor": 8, "max_prompt_tokens": 256}
REQUEST_ERROR_GOAL = 0.10  # median per-request latency error of the simulator against the wall clock


@dataclass
class FidelitySettings:
    n_requests: int = 30
    repeats: int = 6
    loads: tuple[float, ...] = (0.7, 0.9)
    baseline: str = "trail_mlp"
    capacity_runs: int = 3
    capacity_requests: int = 48  # per capacity run
    length_divisor: int = 1
    max_prompt_tokens: int | None = None
    max_tokens: int = 1024
    max_resident: int = 512
    decode_slots: int = 8
    waiting_cap: int = 128
    seed: int = 0

    @property
    def policies(self) -> tuple[str, ...]:
        return ("fcfs", "leap", self.baseline, "oracle")


def steady_rate(finish: np.ndarray) -> float:
    """Completions per second between the 25th and the 75th percentile of a saturated run's completions
    (neither the ramp-up nor the drain tail enters it)."""
    finish = np.sort(np.asarray(finish, dtype=np.float64))
    low, high = finish.size // 4, (3 * finish.size) // 4
    span = float(finish[high] - finish[low])
    if high <= low or span <= 0:
        raise ValueError(f"a saturated run of {finish.size} requests has no steady window to count")
    return (high - low) / span


def paired_ratio(num: np.ndarray, den: np.ndarray, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Ratio of mean PTL, numerator arm over denominator arm, of per-(repeat, request) figures laid out
    repeat after repeat, with a two-level bootstrap interval: repeats drawn with replacement, then requests
    within each, both arms jointly (`leap_core.intervals.hierarchical_bootstrap_ci`). A repeat's runs share
    the machine's state of those minutes, so a slow run moves every request in it: resampling requests
    alone would take one run's luck for a difference between the arms. `per_repeat`: each repeat's ratio."""
    num = np.asarray(num, dtype=np.float64).reshape(repeats, -1)
    den = np.asarray(den, dtype=np.float64).reshape(repeats, -1)
    interval = hierarchical_bootstrap_ci(ratio_of_means, num, den, seed=seed)
    return {**interval, "per_repeat": [float(r) for r in ratio_of_means(num, den)]}


def ratio_pairs(policies: Sequence[str], baseline: str) -> dict[str, tuple[str, str]]:
    """The ratios the study checks: every policy over FCFS, LEAP over the oracle and over the baseline."""
    pairs = {f"{p.replace('-', '_')}_over_fcfs": (p, "fcfs") for p in policies if p != "fcfs"}
    pairs["leap_over_oracle"] = ("leap", "oracle")
    pairs["leap_over_baseline"] = ("leap", baseline)
    return pairs


def compare(live_ptl: dict[str, np.ndarray], sim_ptl: dict[str, np.ndarray], pairs: dict[str, tuple[str, str]],
            repeats: int, seed: int = 0) -> dict[str, dict]:
    """{name: {live: {value, ci_low, ci_high}, sim, inside}} for each ratio of `pairs`."""
    out = {}
    for name, (num, den) in pairs.items():
        live = paired_ratio(live_ptl[num], live_ptl[den], repeats, seed)
        sim = float(sim_ptl[num].mean() / sim_ptl[den].mean())
        out[name] = {"live": live, "sim": sim, "inside": bool(live["ci_low"] <= sim <= live["ci_high"])}
    return out


def relative_errors(sim: np.ndarray, live: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(sim) - np.asarray(live)) / np.asarray(live)


def _shrunk(requests: list[Any], divisor: int) -> list[Any]:
    if divisor == 1:
        return requests
    return [replace(r, fixed_length=max(1, int(r.fixed_length) // divisor)) for r in requests]


def loop_periods(per_step: dict[str, np.ndarray]) -> np.ndarray:
    """Seconds from each step's start to the next one's in a saturated run (no idle gaps): the step plus
    the serving loop's own work around it (releasing arrivals, reading outputs), which a replay on the wall
    clock also pays; the last step counts its own duration."""
    started, seconds = per_step["started"], per_step["seconds"]
    return np.append(np.diff(started), seconds[-1:]) if started.size else seconds


def simulated_steady_rate(prompt_tokens: Sequence[int], output_tokens: Sequence[int], config: Any) -> float:
    """`steady_rate` of the same saturated FCFS run in the simulator."""
    from leap_core.simulator import simulate

    prompt, out = np.asarray(prompt_tokens, dtype=np.int64), np.asarray(output_tokens, dtype=np.int64)
    return steady_rate(simulate(np.zeros(out.size), prompt, out, out, replace(config, policy="fcfs")).finish)


def engine_over_simulator(runs: Sequence[Mapping[str, Any]], config: Any) -> dict[str, float]:
    """The engine's steady rate over the simulator's on the same saturated run, averaged over `runs`
    ({rps, prompt_tokens, output_tokens}) with its t interval: the factor that carries the engine's capacity
    to any pool's length mix (a sample's mix moves both rates alike, so the ratio varies far less than
    either)."""
    return mean_over_runs([run["rps"] / simulated_steady_rate(run["prompt_tokens"], run["output_tokens"], config)
                          for run in runs])


def capacity_runs(live: Any, samples: Sequence[list[Any]]) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
    """Saturated FCFS runs of each sample on the wall clock: per run {rps (steady rate), prompt_tokens,
    output_tokens}, and every run's step shapes and loop periods (for the step model's fit)."""
    from harness.replay import replay

    runtime = live.runtime
    runtime.reset_readout(None, None)
    runtime.configure(policy="fcfs", rls=False)
    runs, shapes, periods = [], [], []
    for k, sample in enumerate(samples):
        result = replay(live.engine, sample, np.zeros(len(sample)), "capacity", runtime=runtime, tag=f"cap{k}-")
        runs.append({"rps": steady_rate(result.per_request["finish"] - result.per_request["arrival"]),
                     "prompt_tokens": [len(r.prompt_token_ids) for r in sample],
                     "output_tokens": [int(r.fixed_length) for r in sample]})
        shapes.append(result.per_step["shapes"])
        periods.append(loop_periods(result.per_step))
    return runs, np.concatenate(shapes), np.concatenate(periods)


def run_fidelity(train_prompts: Sequence[dict], pool_prompts: Sequence[dict], settings: FidelitySettings,
                 model: str | None = None, say: Callable[[str], None] = lambda message: None) -> dict:
    """The study of the module docstring; `pool_prompts` are held out from `train_prompts` and split into
    the capacity samples and the replayed requests, disjoint."""
    from evaluation.baseline_fits import hyperparameters
    from evaluation.data import length_data
    from evaluation.live import (
        fit_leap_with_anchor,
        fit_predictors,
        open_replay_engine,
        predicted_lengths,
        prefill_budget,
        replay_policy,
        simulated_latency,
        training_and_requests,
    )
    from harness.replay import planned_arrivals
    from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity

    live = open_replay_engine(settings, model)
    try:
        say(f"lengths and features of {len(train_prompts)} training and {len(pool_prompts)} held-out prompts")
        train, pool_corpus, requests = training_and_requests(live, train_prompts, pool_prompts)
        if settings.max_prompt_tokens is not None:
            requests = [r for r in requests if len(r.prompt_token_ids) <= settings.max_prompt_tokens]
        requests = _shrunk(requests, settings.length_divisor)
        needed = settings.n_requests + settings.capacity_runs * settings.capacity_requests
        if len(requests) < needed:
            raise ValueError(f"{len(requests)} usable held-out requests, the study needs {needed}")
        order = np.random.default_rng(settings.seed).permutation(len(requests))
        replayed = [requests[i] for i in order[:settings.n_requests]]
        rest = order[settings.n_requests:]
        samples = [[requests[i] for i in rest[k * settings.capacity_requests:(k + 1) * settings.capacity_requests]]
                   for k in range(settings.capacity_runs)]

        predictors = fit_predictors(train, [settings.baseline], say)
        readout, anchor = fit_leap_with_anchor(train)
        readout.metadata.update(model_fingerprint=live.model.fingerprint, model_id=live.model.model_id,
                                layer=live.runtime.layer, version="fidelity-train")
        say(f"measuring capacity: {settings.capacity_runs} saturated FCFS runs on the wall clock")
        runs, shapes, seconds = capacity_runs(live, samples)
        step_model = StepTimeModel.fit_shapes(shapes, seconds)
        modeled = step_model.shape_seconds(shapes)
        sim_config = SimConfig(max_resident=settings.max_resident, decode_slots=settings.decode_slots,
                               waiting_cap=settings.waiting_cap, step_model=step_model,
                               max_prefill_tokens_per_step=prefill_budget(live))
        scale = engine_over_simulator(runs, sim_config)
        simulated_rps = fcfs_capacity(np.array([len(r.prompt_token_ids) for r in replayed]),
                                      np.array([r.fixed_length for r in replayed]), sim_config)
        capacity = {"capacity_rps": {key: value * simulated_rps for key, value in scale.items()},
                    "engine_over_simulator": scale, "capacity_sim_rps": simulated_rps, "runs": runs,
                    "measure": "the replayed requests' FCFS capacity in the simulator x the engine's steady rate "
                               "over the simulator's on saturated FCFS runs of other held-out requests (t interval "
                               "over the runs)"}
        rows = length_data(pool_corpus, pool_prompts)
        predicted = predicted_lengths(replayed, rows, readout, predictors)
        rate_of = {load: load * capacity["capacity_rps"]["value"] for load in settings.loads}
        live_runs: dict[float, dict[str, list]] = {m: {p: [] for p in settings.policies} for m in settings.loads}
        sim_runs: dict[float, dict[str, list]] = {m: {p: [] for p in settings.policies} for m in settings.loads}
        for repeat in range(settings.repeats):
            for m in settings.loads:
                arrivals = planned_arrivals(len(replayed), rate_of[m], None, settings.seed + 100 * repeat + 1)
                policies = list(settings.policies) if repeat % 2 == 0 else list(reversed(settings.policies))
                for name in policies:
                    say(f"repeat {repeat + 1}/{settings.repeats}, load {m:g}: {name} on the wall clock")
                    run = replay_policy(live, name, replayed, arrivals, predictors, readout, anchor,
                                        settings.max_tokens, tag=f"f{repeat}-{m:g}-{name}-")
                    live_runs[m][name].append(run)
                    sim_runs[m][name].append(simulated_latency(name, arrivals, replayed, predicted, sim_config))
    finally:
        live.close()
    result = _aggregate(live_runs, sim_runs, settings, capacity, rate_of, step_model, modeled, seconds, len(train))
    return {**result, "baseline_hyperparameters": {name: hyperparameters(p) for name, p in predictors.items()}}


def _aggregate(live_runs: dict, sim_runs: dict, settings: FidelitySettings, capacity: dict, rate_of: dict,
               step_model: Any, modeled: np.ndarray, seconds: np.ndarray, n_train: int) -> dict:
    errors, by_policy, ratios, policies = [], {}, {}, {}
    pairs = ratio_pairs(settings.policies, settings.baseline)
    for m in settings.loads:
        live_ptl, sim_ptl = {}, {}
        for name in settings.policies:
            runs = live_runs[m][name]
            tokens = np.concatenate([r["tokens_per_request"] for r in runs])
            live_latency = np.concatenate([r["latency_per_request"] for r in runs])
            sim_latency = np.concatenate(sim_runs[m][name])
            live_ptl[name], sim_ptl[name] = live_latency / tokens, sim_latency / tokens
            error = relative_errors(sim_latency, live_latency)
            errors.append(error)
            by_policy.setdefault(name, []).append(error)
            policies.setdefault(name, {})[str(m)] = {
                "mean_ptl_live": float(live_ptl[name].mean()), "mean_ptl_sim": float(sim_ptl[name].mean()),
                "mean_latency_live_s": float(live_latency.mean()), "mean_latency_sim_s": float(sim_latency.mean()),
                "median_request_error": float(np.median(error))}
        for name, figures in compare(live_ptl, sim_ptl, pairs, settings.repeats).items():
            ratios[f"{name}@{m:g}"] = figures
    every = np.concatenate(errors)
    median, p90 = float(np.median(every)), float(np.percentile(every, 90))
    inside = [r["inside"] for r in ratios.values()]
    return {
        "request_error_wall": {"median": median, "p90": p90, "requests": int(every.size)},
        "request_error_by_policy": {name: float(np.median(np.concatenate(e))) for name, e in by_policy.items()},
        "ratios": ratios,
        "goals": {"request_error_median_at_most": REQUEST_ERROR_GOAL, "every_ratio_inside": True,
                  "met": {"request_error": median <= REQUEST_ERROR_GOAL, "ratios_inside": all(inside)},
                  "ratios_inside": int(sum(inside)), "ratios": len(inside)},
        "capacity": capacity,
        "capacity_rps": capacity["capacity_rps"],
        "rates_rps": {str(m): float(r) for m, r in rate_of.items()},
        "step_model": asdict(step_model),
        "step_model_fit": {"steps": int(seconds.size),
                           "median_abs_rel_error": float(np.median(np.abs(modeled - seconds) / seconds)),
                           "fitted_on": "the capacity runs' steps only (requests disjoint from the replays)"},
        "policies": policies,
        "settings": {**asdict(settings), "policies": list(settings.policies)},
        "n_train": n_train,
        "clock": "wall",
    }


def section_fidelity(result: dict, image: str | None = None) -> str:
    """docs/results.md's section: the error, the capacity and the ratio table."""
    s = result["settings"]
    cap = result["capacity_rps"]
    ratio = result["capacity"]["engine_over_simulator"]
    err = result["request_error_wall"]
    rows = ["| ratio @ load | live [95% CI] | simulated | inside |", "|---|---:|---:|:---:|"]
    for name, r in result["ratios"].items():
        live = r["live"]
        rows.append(f"| {name} | {live['value']:.4f} [{live['ci_low']:.4f}, {live['ci_high']:.4f}] | {r['sim']:.4f} | "
                    f"{'yes' if r['inside'] else 'no'} |")
    shrink = (f" Quick run: prompts of at most {s['max_prompt_tokens']} tokens, recorded lengths divided by "
              f"{s['length_divisor']}." if s.get("length_divisor", 1) != 1 else "")
    goals = result["goals"]
    return "\n".join([
        "## Simulator against the wall clock" + (" (quick)" if result.get("quick") else ""),
        "",
        f"{s['n_requests']} held-out ShareGPT requests with their recorded lengths, replayed on the real engine on "
        f"the wall clock at {', '.join(f'{m:g}' for m in s['loads'])} of their capacity measured on the engine "
        f"({cap['value']:.3f} requests/s [{cap['ci_low']:.3f}, {cap['ci_high']:.3f}]: the simulator's "
        f"{result['capacity']['capacity_sim_rps']:.3f} x the engine's steady rate over the simulator's on "
        f"{s['capacity_runs']} saturated FCFS runs of {s['capacity_requests']} other held-out requests, "
        f"{ratio['value']:.3f} [{ratio['ci_low']:.3f}, {ratio['ci_high']:.3f}]), {s['repeats']} repeats with fresh Poisson "
        f"arrivals, the policies in reverse order every other repeat; R = {s['max_resident']}, K = "
        f"{s['decode_slots']}. The step model was fitted on the capacity runs only ({result['step_model_fit']['steps']} "
        f"steps, median step error {100 * result['step_model_fit']['median_abs_rel_error']:.1f}%): "
        f"{_step_model_text(result['step_model'])}.{shrink} Live intervals resample the repeats, then the requests "
        "within each.",
        "",
        f"Per-request latency, simulator against wall clock: median error {100 * err['median']:.1f}%, P90 "
        f"{100 * err['p90']:.1f}% over {err['requests']} request runs (goal: median <= "
        f"{100 * goals['request_error_median_at_most']:.0f}%: {'met' if goals['met']['request_error'] else 'not met'}). "
        f"Simulated ratios inside the live interval: {goals['ratios_inside']} of {goals['ratios']}.",
        "",
        *rows,
        "",
        f"Regenerate: `{result['command']}`" if "command" in result else "",
    ])


def _step_model_text(model: dict) -> str:
    table = model.get("decode_base_s") or []
    fixed = (f"a fixed {', '.join(f'{1e3 * v:.1f}' for v in table)} ms for 0 to {len(table) - 1} decoded requests"
             if table else f"{1e3 * model['base_s']:.1f} ms a step + {1e3 * model['per_decode_s']:.2f} ms a decoded request")
    return (f"{fixed} + {1e6 * model.get('per_context_token_s', 0.0):.2f} us a token of their context + "
            f"{1e3 * model['per_prefill_token_s']:.2f} ms a prefill token + "
            f"{1e9 * model.get('per_prefill_pair_s', 0.0):.0f} ns a pair of prefill tokens attending to each other")


def plot_fidelity(result: dict, path) -> None:
    """Each ratio at each load: the live value with its 95% interval, the simulated value beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["ratios"])
    live = np.array([[r["live"]["value"], r["live"]["ci_low"], r["live"]["ci_high"]]
                     for r in result["ratios"].values()])
    sim = np.array([r["sim"] for r in result["ratios"].values()])
    y = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5), dpi=120)
    ax.errorbar(live[:, 0], y, xerr=np.vstack((live[:, 0] - live[:, 1], live[:, 2] - live[:, 0])), fmt="o",
                capsize=3, label="wall clock (95% CI)")
    ax.plot(sim, y, "x", color="tab:red", label="simulator, same runs")
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_yticks(y, names)
    ax.set_xlabel("ratio of mean per-token latency")
    err = result["request_error_wall"]
    ax.set_title(f"Simulator against the wall clock: median request error {100 * err['median']:.1f}%")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
