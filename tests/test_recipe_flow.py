"""Feature recipes through the pipeline: segments record their capture recipe, the store keeps each
recipe's rows apart, and the fit flow chooses among candidate recipes by validation and logs the choice.

Against the real parts, as tests/test_flows.py: segments written by the serving writer with its capture
recipe, a DuckDB log store, a sqlite MLflow registry and a temporary Prefect server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("prefect")
pytest.importorskip("mlflow")

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.testing.utilities import prefect_test_harness
from pydantic import ValidationError

from flows.pipeline import fit_flow
from flows.settings import PipelineSettings
from flows.tasks import latest_feature_space
from leap_io.feedback_schema import META_RECIPE, read_segment_file
from registry.client import CHALLENGER, ReadoutRegistry
from registry.runs import READOUT_EXPERIMENT, RECIPE_VALIDATION_FILE
from serving.feedback.writer import FeedbackWriter
from store.duckdb import SCHEMA_VERSION, LogStore
from store.ingest import ingest_folder
from store.validation import (
    REASON_FEATURE_DIM_CONFLICT,
    REASON_RECIPE_WRONG_DIM,
    REASON_UNPARSABLE_RECIPE,
)
from tests.flow_fixtures import ingest_and_fit, pipeline_home
from tests.segment_fuzz import write_segment
from training.spec import FeatureSpace, covered_recipes

pytestmark = [pytest.mark.pipeline,
              pytest.mark.filterwarnings("ignore:Type object .* OperatorClass:DeprecationWarning")]

MODEL_ID = "smol-recipes"
FINGERPRINT = "sha256:feedrecipe"
LAYER = 1
HIDDEN = 8
MAX_TOKENS = 512
CAPTURE = "last@1+mean@1"  # the wide capture: [last-token state | mean over the prompt], 2 x HIDDEN
SWAPPED = "mean@1+last@1"  # the same blocks in the other order: same dim, other columns
WIDE_ROWS = 200  # per segment of the wide capture; two of them are the newest feedback
CANDIDATES = ["last@1", "mean@1", "last@5", "mean@1+prompt"]  # the last two are not covered by CAPTURE
START = 1_750_000_000.0


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _rows(rng: np.random.Generator, prefix: str, first: int, n: int, dim: int, *, signal: slice | None,
          start: float) -> list[dict]:
    """Rows whose output length follows the feature columns of `signal` (None: no column carries it)."""
    rows = []
    for i in range(first, first + n):
        feature = rng.normal(size=dim).astype(np.float32)
        if signal is None:
            drive = 0.0
        else:
            block = feature[signal]
            drive = float(block @ np.linspace(1.0, -1.0, block.size)) / np.sqrt(block.size)
        length = int(np.clip(np.exp(4.2 + 1.2 * drive + 0.1 * rng.normal()), 1, MAX_TOKENS))
        arrival = start + 2.0 * i
        rows.append({
            "request_id": f"{prefix}-{i:05d}", "model_id": MODEL_ID, "model_fingerprint": FINGERPRINT,
            "layer": LAYER, "policy": "leap", "arrival_time": arrival, "first_token_time": arrival + 0.1,
            "finish_time": arrival + 0.1 + 0.02 * length, "prompt_tokens": 40, "output_tokens": length,
            "finish_reason": "length" if length == MAX_TOKENS else "stop", "max_tokens": MAX_TOKENS,
            "decoding": json.dumps({"temperature": 0.0}), "domain": "chat" if i % 2 else "code",
            "predicted_at_admission": None, "predicted_latest": None, "readout_version": "", "feature": feature,
        })
    return rows


def _stamp(path: Path, recipe: str | bytes) -> None:
    """Record a capture recipe in a closed segment's metadata as the serving writer does (rewritten
    under a temporary name and renamed, like the writer's own segments)."""
    table = read_segment_file(path)
    value = recipe if isinstance(recipe, bytes) else recipe.encode()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_RECIPE: value})
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temporary)
    os.replace(temporary, path)


