"""Promotion and rollback as one operation over a real MLflow registry and real replica admin servers.

The registry is a sqlite MLflow store (a real `mlflow server` subprocess where MLflow must go down);
replicas are `serving.admin.api.AdminServer`s whose target validates pushes as a serving replica does,
including its refusal to go back to an older readout version unless the push is forced. Versions
follow the fit flow's time scheme, so putting the previous champion back needs that force.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("prefect")

from experiments.faults import pipeline as faults
from flows.promotion import PromotionFailed, PushOptions, promote, recover, rollback
from ops.servers import free_port
from registry.client import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    AliasLockTimeout,
    ReadoutRegistry,
    RegistryUnavailable,
)
from study_harness.servers import MlflowServer

pytestmark = pytest.mark.pipeline

REPO_ROOT = Path(__file__).resolve().parents[1]
V1, V2, V3 = "20250101T000000-aaaa0001", "20250102T000000-aaaa0002", "20250103T000000-aaaa0003"
OPTIONS = PushOptions(faults.TOKEN, retries=1, timeout=10.0, backoff_s=0.05)


def _registry(folder: Path, versions=(V1, V2), **kwargs) -> tuple[ReadoutRegistry, str, list[str]]:
    registry = ReadoutRegistry(f"sqlite:///{folder}/mlflow.db", **kwargs)
    logged = []
    for seed, version in enumerate(versions, start=1):
        readout, rls = faults.fitted_readout(version, seed)
        logged.append(registry.log_readout(readout, rls=rls, params={"data_hash": "t"}, metrics={"spearman": 0.5}))
    return registry, logged[0].name, [entry.version for entry in logged]


@pytest.fixture
def setup(tmp_path):
    """Registry with v1 champion on two replicas, v2 challenger."""
    registry, name, versions = _registry(tmp_path / "mlflow")
    journal = tmp_path / "promotions"
    with faults.replicas(2) as (targets, urls):
        promote(registry, name, versions[0], urls, OPTIONS, journal)
        registry.set_challenger(name, versions[1])
        yield {"registry": registry, "name": name, "versions": versions, "targets": targets, "urls": urls,
               "journal": journal, "tmp": tmp_path}


def _serving(targets) -> list[str]:
    return [target.version for target in targets]


def test_promotion_moves_every_replica_and_the_aliases_together(setup):
    registry, name, (v1, v2) = setup["registry"], setup["name"], setup["versions"]

    result = promote(registry, name, v2, setup["urls"], OPTIONS, setup["journal"])

    assert result["status"] == "promoted" and result["replaced"] == v1
    assert [pushed["version"] for pushed in result["pushed"]] == [V2, V2]
    assert _serving(setup["targets"]) == [V2, V2]
    assert registry.aliases(name) == {CHAMPION: v2, PREVIOUS_CHAMPION: v1}
    assert not list(setup["journal"].glob("*"))


def test_a_promotion_whose_gate_judged_another_champion_changes_nothing(setup):
    registry, name, (v1, v2) = setup["registry"], setup["name"], setup["versions"]
    before, pushes = registry.aliases(name), [list(target.history) for target in setup["targets"]]

    with pytest.raises(PromotionFailed, match="did not start, nothing was changed.*gate it again") as failure:
        promote(registry, name, v2, setup["urls"], OPTIONS, setup["journal"], gated_against=None)

    assert failure.value.restored is True
    assert registry.aliases(name) == before and [list(t.history) for t in setup["targets"]] == pushes
    assert _serving(setup["targets"]) == [V1, V1]
    result = promote(registry, name, v2, setup["urls"], OPTIONS, setup["journal"], gated_against=v1)
    assert result["status"] == "promoted" and registry.get_alias(name, CHAMPION) == v2


def test_a_replica_refusing_the_challenger_puts_the_others_back_and_moves_no_alias(setup):
    registry, name, (v1, v2) = setup["registry"], setup["name"], setup["versions"]
    setup["targets"][1].dim += 1  # a replica of another model: it refuses every readout of this one
    before = registry.aliases(name)

    with pytest.raises(PromotionFailed) as failure:
        promote(registry, name, v2, setup["urls"], OPTIONS, setup["journal"])

    assert failure.value.restored is True
    assert setup["urls"][1] in str(failure.value) and "The earlier state is back" in str(failure.value)
    assert setup["targets"][0].history[-2:] == [V2, V1]  # took v2, then v1 again (a forced push)
    assert _serving(setup["targets"]) == [V1, V1]
    assert registry.aliases(name) == before == {CHAMPION: v1, CHALLENGER: v2}
    assert not list(setup["journal"].glob("*"))


def test_rollback_moves_the_aliases_and_pushes_the_restored_champion(setup):
    registry, name, (v1, v2) = setup["registry"], setup["name"], setup["versions"]
    promote(registry, name, v2, setup["urls"], OPTIONS, setup["journal"])

    result = rollback(registry, name, setup["urls"], OPTIONS, setup["journal"])

    assert result["status"] == "rolled-back" and result["version"] == v1
    assert _serving(setup["targets"]) == [V1, V1]  # older than v2: pushed with force
    assert registry.aliases(name) == {CHAMPION: v1, PREVIOUS_CHAMPION: v2}
    again = rollback(registry, name, setup["urls"], OPTIONS, setup["journal"])  # undoes the rollback
    assert again["version"] == v2 and _serving(setup["targets"]) == [V2, V2]
    assert registry.aliases(name) == {CHAMPION: v2, PREVIOUS_CHAMPION: v1}


def test_rollback_without_previous_champion_fails_and_changes_nothing(setup):
    registry, name = setup["registry"], setup["name"]
    with pytest.raises(PromotionFailed, match="previous-champion") as failure:
        rollback(registry, name, setup["urls"], OPTIONS, setup["journal"])
    assert failure.value.restored is True
    assert _serving(setup["targets"]) == [V1, V1]


_PROMOTE_CHILD = """
import json, sys
from flows.promotion import PushOptions, promote
from registry.client import ReadoutRegistry
args = json.loads(sys.argv[1])
registry = ReadoutRegistry(args["uri"], lock_path=args["lock"])
print("ready", flush=True)
sys.stdin.readline()
promote(registry, args["name"], args["version"], args["urls"], PushOptions(args["token"], retries=0), args["journal"])
print("promoted", flush=True)
"""


def test_a_promotion_killed_mid_push_is_undone_by_the_next_operation(setup):
    """kill -9 of the promoting process the moment the first replica takes the challenger: the journal
    it left lets the next operation put that replica back before anything else moves."""
    registry, name, (v1, v2) = setup["registry"], setup["name"], setup["versions"]
    args = {"uri": registry.tracking_uri, "lock": str(registry.alias_lock.path), "name": name, "version": v2,
            "urls": setup["urls"], "token": faults.TOKEN, "journal": str(setup["journal"])}
    child = subprocess.Popen([sys.executable, "-c", _PROMOTE_CHILD, json.dumps(args)], cwd=REPO_ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert child.stdout.readline().strip() == "ready"
        setup["targets"][0].on_push = lambda version: os.kill(child.pid, signal.SIGKILL)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    setup["targets"][0].on_push = None
    assert setup["targets"][0].version == V2 and setup["targets"][1].version == V1  # half promoted
    assert (setup["journal"] / f"{name}.json").exists()
    assert registry.aliases(name) == {CHAMPION: v1, CHALLENGER: v2}

    recovered = recover(registry, name, OPTIONS, setup["journal"])

    assert recovered["recovered"] == "restored" and recovered["replicas_restored"] == [setup["urls"][0]]
    assert _serving(setup["targets"]) == [V1, V1]
    assert registry.aliases(name) == {CHAMPION: v1, CHALLENGER: v2}
    assert not list(setup["journal"].glob("*"))
    # and the promotion, run again, completes
    promote(registry, name, v2, setup["urls"], OPTIONS, setup["journal"])
    assert _serving(setup["targets"]) == [V2, V2] and registry.get_alias(name, CHAMPION) == v2


_HOLD_LOCK = """
import sys, time
from registry.locking import AliasLock
with AliasLock.for_path(sys.argv[1]).held():
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_alias_writes_wait_for_the_lock_another_process_holds(tmp_path):
    registry, name, (v1, _) = _registry(tmp_path, lock_timeout_s=0.5)
    lock = registry.alias_lock.path
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock), "3"], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        held_at = time.monotonic()
        with pytest.raises(AliasLockTimeout, match="stayed held"):
            registry.set_alias(name, CHAMPION, v1)
        assert registry.get_alias(name, CHAMPION) is None

        patient = ReadoutRegistry(registry.tracking_uri, lock_path=lock, lock_timeout_s=60)
        started = time.monotonic()
        patient.promote(name, v1)  # reentrant: promote writes through set/apply under the same lock
        assert time.monotonic() - started > 0.5
        # it got the lock only once the holder had let go, 3 s after saying "held" (the holder's exit may lag)
        assert time.monotonic() - held_at > 2.5
        assert holder.wait(timeout=30) == 0
        assert patient.get_alias(name, CHAMPION) == v1
    finally:
        holder.kill()
        holder.wait()


