"""An in-process vLLM engine with LEAP active, for the replay harness, the corpus builder and tests.

Everything runs in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the scheduler and its
LEAP runtime are reachable as Python objects. The engine runs as vLLM would by default (compiled,
the model's own dtype): LEAP's capture reads aux hidden states, which survive compilation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from leap_io.paths import sub_dir
from serving.config import LeapConfig
from serving.readout.sources import RegistrySourceFactory


def engine_environment() -> None:
    """Environment the engine needs here: in-process, offline, caches inside the project."""
    cache = sub_dir("cache")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries `--json` results
    if is_cpu_platform():  # vLLM's platform check, after the logging settings it reads at import
        # vLLM's CPU backend compiles without Inductor, and its AOT cache then fails to load at every
        # start ("'function' object has no attribute 'finalize_loading'") and compiles again: warm
        # starts took 68-74 s with it and 24-28 s with vLLM's earlier compile cache (SmolLM2-135M).
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@dataclass
class EngineSettings:
    """The engine-side knobs that matter for LEAP experiments."""

    model: str
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # only for a model without aux hidden states (the forward-hook fallback)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def leap_engine_args(leap: LeapConfig, registry_source: RegistrySourceFactory | None = None) -> dict[str, Any]:
    """The engine arguments that turn a stock engine into a LEAP one (and nothing else); `registry_source`
    opens the registry at `leap.registry_uri` (default: the installed `leap.readout_sources` entry point)."""
    from serving.scheduler import scheduler_class

    return dict(scheduler_cls=scheduler_class(not is_cpu_platform(), registry_source),
                worker_cls="serving.worker.LeapWorker", max_num_seqs=leap.max_resident,
                additional_config={"leap": leap.model_dump(exclude_none=True)})


def build_default_engine(model: str, max_model_len: int = 4096, leap: LeapConfig | None = None) -> Any:
    """vLLM as a user runs it: the model and its context length, every other setting vLLM's default (with
    `leap`, LEAP's engine arguments on top and nothing else)."""
    engine_environment()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    extra = leap_engine_args(leap) if leap is not None else {}
    return LLMEngine.from_engine_args(EngineArgs(model=model, max_model_len=max_model_len, **extra))


def build_engine(settings: EngineSettings, leap: LeapConfig | None, stock: bool = False,
                 registry_source: RegistrySourceFactory | None = None) -> Any:
    """An LLMEngine; `stock=True` keeps vLLM's own scheduler and worker, with the same engine shape.
    `registry_source` opens the registry whose champion serves at start (`leap_engine_args`)."""
    engine_environment()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    leap = leap or LeapConfig.from_environment()
    kwargs: dict[str, Any] = dict(
        model=settings.model, max_model_len=settings.max_model_len, dtype=settings.dtype or "auto",
        enforce_eager=settings.enforce_eager, max_num_seqs=leap.max_resident,
        max_num_batched_tokens=settings.max_num_batched_tokens, seed=settings.seed,
        enable_prefix_caching=False,
    )
    if not stock:
        kwargs.update(leap_engine_args(leap, registry_source))
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def leap_scheduler(engine: Any) -> Any:
    """The scheduler object of an in-process engine (holds `.leap`, the runtime)."""
    from serving.vllm_compat import in_process_scheduler

    return in_process_scheduler(engine)