def _write(feedback: Path, replica: str, segments: list[list[dict]], dim: int, recipe: str | None) -> None:
    """Each list of rows as one segment of the serving writer (named after the replica), which records
    `recipe` in the segment's metadata (None: a writer from before recipes, which records none)."""
    for rows in segments:
        writer = FeedbackWriter(feedback, dim, LAYER, MODEL_ID, FINGERPRINT, replica_id=replica, recipe=recipe)
        for row in rows:
            assert writer.write(row)
        assert writer.close()
    paths = sorted(feedback.glob(f"feedback-*-{replica}-*.parquet"))
    assert len(paths) == len(segments)
    for path in paths:
        recorded = pq.read_schema(path).metadata.get(META_RECIPE)
        assert recorded == (None if recipe is None else recipe.encode())


@pytest.fixture(scope="module")
def home(tmp_path_factory, prefect_server):
    """Feedback of one model and layer under several capture recipes, oldest first:
    a-plain: segments from before recipes (none recorded: last@1, HIDDEN wide);
    c-swapped: SWAPPED, as wide as CAPTURE, lengths follow nothing;
    e-misfit: CAPTURE on 15 floats, which no hidden size gives; d-bad: a recipe that does not parse;
    b-wide: CAPTURE, the newest, lengths driven by the mean block alone."""
    folder = tmp_path_factory.mktemp("leap-recipes")
    feedback = folder / "feedback"
    rng = np.random.default_rng(11)
    _write(feedback, "a-plain", [_rows(rng, "plain", 0, 120, HIDDEN, signal=slice(0, HIDDEN), start=START)],
           HIDDEN, None)
    _write(feedback, "c-swapped", [_rows(rng, "swapped", 0, 120, 2 * HIDDEN, signal=None, start=START + 1e4)],
           2 * HIDDEN, SWAPPED)
    _write(feedback, "e-misfit", [_rows(rng, "misfit", 0, 30, 15, signal=None, start=START + 2e4)], 15, CAPTURE)
    _write(feedback, "d-bad", [_rows(rng, "bad", 0, 25, 2 * HIDDEN, signal=None, start=START + 3e4)],
           2 * HIDDEN, "last@1+bogus")
    mean = slice(HIDDEN, 2 * HIDDEN)
    _write(feedback, "b-wide", [_rows(rng, "wide", s * WIDE_ROWS, WIDE_ROWS, 2 * HIDDEN, signal=mean,
                                      start=START + 1e5) for s in range(2)], 2 * HIDDEN, CAPTURE)
    with pipeline_home(folder, LEAP_RECIPES=",".join(CANDIDATES)):
        yield folder


@pytest.fixture(scope="module")
def fitted(home):
    return ingest_and_fit(home)


# ---------------------------------------------------------------------------- ingest and the store

def test_ingest_records_each_segments_recipe_and_quarantines_bad_ones(fitted):
    ingested, store = fitted["ingest"], fitted["store"]
    assert ingested["status"] == "ingested" and ingested["failed"] == 0
    assert ingested["quarantined"] == 25 + 30
    assert store.quarantine_reasons() == {REASON_UNPARSABLE_RECIPE: 25, REASON_RECIPE_WRONG_DIM: 30}
    with store.connect(read_only=True) as con:
        stored = dict(con.execute("SELECT recipe, count(*) FROM features GROUP BY ALL").fetchall())
        dims = dict(con.execute("SELECT coalesce(recipe, '-'), min(dim) FROM features GROUP BY ALL").fetchall())
    # rows without a recipe stay NULL (last@1); two recipes of one layer with other dims are no dim conflict
    assert stored == {None: 120, SWAPPED: 120, CAPTURE: 2 * WIDE_ROWS}
    assert dims == {"-": HIDDEN, SWAPPED: 2 * HIDDEN, CAPTURE: 2 * HIDDEN}


def test_frames_never_mix_recipes(fitted):
    store = fitted["store"]
    wide = store.training_frame(model_fingerprint=FINGERPRINT, layer=LAYER, recipe=CAPTURE)
    assert wide.features.shape == (2 * WIDE_ROWS, 2 * HIDDEN)
    assert all(rid.startswith("wide-") for rid in wide.request_ids)
    swapped = store.training_frame(layer=LAYER, recipe=" mean@1 + last@1 ")  # canonical names compare
    assert swapped.features.shape == (120, 2 * HIDDEN) and all(r.startswith("swapped-") for r in swapped.request_ids)
    plain = store.training_frame(layer=LAYER, recipe="last@1")  # the rows that record none
    assert plain.features.shape == (120, HIDDEN) and all(r.startswith("plain-") for r in plain.request_ids)
    # the same dim, two recipes: refused, not mixed
    with pytest.raises(ValueError, match="mixes capture recipes"):
        store.training_frame(since=START + 1e4, model_fingerprint=FINGERPRINT, layer=LAYER)


