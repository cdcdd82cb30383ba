"""Serving readouts by recipe, without an engine: each readout reads its own recipe's columns of the captured
vector (in-step, on the predictor thread, when a publish rescores and in RLS), a readout whose recipe the
capture does not hold is refused at start and on push, files from before recipes still serve (`last@<layer>`),
and feedback keeps the whole captured vector."""

from __future__ import annotations

import logging
import time

import httpx
import numpy as np
import pytest

from leap_core import targets
from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.recipes import DOMAIN_VALUE, Recipe, request_columns
from leap_core.rls import fit_readout_with_anchor
from leap_io.feedback_schema import read_segment_file
from leap_io.push_bundle import make_bundle
from serving.config import LeapConfig
from serving.readout.push import CaptureSpace, PushRefused
from serving.readout.service import ReadoutService
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker
from tests.runtime_fixtures import DIM, LAYER, MODEL, build, eventually, first_value_readout  # noqa: F401  (pytest fixtures, used by name)

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from serving.capture.hidden_states import FeatureSender

CAPTURE = "last@1+last@2+mean@2+prompt+decoding+domain=a/b"
WIDTH = Recipe.parse(CAPTURE).dim(DIM)
TOKEN = "recipe-test-token"


def column_of(block: str, capture: str = CAPTURE, k: int = 0) -> int:
    """The index in a captured vector of the k-th column of `block`."""
    return Recipe.parse(capture).offsets(DIM)[block][0] + k


def distinct(width: int = WIDTH) -> np.ndarray:
    """A captured vector whose every column holds its own value (100 + its index)."""
    return (100.0 + np.arange(width)).astype(np.float32)


def one_hot_readout(recipe: str, index: int, version: str, hidden: int = DIM) -> LinearReadout:
    """A readout on `recipe` whose prediction (raw target) is its own column `index`."""
    dim = Recipe.parse(recipe).dim(hidden)
    coef = np.zeros(dim)
    coef[index] = 1.0
    return LinearReadout.from_weights(mean=np.zeros(dim), scale=np.ones(dim), coef=coef, intercept=0.0, alpha=1.0,
                                      target="raw", max_tokens=4096,
                                      metadata={"model_id": MODEL, "recipe": recipe, "version": version})


def request(rid: str) -> Request:
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=64), None, arrival_time=time.time())


def predicted(runtime, rid: str, vector: np.ndarray) -> float:
    """Send `vector` as the captured feature of a new request and return its prediction."""
    runtime.before_schedule([request(rid)], 0)
    FeatureSender(runtime.config.channel).send([rid], vector[None])
    assert eventually(lambda: rid in runtime.tracker.predictions), rid
    return runtime.tracker.predictions[rid]


# -- column selection -------------------------------------------------------------------------------------
def test_each_readout_reads_its_recipes_columns_in_step_on_the_predictor_thread_and_when_rescored(build):
    runtime = build(policy="leap", recipe=CAPTURE)
    vector = distinct()
    runtime.reset_readout(one_hot_readout("last@2+prompt", DIM, "v1"), None)  # its prompt column
    assert predicted(runtime, "a-00000001", vector) == pytest.approx(vector[column_of("prompt")])

    # a publish rescores the live request from its cached vector with the new readout's columns
    runtime.reset_readout(one_hot_readout("mean@2+decoding", DIM + 2, "v2"), None)  # log(1 + max_tokens)
    assert runtime.tracker.predictions["a-00000001"] == pytest.approx(vector[column_of("decoding", k=2)])

    class Head:
        """An evaluation head (served on the predictor thread) on the second domain of the capture's two."""

        metadata = {"version": "head", "recipe": "last@1+domain=b"}

        def predict(self, X: np.ndarray) -> np.ndarray:
            assert X.shape[1] == DIM + 1
            return X[:, -1].astype(np.float64)

    runtime.serve_predictor(Head(), "head")
    assert runtime.tracker.predictions["a-00000001"] == pytest.approx(vector[column_of("domain=a/b", k=1)])
    assert predicted(runtime, "b-00000001", vector + 1) == pytest.approx(vector[column_of("domain=a/b", k=1)] + 1)


def test_the_capture_and_the_serving_readouts_recipe_are_reported(build):
    runtime = build(policy="leap", recipe=CAPTURE)
    assert runtime.describe()["recipe"] == CAPTURE and runtime.describe()["readout_recipe"] is None
    runtime.reset_readout(first_value_readout("old"), None)
    described, stats = runtime.describe(), runtime.stats()
    assert described["feature_dim"] == WIDTH
    assert described["readout_recipe"] == stats["readout_recipe"] == f"last@{LAYER}"
    assert stats["recipe"] == CAPTURE


