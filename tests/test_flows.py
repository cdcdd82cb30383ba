"""The Prefect flows against real parts: feedback segments written by the serving writer, a DuckDB log
store and a sqlite MLflow registry in a temporary folder, and a temporary Prefect server.

The replay gate itself needs the engine and is exercised by the engine tests; here the verdict logic
is tested directly and the flows are driven through recorded gates.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("prefect")
pytest.importorskip("mlflow")

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from flows.pipeline import fit_flow, gate_flow, ingest_flow, push_flow, retrain_flow
from flows.tasks import gate_slice, promote_if_passed, record_gate, recorded_gate
from leap_core.gate_verdict import gate_verdict
from registry.client import CHALLENGER, CHAMPION, PREVIOUS_CHAMPION, ReadoutRegistry
from serving.feedback.writer import FeedbackWriter
from tests.flow_fixtures import ingest_and_fit, pipeline_home

pytestmark = [pytest.mark.pipeline,
              pytest.mark.filterwarnings("ignore:Type object .* OperatorClass:DeprecationWarning")]

MODEL_ID = "smol-flows"
FINGERPRINT = "sha256:0123abcd"
LAYER = 9
DIM = 16
MAX_TOKENS = 512
ROWS_PER_SEGMENT = 150
SEGMENTS = 2


@pytest.fixture(scope="session")
def prefect_server():
    with prefect_test_harness(), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _feedback_rows(rng: np.random.Generator, start: int, n: int) -> list[dict]:
    """Rows whose output length is a noisy log-linear function of the feature: learnable by a readout."""
    weights = np.linspace(1.0, -1.0, DIM) / np.sqrt(DIM)
    rows = []
    for i in range(start, start + n):
        feature = rng.normal(size=DIM).astype(np.float32)
        length = int(np.clip(np.exp(4.2 + 1.2 * feature @ weights + 0.15 * rng.normal()), 1, MAX_TOKENS))
        arrival = 1_750_000_000.0 + 2.0 * i
        rows.append({
            "request_id": f"req-{i:05d}", "model_id": MODEL_ID, "model_fingerprint": FINGERPRINT, "layer": LAYER,
            "policy": "leap", "arrival_time": arrival, "first_token_time": arrival + 0.1,
            "finish_time": arrival + 0.1 + 0.02 * length, "prompt_tokens": 40, "output_tokens": length,
            "finish_reason": "length" if length == MAX_TOKENS else "stop", "max_tokens": MAX_TOKENS,
            "decoding": json.dumps({"temperature": 0.0}), "domain": "chat" if i % 2 else "code",
            "predicted_at_admission": None, "predicted_latest": None, "readout_version": "",
            "feature": feature,
        })
    return rows


@pytest.fixture(scope="module")
def home(tmp_path_factory, prefect_server):
    """LEAP_HOME with two closed feedback segments; MLflow on a sqlite file, no replicas to push to."""
    folder = tmp_path_factory.mktemp("leap-home")
    rng = np.random.default_rng(7)
    for segment in range(SEGMENTS):
        writer = FeedbackWriter(folder / "feedback", DIM, LAYER, MODEL_ID, FINGERPRINT)
        for row in _feedback_rows(rng, segment * ROWS_PER_SEGMENT, ROWS_PER_SEGMENT):
            writer.write(row)
        writer.close()
    with pipeline_home(folder):
        yield folder


@pytest.fixture(scope="module")
def fitted(home):
    """The loop's first two steps, run once for the module."""
    return ingest_and_fit(home)


def _summary(ptl, tokens) -> dict:
    ptl = np.asarray(ptl, dtype=float)
    return {"mean_ptl": float(ptl.mean()), "ptl": ptl.tolist(), "output_tokens": list(tokens)}


# ---------------------------------------------------------------------------- ingest and fit

def test_ingest_flow_is_idempotent(fitted):
    first = fitted["ingest"]
    assert first["status"] == "ingested"
    assert first["accepted"] == SEGMENTS * ROWS_PER_SEGMENT and first["quarantined"] == 0
    again = ingest_flow()
    assert again["skipped"] == again["segments"] == SEGMENTS
    assert again["accepted"] == again["rows_read"] == 0
    assert again["store"]["requests"] == first["store"]["requests"] == SEGMENTS * ROWS_PER_SEGMENT


