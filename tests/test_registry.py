"""The MLflow registry against a real sqlite store: versions, aliases, the pyfunc model, gate runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("mlflow")

from mlflow.exceptions import MlflowException

from leap_core.readout import LinearReadout
from leap_core.readout_format import ReadoutMismatchError
from leap_core.rls import RLS
from registry import plots
from registry.client import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    ReadoutRegistry,
    RegistryError,
    ensure_db,
)
from registry.model import READOUT_FILE, RLS_STATE_FILE
from registry.tracking import sqlite_path

pytestmark = pytest.mark.pipeline

MODEL_ID = "Qwen/Qwen2.5-0.5B-Instruct"
LAYER = 18
MAX_TOKENS = 1024
DIM = 12


def _data(seed: int, n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, DIM)).astype(np.float32)
    weights = np.linspace(-1.0, 1.0, DIM)
    lengths = np.clip(np.exp(4.5 + 0.6 * features @ weights / np.sqrt(DIM)), 1, MAX_TOKENS).round()
    return features, lengths


def _readout(alpha: float, fingerprint: str = "sha256:abc123") -> LinearReadout:
    features, lengths = _data(seed=0)
    readout = LinearReadout(alpha=alpha, target="sqrt", max_tokens=MAX_TOKENS).fit(features, lengths)
    readout.metadata.update(model_id=MODEL_ID, model_fingerprint=fingerprint, layer=LAYER,
                            version=f"alpha{alpha}")
    return readout


def _log(registry: ReadoutRegistry, readout: LinearReadout, with_rls: bool):
    features, lengths = _data(seed=1)
    predicted = readout.predict(features)
    rls = RLS.from_readout(readout, _data(seed=0)[0]) if with_rls else None
    return registry.log_readout(
        readout,
        rls=rls,
        params={"data_window": "2025-01-01/2025-01-31", "train_rows": 240, "eval_rows": 240,
                "data_hash": "deadbeef"},
        metrics={"spearman": 0.8, "kendall": 0.6, "mae_0-63": 12.5, "spearman_math/gsm8k": 0.7},
        eval_arrays={"true": lengths, "pred": predicted},
        run_name=f"fit-alpha{readout.alpha}",
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """One sqlite store holding two logged versions of the same serving model and layer."""
    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder}/mlflow.db"
    registry = ReadoutRegistry(uri)
    readouts = {"1": _readout(alpha=1.0), "2": _readout(alpha=30.0)}
    logged = {"1": _log(registry, readouts["1"], with_rls=True),
              "2": _log(registry, readouts["2"], with_rls=False)}
    return {"uri": uri, "folder": folder, "registry": registry, "readouts": readouts, "logged": logged}


def test_model_name_is_one_safe_name_per_model_and_layer():
    name = ReadoutRegistry.model_name("Qwen/Qwen2.5-0.5B-Instruct", 18)
    assert name == "leap-readout-qwen-qwen2.5-0.5b-instruct-L18"
    assert ReadoutRegistry.model_name("Qwen/Qwen2.5-0.5B-Instruct", 20) != name
    assert "/" not in ReadoutRegistry.model_name("org//a b:c", 3)


def test_sqlite_path_reads_relative_and_absolute_uris():
    assert sqlite_path("sqlite:////tmp/x/mlflow.db") == Path("/tmp/x/mlflow.db")
    assert sqlite_path("sqlite:///.leap/mlflow.db") == Path(".leap/mlflow.db")
    assert sqlite_path("http://localhost:5000") is None


def test_two_fits_become_two_versions_of_one_registered_model(store):
    registry, logged = store["registry"], store["logged"]
    assert logged["1"].name == logged["2"].name == ReadoutRegistry.model_name(MODEL_ID, LAYER)
    assert [logged["1"].version, logged["2"].version] == ["1", "2"]
    assert logged["1"].run_id != logged["2"].run_id

    versions = registry.list_versions(logged["1"].name)
    assert [v.version for v in versions] == ["2", "1"]
    assert versions[1].run_id == logged["1"].run_id
    assert versions[1].tags["model_fingerprint"] == "sha256:abc123"
    assert versions[1].tags["layer"] == str(LAYER)


def test_run_records_params_metrics_tags_and_artifacts(store):
    registry, readout, logged = store["registry"], store["readouts"]["1"], store["logged"]["1"]
    run = registry.client.get_run(logged.run_id)
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    assert params["layer"] == str(LAYER)
    assert float(params["alpha"]) == readout.alpha
    assert params["dim"] == str(DIM) and params["n_params"] == str(readout.n_params_)
    assert params["max_tokens"] == str(MAX_TOKENS) and params["data_hash"] == "deadbeef"
    assert metrics["spearman"] == pytest.approx(0.8) and metrics["mae_0-63"] == pytest.approx(12.5)
    assert metrics["spearman_math/gsm8k"] == pytest.approx(0.7)
    assert tags["model_fingerprint"] == "sha256:abc123" and tags["model_id"] == MODEL_ID
    assert tags["readout_version"] == "alpha1.0" and tags["registered_version"] == "1"
    assert run.info.status == "FINISHED"

    artifacts = registry.list_artifacts(logged.run_id)
    assert READOUT_FILE in artifacts and f"model/artifacts/{RLS_STATE_FILE}" in artifacts
    pngs = [a for a in artifacts if a.endswith(".png")]
    if plots.available():
        assert {Path(p).name for p in pngs} == {"pred_vs_true.png", "mae_by_bucket.png"}
        for png in pngs:
            local = Path(registry.client.download_artifacts(logged.run_id, png, str(store["folder"])))
            assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "model/MLmodel" in artifacts
    assert f"model/artifacts/{READOUT_FILE}" in artifacts
    # the version without RLS carries no RLS state
    without_rls = registry.list_artifacts(store["logged"]["2"].run_id)
    assert not any(a.endswith(RLS_STATE_FILE) for a in without_rls)


def test_challenger_promote_and_rollback_move_aliases(store):
    registry, name = store["registry"], store["logged"]["1"].name
    for alias in (CHAMPION, CHALLENGER, PREVIOUS_CHAMPION):
        if registry.get_alias(name, alias) is not None:
            registry.client.delete_registered_model_alias(name, alias)

    assert registry.get_alias(name, CHAMPION) is None
    assert registry.get_alias("leap-readout-no-such-model-L0", CHAMPION) is None
    assert registry.promote(name, 1) is None
    assert registry.get_alias(name, CHAMPION) == "1"
    assert registry.get_alias(name, PREVIOUS_CHAMPION) is None

    registry.set_challenger(name, 2)
    assert registry.get_alias(name, CHALLENGER) == "2"
    assert registry.promote(name, "2") == "1"
    assert registry.get_alias(name, CHAMPION) == "2"
    assert registry.get_alias(name, PREVIOUS_CHAMPION) == "1"
    assert registry.get_alias(name, CHALLENGER) is None
    aliases = {v.version: v.aliases for v in registry.list_versions(name)}
    assert aliases == {"2": (CHAMPION,), "1": (PREVIOUS_CHAMPION,)}

    assert registry.rollback(name) == "1"
    assert registry.get_alias(name, CHAMPION) == "1"
    assert registry.get_alias(name, PREVIOUS_CHAMPION) == "2"
    assert registry.rollback(name) == "2"  # a rollback is itself undone by one more
    assert registry.get_alias(name, CHAMPION) == "2"

    with pytest.raises(RegistryError) as refused:
        registry.promote(name, 99)
    assert refused.value.not_found
    assert registry.get_alias(name, CHAMPION) == "2"


def test_rollback_without_previous_champion_is_refused(store):
    registry, name = store["registry"], store["logged"]["1"].name
    registry.set_alias(name, CHAMPION, 1)
    if registry.get_alias(name, PREVIOUS_CHAMPION) is not None:
        registry.client.delete_registered_model_alias(name, PREVIOUS_CHAMPION)
    with pytest.raises(LookupError):
        registry.rollback(name)


def test_pyfunc_champion_predicts_like_the_readout(store, monkeypatch):
    import mlflow.pyfunc

    registry, name = store["registry"], store["logged"]["1"].name
    registry.set_alias(name, CHAMPION, 2)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", store["uri"])
    model = mlflow.pyfunc.load_model(f"models:/{name}@{CHAMPION}")

    features, _ = _data(seed=2, n=50)
    expected = store["readouts"]["2"].predict(features)
    np.testing.assert_allclose(model.predict(features), expected, rtol=1e-10)
    as_vectors = pd.DataFrame({"feature": list(features)})
    np.testing.assert_allclose(model.predict(as_vectors), expected, rtol=1e-10)
    as_columns = pd.DataFrame(features, columns=[f"h{i}" for i in range(DIM)])
    np.testing.assert_allclose(model.predict(as_columns), expected, rtol=1e-10)
    # version 1 is a different fit, so the alias really selected version 2
    assert not np.allclose(store["readouts"]["1"].predict(features), expected)
    with pytest.raises(MlflowException):
        model.predict(features[:, :-1])  # the signature fixes the hidden size


def test_load_readout_validates_the_expected_model(store):
    registry, name = store["registry"], store["logged"]["1"].name
    registry.set_alias(name, CHAMPION, 1)
    features, _ = _data(seed=3, n=40)

    loaded = registry.load_readout(name, CHAMPION, expect={"model_fingerprint": "sha256:abc123",
                                                           "layer": LAYER})
    np.testing.assert_allclose(loaded.predict(features), store["readouts"]["1"].predict(features))
    by_version = registry.load_readout(name, 2)
    np.testing.assert_allclose(by_version.predict(features), store["readouts"]["2"].predict(features))
    with pytest.raises(ReadoutMismatchError):
        registry.load_readout(name, CHAMPION, expect={"model_fingerprint": "sha256:other"})


def test_rls_state_round_trips_and_is_absent_when_not_logged(store):
    registry, name, readout = store["registry"], store["logged"]["1"].name, store["readouts"]["1"]
    in_memory = RLS.from_readout(readout, _data(seed=0)[0])
    loaded = registry.load_rls_state(name, 1)
    assert loaded is not None
    for key, value in in_memory.state_arrays().items():
        np.testing.assert_allclose(loaded.state_arrays()[key], value)
    # a resumed corrector continues exactly where the logged one stood
    feedback, lengths = _data(seed=5, n=30)
    in_memory.partial_fit(feedback, lengths)
    loaded.partial_fit(feedback, lengths)
    np.testing.assert_allclose(loaded.theta_, in_memory.theta_, rtol=1e-12)
    assert not np.allclose(loaded.theta_, readout.theta_)
    assert registry.load_rls_state(name, 2) is None


def test_gate_run_links_both_versions_and_stores_the_verdict(store, tmp_path):
    registry, name = store["registry"], store["logged"]["1"].name
    rng = np.random.default_rng(4)
    latencies = {"champion": rng.exponential(2.0, 200), "challenger": rng.exponential(1.5, 200)}
    cdf = plots.latency_cdf(latencies, tmp_path) if plots.available() else None
    results = {policy: {"p50_latency_s": float(np.median(v)), "p99_latency_s": float(np.quantile(v, 0.99)),
                        "policy_name": policy} for policy, v in latencies.items()}
    verdict = {"promote": True, "reason": "p50 latency improved", "p50_gain": 0.25}

    run_id = registry.log_gate(name, 2, 1, results, verdict, {"latency_cdf": cdf} if cdf else {})

    run = registry.client.get_run(run_id)
    assert run.data.tags["challenger_version"] == "2" and run.data.tags["champion_version"] == "1"
    assert json.loads(run.data.tags["verdict"]) == verdict
    challenger_p50 = results["challenger"]["p50_latency_s"]
    assert run.data.metrics["challenger.p50_latency_s"] == pytest.approx(challenger_p50)
    assert run.data.metrics["verdict.p50_gain"] == pytest.approx(0.25)
    assert run.data.params["champion.policy_name"] == "champion"
    artifacts = registry.list_artifacts(run_id)
    assert "verdict.json" in artifacts and "results.json" in artifacts
    if cdf is not None:
        assert "plots/latency_cdf.png" in artifacts
    stored = Path(registry.client.download_artifacts(run_id, "verdict.json", str(tmp_path)))
    assert json.loads(stored.read_text()) == verdict
    assert registry.client.get_model_version(name, "2").tags["gate_run_id"] == run_id


def test_a_gate_run_shows_its_paired_table_cdf_and_the_verdict_on_the_version_page(store, tmp_path):
    """The real verdict of paired replays: the run holds the per-request table and the CDF, and the
    challenger version's description states the outcome with its interval (what the MLflow UI shows)."""
    from leap_core.gate_verdict import gate_verdict
    from registry.gate_report import CDF_FILE, PAIRED_TABLE_FILE

    registry, name = store["registry"], store["logged"]["1"].name
    rng = np.random.default_rng(7)
    tokens = np.tile(rng.integers(10, 400, 40), 2)
    bar = rng.lognormal(0.0, 0.4, 80)
    results = {policy: {"mean_ptl": float(ptl.mean()), "ptl": ptl.tolist(), "output_tokens": tokens.tolist(),
                        "repeats": 2} for policy, ptl in (("champion", bar), ("challenger", 0.8 * bar))}
    verdict = gate_verdict(results)
    registry.client.update_model_version(name, "2", description="Fitted on 240 rows.")
    run_id = registry.log_gate(name, 2, 1, results, verdict)
    artifacts = registry.list_artifacts(run_id)
    assert PAIRED_TABLE_FILE in artifacts
    if plots.available():
        assert f"plots/{CDF_FILE}" in artifacts
    table = json.loads(Path(registry.client.download_artifacts(run_id, PAIRED_TABLE_FILE, str(tmp_path))).read_text())
    assert table["columns"][:5] == ["request", "repeat", "output_tokens", "champion_ptl", "challenger_ptl"]
    assert len(table["data"]) == 80 and table["data"][41][:2] == [1, 1]
    version = registry.client.get_model_version(name, "2")
    assert version.description.startswith("Fitted on 240 rows.\n\nGate: better against champion v1, passed\n\n"
                                          "| figure | value |")
    assert "| mean PTL ratio | x0.800 of the champion's" in version.description
    assert f"x{verdict['ci_low']:.3f} to x{verdict['ci_high']:.3f}" in version.description
    # each figure is a tag the registry can search by, and a metric of the version's logged model
    assert version.tags["leap.gate.outcome"] == "better" and version.tags["leap.gate.passed"] == "true"
    assert float(version.tags["leap.gate.ratio"]) == pytest.approx(0.8, abs=1e-4)
    found = registry.client.search_model_versions(f"name = '{name}' and tags.`leap.gate.outcome` = 'better'")
    assert [str(v.version) for v in found] == ["2"]
    model = registry.client.get_logged_model(version.tags["leap.logged_model_id"])
    logged = {metric.key: metric for metric in model.metrics}
    assert logged["gate.ratio"].value == pytest.approx(verdict["mean_ptl_ratio"])
    assert logged["gate.ratio_high"].value == pytest.approx(verdict["ci_high"]) and logged["gate.ratio"].run_id == run_id
    # a second gate replaces the section and its figures, the fit's words stay
    registry.log_gate(name, 2, 1, results, gate_verdict(results, margin=0.5))
    again = registry.client.get_model_version(name, "2")
    assert again.description.count("Gate:") == 1 and "no-difference against champion v1" in again.description
    assert again.description.startswith("Fitted on 240 rows.")
    assert again.tags["leap.gate.outcome"] == "no-difference" and again.tags["leap.gate.passed"] == "false"
    assert again.tags["leap.logged_model_id"] == model.model_id  # one logged model a version


def test_ensure_db_is_idempotent_and_safe_from_two_processes(tmp_path):
    import multiprocessing

    from mlflow.store.db import utils as db_utils

    uri = f"sqlite:///{tmp_path}/fresh.db"
    # spawn, not fork: the suite may already hold engine threads that a forked child must not inherit
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=ensure_db, args=(uri,)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    ensure_db(uri)
    ensure_db(uri)
    engine = db_utils.create_sqlalchemy_engine(uri)
    try:
        assert db_utils._get_schema_version(engine) == db_utils._get_latest_schema_revision()
    finally:
        engine.dispose()


@pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")
def test_plots_write_png_files(tmp_path):
    true = np.array([3, 40, 300, 900, 12])
    pred = np.array([5, 30, 250, 1000, 20])
    written = [plots.prediction_scatter(true, pred, tmp_path, max_tokens=MAX_TOKENS),
               plots.bucket_bar_chart({"0-63": 4.0, "64-255": 10.0}, tmp_path),
               plots.latency_cdf({"fcfs": [1.0, 2.0, 3.0], "countdown": [0.5, 1.0]}, tmp_path)]
    assert [p.parent for p in written] == [tmp_path] * 3
    assert len({p.name for p in written}) == 3
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
