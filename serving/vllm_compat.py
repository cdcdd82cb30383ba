"""Every private vLLM attribute or function LEAP touches, in one place, checked against the installed version.

LEAP rides on internals that vLLM does not promise to keep: the scheduler's `running` list, its
`current_step` counter and `next_decode_eligible_step` hold-outs, `_free_request`, the request-id suffix,
the in-process engine-core object, the model runners' batch layout and aux-hidden-state switch, the IR
kernel priorities of the CPU platform and the worker classes. Nothing else in LEAP names them. The
installed version is checked once, when the plugin starts (`check_version`), and a version this module
was not written against fails fast with a message saying so instead of misbehaving later.

Sections: version; scheduler; engine; worker and model runner (capture).
"""

from __future__ import annotations

import functools
import os
from typing import Any

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


@functools.cache
def check_version() -> str:
    """The installed vLLM version; raise UnsupportedVllmVersion on one this module does not know.

    `LEAP_ALLOW_UNKNOWN_VLLM=1` lets an operator try a newer vLLM at their own risk.
    """
    version = installed_version()
    if not is_supported(version) and os.environ.get(ALLOW_UNKNOWN_ENV) != "1":
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


# -- engine ------------------------------------------------------------------------------------------
def in_process_scheduler(engine: Any) -> Any:
    """The scheduler object of an in-process `LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return engine.engine_core.engine_core.scheduler


# -- worker and model runner (capture) ---------------------------------------------------------------
