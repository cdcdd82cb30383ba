"""LEAP against stock vLLM where users run it: the wall clock, through the OpenAI API, sampled decoding.

Each run starts a fresh server, stock vLLM's OpenAI server at its defaults or `leap serve` at its defaults
(serving a readout fitted on the chat training window of the committed snapshot, RLS on), on the same model
with the same KV-cache size (`VLLM_CPU_KVCACHE_SPACE`, which the parent sets for both), and drives it with one
streaming client. Requests are held-out ShareGPT prompts (never in the training window), sampled at
`temperature` with the corpus's frequency penalty up to the corpus budget M, each with a seed of its own
that every arm sends, so the arms draw the same tokens where the engine allows (`lengths_matched` says how
often they did). vllm-cpu 0.32 kills its engine when a seeded request's prefill is chunked (the model runner
rewinds the request's generator offset, which a CPU generator lacks: "CPU Generator does not use offset"), so
prompts are capped at `max_prompt_tokens` (512, a quarter of the CPU's 2,048-token step budget: four prompts
must start in one step before one is chunked), and the capacity burst, which chunks, sends no seeds. The
oracle arm is `leap serve --policy oracle` told each request's length from the stock
run of the same repeat.

Capacity is stock's sustained throughput on this request mix: `capacity_requests` training-window prompts
released at once into the first stock server, generated tokens per second while at least half of them are
still running, over the mean output length of those requests. Each run then plays one segment per
(pattern, load): `requests` prompts arriving by a Poisson process or with the Azure conversation trace's
gaps (`evaluation.simulation.bursty_arrivals`), rescaled to `load` x capacity, and waits for the segment to
drain before the next starts. Arms alternate within a repeat (stock, LEAP, then LEAP, stock, ...; the
oracle last, as it needs stock's lengths), each repeat draws new prompts, seeds and arrivals shared by its
arms, and every ratio's interval is over repeats (`leap_core.intervals.ratio_over_runs`), not requests.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evaluation import versus_stock_progress as progress
from leap_core.intervals import ratio_over_runs
from study_harness.openai_traffic import OpenAIServer, Outcome, TrafficRequest, free_port, send_traffic

STOCK, LEAP, ORACLE = "stock", "leap", "oracle"
EXTRA_ARMS = {  # arms that tell apart what of leap serve's difference from stock comes from where
    "stock-r512": "stock vLLM with LEAP's resident size (--max-num-seqs 512)",
    "stock-scheduler": "stock vLLM with LEAP's scheduler class in FCFS order (no capture worker, no middleware)",
    "leap-fcfs": "leap serve in FCFS order (capture, predictor and RLS running, no ordering)",
}
PATTERNS = ("poisson", "bursty")
LOADS = (0.5, 0.8, 0.95)
FIGURES = ("mean_latency", "p50_latency", "p90_latency", "p99_latency", "mean_ptl", "mean_ttft", "p99_ttft",
           "throughput", "long_p95_latency")
LATENCY_FIGURES = tuple(f for f in FIGURES if f != "throughput")


@dataclass
class VersusStockSettings:
    """What one study runs. `requests`: prompts per segment (one pattern at one load) per run."""

    requests: int = 48
    repeats: int = 6
    loads: tuple[float, ...] = LOADS
    patterns: tuple[str, ...] = PATTERNS
    oracle: bool = True
    extra_arms: tuple[str, ...] = ()  # names of EXTRA_ARMS
    temperature: float = 0.7
    frequency_penalty: float = 0.5  # the corpus's decoding (harness.replay.DEFAULT_DECODING)
    max_tokens: int = 1024  # M, the corpus budget
    capacity_requests: int = 48
    max_prompt_tokens: int = 512  # seeded requests must never be chunked on vllm-cpu (see the module docstring)
    max_model_len: int = 4096
    seed: int = 0

    @classmethod
    def quick(cls) -> VersusStockSettings:
        """Minutes, not hours: 24 requests a segment, 3 repeats, no oracle arm, outputs cut at M/4."""
        return cls(requests=24, repeats=3, oracle=False, max_tokens=256, capacity_requests=32)


@dataclass
class Workload:
    """Everything the arms of one study share: the prompts, the readout LEAP serves, the arrival pattern."""

    model: str
    served_name: str
    readout_path: str
    rls_state_path: str
    train_prompts: list[dict]
    test_prompts: list[dict]  # token ids under "prompt_token_ids"
    trace_gaps: np.ndarray | None
    folder: Path
    readout_rows: int = 0
    predicted: dict[str, float] = field(default_factory=dict)  # the readout on each test prompt's corpus row


# -- the servers ---------------------------------------------------------------------------------------------
def server_command(arm: str, work: Workload, port: int, admin_port: int, settings: VersusStockSettings) -> list[str]:
    """What a user runs: stock vLLM's OpenAI server with its defaults, or `leap serve` with its defaults."""
    if arm in (STOCK, "stock-r512", "stock-scheduler"):
        extra = {"stock-r512": ["--max-num-seqs", "512"],
                 "stock-scheduler": ["--scheduler-cls", "serving.scheduler.LeapScheduler", "--additional-config",
                                     json.dumps({"leap": {"policy": "fcfs", "rls": False}})]}.get(arm, [])
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", work.model, "--host",
                "127.0.0.1", "--port", str(port), "--max-model-len", str(settings.max_model_len),
                "--served-model-name", work.served_name, *extra]
    command = [sys.executable, "-m", "leap_cli.main", "serve", "--model", work.model, "--port", str(port),
               "--admin-port", str(admin_port), "--readout", work.readout_path, "--rls-state", work.rls_state_path,
               "--max-model-len", str(settings.max_model_len)]
    return command + (["--policy", "oracle"] if arm == ORACLE else ["--policy", "fcfs"] if arm == "leap-fcfs" else [])


