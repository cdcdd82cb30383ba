"""LEAP's serving settings, one pydantic model shared by the scheduler and worker processes.

vLLM hands the same `VllmConfig` to the engine-core process (scheduler) and to every worker, so the
settings travel in `additional_config["leap"]`. Fields not given there fall back to `LEAP_*`
environment variables, so stock `vllm serve --scheduler-cls ...` can be configured without code.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

POLICIES = ("fcfs", "leap", "oracle")


class LeapConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LEAP_", extra="ignore")

    policy: str = Field("leap", description="fcfs | leap | oracle, or a registered evaluation predictor")
    readout_path: str | None = Field(None, description="leap_core readout file served at start")
    rls_state_path: str | None = Field(None, description="RLS anchor (theta, P) saved with the readout")
    layer: int | None = Field(None, description="decoder layer to capture; default: the readout's layer")
    capture_all_layers: bool = Field(False, description="capture every decoder layer (layer study, not serving)")
    max_resident: int = Field(512, ge=1, description="R: requests kept resident (vLLM max_num_seqs)")
    decode_slots: int = Field(64, ge=1, description="K: requests decoded per step")
    waiting_cap: int = Field(128, ge=1, description="C: steps a resident request may be held out")
    aging: float = Field(0.0, ge=0.0, description="exponential aging strength (0: plain countdown)")
    rls: bool = Field(True, description="correct the readout online from finished requests")
    rls_every: int = Field(8, ge=1, description="finished requests per RLS publish")
    rls_forgetting: float = Field(1.0, gt=0.0, le=1.0)
    ready_wait_ms: float = Field(200.0, ge=0.0, description="longest wait for a missing prediction")
    feedback_dir: str | None = Field(None, description="folder of feedback segments; None: no feedback")
    segment_max_rows: int = Field(5000, ge=1)
    segment_max_seconds: float = Field(300.0, gt=0.0)
    admin_host: str = "127.0.0.1"
    admin_port: int | None = Field(None, description="admin API port; None: no admin server")
    admin_token: str | None = Field(None, description="admin token; else LEAP_ADMIN_TOKEN_FILE")
    admin_token_file: str | None = None
    channel: str | None = Field(None, description="capture channel address; default from the instance id")

    def token(self) -> str | None:
        if self.admin_token:
            return self.admin_token
        if self.admin_token_file and os.path.isfile(self.admin_token_file):
            return open(self.admin_token_file).read().strip() or None
        return None


def leap_config_from_vllm(vllm_config: Any) -> LeapConfig:
    """Read LEAP's settings from `additional_config["leap"]`, falling back to the environment."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    values = dict(extra.get("leap", {})) if isinstance(extra, dict) else {}
    return LeapConfig(**values)


def channel_address(vllm_config: Any, config: LeapConfig) -> str:
    """The ipc address workers push captured features to; unique per engine instance."""
    if config.channel:
        return config.channel
    instance = getattr(vllm_config, "instance_id", "") or str(os.getpid())
    return f"ipc://{tempfile.gettempdir()}/leap-capture-{instance}.sock"
