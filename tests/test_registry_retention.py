"""Registry retention against real MLflow stores: a sqlite store with local artifacts, and an MLflow server
proxying its artifacts. Versions an alias names and the newest few stay, loadable; the others go with
their runs' files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlflow")

from registry.aliases import CHALLENGER, CHAMPION, PREVIOUS_CHAMPION
from registry.client import ReadoutRegistry
from study_harness.servers import MlflowServer
from tests.fleet_fixtures import champion_readout

pytestmark = pytest.mark.pipeline


def _register(registry: ReadoutRegistry, count: int) -> list:
    logged = []
    for i in range(count):
        readout, rls, _, _ = champion_readout(f"2025010{i + 1}T000000-keep{i:04d}", np.random.default_rng(i))
        logged.append(registry.log_readout(readout, rls=rls, params={"data_hash": f"h{i}"}, metrics={"mae": 1.0}))
    return logged


def _files(registry: ReadoutRegistry, run_id: str) -> list[str]:
    return registry.list_artifacts(run_id)


def _prune_and_check(registry: ReadoutRegistry) -> None:
    logged = _register(registry, 6)
    name = logged[0].name
    registry.set_alias(name, PREVIOUS_CHAMPION, 1)
    registry.set_alias(name, CHAMPION, 2)
    registry.set_alias(name, CHALLENGER, 3)
    assert _files(registry, logged[3].run_id)  # version 4 has its files before

    planned = registry.prune_versions(name, keep_last=2, dry_run=True)
    assert planned["pruned"] == ["4"] and [v.version for v in registry.list_versions(name)] == list("654321")
    result = registry.prune_versions(name, keep_last=2)

    assert result["pruned"] == ["4"] and sorted(result["kept"]) == ["1", "2", "3", "5", "6"]
    assert [v.version for v in registry.list_versions(name)] == ["6", "5", "3", "2", "1"]
    assert _files(registry, logged[3].run_id) == []
    assert registry.client.get_run(logged[3].run_id).info.lifecycle_stage == "deleted"
    for kept in ("1", "2", "3", "5", "6"):  # every kept version still loads, RLS state included
        readout = registry.load_readout(name, kept)
        assert readout.metadata["version"].endswith(f"keep{int(kept) - 1:04d}")
    assert registry.prune_versions(name, keep_last=2)["pruned"] == []  # a second run has nothing left to do
    with pytest.raises(ValueError, match="keep_last"):
        registry.prune_versions(name, keep_last=0)


def test_a_sqlite_store_keeps_aliased_and_newest_versions_and_drops_the_rest_with_their_files(tmp_path: Path):
    _prune_and_check(ReadoutRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", lock_path=tmp_path / "aliases.lock"))


def test_an_mlflow_server_deletes_the_pruned_versions_files_from_its_artifact_store(tmp_path: Path):
    with MlflowServer(tmp_path / "mlflow") as server:
        _prune_and_check(ReadoutRegistry(server.url, lock_path=tmp_path / "aliases.lock"))
    artifacts = tmp_path / "mlflow" / "artifacts"
    runs_with_files = {path.relative_to(artifacts).parts[1] for path in artifacts.rglob("*") if path.is_file()}
    assert len(runs_with_files) == 5  # the server's artifact folder lost the pruned run's files
