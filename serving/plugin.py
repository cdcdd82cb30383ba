"""The `vllm.general_plugins` entry point, for stock `vllm serve` without `--worker-cls`.

vLLM loads general plugins in every process before it builds workers. With `LEAP_CAPTURE=1` in the
environment this one wraps the worker's `load_model` so the capture hook is installed after loading,
exactly as `serving.worker.LeapWorker` does; pair it with
`--scheduler-cls serving.scheduler.LeapScheduler --enforce-eager`. Without the variable it does nothing,
so installing LEAP never changes an engine that did not ask for it.
"""

from __future__ import annotations

import functools
import os


def register() -> None:
    if os.environ.get("LEAP_CAPTURE") != "1":
        return
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.load_model, "_leap_wrapped", False):
        return
    original = Worker.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "leap_capture", None) is None:
            from serving.worker import install_capture

            self.leap_capture = install_capture(self)

    load_model._leap_wrapped = True
    Worker.load_model = load_model