# -- old readout files -------------------------------------------------------------------------------------
def test_a_readout_from_before_recipes_reads_its_layer_of_any_capture_that_holds_it(build):
    wide = build(policy="leap", recipe=CAPTURE)
    wide.reset_readout(first_value_readout("old"), None)  # records layer 2, no recipe
    assert predicted(wide, "a-00000001", distinct()) == pytest.approx(distinct()[column_of(f"last@{LAYER}")])

    plain = build(policy="leap")  # today's capture: last@<layer>, the whole vector
    plain.reset_readout(first_value_readout("old"), None)
    assert predicted(plain, "a-00000001", distinct(DIM)) == pytest.approx(100.0)

    every = build(policy="leap", capture_all_layers=True)  # the layer study: any layer's readout serves
    for layer in (1, 3):
        every.reset_readout(first_value_readout(f"L{layer}", layer=layer), None)
        value = predicted(every, f"L{layer}-00000001", distinct(4 * DIM))
        assert value == pytest.approx(100.0 + layer * DIM)


# -- refusals ----------------------------------------------------------------------------------------------
REFUSED = {
    "a layer not captured": (lambda: one_hot_readout("last@3", 0, "bad"), "last@3"),
    "a pool not captured": (lambda: one_hot_readout("mean@1+prompt", 0, "bad"), "mean@1"),
    "a domain not captured": (lambda: one_hot_readout("last@2+domain=c", 0, "bad"), "domain"),
    "a dim not its recipe's": (lambda: first_value_readout("bad", dim=DIM + 1), "dim"),
    "a recipe that does not parse": (lambda: with_recipe(first_value_readout("bad"), "last@2+<script>"), "recipe"),
    "a recipe that is not text": (lambda: with_recipe(first_value_readout("bad"), ["last@2", {"x": 1}]), "recipe"),
}


