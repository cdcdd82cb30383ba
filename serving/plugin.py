"""The `vllm.general_plugins` entry point, for stock `vllm serve` without `--worker-cls`.

vLLM loads general plugins in every process before it builds workers. With `LEAP_CAPTURE=1` in the
environment this one makes every worker install LEAP's capture after loading its model, exactly as
`serving.worker.LeapWorker` does; pair it with `--scheduler-cls serving.scheduler.LeapScheduler`.
Without the variable it does nothing, so installing LEAP never changes an engine that did not ask for it.
"""

from __future__ import annotations


def register() -> None:
    from leap_io.settings import read_settings

    if not read_settings().capture:
        return
    from serving import vllm_compat

    vllm_compat.check_version()

    def install(worker):
        from serving.worker import install_capture

        return install_capture(worker)

    vllm_compat.after_worker_load_model(install)
