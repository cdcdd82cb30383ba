"""The pipeline's settings: `leap_io.settings.LeapSettings`, the one class that reads `LEAP_*` variables.

`PipelineSettings` is that class under the name the flows, the stack and their tests import; the serving
process reads the same class (`serving.config.LeapConfig.from_environment`), so one environment
configures both sides of the loop. Paths left unset derive from the state folder; the MLflow URI points at
the local stack's server while it runs and at the sqlite file otherwise, so flows and the UI see the same
registry either way.
"""

from __future__ import annotations

from pathlib import Path

from leap_io.settings import LeapSettings

PipelineSettings = LeapSettings

__all__ = ["PipelineSettings", "resolved_model_path"]


def resolved_model_path(settings: LeapSettings) -> Path:
    """The serving model folder: `model_path`, else the prepared default model under the state folder."""
    if settings.model_path is not None:
        return Path(settings.model_path)
    from harness.model_prep import DEFAULT_MODEL_ID

    return settings.home / "models" / DEFAULT_MODEL_ID