def with_recipe(readout, recipe):
    """A readout whose metadata names `recipe`, whatever a hostile pusher writes there."""
    readout.metadata["recipe"] = recipe
    return readout


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_push_the_capture_does_not_cover_is_refused_with_both_recipes_and_the_old_readout_serves(build, case):
    runtime = build(policy="leap", recipe=CAPTURE, admin_port=0, admin_token=TOKEN)
    runtime.reset_readout(one_hot_readout("last@2+prompt", DIM, "v1"), None)
    make, named = REFUSED[case]
    response = httpx.post(f"http://127.0.0.1:{runtime.admin.port}/leap/readout", content=to_bytes(make()),
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error.startswith("refused") and named in error
    if case != "a dim not its recipe's":
        assert CAPTURE in error  # names the capture recipe beside the readout's
    assert runtime.readouts.version == "v1" and response.json()["serving"] == "v1"
    assert predicted(runtime, "a-00000001", distinct()) == pytest.approx(distinct()[column_of("prompt")])


def test_a_configured_readout_the_capture_does_not_cover_is_refused_at_start(build, tmp_path):
    path = tmp_path / "readout.leap"
    path.write_bytes(to_bytes(one_hot_readout("last@1+entropy@2", 0, "file")))
    with pytest.raises(PushRefused, match="entropy@2") as refused:
        build(policy="leap", recipe=CAPTURE, readout_path=str(path))
    assert CAPTURE in str(refused.value) and refused.value.status == 409
    path.write_bytes(to_bytes(one_hot_readout("last@1+prompt", DIM, "file")))  # a sub-recipe serves
    assert build(policy="leap", recipe=CAPTURE, readout_path=str(path)).readouts.version == "file"


def test_a_saved_readout_the_new_capture_does_not_cover_is_not_restored(build, tmp_path, caplog):
    state = tmp_path / "state"
    first = build(policy="leap", recipe=CAPTURE, state_dir=str(state))
    first.push_readout(to_bytes(one_hot_readout("mean@2+prompt", 0, "pushed")))
    first.close()
    with caplog.at_level(logging.WARNING, logger="serving"):
        second = build(policy="leap", state_dir=str(state))  # captures last@2 only now
    assert second.describe()["source"] == "none" and second.readouts.version == ""
    assert second.telemetry.dropped("state", "unusable") == 1
    assert any("mean@2" in r.getMessage() and f"last@{LAYER}" in r.getMessage() for r in caplog.records)


# -- feedback -------------------------------------------------------------------------------------------------
def test_feedback_rows_keep_the_whole_captured_vector_and_segments_record_the_capture_recipe(build, tmp_path):
    runtime = build(policy="leap", recipe=CAPTURE, feedback_dir=str(tmp_path / "feedback"))
    runtime.reset_readout(one_hot_readout("last@2+prompt", DIM, "v1"), None)
    live = request("a-00000001")
    predicted_value = predicted(runtime, live.request_id, distinct())
    runtime.tracker.track(live)  # the request predicted() admitted under this id
    live.num_computed_tokens = live.num_prompt_tokens
    live.append_output_token_ids([7, 7])
    live.status = RequestStatus.FINISHED_LENGTH_CAPPED
    runtime.on_finished(live)
    runtime.flush_feedback()
    (segment,) = list((tmp_path / "feedback").glob("*.parquet"))
    table = read_segment_file(segment)
    assert table.schema.metadata[b"leap.recipe"] == CAPTURE.encode()
    assert table.schema.metadata[b"leap.layer"] == str(runtime.layer).encode()  # kept for older readers
    assert table.schema.field("feature").type.list_size == WIDTH
    np.testing.assert_array_equal(np.asarray(table.column("feature")[0].as_py(), np.float32), distinct())
    assert table.column("predicted_latest")[0].as_py() == pytest.approx(predicted_value)


# -- RLS on prompt, decoding and domain columns ----------------------------------------------------------------
HIDDEN, NUM_LAYERS = 6, 3
RLS_CAPTURE = Recipe.parse("last@1+mean@1+prompt+decoding+domain=a/b/c")
RLS_RECIPE = "last@1+prompt+decoding+domain=a/b"  # a part of the capture: no pool, two of its three domains
DOMAINS = ("a", "b", "c", None)


def captured_rows(rng, n: int, shift_a: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(captured vectors, lengths): lengths depend on the state, the prompt, the temperature and the domain;
    `shift_a` adds to domain a's sqrt length (a shift of that domain's traffic)."""
    where = RLS_CAPTURE.offsets(HIDDEN)
    rows, roots = [], []
    for _ in range(n):
        state = rng.normal(size=HIDDEN)
        prompt = int(rng.integers(5, 800))
        settings = {"temperature": float(rng.choice([0.0, 0.7, 1.0])), "top_p": float(rng.choice([0.9, 1.0]))}
        domain = DOMAINS[rng.integers(len(DOMAINS))]
        vector = np.zeros(RLS_CAPTURE.dim(HIDDEN))
        vector[slice(*where["last@1"])] = state
        vector[slice(*where["mean@1"])] = rng.normal(size=HIDDEN)
        for name, values in request_columns(RLS_CAPTURE, prompt, settings, int(rng.choice([256, 1024])),
                                            domain).items():
            vector[slice(*where[name])] = values
        root = 12 + 2 * state[0] + 1.5 * np.log1p(prompt) + 3 * settings["temperature"] \
            + {"a": 4.0 + shift_a, "b": -3.0, "c": 1.0, None: 0.0}[domain] + 0.3 * rng.normal()
        rows.append(vector)
        roots.append(root)
    return np.asarray(rows), np.clip(np.round(np.asarray(roots) ** 2), 1, 2048)


def test_rls_on_a_sub_recipe_equals_the_anchored_ridge_refit_and_moves_only_the_shifted_domain():
    rng = np.random.default_rng(0)
    space = CaptureSpace(RLS_CAPTURE, HIDDEN, NUM_LAYERS)
    columns = space.columns({"recipe": RLS_RECIPE})
    X_train, y_train = captured_rows(rng, 400)
    readout, rls = fit_readout_with_anchor(X_train[:, columns], y_train, alpha=1.0, max_tokens=2048,
                                           metadata={"recipe": RLS_RECIPE, "version": "v1"})
    telemetry = Telemetry()
    service = ReadoutService(LeapConfig(rls=True, rls_every=8), {}, RequestTracker(telemetry), telemetry,
                             space).start()
    try:
        service.push(make_bundle(to_bytes(readout), rls.state_arrays()))
        X_feedback, y_feedback = captured_rows(rng, 160, shift_a=6.0)
        for vector, length in zip(X_feedback, y_feedback):
            service.observe(vector, int(length))  # the whole captured vector, as a finished request gives it
        assert service.learner.wait_idle(10)
        learned = service.readout
    finally:
        service.close()
    assert learned.metadata["version"] == "v1+rls20"

    def augmented(X: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(X)), readout.standardize(X[:, columns])])

    U_train, U_feedback = augmented(X_train), augmented(X_feedback)
    penalty = np.eye(U_train.shape[1])
    penalty[0, 0] = 0.0
    A = U_train.T @ U_train + penalty + U_feedback.T @ U_feedback
    b = U_train.T @ targets.transform(y_train, "sqrt") + U_feedback.T @ targets.transform(y_feedback, "sqrt")
    expected = np.linalg.solve(A, b)
    np.testing.assert_allclose(learned.theta_, expected, rtol=1e-8, atol=1e-8 * np.abs(expected).max())

    # each domain's intercept, in sqrt-length units: its column's slope times its column's value
    start = Recipe.parse(RLS_RECIPE).offsets(HIDDEN)["domain=a/b"][0]
    before = DOMAIN_VALUE * readout.coef_[start:start + 2] / readout.scale_[start:start + 2]
    after = DOMAIN_VALUE * learned.coef_[start:start + 2] / learned.scale_[start:start + 2]
    moved_a, moved_b = after - before
    # with no forgetting, domain a's intercept moves to the average over its old and new rows
    in_a = RLS_CAPTURE.offsets(HIDDEN)["domain=a/b/c"][0]
    old, new = (X_train[:, in_a] > 0).sum(), (X_feedback[:, in_a] > 0).sum()
    assert moved_a == pytest.approx(6.0 * new / (old + new), rel=0.25), (before, after)
    assert abs(moved_b) < 0.05 * moved_a, (before, after)