def test_fit_flow_registers_a_challenger_and_a_refit_returns_it(fitted):
    fit = fitted["fit"]
    assert fit["status"] == "fitted" and fit["reused"] is False
    registry = ReadoutRegistry(fitted["uri"])
    assert fit["name"] == registry.model_name(MODEL_ID, LAYER)
    assert registry.get_alias(fit["name"], CHALLENGER) == fit["version"]
    assert registry.get_alias(fit["name"], CHAMPION) is None
    assert fit["metrics"]["spearman"] > 0.6  # the synthetic lengths follow the features
    readout = registry.load_readout(fit["name"], CHALLENGER)
    assert readout.max_tokens == MAX_TOKENS and readout.metadata["model_fingerprint"] == FINGERPRINT

    refit = fit_flow()
    assert refit["status"] == "reused" and refit["version"] == fit["version"]
    assert len(registry.list_versions(fit["name"])) == 1


def test_fit_flow_waits_for_enough_rows(fitted, monkeypatch):
    monkeypatch.setenv("LEAP_MIN_ROWS", str(SEGMENTS * ROWS_PER_SEGMENT + 1))
    result = fit_flow()
    assert result["status"] == "not-enough-data"
    assert str(SEGMENTS * ROWS_PER_SEGMENT) in result["reason"]


def test_gate_slice_takes_lengths_from_the_store(fitted):
    prompts = [{"id": f"req-{i:05d}", "prompt": f"prompt {i}"} for i in range(0, 40)]
    prompts += [{"id": f"unseen-{i}", "prompt": "never served"} for i in range(20)]
    chosen, lengths = gate_slice(fitted["store"], prompts, size=10, seed=3, held_out_fraction=1.0)
    assert len(chosen) == 10 and set(lengths) == {p["id"] for p in chosen}
    assert all(p["id"].startswith("req-") for p in chosen)
    frame = fitted["store"].training_frame()
    recorded = dict(zip(frame.request_ids, frame.output_tokens))
    assert all(lengths[rid] == recorded[rid] for rid in lengths)
    assert gate_slice(fitted["store"], prompts, size=10, seed=3, held_out_fraction=1.0) == (chosen, lengths)
    with pytest.raises(LookupError):
        gate_slice(fitted["store"], prompts[40:], size=10, seed=3)


def test_gate_slice_replays_only_the_newest_held_out_requests(fitted):
    prompts = [{"id": f"req-{i:05d}", "prompt": f"prompt {i}"} for i in range(0, 40)]
    frame = fitted["store"].training_frame()
    arrival = dict(zip(frame.request_ids, frame.arrival_time))
    cutoff = np.quantile([arrival[p["id"]] for p in prompts if p["id"] in arrival], 0.75)
    chosen, _ = gate_slice(fitted["store"], prompts, size=40, seed=3, held_out_fraction=0.25)
    assert chosen and len(chosen) < 40
    assert all(arrival[p["id"]] >= cutoff for p in chosen)


# ---------------------------------------------------------------------------- the verdict

def test_gate_passes_a_faster_challenger_against_fcfs_without_a_champion():
    tokens = list(range(10, 90, 10)) * 2
    verdict = gate_verdict({"fcfs": _summary(np.full(16, 1.0), tokens), "champion": None,
                            "challenger": _summary(np.full(16, 0.9), tokens)})
    assert verdict["passed"] and verdict["bar"] == "fcfs"
    assert verdict["mean_ptl_ratio"] == pytest.approx(0.9)
    assert verdict["n_long"] == 4  # lengths 70 and 80, twice each: the top quartile


def test_gate_bar_is_the_champion_and_the_margin_is_strict():
    tokens = [5, 10, 20, 40] * 4
    results = {"fcfs": _summary(np.full(16, 2.0), tokens), "champion": _summary(np.full(16, 1.0), tokens),
               "challenger": _summary(np.full(16, 0.99), tokens)}
    verdict = gate_verdict(results, margin=0.02)
    assert verdict["bar"] == "champion" and not verdict["passed"]
    assert verdict["fcfs_mean_ptl_ratio"] == pytest.approx(0.495)
    assert gate_verdict(results, margin=0.005)["passed"]


def test_gate_rejects_a_better_mean_that_starves_long_requests():
    tokens = np.array(([10] * 12 + [400] * 4) * 4)
    bar = np.full(64, 1.0)
    challenger = np.where(tokens > 100, 1.5, 0.5)  # short ones fly, the longest quartile is 50% slower
    verdict = gate_verdict({"fcfs": _summary(bar, tokens), "challenger": _summary(challenger, tokens)})
    assert verdict["mean_ptl_ratio"] == pytest.approx(0.75)
    assert verdict["long_p95_ratio"] == pytest.approx(1.5)
    assert not verdict["passed"] and verdict["outcome"] == "worse" and "longest-quartile" in verdict["reason"]
    allowed = gate_verdict({"fcfs": _summary(bar, tokens), "challenger": _summary(challenger, tokens)},
                           p95_bound=1.6)
    assert allowed["passed"] and allowed["outcome"] == "better" and allowed["ci_high"] < 1.0