def test_a_registry_that_does_not_answer_fails_loudly_after_its_retries(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    registry = ReadoutRegistry(url, lock_path=tmp_path / "aliases.lock", retries=2, backoff_s=0.05)
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable, match="after 3 attempts") as failure:
        registry.aliases("leap-readout-x-L1")
    assert url in str(failure.value) and time.monotonic() - started < 30


def test_registry_calls_are_retried_until_a_restarted_mlflow_answers(tmp_path):
    """MLflow is down when the call starts and comes up while it backs off."""
    port = free_port()
    registry = ReadoutRegistry(f"http://127.0.0.1:{port}", lock_path=tmp_path / "aliases.lock", retries=7,
                               backoff_s=0.5)
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["aliases"] = registry.aliases("leap-readout-x-L1")
        except Exception as error:
            outcome["error"] = error

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)
    assert caller.is_alive()  # still backing off
    with MlflowServer(tmp_path / "mlflow", port=port):
        caller.join(timeout=90)
    assert outcome == {"aliases": {}}


def test_mlflow_killed_mid_promotion_leaves_every_replica_and_alias_as_they_were(tmp_path):
    # the scenario's own bound is 60 s (about 30 s here); a loaded test machine gets more room
    result = faults.mlflow_down("promote", tmp_path, timeout_s=180)
    assert result["survived"], result
    assert result["failed_loudly"] and result["restored"] is True
    assert "RegistryUnavailable" in result["error"]
    # each replica took the challenger, then the champion again once the alias could not move
    for before, history in zip(result["serving_before"], result["pushes_seen"]):
        assert history[-2:] != [before, before] and history[-1] == before and len(set(history)) == 2
    assert result["serving_after"] == result["serving_before"]
    assert result["aliases_after"] == result["aliases_before"]
