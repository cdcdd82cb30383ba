"""The fleet merge against real parts: runtimes that learn online behind real admin servers (no engine),
a real MLflow sqlite registry, the Prefect flow itself. The merged champion equals the anchored ridge
refit on the training rows and every replica's feedback to 1e-8, every replica serves it afterwards,
and a second merge counts only the rows learned since."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("prefect")
pytest.importorskip("vllm")

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from experiments.faults import pipeline as faults
from flows.fleet import merge_flow, merge_refit_diff, reconcile_replicas
from flows.promotion import PushOptions, promote
from leap_core import targets
from leap_core.readout_format import to_bytes
from leap_io.push_bundle import make_bundle, open_bundle
from registry.client import CHAMPION, ReadoutRegistry
from tests.fleet_fixtures import TOKEN, champion_readout, feed, replica, rows
from tests.flow_fixtures import pipeline_home
from tests.runtime_fixtures import build, eventually  # noqa: F401  (pytest fixtures, used by name)

pytestmark = [pytest.mark.pipeline,
              pytest.mark.filterwarnings("ignore:Type object .* OperatorClass:DeprecationWarning")]

V1 = "20250101T000000-base0001"


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _refit(readout, X, lengths):
    """The anchored ridge problem solved once from the rows: A = U^T U + alpha D, b = U^T y, U = [1, Z]."""
    U = np.column_stack([np.ones(len(X)), readout.standardize(X.astype(np.float64))])
    D = np.eye(U.shape[1])
    D[0, 0] = 0.0
    return np.linalg.solve(U.T @ U + readout.alpha * D, U.T @ targets.transform(lengths, readout.target))


def _state(url):
    response = httpx.get(f"{url}/leap/rls", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    return response, json.loads(response.headers.get("X-Leap-Rls", "{}"))


@pytest.fixture
def fleet(tmp_path, build, prefect_server):
    """Three learning replicas serving champion V1 (with its RLS anchor) from a real registry."""
    rng = np.random.default_rng(7)
    readout, rls, X_train, lengths_train = champion_readout(V1, rng)
    runtimes, urls = zip(*(replica(build, tmp_path / f"state-{i}") for i in range(3)))
    with pipeline_home(tmp_path / "home", LEAP_ENDPOINTS=",".join(urls)) as home:
        home.mkdir(parents=True, exist_ok=True)
        (home / "admin.token").write_text(TOKEN)  # the flows' token file
        registry = ReadoutRegistry(f"sqlite:///{home}/mlflow/mlflow.db")
        logged = registry.log_readout(readout, rls=rls, params={"data_hash": "t"}, metrics={"spearman": 0.5})
        promote(registry, logged.name, logged.version, list(urls), PushOptions(TOKEN, retries=1),
                home / "promotions", home / "champion")
        yield {"rng": rng, "readout": readout, "X": [X_train], "lengths": [lengths_train], "runtimes": runtimes,
               "urls": list(urls), "registry": registry, "name": logged.name, "home": home}


def _learn(fleet, index, n, shift):
    X, lengths = rows(fleet["rng"], n, shift)
    feed(fleet["runtimes"][index], X, lengths)
    return X, lengths


def test_the_merged_champion_is_the_refit_on_all_feedback_and_serves_everywhere_twice_over(fleet):
    registry, name = fleet["registry"], fleet["name"]
    learned = [_learn(fleet, 0, 24, 0.5), _learn(fleet, 1, 40, -0.5)]
    X_partial, lengths_partial = rows(fleet["rng"], 14, 1.0)  # 12 learned, 2 wait for the next batch
    feed(fleet["runtimes"][2], X_partial, lengths_partial)
    learned.append((X_partial, lengths_partial))  # the merge's read learns the 2 waiting rows first

    result = merge_flow()

    assert result["status"] == "merged" and result["reused"] is False
    assert result["rows_merged"] == 24 + 40 + 14 and result["replicas_merged"] == 3
    assert result["rows_buffered"] == 0 and result["replicas_skipped"] == 0
    assert [r["rows"] for r in result["replicas"]] == [24, 40, 14]
    merged_version = result["version"]
    assert registry.get_alias(name, CHAMPION) == merged_version
    assert result["versions_equal"] and set(result["versions"].values()) == {result["readout_version"]}
    assert result["promotion"]["published"]["version"] == result["readout_version"]
    sequence = result["promotion"]["published"]["sequence"]  # the pushes carried the publication's number
    assert sequence >= 1 and [r.readouts.state.saved().sequence for r in fleet["runtimes"]] == [sequence] * 3
    tags = registry.client.get_model_version(name, merged_version).tags
    assert json.loads(tags["merge_rows"]) == dict(zip(fleet["urls"], [24, 40, 14]))
    assert tags["merged_from"] == "1" and float(tags["merge_rows_until"]) <= time.time()

    X_fb = np.concatenate([x for x, _ in learned])
    lengths_fb = np.concatenate([y for _, y in learned])
    assert merge_refit_diff(registry, name, merged_version, X_fb, lengths_fb) < 1e-8
    merged = registry.load_readout(name, merged_version)
    expected = _refit(fleet["readout"], np.concatenate([fleet["X"][0], X_fb]),
                      np.concatenate([fleet["lengths"][0], lengths_fb]))
    assert np.max(np.abs(merged.theta_ - expected)) < 1e-8
    for url in fleet["urls"]:  # every replica now learns around the merged anchor, from zero rows
        response, info = _state(url)
        assert response.status_code == 200 and info["base_version"] == result["readout_version"]
        assert info["rows"] == 0

    again = merge_flow()  # nothing learned since: nothing to merge, nothing registered
    assert again["status"] == "nothing-to-merge" and again["base_version"] == result["readout_version"]
    assert registry.get_alias(name, CHAMPION) == merged_version

    second = [_learn(fleet, 0, 8, 2.0), _learn(fleet, 2, 16, -1.0)]
    result2 = merge_flow()
    assert result2["status"] == "merged" and result2["rows_merged"] == 24
    assert result2["base_registry_version"] == merged_version
    X2 = np.concatenate([x for x, _ in second])
    lengths2 = np.concatenate([y for _, y in second])
    assert merge_refit_diff(registry, name, result2["version"], X2, lengths2) < 1e-8
    merged2 = registry.load_readout(name, result2["version"])
    everything = _refit(fleet["readout"], np.concatenate([fleet["X"][0], X_fb, X2]),
                        np.concatenate([fleet["lengths"][0], lengths_fb, lengths2]))
    assert np.max(np.abs(merged2.theta_ - everything)) < 1e-8  # no row counted twice, none left out
    assert result2["versions_equal"] and set(result2["versions"].values()) == {result2["readout_version"]}


def test_a_replica_on_another_anchor_is_skipped_and_counted_then_takes_the_merge(fleet):
    registry, name = fleet["registry"], fleet["name"]
    other, other_rls, _, _ = champion_readout("20250102T000000-other001", np.random.default_rng(99))
    fleet["runtimes"][2].push_readout(make_bundle(to_bytes(other), other_rls.state_arrays()))
    learned = _learn(fleet, 0, 16, 0.0)
    _learn(fleet, 2, 8, 0.0)  # learned around the other anchor: not mergeable with the rest

    result = merge_flow()

    assert result["status"] == "merged" and result["rows_merged"] == 16 and result["replicas_merged"] == 2
    skipped = result["replicas"][2]
    assert skipped["status"] == "other-base" and skipped["rows"] == 8
    assert result["replicas_skipped"] == 1 and result["rows_skipped"] == 8
    assert result["versions_equal"]  # the promotion moved the skipped replica to the merge as well
    assert merge_refit_diff(registry, name, result["version"], *learned) < 1e-8


def test_rls_state_needs_the_token_and_says_when_there_is_none(fleet, build, tmp_path):
    url = fleet["urls"][0]
    assert httpx.get(f"{url}/leap/rls", timeout=10).status_code == 401
    response, info = _state(url)
    assert response.status_code == 200 and info["base_version"] == V1
    bundle = open_bundle(response.content)
    assert bundle.state is not None and bundle.state["A"].shape == (17, 17)

    _, quiet_url = replica(build, tmp_path / "quiet", rls=False)
    response, _ = _state(quiet_url)
    assert response.status_code == 409 and "no RLS state" in response.json()["error"]
    with faults.replicas(1) as (_, (plain_url,)):  # an admin target that keeps no RLS at all
        response = httpx.get(f"{plain_url}/leap/rls", headers={"Authorization": f"Bearer {faults.TOKEN}"})
        assert response.status_code == 404 and "RLS" in response.json()["error"]


def test_leap_merge_then_a_new_replica_takes_the_champion_and_reconcile_moves_one_behind(fleet, build):
    from typer.testing import CliRunner

    import leap_cli.cmd_pipeline  # noqa: F401  (registers the commands)
    from leap_cli.apps import app

    registry, name, urls = fleet["registry"], fleet["name"], fleet["urls"]
    _learn(fleet, 1, 8, 0.0)
    answer = CliRunner().invoke(app, ["merge", "--json"])
    assert answer.exit_code == 0, answer.output
    merged = json.loads([line for line in answer.stdout.splitlines() if line.startswith("{")][-1])
    assert merged["status"] == "merged" and merged["rows_merged"] == 8 and merged["versions_equal"]

    newcomer, _ = replica(build, fleet["home"] / "new-state", champion_url=str(fleet["home"] / "champion"))
    assert (newcomer.describe()["source"], newcomer.readouts.version) == ("champion", merged["readout_version"])
    other, _, _, _ = champion_readout("20250103T000000-behind01", np.random.default_rng(5))
    fleet["runtimes"][1].push_readout(make_bundle(to_bytes(other), None, force=True))  # around the flows

    report = reconcile_replicas.fn(registry.tracking_uri, name, urls + ["http://127.0.0.1:9"], TOKEN,
                                   retries=0, timeout=5.0)

    assert [p["endpoint"] for p in report["pushed"]] == [urls[1]]
    assert report["in_step"] == [urls[0], urls[2]] and list(report["unreachable"]) == ["http://127.0.0.1:9"]
    assert {runtime.readouts.version for runtime in fleet["runtimes"]} == {merged["readout_version"]}


class _StateTarget(faults.ReplicaTarget):
    """An admin target answering GET /leap/rls with whatever body and info it is given."""

    def __init__(self, body: bytes, info: dict) -> None:
        super().__init__()
        self.body, self.info = body, info

    def rls_state(self):
        return self.body, self.info


@pytest.mark.parametrize(("body", "expected"), [
    (b"not a bundle", "refused"),
    (make_bundle(b"PK\x03\x04 torn readout", None), "refused"),
    ("readout only", "refused"),  # a readout without its RLS state
])
def test_a_state_that_does_not_validate_is_refused_not_merged(body, expected):
    from flows.fleet import fetch_replica_state
    from serving.admin.api import AdminServer

    if body == "readout only":
        readout, _, _, _ = champion_readout(V1, np.random.default_rng(1))
        body = make_bundle(to_bytes(readout), None)
    server = AdminServer(_StateTarget(body, {"rows": 3}), "127.0.0.1", 0, TOKEN)
    try:
        fetched = fetch_replica_state(f"http://127.0.0.1:{server.port}", TOKEN)
    finally:
        server.close()
    assert fetched["status"] == expected and "does not validate" in fetched["error"]
    assert fetch_replica_state("http://127.0.0.1:9", TOKEN, timeout=2)["status"] == "unreachable"


def test_replicas_learning_around_a_version_that_is_no_longer_champion_are_brought_to_the_champion(fleet):
    registry, name, urls = fleet["registry"], fleet["name"], fleet["urls"]
    readout, rls, _, _ = champion_readout("20250104T000000-newchamp", np.random.default_rng(11))
    newer = registry.log_readout(readout, rls=rls, params={"data_hash": "t2"}, metrics={"spearman": 0.6})
    registry.promote(name, newer.version)  # the aliases moved, the replicas were not told
    _learn(fleet, 0, 8, 0.0)

    result = merge_flow()

    assert result["status"] == "base-not-champion" and result["champion"] == newer.version
    assert registry.get_alias(name, CHAMPION) == newer.version  # nothing merged over the champion
    assert sorted(p["endpoint"] for p in result["reconcile"]["pushed"]) == sorted(urls)
    assert result["versions_equal"] and set(result["versions"].values()) == {"20250104T000000-newchamp"}
