"""What a user gains or loses by turning LEAP on: stock vLLM with its defaults against LEAP with its defaults.

One Poisson trace of real ShareGPT prompts, each with its recorded output length (the length this model
gives it under the corpus decoding settings, replayed exactly with `ignore_eos`), so both engines do
the same generation work. Each engine runs in its own fresh process (no shared compile state, no
leftover threads), the order alternates between repeats (stock first, then LEAP first, ...), and the
figures are paired per request, so drift on a shared machine hits both sides alike.

- stock: `EngineArgs(model, max_model_len)` and nothing else, i.e. what `vllm serve MODEL` runs;
- LEAP: the same plus LEAP's scheduler, worker and settings (R = 512 resident, K = 64 decode slots, the
  readout fitted on training prompts that the trace does not contain, RLS on);
- with `shadow`, a third arm: LEAP holding a challenger in shadow (`serving.readout.shadow`: the same readout held
  a second time, so every finished request is predicted twice) in alternating blocks of steps, and its
  throughput with the shadow over without, paired by neighbouring blocks (`shadow_cost`).

The arrival rate is `load` times the capacity measured while building the corpus (generated tok/s with
every slot open, divided by the mean recorded length); when every row came from the cache or the committed
snapshot, the first `CAPACITY_REQUESTS` trace requests are released at once to measure it. The default, 3x, is chosen so that the stock engine
queues: its `max_num_seqs` slots (128 on CPU) fill and arrivals wait. At 1.2x on a 2-core CPU the backlog
stays below 128 (about 25 requests in the system by Little's law: 1.27 req/s x 20 s), every request
decodes every step in both engines, and ordering cannot matter; see docs/serving.md for both figures.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from experiments.bench.switchback import block_is_on, throughput_ratio
from leap_core.readout_format import to_bytes
from leap_core.simulator import poisson_arrivals

STOCK, LEAP, SHADOW = "stock", "leap", "leap-shadow"


# -- the parent: prepare once, then one fresh process per engine run --------------------------------------
def prepare(prompts: list[dict], n_requests: int, n_train: int, folder: Path, model: str | None,
            max_tokens: int, say: Callable[[str], None]) -> dict:
    """Corpus of train + trace prompts (cached), a readout fitted on the training prompts, the trace spec."""
    from serving.config import LeapConfig
    from study_harness.corpus import load_corpus
    from study_harness.experiment import corpus_for, fit_on_corpus, fixed_length_requests, open_live

    if len(prompts) < n_requests + n_train:
        raise ValueError(f"{len(prompts)} prompts, but {n_requests} trace + {n_train} training prompts are needed")
    train, trace = prompts[:n_train], prompts[n_train:n_train + n_requests]
    live = open_live(model, LeapConfig(policy="fcfs", rls=False, max_resident=256), max_tokens=max_tokens)
    try:
        say(f"corpus: {len(train)} training + {len(trace)} trace prompts (cached after the first run)")
        cached = set(load_corpus(live.corpus_folder(), live.runtime.layer, max_tokens).ids.tolist())
        started = time.perf_counter()
        shown = [0]

        def progress(done: int, total: int) -> None:
            if total and done * 10 // total > shown[0]:
                shown[0] = done * 10 // total
                say(f"corpus: {done}/{total} prompts generated")

        corpus = corpus_for(live, train + trace, progress)
        requests = fixed_length_requests(live, trace, corpus)
        capacity = _capacity(live.corpus_folder(), corpus, cached, time.perf_counter() - started)
        if capacity["generated_tok_s"] is None:  # every row was cached (the committed snapshot holds them)
            say(f"capacity: {min(len(requests), CAPACITY_REQUESTS)} trace requests generated with every slot open")
            capacity = measure_capacity(live, requests)
            (live.corpus_folder() / "capacity.json").write_text(json.dumps(capacity))
        train_ids = {p["id"] for p in train}
        readout, rls_state = fit_on_corpus(corpus.subset(np.array([rid in train_ids for rid in corpus.ids])),
                                           live.model, version="bench-serving")
    finally:
        live.close()
    (folder / "readout.bin").write_bytes(to_bytes(readout))
    np.savez(folder / "rls.npz", **rls_state)
    return {"model": live.model.path, "layer": int(corpus.layer), "max_tokens": max_tokens,
            "readout_path": str(folder / "readout.bin"), "rls_state_path": str(folder / "rls.npz"),
            "capacity": capacity,
            "requests": [{"id": r.id, "prompt_token_ids": r.prompt_token_ids, "fixed_length": r.fixed_length}
                         for r in requests]}


CAPACITY_REQUESTS = 96  # requests released at once when no corpus build measured the capacity


def measure_capacity(live, requests: list) -> dict:
    """Generated tok/s with every slot open, as a corpus build measures it: the first `CAPACITY_REQUESTS`
    requests (their recorded lengths) released at once into the engine under FCFS, all resident slots
    decoding."""
    from harness.replay import replay

    runtime = live.runtime
    chosen = requests[:CAPACITY_REQUESTS]
    saved = (runtime.config.policy, runtime.config.decode_slots)
    runtime.configure(policy="fcfs", rls=False, decode_slots=runtime.config.max_resident)
    try:
        result = replay(live.engine, chosen, np.zeros(len(chosen)), "fcfs", runtime=runtime, tag="capacity-")
    finally:
        runtime.configure(policy=saved[0], decode_slots=saved[1])
    return {"generated_tok_s": result.throughput_tok_s, "rows": len(chosen), "seconds": result.makespan_s,
            "measured_by": "replay"}


def _capacity(folder: Path, corpus, cached: set, build_s: float, min_new: int = 64) -> dict:
    """Generated tok/s with every slot open, measured on the rows this build generated.

    Kept beside the corpus (`capacity.json`) so a later run on the cached corpus reuses it.
    """
    saved = folder / "capacity.json"
    new = np.array([rid not in cached for rid in corpus.ids])
    if new.sum() >= min_new and build_s > 0:
        measured = {"generated_tok_s": float(corpus.output_tokens[new].sum() / build_s), "rows": int(new.sum()),
                    "seconds": build_s}
        saved.write_text(json.dumps(measured))
    elif saved.is_file():
        measured = json.loads(saved.read_text())
    else:
        measured = {"generated_tok_s": None, "rows": int(new.sum()), "seconds": build_s}
    return measured


def bench_serving(prompts: list[dict], n_requests: int = 200, n_train: int = 300, repeats: int = 2,
                  load: float = 3.0, rate: float | None = None, model: str | None = None, max_tokens: int = 1024,
                  seed: int = 0, via: str = "engine", shadow: bool = False, shadow_block_steps: int = 4,
                  shadow_control_ms: float = 0.0,
                  say: Callable[[str], None] = lambda m: None) -> dict:
    """Run the comparison; figures are ratios LEAP / stock, paired by request within each repeat.

    `via="engine"`: each engine in-process in a fresh Python process (`LLMEngine.step`); `via="http"`:
    the OpenAI servers a user starts (stock `vllm.entrypoints.openai.api_server` and `leap serve`),
    each in its own process, driven by an async HTTP client on loopback. `shadow` adds the arm that holds
    a challenger in shadow in alternating blocks of `shadow_block_steps` steps (in-process engines only);
    the arms rotate order between repeats. `shadow_control_ms` > 0 makes each shadow prediction busy-wait
    that long more: a positive control, a known cost the shadow's figure must find.
    """
    if shadow and via != "engine":
        raise ValueError("the shadow arm runs on in-process engines (via='engine')")
    if shadow_block_steps < 1:
        raise ValueError(f"shadow_block_steps must be at least 1, not {shadow_block_steps}")
    if not 0.0 <= shadow_control_ms <= 1000.0:
        raise ValueError(f"shadow_control_ms must be in [0, 1000], not {shadow_control_ms}")
    folder = Path(tempfile.mkdtemp(prefix="leap-bench-serving-"))
    spec = prepare(prompts, n_requests, n_train, folder, model, max_tokens, say)
    lengths = np.array([r["fixed_length"] for r in spec["requests"]], dtype=np.float64)
    tok_s = spec["capacity"]["generated_tok_s"]
    if rate is None:
        if not tok_s:
            raise ValueError("capacity was not measured (too few new corpus rows): pass --rate")
        rate = load * tok_s / float(lengths.mean())
    spec["arrivals"] = poisson_arrivals(len(lengths), rate, seed=seed).tolist()
    spec["shadow_block_steps"] = shadow_block_steps
    spec["shadow_control_ms"] = shadow_control_ms
    (folder / "spec.json").write_text(json.dumps(spec))
    kinds = (STOCK, LEAP, SHADOW) if shadow else (STOCK, LEAP)
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for repeat in range(repeats):
        shift = repeat % len(kinds)
        order = kinds[shift:] + kinds[:shift]
        if len(kinds) == 2 and repeat % 2:
            order = (LEAP, STOCK)
        for kind in order:
            say(f"{kind} engine, repeat {repeat + 1}/{repeats} ({len(lengths)} requests at {rate:.2f}/s)")
            runs[kind].append(_run_in_subprocess(kind, folder / "spec.json", folder / f"{kind}-{repeat}.json", via))
    return {"via": via, **summarize(runs, rate, spec)}


def _run_in_subprocess(kind: str, spec: Path, out: Path, via: str = "engine") -> dict:
    if via == "http":
        return run_http(kind, json.loads(spec.read_text()))
    command = [sys.executable, "-m", "experiments.bench.serving", kind, str(spec), str(out)]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} engine run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _paired_ratio_ci(leap: np.ndarray, stock: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of mean(leap) / mean(stock), resampling requests in pairs."""
    from scipy.stats import bootstrap

    result = bootstrap((leap, stock), lambda a, b, axis=-1: np.mean(a, axis=axis) / np.mean(b, axis=axis),
                       paired=True, vectorized=True, n_resamples=2000, confidence_level=0.95,
                       random_state=np.random.default_rng(seed), method="percentile")
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def summarize(runs: dict[str, list[dict]], rate: float, spec: dict) -> dict:
    stock_tok = [r["tok_s"] for r in runs[STOCK]]
    leap_tok = [r["tok_s"] for r in runs[LEAP]]
    stock_lat = np.concatenate([r["latency_s"] for r in runs[STOCK]])
    leap_lat = np.concatenate([r["latency_s"] for r in runs[LEAP]])
    tok_ratios = [lt / st for lt, st in zip(leap_tok, stock_tok)]
    lat_ratios = [float(np.mean(lr["latency_s"]) / np.mean(sr["latency_s"]))
                  for lr, sr in zip(runs[LEAP], runs[STOCK])]
    low, high = _paired_ratio_ci(leap_lat, stock_lat)
    ready = [r["ready_before_decode"] for r in runs[LEAP] if r.get("ready_before_decode") is not None]
    return {
        "requests": len(spec["requests"]), "repeats": len(runs[STOCK]), "arrival_rate": rate,
        "capacity": spec["capacity"],
        "stock_tok_s": statistics.mean(stock_tok), "leap_tok_s": statistics.mean(leap_tok),
        "throughput_ratio": statistics.mean(tok_ratios), "throughput_ratio_per_repeat": tok_ratios,
        "stock_mean_latency_s": float(stock_lat.mean()), "leap_mean_latency_s": float(leap_lat.mean()),
        "latency_ratio": float(leap_lat.mean() / stock_lat.mean()), "latency_ratio_ci": [low, high],
        "latency_ratio_per_repeat": lat_ratios,
        "ready_before_decode": min(ready) if ready else None,
        **({"shadow": shadow_cost(runs)} if runs.get(SHADOW) else {}),
        "runs": {kind: [{k: v for k, v in r.items() if k not in ("latency_s", "switchback")} for r in rs]
                 for kind, rs in runs.items()},
    }


