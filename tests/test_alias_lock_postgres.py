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
