"""LEAP's serving settings, one pydantic model shared by the scheduler and worker processes.

vLLM hands the same `VllmConfig` to the engine-core process and every worker, so the settings travel in
`additional_config["leap"]`; fields not given there fall back to the `LEAP_*` variables, read by the one
settings class (`leap_io.settings.LeapSettings`, whose `ServingSection` declares these fields), so stock
`vllm serve --scheduler-cls ...` can be configured without code. `LeapConfig(...)` reads no environment;
`LeapConfig.from_environment(...)` does. A policy name ("fcfs", "leap", "oracle", "client") sets the decode
order and where the predicted length comes from; `order` chooses countdown or Gittins for "leap".
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Literal

from pydantic import ConfigDict

from leap_io.settings import (
    ORDERS,
    POLICIES,
    LeapSettings,
    Order,
    ServingSection,
    read_settings,
)

__all__ = ["ORDERS", "POLICIES", "LeapConfig", "Order", "channel_address", "leap_config_from_vllm"]


class LeapConfig(ServingSection):
    """The serving settings of one process: `leap_io.settings.ServingSection` as a plain model (no
    environment of its own), validated on assignment."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    @classmethod
    def from_environment(cls, settings: LeapSettings | None = None, **values: Any) -> LeapConfig:
        """`values` over the serving settings the environment gives (`LeapSettings.serving_values`)."""
        given = (settings or read_settings()).serving_values()
        return cls(**{**given, **values})

    @property
    def decode_order(self) -> Literal["fcfs", "countdown", "gittins"]:
        """The `leap_core.policy.make_policy` name of this policy's decode order: `order` for policies that
        rank by the predictor, countdown for the oracle's and the client's lengths, FCFS for "fcfs"."""
        if self.policy == "fcfs":
            return "fcfs"
        return self.order if self.length_source == "predicted" else "countdown"

    @property
    def length_source(self) -> Literal["none", "predicted", "oracle", "client"]:
        """Where a request's predicted total length comes from under this policy."""
        if self.policy in ("fcfs", "oracle", "client"):
            return "none" if self.policy == "fcfs" else self.policy
        return "predicted"

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
    return LeapConfig.from_environment(**values)


def channel_address(vllm_config: Any, config: LeapConfig) -> str:
    """The ipc address workers push captured features to; unique per engine instance."""
    if config.channel:
        return config.channel
    instance = getattr(vllm_config, "instance_id", "") or str(os.getpid())
    return f"ipc://{tempfile.gettempdir()}/leap-capture-{instance}.sock"