def shadow_cost(runs: dict[str, list[dict]]) -> dict:
    """What holding a shadow costs LEAP's throughput, from the shadow arm's switchback runs: the shadow held
    in alternating blocks of steps (`experiments.bench.switchback`), throughput with it over without on the
    same work, pooled over the pairs of neighbouring blocks of every repeat, with a bootstrap interval over
    pairs. Whole runs are no use for this: two LEAP runs on the same trace differ by several percent.

    The direct cost is the time the shadow's predictions and live figures took in the serving process, over
    the step seconds of the blocks that held it."""
    records = [r["switchback"] for r in runs[SHADOW] if r.get("switchback")]
    block_steps = records[0]["block_steps"] if records else None
    figure = throughput_ratio(records, block_steps) if records else throughput_ratio([], 1)
    direct = []
    for run in runs[SHADOW]:
        record = run.get("switchback")
        on_seconds = sum(s for s, on in zip(record["seconds"], record["on"]) if on) if record else 0.0
        if run.get("shadow_seconds") is not None and on_seconds > 0:
            direct.append(run["shadow_seconds"] / on_seconds)
    control = [r.get("shadow_control_ms") for r in runs[SHADOW]]
    return {"throughput_ratio": figure["ratio"], "throughput_ratio_ci": [figure["ci_low"], figure["ci_high"]],
            "control_ms_per_prediction": control[0] if control else None,
            "unadjusted_ratio": figure["unadjusted_ratio"], "delta_ms_per_step": figure["delta_ms_per_step"],
            "pairs": figure["pairs"], "repeats": len(records), "block_steps": block_steps,
            "shadow_predictions": [r.get("shadow_predicted") for r in runs[SHADOW]],
            "shadow_seconds_over_on_seconds": direct}


