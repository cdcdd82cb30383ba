"""A replica with nothing pushed and no state serves the registry champion, loaded in the background:
a real MLflow sqlite store, a real runtime (no engine). A push that lands first wins; a registry that
cannot be reached is logged and leaves the replica serving nothing, never down."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("vllm")

from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from registry.client import ReadoutRegistry
from tests.runtime_fixtures import DIM, build, eventually, first_value_readout  # noqa: F401  (pytest fixtures, used by name)

pytestmark = pytest.mark.pipeline


@pytest.fixture
def champion_store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    registry = ReadoutRegistry(uri)
    readout = first_value_readout("champion-7")
    X = np.random.default_rng(0).normal(scale=4.0, size=(4 * DIM, DIM))
    logged = registry.log_readout(readout, rls=RLS.from_readout(readout, X), params={"data_hash": "test"},
                                  metrics={"spearman": 0.5})
    registry.promote(logged.name, logged.version)
    return uri


def test_the_registry_champion_serves_when_there_is_no_push(build, champion_store, tmp_path):
    runtime = build(policy="leap", rls=True, registry_uri=champion_store, state_dir=str(tmp_path / "state"))
    assert eventually(lambda: runtime.describe()["registry"]["state"] != "loading", 60)
    described = runtime.describe()
    assert described["registry"]["state"] == "loaded", described["registry"]
    assert (described["source"], described["version"]) == ("registry", "champion-7")
    assert described["rls"]["active"] is True


def test_a_push_is_never_overwritten_by_the_registry_champion(build, champion_store):
    runtime = build(policy="leap", registry_uri=champion_store)
    runtime.push_readout(to_bytes(first_value_readout("pushed-1")))
    assert eventually(lambda: runtime.describe()["registry"]["state"] != "loading", 60)
    described = runtime.describe()
    assert (described["source"], described["version"]) == ("push", "pushed-1")


def test_an_unreachable_registry_is_logged_and_never_fatal(build, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LEAP_MLFLOW_RETRIES", "0")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the store's folder should be")
    with caplog.at_level(logging.WARNING, logger="serving"):
        runtime = build(policy="leap", registry_uri=f"sqlite:///{blocked}/mlflow.db")
        assert eventually(lambda: runtime.describe()["registry"]["state"] != "loading", 60)
    described = runtime.describe()
    assert described["registry"]["state"] == "failed" and described["source"] == "none"
    assert runtime.health()["healthy"]
    assert any("registry" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("registered", [False, True], ids=["nothing-registered", "versions-but-no-champion"])
def test_a_registry_without_a_champion_yet_is_a_first_deployment_not_a_failure(build, tmp_path, caplog, registered):
    empty = f"sqlite:///{tmp_path}/mlflow.db"
    registry = ReadoutRegistry(empty)  # the store exists, nothing is promoted in it
    if registered:  # a fit registered a version, no gate promoted it yet (MLflow: "alias champion not found")
        readout = first_value_readout("challenger-1")
        X = np.random.default_rng(0).normal(scale=4.0, size=(4 * DIM, DIM))
        registry.log_readout(readout, rls=RLS.from_readout(readout, X), params={"data_hash": "test"},
                             metrics={"spearman": 0.5})
    with caplog.at_level(logging.INFO, logger="serving"):
        runtime = build(policy="leap", registry_uri=empty)
        assert eventually(lambda: runtime.describe()["registry"]["state"] != "loading", 60)
    described = runtime.describe()
    assert described["registry"]["state"] == "none" and described["source"] == "none", described["registry"]
    assert "not found" in described["registry"]["error"]
    assert runtime.health()["healthy"]
    said = [r for r in caplog.records if "no champion in the registry" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "registry" in r.getMessage()]