def test_the_latest_feature_space_carries_its_recipe(fitted):
    store = fitted["store"]
    assert latest_feature_space(store) == FeatureSpace(MODEL_ID, FINGERPRINT, LAYER, CAPTURE)
    assert latest_feature_space(store, recipe="last@1").recipe == "last@1"
    assert latest_feature_space(store, recipe=SWAPPED).recipe == SWAPPED
    assert latest_feature_space(store, recipe="last@7") is None
    assert FeatureSpace(MODEL_ID, FINGERPRINT, 9).recipe == "last@9"  # none given: today's recipe


def test_explicit_last_recipe_is_the_same_space_as_none(tmp_path: Path):
    """`last@20` recorded and nothing recorded are one feature space: one dim, one frame."""
    store = LogStore(tmp_path / "log.duckdb")
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    write_segment(feedback / "seg-1.parquet", 20, 8, seed=1, start_time=START)
    _stamp(write_segment(feedback / "seg-2.parquet", 20, 8, seed=2, start_time=START + 1e4).path, "last@20")
    _stamp(write_segment(feedback / "seg-3.parquet", 20, 6, seed=3, start_time=START + 2e4).path, "last@20")
    _stamp(write_segment(feedback / "seg-4.parquet", 20, 13, seed=4, start_time=START + 3e4).path,
           "last@20+mean@20")  # two state blocks cannot make 13 floats
    _stamp(write_segment(feedback / "seg-5.parquet", 20, 8, seed=5, start_time=START + 4e4).path, b"\xff\xfe")

    reports = ingest_folder(store, feedback)

    assert [r.accepted for r in reports] == [20, 20, 0, 0, 0]
    assert [r.quarantined for r in reports] == [0, 0, 20, 20, 20]
    assert store.quarantine_reasons() == {REASON_FEATURE_DIM_CONFLICT: 20, REASON_RECIPE_WRONG_DIM: 20,
                                          REASON_UNPARSABLE_RECIPE: 20}
    assert store.training_frame(recipe="last@20").features.shape == (40, 8)
    assert store.training_frame().features.shape == (40, 8)  # one space: nothing to mix
    with store.connect(read_only=True) as con:
        assert dict(con.execute("SELECT recipe, count(*) FROM features GROUP BY ALL").fetchall()) == {
            None: 20, "last@20": 20}


def test_a_version_2_store_migrates_and_its_rows_are_last_at_their_layer(tmp_path: Path):
    path = tmp_path / "v2.duckdb"
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    write_segment(feedback / "old.parquet", 30, 4, seed=1)
    ingest_folder(LogStore(path), feedback)
    con = duckdb.connect(str(path))  # back to version 2: no recipe column
    con.execute("ALTER TABLE features DROP COLUMN recipe")
    con.execute("UPDATE store_meta SET value = '2' WHERE key = 'schema_version'")
    con.close()

    store = LogStore(path)
    frame = store.training_frame(recipe="last@20")  # a reader migrates once, then reads

    assert store.schema_version() == SCHEMA_VERSION
    assert frame.features.shape == (30, 4)
    with store.connect(read_only=True) as con:
        assert con.execute("SELECT count(*) FROM features WHERE recipe IS NULL").fetchone() == (30,)
    assert latest_feature_space(store).recipe == "last@20"


def test_settings_read_candidate_recipes_and_refuse_bad_ones(monkeypatch):
    monkeypatch.setenv("LEAP_RECIPES", "last@17, last@17+mean@17+prompt,last@17")
    assert PipelineSettings().recipes == ("last@17", "last@17+mean@17+prompt")  # serving's type: one setting
    monkeypatch.setenv("LEAP_RECIPES", '["mean@3"]')
    assert PipelineSettings().recipes == ("mean@3",)
    monkeypatch.setenv("LEAP_RECIPES", "")
    assert PipelineSettings().recipes == ()
    monkeypatch.delenv("LEAP_RECIPES")
    assert PipelineSettings().recipes == ()
    monkeypatch.setenv("LEAP_RECIPES", "last@17,last@x")
    with pytest.raises(ValidationError, match="last@x"):
        PipelineSettings()