# -- through the OpenAI API: the servers a user starts, driven by an HTTP client ------------------------------
def server_command(kind: str, spec: dict, port: int, admin_port: int) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` as a user starts it, or `leap serve` on the same model."""
    name = ["--served-model-name", "bench"]
    if kind == STOCK:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec["model"],
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", *name]
    return [sys.executable, "-m", "leap_cli.main", "serve", "--model", spec["model"], "--port", str(port),
            "--admin-port", str(admin_port), "--readout", spec["readout_path"], "--rls-state",
            spec["rls_state_path"], "--max-model-len", "4096", "--", *name]


def run_http(kind: str, spec: dict, timeout_s: float = 600.0) -> dict:
    """Start the server in its own process group, replay the trace through /v1/completions, stop it."""
    import os
    import secrets

    from leap_io.admin_client import AdminClient
    from study_harness.openai_traffic import OpenAIServer, TrafficRequest, free_port, send_traffic

    port, admin_port = free_port(), free_port()
    # a user's server: engine core in its own process, and a LEAP home of its own (no earlier push restored)
    token = secrets.token_urlsafe(24)
    env = dict(os.environ, LEAP_HOME=tempfile.mkdtemp(prefix=f"leap-bench-{kind}-"), VLLM_ENABLE_V1_MULTIPROCESSING="1",
               LEAP_ADMIN_TOKEN=token)
    fixed = {"temperature": 0.0, "ignore_eos": True}  # with max_tokens the recorded length: exactly that many

    def traffic(requests: list[dict], arrivals: list[float]) -> list[TrafficRequest]:
        return [TrafficRequest(id=r["id"], prompt_token_ids=r["prompt_token_ids"], at=float(a),
                               max_tokens=r["fixed_length"]) for r, a in zip(requests, arrivals)]

    with OpenAIServer(server_command(kind, spec, port, admin_port), port, Path(env["LEAP_HOME"]) / "server.log", env,
                      start_timeout_s=timeout_s) as server:
        warm = spec["requests"][:8]
        send_traffic(server.base_url, "bench", traffic(warm, [0.0] * len(warm)), fixed)
        start = time.perf_counter()
        done = send_traffic(server.base_url, "bench", traffic(spec["requests"], spec["arrivals"]), fixed)
        makespan = time.perf_counter() - start
        failed = [o for o in done if o.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed through the {kind} server: {failed[0].error}")
        latency = np.array([o.finish - o.at for o in done])
        tokens = int(sum(o.tokens for o in done))
        result = {"kind": kind, "via": "http", "tok_s": tokens / makespan, "makespan_s": makespan,
                  "mean_latency_s": float(latency.mean()), "output_tokens": tokens, "latency_s": latency.tolist(),
                  "ready_before_decode": None}
        if kind == LEAP:
            stats = AdminClient(f"http://127.0.0.1:{admin_port}", token, timeout=10).readout().json().get("stats", {})
            result["ready_before_decode"] = stats.get("ready_before_decode")
        return result


class _ShadowSwitch:
    """Holds the shadow in 'on' blocks of steps and lets it go in 'off' ones (`experiments.bench.switchback`),
    through the runtime's own `hold_shadow`, between steps."""

    def __init__(self, runtime, spec: dict) -> None:
        from leap_io.push_bundle import make_bundle

        self.runtime = runtime
        self.block_steps = int(spec["shadow_block_steps"])
        self.bundle = make_bundle(Path(spec["readout_path"]).read_bytes(), None)
        self.on: list[bool] = []
        self.held = False
        control_ms = float(spec.get("shadow_control_ms") or 0.0)
        if control_ms > 0:  # a positive control: a known extra cost per shadow prediction the bench must find
            predict = runtime.shadow.predict

            def predict_slowly(feature):
                answer = predict(feature)
                if answer[0] is not None:
                    until = time.perf_counter() + control_ms / 1000.0
                    while time.perf_counter() < until:
                        pass
                return answer

            runtime.shadow.predict = predict_slowly

    def before_step(self, step: int) -> None:
        want = block_is_on(step, self.block_steps)
        if want != self.held:
            self.runtime.hold_shadow(self.bundle if want else b"")
            self.held = want
        self.on.append(want)

    def record(self, result) -> dict:
        """Each step's flag, generated tokens, seconds and shape (decoded requests, prefill tokens)."""
        shapes = result.per_step["shapes"].reshape(-1, 4)
        return {"block_steps": self.block_steps, "on": self.on, "tokens": result.per_step["tokens"].tolist(),
                "seconds": result.per_step["seconds"].tolist(), "decodes": shapes[:, 0].tolist(),
                "prefill": shapes[:, 1].tolist()}


# -- the child: one engine, one replay ---------------------------------------------------------------------
def run_engine(kind: str, spec: dict) -> dict:
    """Build the engine as a user would, warm it up, replay the trace; per-request latency and tok/s."""
    from harness.engine import build_default_engine
    from harness.replay import ReplayRequest, replay
    from serving.config import LeapConfig

    runtime = None
    leap = None
    if kind in (LEAP, SHADOW):
        leap = LeapConfig(readout_path=spec["readout_path"], rls_state_path=spec["rls_state_path"],
                          layer=spec["layer"])
    engine = build_default_engine(spec["model"], leap=leap)
    try:
        if kind in (LEAP, SHADOW):
            from harness.engine import leap_scheduler

            runtime = leap_scheduler(engine).leap
        requests = [ReplayRequest(id=r["id"], prompt_token_ids=r["prompt_token_ids"], max_tokens=spec["max_tokens"],
                                  fixed_length=r["fixed_length"]) for r in spec["requests"]]
        warm = requests[:8]
        replay(engine, warm, np.zeros(len(warm)), kind, tag="warmup-")
        if runtime is not None:
            runtime.configure()  # counters from the measured replay only
        switch = _ShadowSwitch(runtime, spec) if kind == SHADOW else None
        result = replay(engine, requests, np.asarray(spec["arrivals"]), kind, runtime=runtime, tag="trace-",
                        before_step=None if switch is None else switch.before_step)
        latency = result.per_request["finish"] - result.per_request["arrival"]
        return {"kind": kind, "tok_s": result.throughput_tok_s, "makespan_s": result.makespan_s,
                "mean_latency_s": float(np.mean(latency)), "mean_ptl": result.mean_ptl,
                "output_tokens": result.output_tokens, "steps": result.steps,
                "step_ms": result.step_time_mean_ms, "ready_before_decode": result.ready_before_decode,
                "max_num_seqs": engine.vllm_config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": engine.vllm_config.scheduler_config.max_num_batched_tokens,
                "compilation_mode": str(engine.vllm_config.compilation_config.mode),
                "dtype": str(engine.vllm_config.model_config.dtype),
                "shadow_predicted": None if runtime is None else runtime.shadow.predicted,
                "shadow_seconds": None if runtime is None else runtime.shadow.seconds,
                **({} if switch is None else {"switchback": switch.record(result),
                                              "shadow_control_ms": float(spec.get("shadow_control_ms") or 0.0)}),
                "latency_s": latency.tolist()}
    finally:
        engine.engine_core.shutdown()


if __name__ == "__main__":
    kind_arg, spec_arg, out_arg = sys.argv[1:4]
    Path(out_arg).write_text(json.dumps(run_engine(kind_arg, json.loads(Path(spec_arg).read_text()))))
