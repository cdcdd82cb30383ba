"""The alias lock in the fleet's PostgreSQL store: one queue for alias writers on every host, released by
the server when its holder dies. A real PostgreSQL server (tests/postgres_fixtures.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from registry.locking import AliasLock, AliasLockTimeout, PostgresAliasLock
from tests.postgres_fixtures import postgres_port, postgres_url  # noqa: F401  (fixtures)


def test_two_holders_queue_and_a_killed_holder_leaves_no_stale_lock(postgres_url):
    first, second = PostgresAliasLock(postgres_url), PostgresAliasLock(postgres_url)  # as two hosts would
    with first.held(timeout_s=5):
        started = time.monotonic()
        with pytest.raises(AliasLockTimeout, match="stayed held"), second.held(timeout_s=0.4):
            pass
        assert time.monotonic() - started >= 0.4
        with first.held(timeout_s=1):  # reentrant within the holding thread
            pass
    with second.held(timeout_s=2):
        pass

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from registry.locking import PostgresAliasLock
        with PostgresAliasLock({postgres_url!r}).held(timeout_s=10):
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AliasLockTimeout):
            with first.held(timeout_s=0.3):
                pass
        holder.kill()  # SIGKILL: no unlock runs; the server ends the session and its lock
        holder.wait(10)
        with first.held(timeout_s=10):
            pass
    finally:
        holder.kill()
        holder.wait(10)


def test_pipelines_with_separate_homes_share_the_lock_of_their_postgres_store(postgres_url, tmp_path, monkeypatch):
    from flows.settings import PipelineSettings

    homes = [PipelineSettings(home=tmp_path / name, store_url=postgres_url) for name in ("host-a", "host-b")]
    assert homes[0].alias_lock_location == homes[1].alias_lock_location == postgres_url
    assert isinstance(AliasLock.for_path(homes[0].alias_lock_location), PostgresAliasLock)
    local = PipelineSettings(home=tmp_path / "one-machine")
    assert local.alias_lock_location == str(local.alias_lock_path)
    assert isinstance(AliasLock.for_path(local.alias_lock_location), AliasLock)
    assert "***" in PostgresAliasLock("postgresql+psycopg://leap:secret@db:5432/leap").path


_PROMOTER = """
import json, sys
from flows.promotion import PushOptions, promote
from flows.settings import PipelineSettings
from registry.client import ReadoutRegistry

name, version, endpoints, token = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
settings = PipelineSettings()  # its own LEAP_HOME; the store, registry and lock come from the environment
registry = ReadoutRegistry(settings.mlflow_tracking_uri, lock_path=settings.alias_lock_location)
print("ready", flush=True)
sys.stdin.readline()
try:
    outcome = promote(registry, name, version, endpoints, PushOptions(token, retries=0, timeout=30.0),
                      settings.promotion_journal_dir)
    print(json.dumps({"version": version, "status": outcome["status"]}), flush=True)
except Exception as error:
    print(json.dumps({"version": version, "status": "failed", "restored": getattr(error, "restored", None),
                      "error": f"{type(error).__name__}: {str(error)[:300]}"}), flush=True)
"""


def test_two_processes_with_separate_homes_promoting_at_once_leave_every_replica_on_the_champion(
        postgres_url, tmp_path):
    """Both promote onto the same slow replicas; the lock in the shared store takes them one after the other,
    so the replicas take the versions in one order and end on the registry's champion (a promotion that
    cannot go through fails with the earlier state restored)."""
    import json
    import os

    from experiments.faults.pipeline import TOKEN, fitted_readout, replicas
    from flows.promotion import PushOptions, promote
    from ops.servers import MlflowServer
    from registry.aliases import CHAMPION
    from registry.client import ReadoutRegistry

    repo = Path(__file__).resolve().parents[1]
    with MlflowServer(tmp_path / "mlflow") as server, replicas(2) as (targets, urls):
        registry = ReadoutRegistry(server.url, lock_path=postgres_url)
        logged = []
        for day in (1, 2, 3):
            readout, rls = fitted_readout(f"2025010{day}T000000-v{day}", seed=day)
            logged.append(registry.log_readout(readout, rls=rls, params={"data_hash": "lock"}, metrics={"spearman": 0.5}))
        name = logged[0].name
        promote(registry, name, logged[0].version, urls, PushOptions(TOKEN, retries=0), tmp_path / "journal")
        for target in targets:  # slow replicas: each push takes a while, so the two promotions overlap
            target.on_push = lambda version: time.sleep(0.2)
        base = {key: value for key, value in os.environ.items() if not key.startswith("LEAP_")}
        children = [subprocess.Popen(
            [sys.executable, "-c", _PROMOTER, name, str(entry.version), json.dumps(urls), TOKEN], cwd=repo,
            env={**base, "LEAP_HOME": str(tmp_path / f"host-{index}"), "LEAP_STORE_URL": postgres_url,
                 "LEAP_MLFLOW_TRACKING_URI": server.url},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for index, entry in enumerate(logged[1:])]
        try:
            assert [child.stdout.readline().strip() for child in children] == ["ready", "ready"]
            for child in children:  # both at once
                child.stdin.write("go\n")
                child.stdin.flush()
            outcomes = [json.loads(child.stdout.readline()) for child in children]
        finally:
            for child in children:
                child.kill()
                child.wait(10)
        champion = registry.get_alias(name, CHAMPION)
        serving = str(registry.load_readout(name, champion).metadata["version"])
        assert any(outcome["status"] == "promoted" for outcome in outcomes), outcomes
        assert all(o["status"] == "promoted" or o.get("restored") for o in outcomes), outcomes
        assert [target.version for target in targets] == [serving, serving]
        assert targets[0].history == targets[1].history, [target.history for target in targets]
