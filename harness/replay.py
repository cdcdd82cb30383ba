"""Replay real prompts through the real engine at planned arrival times and measure latency after scheduling.

Requests are released at their planned arrivals (Poisson, or a trace's timestamps) and the engine is
stepped in between. The clock is the wall clock, or a step clock (`clock=` a calibrated `StepTimeModel`)
that prices each step the real engine took, so policies replayed minutes apart compare on equal terms
however the machine's speed drifts; wall step times are kept beside to validate the model. With fixed
lengths every policy replays the same generation work. PTL is the paper's: (finish - planned arrival) /
output tokens, averaged over requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from leap_core.metrics import ptl, summary
from leap_core.simulator import poisson_arrivals

DEFAULT_DECODING = {"temperature": 0.0, "frequency_penalty": 0.5}


@dataclass
class ReplayRequest:
    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    fixed_length: int | None = None
    domain: str | None = None
    oracle_length: int | None = None
    text: str | None = None  # the user message, for predictors that read text at arrival


@dataclass
class ReplayResult:
    policy: str
    n: int
    mean_ptl: float
    p95_ptl: float
    mean_ttft: float
    p95_ttft: float
    throughput_tok_s: float
    ready_before_decode: float | None
    max_steps_held_out: int
    makespan_s: float
    arrival_predict_s: float
    output_tokens: int
    steps: int
    step_time_mean_ms: float
    schedule_overhead_ms_per_step: float
    per_request: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    per_step: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("per_request", "per_step")}


def encode_prompts(tokenizer: Any, prompts: Sequence[dict], max_prompt_tokens: int) -> tuple[list[dict], int]:
    """Chat-template and tokenize prompts; drop those longer than the budget (returns how many)."""
    kept, dropped = [], 0
    for item in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}], tokenize=True,
                                            add_generation_prompt=True)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append({**item, "prompt_token_ids": ids})
    return kept, dropped


def planned_arrivals(n: int, rate: float | None, trace_arrivals: np.ndarray | None, seed: int) -> np.ndarray:
    """Seconds after the start at which each request is released."""
    if trace_arrivals is not None:
        arrivals = np.asarray(trace_arrivals[:n], dtype=np.float64)
        return arrivals - arrivals[0]
    if rate is None or rate <= 0:
        return np.zeros(n)
    return poisson_arrivals(n, rate, seed)


def sampling_params(request: ReplayRequest, decoding: dict) -> Any:
    from vllm import SamplingParams

    extra = {"leap_request_id": request.id}
    if request.domain:
        extra["leap_domain"] = request.domain
    if request.fixed_length is not None:
        extra["leap_oracle_length"] = request.fixed_length
        return SamplingParams(max_tokens=request.fixed_length, ignore_eos=True, extra_args=extra,
                              **{k: v for k, v in decoding.items() if k != "max_tokens"})
    if request.oracle_length is not None:
        extra["leap_oracle_length"] = request.oracle_length
    return SamplingParams(max_tokens=request.max_tokens, extra_args=extra,
                          **{k: v for k, v in decoding.items() if k != "max_tokens"})


ArrivalPredictor = Callable[[list[ReplayRequest]], np.ndarray]


def replay(engine: Any, requests: Sequence[ReplayRequest], arrivals: np.ndarray, policy: str,
           decoding: dict | None = None, runtime: Any = None,
           on_progress: Callable[[int, int], None] | None = None, tag: str = "",
           predict_at_arrival: ArrivalPredictor | None = None, clock: Any = None,
           before_step: Callable[[int], None] | None = None) -> ReplayResult:
    """Release `requests` at `arrivals` (seconds from now) into `engine`, step until all finish.

    `clock` (a `StepTimeModel`, needs `runtime`) replays on the step clock described above; every time
    in the result is then step-clock seconds.

    `predict_at_arrival` (a separate predictor that reads the prompt, as SSJF/LTR-style systems do) runs
    in the serving loop on each batch of newly arrived requests before they are added, so its time delays
    the engine exactly as a predictor sharing the accelerator would; its lengths go to the `client` policy.

    `before_step(k)` runs before the k-th engine step, outside its timing (a switchback experiment turns
    something on and off between steps); `per_step["tokens"]` counts the tokens each step generated.
    """
    decoding = decoding or DEFAULT_DECODING
    if clock is not None and runtime is None:
        raise ValueError("the step clock prices the runtime's step shapes: pass runtime")
    order = np.argsort(arrivals, kind="stable")
    n = len(requests)
    index_of = {f"{tag}{requests[i].id}": i for i in range(n)}
    first_token = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    out_tokens = np.zeros(n, dtype=np.int64)
    step_times: list[float] = []
    step_tokens: list[int] = []
    step_starts: list[float] = []
    step_shapes: list[tuple[int, int]] = []
    start = 0.0 if clock is not None else time.time()
    planned = start + np.asarray(arrivals, dtype=np.float64)
    released, done = 0, 0
    predict_s = 0.0
    modeled = 0.0  # the step clock
    while done < n:
        now = modeled if clock is not None else time.time()
        arrived = []
        while released < n and planned[order[released]] <= now:
            arrived.append(int(order[released]))
            released += 1
        if arrived:
            lengths = None
            if predict_at_arrival is not None:
                predict_start = time.perf_counter()
                lengths = predict_at_arrival([requests[i] for i in arrived])
                spent = time.perf_counter() - predict_start
                predict_s += spent
                modeled += spent  # the serving loop waited for it
            for k, i in enumerate(arrived):
                request = requests[i]
                params = sampling_params(request, decoding)
                wall_arrival = float(planned[i]) if clock is None else time.time()
                params.extra_args["leap_planned_arrival"] = wall_arrival
                if lengths is not None:
                    params.extra_args["leap_predicted_length"] = float(lengths[k])
                engine.add_request(f"{tag}{request.id}", {"prompt_token_ids": request.prompt_token_ids}, params,
                                   arrival_time=wall_arrival)
        if not engine.has_unfinished_requests():
            if released < n and clock is not None:
                modeled = max(modeled, float(planned[order[released]]))  # idle: jump to the next arrival
            elif released < n:
                time.sleep(max(0.0, min(planned[order[released]] - time.time(), 0.05)))
            continue
        if before_step is not None:
            before_step(len(step_times))
        step_start = time.perf_counter()
        step_starts.append(step_start)
        outputs = engine.step()
        step_times.append(time.perf_counter() - step_start)
        if runtime is not None:
            step_shapes.append(runtime.steps.last_step_shape)
        if clock is not None:
            modeled += float(clock.step_seconds(*runtime.steps.last_step_shape))
        now = modeled if clock is not None else time.time()
        generated = 0
        for output in outputs:
            i = index_of.get(output.request_id)
            if i is None:
                continue
            so_far = len(output.outputs[0].token_ids) if output.outputs else 0
            generated += so_far - int(out_tokens[i])
            out_tokens[i] = so_far
            if np.isnan(first_token[i]) and so_far > 0:
                first_token[i] = now
            if output.finished:
                finish[i] = now
                done += 1
                if on_progress is not None:
                    on_progress(done, n)
        step_tokens.append(generated)
    per_request_ptl = ptl(planned, finish, np.maximum(out_tokens, 1))
    ttft = first_token - planned
    ptl_summary, ttft_summary = summary(per_request_ptl), summary(ttft)
    makespan = float(np.nanmax(finish) - start)
    stats = runtime.stats() if runtime is not None else {}
    steps = len(step_times)
    return ReplayResult(
        policy=policy, n=n, mean_ptl=ptl_summary["mean"], p95_ptl=ptl_summary["p95"],
        mean_ttft=ttft_summary["mean"], p95_ttft=ttft_summary["p95"],
        throughput_tok_s=float(out_tokens.sum() / makespan) if makespan > 0 else float("nan"),
        ready_before_decode=stats.get("ready_before_decode"),
        max_steps_held_out=int(stats.get("max_steps_held_out", 0)), makespan_s=makespan,
        arrival_predict_s=predict_s,
        output_tokens=int(out_tokens.sum()), steps=steps,
        step_time_mean_ms=1000.0 * float(np.mean(step_times)) if steps else float("nan"),
        schedule_overhead_ms_per_step=1000.0 * stats.get("schedule_overhead_s", 0.0) / max(steps, 1),
        per_request={"ptl": per_request_ptl, "ttft": ttft, "output_tokens": out_tokens,
                     "finish": finish - start, "arrival": planned - start},
        per_step={"seconds": np.asarray(step_times), "shapes": np.asarray(step_shapes, dtype=np.int64),
                  "started": np.asarray(step_starts), "tokens": np.asarray(step_tokens, dtype=np.int64)},
    )