def test_gate_fails_closed_on_incomparable_replays():
    tokens = [10, 20, 30, 40]
    good = _summary([1.0, 1.0, 1.0, 1.0], tokens)
    assert not gate_verdict({"fcfs": good, "challenger": _summary([0.5] * 4, [10, 20, 30, 41])})["passed"]
    assert not gate_verdict({"fcfs": good, "challenger": _summary([0.5, np.nan, 0.5, 0.5], tokens)})["passed"]
    assert not gate_verdict({"fcfs": good})["passed"]


# ---------------------------------------------------------------------------- record, promote, push

def _verdict(passed: bool) -> dict:
    return {"passed": passed, "reason": "passed: test" if passed else "failed: test", "bar": "fcfs",
            "mean_ptl_ratio": 0.8 if passed else 1.0}


def test_record_gate_writes_once_to_duckdb_and_mlflow(fitted, home):
    name, version = fitted["fit"]["name"], fitted["fit"]["version"]
    results = {"fcfs": _summary([1.0, 1.2], [10, 20]), "challenger": _summary([0.9, 1.0], [10, 20])}
    first = record_gate.fn(str(home / "leap.duckdb"), fitted["uri"], name, version, None, results,
                           _verdict(False))
    again = record_gate.fn(str(home / "leap.duckdb"), fitted["uri"], name, version, None, results,
                           _verdict(False))
    assert first["recorded"] and not again["recorded"] and again["gate_run_id"] == first["gate_run_id"]
    with fitted["store"].connect(read_only=True) as con:
        rows = con.execute("SELECT challenger, champion, passed, results FROM gates").fetchall()
    assert len(rows) == 1 and rows[0][:3] == (version, None, False) and json.loads(rows[0][3]) == results
    registry = ReadoutRegistry(fitted["uri"])
    run = registry.client.get_run(first["gate_run_id"])
    assert json.loads(run.data.tags["verdict"])["passed"] is False
    assert registry.client.get_model_version(name, version).tags["gate_run_id"] == first["gate_run_id"]
    # the gate flow answers from the record instead of replaying
    answer = gate_flow()
    assert answer["status"] == "recorded" and answer["verdict"]["passed"] is False


def test_promote_if_passed_moves_aliases_only_on_a_passing_verdict(fitted):
    registry = ReadoutRegistry(fitted["uri"])
    name, version = fitted["fit"]["name"], fitted["fit"]["version"]
    kept = promote_if_passed.fn(fitted["uri"], name, version, _verdict(False))
    assert kept["promoted"] is False
    assert registry.get_alias(name, CHAMPION) is None and registry.get_alias(name, CHALLENGER) == version
    # the push flow refuses to promote on the failing verdict recorded above
    refused = push_flow(promote=True)
    assert refused["status"] == "not-promoted" and registry.get_alias(name, CHAMPION) is None


def test_passing_gate_is_pushed_then_promoted_and_retrain_then_has_nothing_to_do(fitted, home):
    registry = ReadoutRegistry(fitted["uri"])
    name, version = fitted["fit"]["name"], fitted["fit"]["version"]
    results = {"fcfs": _summary([1.0, 1.2], [10, 20]), "challenger": _summary([0.7, 0.8], [10, 20])}
    record_gate.fn(str(home / "leap.duckdb"), fitted["uri"], name, version, None, results, _verdict(True))
    assert recorded_gate(fitted["store"], name, version, None)["verdict"]["passed"] is True

    promoted = push_flow(promote=True)
    assert promoted["status"] == "promoted" and promoted["pushed"] == []
    assert registry.get_alias(name, CHAMPION) == version
    assert registry.get_alias(name, CHALLENGER) is None
    assert registry.get_alias(name, PREVIOUS_CHAMPION) is None

    rerun = retrain_flow()
    assert rerun["status"] == "unchanged"
    assert rerun["ingest"]["accepted"] == 0 and rerun["fit"]["status"] == "reused"
    assert registry.get_alias(name, CHAMPION) == version
    # the retrain ends by pruning the registry: the champion stays, there is nothing else to drop yet
    assert rerun["registry_pruned"] == {"name": name, "kept": [version], "pruned": [], "dry_run": False}


# ---------------------------------------------------------------------------- the CLI: promote, rollback

