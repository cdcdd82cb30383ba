"""The registry champion serves a new replica of the real engine, loaded in vLLM's own engine process.

vLLM builds the scheduler, and with it LEAP's runtime, in a process it starts itself (spawned here, so
nothing of this test's imports reaches it) from the scheduler's class; the runtime finds the MLflow
registry there through the installed `leap.readout_sources` entry point alone. The replica has no
saved push, no readout file and no published champion, so the registry's champion is what it serves,
as its admin API reports.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.engine
TOKEN = "registry-engine-token"
VERSION = "20260101T000000-registry01"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _described(port: int) -> dict | None:
    try:
        asked = urllib.request.Request(f"http://127.0.0.1:{port}/leap/readout",
                                       headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(asked, timeout=5) as answer:
            return json.loads(answer.read())
    except OSError:
        return None


def test_a_new_replica_in_vllms_engine_process_serves_the_registry_champion(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from harness.engine import EngineSettings, build_engine
    from harness.model_prep import prepare_model
    from leap_core.layers import default_layer
    from leap_core.readout import LinearReadout
    from registry.client import ReadoutRegistry
    from serving.config import LeapConfig

    model = prepare_model()
    layer = default_layer(model.num_layers)
    readout = LinearReadout.from_weights(
        mean=np.zeros(model.hidden_size), scale=np.ones(model.hidden_size), coef=np.zeros(model.hidden_size),
        intercept=40.0, alpha=1.0, target="raw", max_tokens=512,
        metadata={"model_id": model.model_id, "model_fingerprint": model.fingerprint, "layer": layer,
                  "version": VERSION})
    uri = f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    registry = ReadoutRegistry(uri)
    logged = registry.log_readout(readout, params={"data_hash": "registry-engine"}, metrics={"mae": 1.0})
    registry.promote(logged.name, logged.version)

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine core runs in its own process
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # a fresh interpreter, nothing inherited
    port = _free_port()
    config = LeapConfig(policy="leap", layer=layer, max_resident=8, decode_slots=8, rls=False,
                        admin_port=port, admin_token=TOKEN, registry_uri=uri, champion_url="")
    engine = build_engine(EngineSettings(model=model.path, max_model_len=1024, max_num_batched_tokens=1024), config)
    try:
        deadline = time.monotonic() + 120
        described = _described(port)
        while (described is None or described["registry"]["state"] == "loading") and time.monotonic() < deadline:
            time.sleep(0.5)
            described = _described(port)
    finally:
        engine.engine_core.shutdown()
    assert described is not None, "the engine's admin API never answered"
    assert described["registry"] == {"state": "loaded", "model": logged.name}, described["registry"]
    assert (described["source"], described["version"]) == ("registry", VERSION)