def test_covered_recipes_splits_the_candidates_by_the_capture():
    assert covered_recipes(CANDIDATES, CAPTURE, 2 * HIDDEN) == (["last@1", "mean@1"], ["last@5", "mean@1+prompt"])
    assert covered_recipes(None, CAPTURE, 2 * HIDDEN) == ([], [])
    with pytest.raises(ValueError, match="not a capture"):
        covered_recipes(["last@1"], CAPTURE, 15)


# ---------------------------------------------------------------------------- the fit chooses

def test_fit_chooses_the_recipe_whose_columns_carry_the_signal(fitted, monkeypatch):
    fit = fitted["fit"]
    assert fit["status"] == "fitted" and fit["recipe"] == "mean@1"
    registry = ReadoutRegistry(fitted["uri"])
    assert fit["name"] == registry.model_name(MODEL_ID, LAYER)
    assert registry.get_alias(fit["name"], CHALLENGER) == fit["version"]

    run = registry.client.get_run(fit["run_id"])
    params, metrics = run.data.params, run.data.metrics
    assert params["recipe"] == "mean@1" and params["capture_recipe"] == CAPTURE
    assert params["recipe_candidates"] == "last@1,mean@1"
    assert params["recipe_candidates_not_covered"] == "last@5,mean@1+prompt"
    assert params["recipe_choice"] == "validation" and params["dim"] == str(HIDDEN)
    assert int(params["n_train"]) + int(params["n_test"]) == 2 * WIDE_ROWS  # the wide rows alone
    assert run.data.tags["recipe"] == "mean@1"

    # the table is what the MLflow UI lists among the run's tables, and compares across runs
    assert {"path": RECIPE_VALIDATION_FILE, "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    experiment = registry.client.get_experiment_by_name(READOUT_EXPERIMENT)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fitted["uri"])  # load_table searches runs through the fluent API
    table = registry.client.load_table(experiment.experiment_id, artifact_file=RECIPE_VALIDATION_FILE,
                                       run_ids=[fit["run_id"]])
    rows = {row["recipe"]: row for row in table.to_dict("records")}
    assert set(rows) == {"last@1", "mean@1"}
    assert {"alpha", "spearman", "mae", "n", "dim", "chosen"} <= set(table.columns)
    assert rows["mean@1"]["chosen"] and not rows["last@1"]["chosen"]
    assert rows["mean@1"]["spearman"] > 0.8 > 0.3 > rows["last@1"]["spearman"]
    assert rows["mean@1"]["dim"] == rows["last@1"]["dim"] == HIDDEN
    assert metrics["validation_spearman"] == pytest.approx(rows["mean@1"]["spearman"])
    assert fit["metrics"]["spearman"] > 0.8  # on the test rows, which the choice never saw

    version = registry.client.get_model_version(fit["name"], fit["version"])
    assert version.tags["recipe"] == "mean@1"
    readout = registry.load_readout(fit["name"], fit["version"])
    assert readout.metadata["recipe"] == "mean@1" and readout.metadata["recipe_version"] == 1
    assert readout.dim_ == HIDDEN and readout.metadata["model_fingerprint"] == FINGERPRINT


def test_the_fit_key_holds_the_candidates(fitted):
    first = fitted["fit"]
    registry = ReadoutRegistry(fitted["uri"])

    again = fit_flow()
    assert again["status"] == "reused" and again["version"] == first["version"] and again["recipe"] == "mean@1"

    other = fit_flow(recipes=["last@1", "mean@1", CAPTURE])  # another candidate list: another fit
    assert other["status"] == "fitted" and other["fit_key"] != first["fit_key"]
    assert registry.client.get_run(other["run_id"]).data.params["recipe_candidates"] == f"last@1,mean@1,{CAPTURE}"

    capture = fit_flow(recipes=[])  # no candidates: the capture recipe, as before recipes
    assert capture["status"] == "fitted" and capture["recipe"] == CAPTURE
    run = registry.client.get_run(capture["run_id"])
    assert run.data.params["recipe_choice"] == "capture" and run.data.params["dim"] == str(2 * HIDDEN)
    assert "validation_spearman" not in run.data.metrics
    assert RECIPE_VALIDATION_FILE not in registry.list_artifacts(capture["run_id"])
    assert registry.load_readout(capture["name"], capture["version"]).metadata["recipe"] == CAPTURE


def test_settings_read_candidate_targets_and_refuse_unknown_ones(monkeypatch):
    monkeypatch.setenv("LEAP_TARGETS", "log, sqrt,log")
    assert PipelineSettings().targets == ["log", "sqrt"]
    monkeypatch.setenv("LEAP_TARGETS", "")
    assert PipelineSettings().targets is None
    monkeypatch.setenv("LEAP_TARGETS", "sqrt,cube")
    with pytest.raises(ValidationError, match="cube"):
        PipelineSettings()
    monkeypatch.delenv("LEAP_TARGETS")
    monkeypatch.setenv("LEAP_TARGET", "square")
    with pytest.raises(ValidationError, match="square"):
        PipelineSettings()


def test_fitted_targets_are_chosen_versioned_and_served_with_their_map(fitted):
    """rank and softbin are candidates like sqrt and log: the chosen one is registered with the map it learned
    from the training lengths, and the registry's readout (what serving loads) decodes through that map."""
    registry = ReadoutRegistry(fitted["uri"])
    chosen = fit_flow(targets=["rank", "softbin"])
    params = registry.client.get_run(chosen["run_id"]).data.params
    assert params["target_candidates"] == "rank,softbin" and params["target"] in ("rank", "softbin")
    readout = registry.load_readout(chosen["name"], chosen["version"])
    assert readout.target == params["target"] and readout.target_map_ is not None
    assert readout.target_map_.name == readout.target and readout.target_map_.max_tokens == readout.max_tokens
    predicted = readout.predict(np.zeros((1, readout.dim_)))
    assert 1.0 <= predicted[0] <= readout.max_tokens


def test_the_fit_chooses_the_target_with_the_recipe_until_a_champion_fixes_it(fitted, monkeypatch):
    """Lengths here are exp(linear drive): each (recipe, target) pair is one validation row, the served pair
    is the best one, and the readout regresses in its target. A champion then fixes the target: candidates
    with it fit in it, candidates without it are refused (serving would refuse the challenger)."""
    from registry.aliases import CHAMPION

    registry = ReadoutRegistry(fitted["uri"])
    chosen = fit_flow(targets=["sqrt", "log"])
    assert chosen["status"] == "fitted" and chosen["recipe"] == "mean@1"
    run = registry.client.get_run(chosen["run_id"])
    params = run.data.params
    assert params["target_candidates"] == "sqrt,log" and params["target_choice"] == "validation"
    experiment = registry.client.get_experiment_by_name(READOUT_EXPERIMENT)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fitted["uri"])
    table = registry.client.load_table(experiment.experiment_id, artifact_file=RECIPE_VALIDATION_FILE,
                                       run_ids=[chosen["run_id"]]).to_dict("records")
    assert sorted((row["recipe"], row["target"]) for row in table) == [
        ("last@1", "log"), ("last@1", "sqrt"), ("mean@1", "log"), ("mean@1", "sqrt")]
    served = [row for row in table if row["chosen"]]
    assert len(served) == 1 and served[0]["spearman"] == max(row["spearman"] for row in table)
    assert params["target"] == served[0]["target"] and params["recipe"] == served[0]["recipe"]
    assert run.data.metrics["validation_spearman"] == pytest.approx(served[0]["spearman"])
    assert registry.load_readout(chosen["name"], chosen["version"]).target == served[0]["target"]

    registry.set_alias(chosen["name"], CHAMPION, chosen["version"])
    try:
        fixed = fit_flow(targets=["log", "sqrt"])
        fixed_params = registry.client.get_run(fixed["run_id"]).data.params
        assert fixed_params["target"] == served[0]["target"] and fixed_params["target_choice"] == "given"
        other = "log" if served[0]["target"] == "sqrt" else "sqrt"
        with pytest.raises(Exception, match="champion's target"):
            fit_flow(targets=[other])
    finally:
        registry.client.delete_registered_model_alias(chosen["name"], CHAMPION)
