"""The drift watch on the real engine: a readout fitted on one prompt set meets another one in vLLM.

The champion is fitted on the committed snapshot's alpaca rows (SmolLM2-135M-Instruct's layer-22 state
as serving captures it, lengths under the snapshot's decoding cut at this test's budget, which greedy
decoding makes exact) and registered with its validation MAE. The real engine serves it and then
generates alpaca_zh prompts under the same decoding; the watch scrapes the engine's admin API, finds
live error well above the validation error over its window, and starts one retrain.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.drift_fixtures import LAYER, snapshot_domains

pytestmark = pytest.mark.engine
TOKEN = "drift-engine-token"
BUDGET = 64  # short outputs keep the test in minutes on CPU; the domains still differ (most zh outputs reach it)
FITTED_ON, SHIFTED_TO = "alpaca", "alpaca_zh"


def test_the_engine_serving_another_prompt_set_starts_a_retrain(tmp_path):
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness
    from vllm import SamplingParams

    from flows.drift import RETRAIN, drift_flow
    from flows.promotion import PushOptions, promote
    from harness.engine import EngineSettings, build_engine, leap_scheduler
    from harness.model_prep import prepare_model
    from harness.replay import DEFAULT_DECODING, encode_prompts
    from leap_core.metrics import mae
    from leap_core.rls import fit_readout_with_anchor
    from registry.client import ReadoutRegistry
    from serving.config import LeapConfig
    from study_harness.snapshot import read_manifest, read_prompts
    from tests.flow_fixtures import pipeline_home

    model = prepare_model()
    if read_manifest()["model"]["fingerprint"] != model.fingerprint:
        pytest.skip("the snapshot's features are of other weights than the prepared model's")
    fitted = snapshot_domains(FITTED_ON)[FITTED_ON]
    lengths = np.minimum(fitted.lengths, BUDGET)
    readout, rls = fit_readout_with_anchor(
        fitted.features[:200], lengths[:200], alpha=30.0, max_tokens=BUDGET,
        metadata={"model_id": model.model_id, "model_fingerprint": model.fingerprint, "layer": LAYER,
                  "version": "20260101T000000-engine01"})
    validation_mae = mae(lengths[200:], readout.predict(fitted.features[200:]))
    home = tmp_path / "home"
    registry = ReadoutRegistry(f"sqlite:///{home}/mlflow/mlflow.db")
    logged = registry.log_readout(readout, rls=rls, params={"data_hash": FITTED_ON}, metrics={"mae": validation_mae})

    config = LeapConfig(policy="leap", layer=LAYER, max_resident=32, decode_slots=32, waiting_cap=1000, rls=False,
                        admin_port=0, admin_token=TOKEN)
    engine = build_engine(EngineSettings(model=model.path, max_model_len=1024, max_num_batched_tokens=1024), config)
    try:
        runtime = leap_scheduler(engine).leap
        url = f"http://127.0.0.1:{runtime.admin.port}"
        promote(registry, logged.name, logged.version, [url], PushOptions(TOKEN, retries=0), home / "promotions")
        assert runtime.readouts.version == readout.metadata["version"]
        prompts, _ = encode_prompts(engine.get_tokenizer(), read_prompts(SHIFTED_TO)[:24], 512)
        token = home / "replica.token"
        token.write_text(TOKEN)
        env = {"LEAP_ENDPOINTS": url, "LEAP_ADMIN_TOKEN_FILE": str(token), "LEAP_DRIFT_WINDOW": "2",
               "LEAP_DRIFT_MIN_ROWS": "16", "LEAP_MIN_ROWS": "100000"}
        passes, generated = [], []
        with prefect_test_harness(server_startup_timeout=120), \
                temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), pipeline_home(home, **env):
            for batch in (prompts[:16], prompts[16:]):  # two observations, each over >= 16 requests
                for item in batch:
                    params = SamplingParams(max_tokens=BUDGET, **DEFAULT_DECODING,
                                            extra_args={"leap_request_id": item["id"], "leap_domain": SHIFTED_TO})
                    engine.add_request(item["id"], {"prompt_token_ids": item["prompt_token_ids"]}, params)
                while engine.has_unfinished_requests():
                    generated += [len(o.outputs[0].token_ids) for o in engine.step() if o.finished]
                passes.append(drift_flow())
    finally:
        engine.engine_core.shutdown()
    live = {o["domain"]: o for o in passes[-1]["observations"]}[SHIFTED_TO]
    assert live["rows"] == len(generated) == 24
    assert live["mae"] > 1.25 * validation_mae, (live, validation_mae)
    assert passes[0]["retrains"] == 0  # one observation is not a window
    retrains = [d for d in passes[1]["decisions"] if d["action"] == RETRAIN and d["acted"]]
    assert len(retrains) == 1 and passes[1]["retrains"] == 1 and retrains[0]["done"], passes[1]["decisions"]
