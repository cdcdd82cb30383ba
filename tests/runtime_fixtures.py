"""A LEAP runtime without an engine: the `VllmConfig` fields LEAP reads, a readout whose prediction is the
feature's first value, a fixture that builds runtimes and closes them after the test, and a poll."""

from __future__ import annotations

import tempfile
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from leap_core.readout import LinearReadout

DIM, LAYERS, LAYER = 16, 4, 2
MODEL = "leap-test-model"


def channel() -> str:
    return f"ipc://{tempfile.gettempdir()}/leap-test-{uuid.uuid4().hex[:12]}.sock"


def engine_config(**leap) -> SimpleNamespace:
    """The fields of vLLM's `VllmConfig` that LEAP reads; the LEAP settings travel as in a real engine."""
    settings = {"layer": LAYER, "decode_slots": 1, "waiting_cap": 1000, "rls": False, "channel": channel(),
                "ready_wait_ms": 0.0, **leap}
    hf = SimpleNamespace(hidden_size=DIM, num_hidden_layers=LAYERS)
    model = SimpleNamespace(hf_text_config=hf, model=MODEL, max_model_len=4096)
    return SimpleNamespace(model_config=model, additional_config={"leap": settings},
                           instance_id=uuid.uuid4().hex[:8])


def first_value_readout(version: str = "v1", dim: int = DIM, layer: int = LAYER,
                        max_tokens: int = 4096) -> LinearReadout:
    """A readout whose predicted length is the vector's first value (raw target), clipped to [1, M]."""
    coef = np.zeros(dim)
    coef[0] = 1.0
    return LinearReadout.from_weights(mean=np.zeros(dim), scale=np.ones(dim), coef=coef, intercept=0.0, alpha=1.0,
                                      target="raw", max_tokens=max_tokens,
                                      metadata={"model_id": MODEL, "layer": layer, "version": version})


def scaled_readout(version: str, scale: float, intercept: float = 0.0) -> LinearReadout:
    """A readout predicting `intercept` plus `scale` times the vector's first value (raw target, M 4096)."""
    coef = np.zeros(DIM)
    coef[0] = scale
    return LinearReadout.from_weights(mean=np.zeros(DIM), scale=np.ones(DIM), coef=coef, intercept=intercept,
                                      alpha=1.0, target="raw", max_tokens=4096,
                                      metadata={"model_id": MODEL, "layer": LAYER, "version": version})


def eventually(condition, timeout: float = 10.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def build():
    """`build(registry_source=None, **leap)`: a LeapRuntime on `engine_config(**leap)` that opens its
    registry through `registry_source` (None: the installed entry point), closed when the test ends."""
    from serving.runtime import LeapRuntime

    made = []

    def _build(registry_source=None, **leap) -> LeapRuntime:
        runtime = LeapRuntime(engine_config(**leap), registry_source=registry_source)
        made.append(runtime)
        return runtime

    yield _build
    for runtime in made:
        runtime.close()