def _server(arm: str, work: Workload, settings: VersusStockSettings, label: str) -> tuple[OpenAIServer, dict]:
    home = Path(tempfile.mkdtemp(prefix=f"{arm}-", dir=work.folder))
    token = secrets.token_urlsafe(24)
    port, admin_port = free_port(), free_port()
    env = dict(os.environ, LEAP_HOME=str(home), LEAP_ADMIN_TOKEN=token, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    env.pop("LEAP_REGISTRY_URI", None)  # the readout given on the command line serves, not a registry's
    server = OpenAIServer(server_command(arm, work, port, admin_port, settings), port, home / "server.log", env)
    return server, {"admin": f"http://127.0.0.1:{admin_port}", "token": token}


def _leap_stats(admin: dict) -> dict | None:
    import httpx

    from leap_io.admin_client import AdminClient

    try:
        answer = AdminClient(admin["admin"], admin["token"], timeout=10).readout()
        return answer.json().get("stats") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


# -- what each run measures ----------------------------------------------------------------------------------
def sustained_capacity(outcomes: Sequence[Outcome]) -> dict:
    """Generated tokens per second while at least half of a burst released at once was still running, and
    the burst's mean output length; their quotient is the capacity in requests per second."""
    done = [o for o in outcomes if o.error is None and o.finish is not None]
    if len(done) < 4:
        raise RuntimeError(f"only {len(done)} of {len(outcomes)} capacity requests finished")
    finishes = np.sort([o.finish for o in done])
    end = float(finishes[len(outcomes) // 2 - 1]) if len(finishes) >= len(outcomes) // 2 else float(finishes[-1])
    start = min(o.first_token for o in done)
    tokens = sum(sum(1 for t in o.chunks if start <= t <= end) for o in done)  # a streamed chunk is a token
    mean_length = float(np.mean([o.tokens for o in done]))
    tok_s = tokens / (end - start) if end > start else float("nan")
    return {"generated_tok_s": tok_s, "mean_output_tokens": mean_length, "requests": len(outcomes),
            "window_s": end - start, "rps": tok_s / mean_length}


def figures(outcomes: Sequence[Outcome], long_ids: set[str]) -> dict[str, float]:
    """The client's figures of one segment: latency from the planned arrival to the last token."""
    done = [o for o in outcomes if o.error is None and o.finish is not None and o.tokens > 0]
    if not done:
        return {f: float("nan") for f in FIGURES} | {"n": 0, "failed": len(outcomes)}
    latency = np.array([o.finish - o.at for o in done])
    ttft = np.array([o.first_token - o.at for o in done])
    tokens = np.array([o.tokens for o in done], dtype=np.float64)
    long = np.array([o.finish - o.at for o in done if o.id in long_ids])
    span = max(o.finish for o in done) - min(o.at for o in done)
    return {"mean_latency": float(latency.mean()), "p50_latency": float(np.percentile(latency, 50)),
            "p90_latency": float(np.percentile(latency, 90)), "p99_latency": float(np.percentile(latency, 99)),
            "mean_ptl": float((latency / tokens).mean()), "mean_ttft": float(ttft.mean()),
            "p99_ttft": float(np.percentile(ttft, 99)), "throughput": float(tokens.sum() / span),
            "long_p95_latency": float(np.percentile(long, 95)) if long.size else float("nan"),
            "n": len(done), "failed": len(outcomes) - len(done), "output_tokens": int(tokens.sum())}


def segment_requests(work: Workload, settings: VersusStockSettings, capacity_rps: float, repeat: int
                     ) -> dict[str, list[TrafficRequest]]:
    """Each (pattern, load) segment's requests for one repeat: new prompts, seeds and arrivals per repeat,
    the same for every arm of the repeat."""
    from evaluation.simulation import bursty_arrivals
    from leap_core.simulator import poisson_arrivals

    rng = np.random.default_rng([settings.seed, repeat])
    pool = work.test_prompts
    segments: dict[str, list[TrafficRequest]] = {}
    order = rng.permutation(len(pool))
    taken = 0
    for pattern in settings.patterns:
        for load in settings.loads:
            if taken + settings.requests > len(order):
                order, taken = rng.permutation(len(pool)), 0
            chosen = [pool[i] for i in order[taken:taken + settings.requests]]
            taken += settings.requests
            rate = load * capacity_rps
            arrival_seed = int(rng.integers(2**31))
            if pattern == "poisson" or work.trace_gaps is None:
                at = poisson_arrivals(len(chosen), rate, seed=arrival_seed)
            else:
                at = bursty_arrivals(work.trace_gaps, len(chosen), rate, seed=arrival_seed)
            at = np.asarray(at, dtype=np.float64) - float(np.min(at))
            seeds = rng.integers(1, 2**31, size=len(chosen))
            segments[segment_name(pattern, load)] = [
                TrafficRequest(id=f"r{repeat}-{pattern}-{load:g}-{i}-{p['id']}", prompt_token_ids=p["prompt_token_ids"],
                               at=float(t), max_tokens=settings.max_tokens, seed=int(s))
                for i, (p, t, s) in enumerate(zip(chosen, at, seeds))]
    return segments


def segment_name(pattern: str, load: float) -> str:
    return f"{pattern}@{load:g}"


def run_arm(arm: str, work: Workload, settings: VersusStockSettings, segments: dict[str, list[TrafficRequest]],
            oracle_lengths: dict[str, int] | None, say: Callable[[str], None], label: str,
            capacity: list[TrafficRequest] | None = None) -> dict:
    """One fresh server: (the capacity burst,) a short warm-up, then every segment, each drained before the
    next. Returns each segment's outcomes and the server's start time."""
    sampling = {"temperature": settings.temperature, "frequency_penalty": settings.frequency_penalty}
    server, admin = _server(arm, work, settings, label)
    started = time.perf_counter()
    with server:
        say(f"{label}: {arm} server answered in {server.started_s:.0f} s")
        warm = [TrafficRequest(id=f"warm-{i}", prompt_token_ids=p["prompt_token_ids"], at=0.0, max_tokens=32)
                for i, p in enumerate(work.train_prompts[:4])]
        send_traffic(server.base_url, work.served_name, warm, sampling)
        result: dict[str, Any] = {"arm": arm, "start_s": server.started_s, "segments": {}}
        if capacity is not None:
            say(f"{label}: capacity, {len(capacity)} requests at once")
            result["capacity"] = sustained_capacity(send_traffic(server.base_url, work.served_name, capacity,
                                                                 sampling, keep_chunks=True))
            return result
        for name, requests in segments.items():
            if oracle_lengths is not None:
                requests = [TrafficRequest(**{**asdict(r), "extras": {
                    "leap_oracle_length": float(oracle_lengths.get(r.id, settings.max_tokens))}}) for r in requests]
            t0 = time.perf_counter()
            outcomes = send_traffic(server.base_url, work.served_name, requests, sampling)
            result["segments"][name] = [o.to_dict() | {"prompt_tokens": len(r.prompt_token_ids)}
                                        for o, r in zip(outcomes, requests)]
            failed = sum(o.error is not None for o in outcomes)
            say(f"{label}: {arm} {name}: {len(outcomes)} requests in {time.perf_counter() - t0:.0f} s"
                + (f", {failed} failed" if failed else ""))
        if arm in (LEAP, ORACLE, "leap-fcfs"):
            result["leap_stats"] = _leap_stats(admin)
    result["wall_s"] = time.perf_counter() - started
    return result


# -- the study -----------------------------------------------------------------------------------------------
def arm_order(repeat: int, oracle: bool, extra_arms: Sequence[str] = ()) -> tuple[str, ...]:
    """Stock and LEAP alternate (stock first in even repeats; with extra arms they all rotate); the oracle
    follows, as it needs stock's lengths."""
    arms = (STOCK, LEAP, *extra_arms)
    shift = repeat % len(arms)
    order = arms[shift:] + arms[:shift] if extra_arms else (arms if repeat % 2 == 0 else arms[::-1])
    return order + ((ORACLE,) if oracle else ())


def run_study(work: Workload, settings: VersusStockSettings, say: Callable[[str], None] = lambda m: None,
              progress_path: Path | None = None, repeats_now: int | None = None) -> dict:
    """Every repeat's arms on fresh servers; the per-run figures and the ratios over runs.

    With `progress_path`, each finished repeat is kept there and a later call resumes after the last one
    (`evaluation.versus_stock_progress`); `repeats_now` plays at most that many repeats in this call."""
    started = time.perf_counter()
    sampling_note = {"temperature": settings.temperature, "frequency_penalty": settings.frequency_penalty,
                     "max_tokens": settings.max_tokens}
    settings_dict = {**asdict(settings), "loads": list(settings.loads), "patterns": list(settings.patterns),
                     "extra_arms": list(settings.extra_arms)}
    key = progress.workload_key(Path(work.readout_path).read_bytes(), [p["id"] for p in work.test_prompts],
                                [p["id"] for p in work.train_prompts])
    kept = progress.load(progress_path, settings_dict, key) if progress_path is not None else None
    if kept is None:
        capacity_requests = [TrafficRequest(id=f"cap-{p['id']}", prompt_token_ids=p["prompt_token_ids"], at=0.0,
                                            max_tokens=settings.max_tokens)  # no seed: a burst's prefills chunk
                             for p in work.train_prompts[-settings.capacity_requests:]]
        say("capacity: stock vLLM, a burst of training-window prompts")
        capacity = run_arm(STOCK, work, settings, {}, None, say, "capacity", capacity=capacity_requests)["capacity"]
        kept = progress.start(settings_dict, key, capacity)
        if progress_path is not None:
            progress.save(kept, progress_path)
    else:
        say(f"resuming {progress_path}: {len(kept['runs'])} of {settings.repeats} repeats played")
    capacity = kept["capacity"]
    say(f"capacity: {capacity['rps']:.3f} requests/s ({capacity['generated_tok_s']:.0f} tok/s, "
        f"{capacity['mean_output_tokens']:.0f} tokens a request)")
    runs: list[dict[str, dict]] = kept["runs"]
    first = len(runs)
    for repeat in range(first, settings.repeats if repeats_now is None else min(settings.repeats, first + repeats_now)):
        repeat_started = time.time()
        segments = segment_requests(work, settings, capacity["rps"], repeat)
        by_arm: dict[str, dict] = {}
        for arm in arm_order(repeat, settings.oracle, settings.extra_arms):
            lengths = None
            if arm == ORACLE:
                lengths = {o["id"]: int(o["tokens"]) for outs in by_arm[STOCK]["segments"].values() for o in outs}
            by_arm[arm] = run_arm(arm, work, settings, segments, lengths, say, f"repeat {repeat + 1}/{settings.repeats}")
        progress.add_repeat(kept, by_arm, repeat_started, progress_path)
    if not runs:
        raise ValueError("no repeat has been played yet: nothing to summarize")
    summary = summarize(runs, settings, capacity)
    step_model, step_source = saved_step_model()
    summary["simulated"] = {"step_model": asdict(step_model), "step_model_source": step_source,
                            "segments": simulated_check(runs, summary["segments"], work.predicted, step_model,
                                                        settings.max_tokens)}
    return summary | {
        "settings": {**asdict(settings), "loads": list(settings.loads), "patterns": list(settings.patterns)},
        "decoding": sampling_note, "readout_rows": work.readout_rows, "model": Path(work.model).name,
        "test_prompts": len(work.test_prompts), "study_s": time.perf_counter() - started,
        "repeats_played": len(runs), "complete": len(runs) >= settings.repeats, "played_on": kept["played_on"],
        "cost": _cost(runs), "runs": runs}


def _cost(runs: list[dict[str, dict]]) -> dict:
    """What a run costs: server start and whole-run seconds per arm, averaged over repeats."""
    out = {}
    for arm in runs[0]:
        out[arm] = {"start_s": float(np.mean([r[arm]["start_s"] for r in runs])),
                    "run_s": float(np.mean([r[arm]["wall_s"] for r in runs]))}
    return out


OUTCOME_KEYS = frozenset(Outcome.__dataclass_fields__) - {"chunks"}


def _outcomes(run: dict, name: str) -> list[Outcome]:
    return [Outcome(**{k: v for k, v in o.items() if k in OUTCOME_KEYS}) for o in run["segments"][name]]


def summarize(runs: list[dict[str, dict]], settings: VersusStockSettings, capacity: dict) -> dict:
    """Per arm and segment: each figure per run; per segment: each arm over stock with its interval over runs,
    and how many lengths matched stock's; then the goals."""
    arms = list(runs[0])
    by_segment: dict[str, dict] = {}
    for pattern in settings.patterns:
        for load in settings.loads:
            name = segment_name(pattern, load)
            per_arm: dict[str, list[dict]] = {arm: [] for arm in arms}
            matched, compared = 0, 0
            for run in runs:
                stock = {o.id: o for o in _outcomes(run[STOCK], name)}
                lengths = np.array([o.tokens for o in stock.values()])
                cut = np.percentile(lengths, 75) if lengths.size else 0
                long_ids = {i for i, o in stock.items() if o.tokens >= cut}  # stock's longest quartile
                for arm in arms:
                    outs = _outcomes(run[arm], name)
                    per_arm[arm].append(figures(outs, long_ids))
                    if arm == LEAP:
                        for o in outs:
                            if o.id in stock and o.error is None:
                                compared += 1
                                matched += int(o.tokens == stock[o.id].tokens)
            entry: dict[str, Any] = {"pattern": pattern, "load": load,
                                     "arms": {arm: _mean_figures(rows) for arm, rows in per_arm.items()},
                                     "per_run": per_arm, "lengths_matched": matched, "lengths_compared": compared}
            for arm in arms:
                if arm == STOCK:
                    continue
                entry[f"{arm}_over_stock"] = {
                    f: ratio_over_runs([r[f] for r in per_arm[arm]], [r[f] for r in per_arm[STOCK]])
                    for f in FIGURES}
            by_segment[name] = entry
    return {"capacity": capacity, "segments": by_segment, "goals": goals(by_segment),
            "goals_met": all(g["met"] for g in goals(by_segment).values())}


def _mean_figures(rows: list[dict]) -> dict[str, float]:
    return {f: float(np.nanmean([r[f] for r in rows])) for f in FIGURES}


GOALS = {  # load: [(figure, most LEAP over stock may be, most its interval's upper bound may be)]
    0.95: [("mean_latency", 0.85, 1.0), ("mean_ptl", 0.75, 1.0), ("long_p95_latency", 1.25, None)],
    0.8: [("mean_latency", 0.92, 1.0)],
    0.5: [(f, 1.02, 1.03) for f in LATENCY_FIGURES],
}
MIN_THROUGHPUT = {0.95: 0.98}


def goals(by_segment: dict[str, dict]) -> dict[str, dict]:
    """Issue 43's goals for LEAP over stock, each with the figure it read and whether it is met (the
    upper bound counts only where a goal names one; an interval that is not yet defined misses)."""
    out: dict[str, dict] = {}
    for name, entry in by_segment.items():
        ratios = entry.get(f"{LEAP}_over_stock")
        load = entry["load"]
        if ratios is None:
            continue
        for figure, most, upper in GOALS.get(load, []):
            r = ratios[figure]
            met = bool(r["value"] <= most and (upper is None or r["ci_high"] < upper
                                               or (upper == 1.03 and r["ci_high"] <= upper)))
            out[f"{name}:{figure}"] = {"value": r["value"], "ci": [r["ci_low"], r["ci_high"]], "at_most": most,
                                       "upper_below": upper, "met": met}
        if load in MIN_THROUGHPUT:
            r = ratios["throughput"]
            out[f"{name}:throughput"] = {"value": r["value"], "ci": [r["ci_low"], r["ci_high"]],
                                         "at_least": MIN_THROUGHPUT[load], "met": bool(r["value"] >= MIN_THROUGHPUT[load])}
    return out


# -- the simulator against the wall clock -------------------------------------------------------------------
def simulated_check(runs: list[dict[str, dict]], by_segment: dict[str, dict], predicted: dict[str, float],
                    step_model, max_tokens: int) -> dict:
    """Each segment of each run simulated as it was played: the same arrivals and prompt lengths, the lengths
    stock generated, LEAP ordering by the readout's prediction for the prompt (its corpus row), stock as
    `SimConfig.stock` and LEAP as `leap serve` runs (R 512, K 64, the same prefill budget). Per segment, the
    simulated LEAP-over-stock mean latency and PTL (geometric mean over runs) and whether each lies inside the
    wall clock's interval."""
    from leap_core.simulator import SimConfig, simulate

    stock_config = SimConfig.stock(step_model)
    leap_config = SimConfig(max_resident=512, decode_slots=64, waiting_cap=128, policy="countdown",
                            max_prefill_tokens_per_step=stock_config.max_prefill_tokens_per_step,
                            chunked_prefill=True, step_model=step_model)
    out: dict[str, dict] = {}
    for name, entry in by_segment.items():
        ratios: dict[str, list[float]] = {"mean_latency": [], "mean_ptl": []}
        covered = total = 0
        for run in runs:
            rows = [o for o in run[STOCK]["segments"][name] if o.get("error") is None and o.get("tokens", 0) > 0]
            if not rows:
                continue
            ids = [o["id"] for o in rows]
            prompt_ids = [i.split("-", 4)[-1] for i in ids]  # r{repeat}-{pattern}-{load}-{i}-{prompt id}
            guess = np.array([predicted.get(p, np.nan) for p in prompt_ids], dtype=np.float64)
            covered += int(np.isfinite(guess).sum())
            total += len(rows)
            guess = np.where(np.isfinite(guess), guess, float(max_tokens))
            args = (np.array([o["at"] for o in rows]), np.array([o.get("prompt_tokens", 1) for o in rows]),
                    np.array([o["tokens"] for o in rows]), guess)
            stock, leap = simulate(*args, stock_config), simulate(*args, leap_config)
            ratios["mean_latency"].append(float(leap.latency.mean() / stock.latency.mean()))
            ratios["mean_ptl"].append(float(leap.ptl.mean() / stock.ptl.mean()))
        live = entry.get(f"{LEAP}_over_stock", {})
        figures_out = {}
        for figure, values in ratios.items():
            value = float(np.exp(np.mean(np.log(values)))) if values else float("nan")
            interval = live.get(figure, {})
            low, high = interval.get("ci_low"), interval.get("ci_high")
            inside = None if low is None or high is None or not np.isfinite([low, high]).all() else bool(low <= value <= high)
            figures_out[figure] = {"simulated": value, "live": interval.get("value"), "live_ci": [low, high],
                                   "inside": inside}
        out[name] = {**figures_out, "predicted_share": covered / total if total else 0.0}
    return out


# -- the shared inputs ---------------------------------------------------------------------------------------
def prepare_workload(settings: VersusStockSettings, model: str | None, say: Callable[[str], None]) -> Workload:
    """The chat training window's readout (fitted on the committed snapshot's rows, as the fit flow fits, with
    its RLS anchor), the held-out ShareGPT prompts tokenized with the chat template, the Azure trace's gaps."""
    from transformers import AutoTokenizer

    from evaluation.data import length_data
    from evaluation.live import fit_leap_with_anchor
    from evaluation.selections import CHAT_TEST, CHAT_TRAIN, select
    from harness.datasets import trace_gaps
    from harness.replay import DEFAULT_DECODING, encode_prompts
    from leap_core.layers import default_layer
    from leap_core.readout_format import to_bytes
    from study_harness.corpus import corpus_dir, corpus_key, load_corpus
    from study_harness.experiment import resolve_model

    info = resolve_model(model)
    folder = Path(tempfile.mkdtemp(prefix="leap-versus-stock-"))
    train = select(CHAT_TRAIN)
    test = select(CHAT_TEST, exclude={p["id"] for p in train})
    layer = default_layer(info.num_layers)
    corpus = load_corpus(corpus_dir(corpus_key(info.fingerprint, layer, 1024, DEFAULT_DECODING)), layer, 1024)
    rows = length_data(corpus, train)
    if len(rows.lengths) < 100:
        raise RuntimeError(f"the corpus holds {len(rows.lengths)} rows of the training window for this model: "
                           "build it first (`leap corpus build --snapshot`)")
    say(f"readout: fitted on {len(rows.lengths)} training-window rows at layer {layer}")
    readout, rls_state = fit_leap_with_anchor(rows)
    readout.metadata = {**readout.metadata, "model_id": info.model_id, "model_fingerprint": info.fingerprint,
                        "layer": layer, "version": "versus-stock", "n_train": len(rows.lengths)}
    (folder / "readout.bin").write_bytes(to_bytes(readout))
    np.savez(folder / "rls.npz", **rls_state)
    held = length_data(corpus, test)
    predicted = dict(zip((str(i) for i in held.ids), readout.predict(held.features).astype(float)))
    tokenizer = AutoTokenizer.from_pretrained(info.path)
    budget = min(settings.max_prompt_tokens, settings.max_model_len - settings.max_tokens - 1)
    test_encoded, _ = encode_prompts(tokenizer, test, budget)
    train_encoded, _ = encode_prompts(tokenizer, train, budget)
    train_encoded = train_encoded[-max(settings.capacity_requests, 4):]
    return Workload(model=info.path, served_name=Path(info.path).name, readout_path=str(folder / "readout.bin"),
                    rls_state_path=str(folder / "rls.npz"), train_prompts=train_encoded, test_prompts=test_encoded,
                    trace_gaps=trace_gaps(), folder=folder, readout_rows=len(rows.lengths), predicted=predicted)


def saved_step_model():
    """The step-time model the full fidelity study fitted on this engine (docs/results/fidelity.json), else the
    simulator's defaults, and where it came from."""
    from evaluation.studies import FIDELITY_RESULT
    from leap_core.simulator import StepTimeModel

    saved = json.loads(FIDELITY_RESULT.read_text()) if FIDELITY_RESULT.exists() else {}
    if "step_model" in saved:
        return StepTimeModel(**saved["step_model"]), (f"{FIDELITY_RESULT.name} (commit {str(saved.get('commit'))[:12]}), "
                                                      f"fitted at K {saved.get('settings', {}).get('decode_slots')}")
    return StepTimeModel(), "the simulator's defaults (no saved fidelity study)"