def _cli_json(result) -> dict:
    """The one JSON line `--json` prints on stdout."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, (result.exit_code, result.stdout, result.stderr)
    return json.loads(lines[-1])


def test_cli_promotes_rolls_back_and_fails_loudly_with_the_earlier_state_restored(prefect_server, tmp_path,
                                                                                  monkeypatch):
    """`leap push --promote` and `leap rollback` move the aliases and every replica together; a promotion
    a replica refuses exits 1, says the earlier state is back, and leaves replicas and aliases as they were."""
    from typer.testing import CliRunner

    import leap_cli.cmd_pipeline  # noqa: F401  (registers the commands)
    from experiments.faults import pipeline as faults
    from flows.promotion import PushOptions, promote
    from leap_cli.apps import app

    uri = f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    registry = ReadoutRegistry(uri)
    versions = []
    for seed, readout_version in enumerate(("20250101T000000-cli00001", "20250102T000000-cli00002"), start=1):
        readout, rls = faults.fitted_readout(readout_version, seed)
        versions.append(registry.log_readout(readout, rls=rls, params={"data_hash": "cli"}, metrics={}))
    name, (v1, v2) = versions[0].name, [entry.version for entry in versions]
    runner = CliRunner()
    with faults.replicas(2) as (targets, urls):
        promote(registry, name, v1, urls, PushOptions(faults.TOKEN), tmp_path / "promotions")
        registry.set_challenger(name, v2)
        record_gate.fn(str(tmp_path / "leap.duckdb"), uri, name, v2, v1,
                       {"fcfs": _summary([1.0, 1.2], [10, 20]), "challenger": _summary([0.7, 0.8], [10, 20])},
                       _verdict(True))
        for key, value in {"LEAP_HOME": str(tmp_path), "LEAP_MLFLOW_TRACKING_URI": uri,
                           "LEAP_ENDPOINTS": ",".join(urls), "LEAP_ADMIN_TOKEN": faults.TOKEN,
                           "LEAP_PUSH_RETRIES": "0"}.items():
            monkeypatch.setenv(key, value)

        promoted = runner.invoke(app, ["push", "--promote", "--name", name, "--json"])
        assert promoted.exit_code == 0, promoted.output
        assert _cli_json(promoted)["status"] == "promoted"
        assert [t.version for t in targets] == ["20250102T000000-cli00002"] * 2
        assert registry.aliases(name) == {CHAMPION: v2, PREVIOUS_CHAMPION: v1}

        rolled = runner.invoke(app, ["rollback", "--name", name, "--json"])
        assert rolled.exit_code == 0, rolled.output
        assert _cli_json(rolled)["status"] == "rolled-back"
        assert [t.version for t in targets] == ["20250101T000000-cli00001"] * 2
        assert registry.aliases(name) == {CHAMPION: v1, PREVIOUS_CHAMPION: v2}

        targets[1].dim += 1  # this replica now refuses every readout of the model
        refused = runner.invoke(app, ["push", "--promote", "--version", v2, "--name", name, "--json"])
        assert refused.exit_code == 1
        answer = _cli_json(refused)
        assert answer["status"] == "failed" and answer["restored"] is True
        assert "The earlier state is back" in answer["error"] and urls[1] in answer["error"]
        assert [t.version for t in targets] == ["20250101T000000-cli00001"] * 2
        assert registry.aliases(name) == {CHAMPION: v1, PREVIOUS_CHAMPION: v2}


def test_a_fit_anchored_at_the_champion_registers_a_refinement_of_it(fitted):
    """`leap fit --anchor champion`: the window corrects the champion's RLS state (registered with both)."""
    from leap_core.rls import RLS

    registry = ReadoutRegistry(fitted["uri"])
    name = fitted["fit"]["name"]
    if registry.get_alias(name, CHAMPION) is None:
        registry.promote(name, fitted["fit"]["version"])
    champion = registry.get_alias(name, CHAMPION)
    base = registry.load_readout(name, CHAMPION)

    refined = fit_flow(anchor="champion")
    assert refined["status"] == "fitted" and refined["version"] != champion  # another fit key: not reused
    assert registry.get_alias(name, CHALLENGER) == refined["version"]
    params = registry.client.get_run(refined["run_id"]).data.params
    assert params["anchor"] == f"champion v{champion}" and params["alpha_selection"] == "anchor"
    readout = registry.load_readout(name, refined["version"])
    assert readout.alpha == base.alpha and readout.max_tokens == base.max_tokens
    assert readout.metadata["n_train"] > base.metadata["n_train"]  # the champion's rows and the window's
    # the champion's state holds the window's rows up to its training split's newest: only later ones count
    cut = registry.information_until(name, champion)
    assert cut is not None and 2 <= refined["rows"] < fitted["fit"]["rows"]
    assert registry.information_until(name, refined["version"]) > cut
    state = registry.load_rls_state(name, refined["version"], readout=readout)
    np.testing.assert_allclose(state.theta_, readout.theta_, rtol=1e-10)
    assert isinstance(state, RLS)
    assert fit_flow(anchor="champion")["status"] == "reused"
