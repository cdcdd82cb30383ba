"""Fault scenarios of the control plane across hosts: two promoters at once, and two clocks that disagree.

- `two_promotions_separate_homes`: two processes, each with a `$LEAP_HOME` of its own (as two hosts would
  have), promote different versions onto the same slow replicas at the same moment. Their alias lock is
  the PostgreSQL store's advisory lock, so they go one after the other: every replica ends on the
  registry's champion and every replica took the versions in the same order. The one that goes second
  finds the champion its gate judged against replaced, and promotes nothing.
- `clock_skew`: the host that promotes runs an hour behind the replica's host. A promotion pushes v1 to
  the replica (which saves it, stamped by its own clock) and publishes it; the replica stops; a second
  promotion publishes v2 while the replica is away. By the clocks the replica's saved push looks newer
  than the publication; by the publication sequence both carry, it is older. The restarted replica must
  serve v2.

Real parts: a PostgreSQL server, an MLflow server, the push flow (`leap push --promote`) in separate
processes, admin servers and a LEAP runtime that restarts from its state folder. Gates are recorded as
passed beforehand (their replay needs the serving engine, which these scenarios run without). The one stand-in is the promoting host's
clock: its process sees `time.time()` an hour behind (no clock of the machine is changed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from experiments.bench.ingest import BENCH_LAYER, BENCH_MODEL_ID
from experiments.faults.pipeline import (
    DIM,
    TOKEN,
    fitted_readout,
    record_passing_gate,
    replicas,
    scenario_result,
    scratch_folder,
)
from ops.servers import create_database, free_port
from study_harness.servers import MlflowServer, running_postgres

REPO = Path(__file__).resolve().parents[3]
SKEW_S = 3600.0

_PROMOTER = """
import json, sys, time
skew = float(sys.argv[3])
if skew:  # this host's clock runs behind: every time.time() it reads is `skew` seconds early
    real_time = time.time
    time.time = lambda: real_time() - skew
from prefect.client.orchestration import get_client
from flows.pipeline import push_flow

with get_client(sync_client=True) as client:  # this host's Prefect API (a temporary server without a URL) is up
    client.api_healthcheck()
print("ready", flush=True)
sys.stdin.readline()
try:  # the host's settings (its LEAP_HOME, store, registry, replicas, champion location) come from its environment
    outcome = push_flow(version=sys.argv[2], name=sys.argv[1], promote=True)
    print(json.dumps({"version": sys.argv[2], "status": outcome["status"], "reason": outcome.get("reason"),
                      "published": outcome.get("published")}), flush=True)
except Exception as error:
    print(json.dumps({"version": sys.argv[2], "status": "failed", "restored": getattr(error, "restored", None),
                      "error": f"{type(error).__name__}: {str(error)[:300]}"}), flush=True)
"""


def _host_environment(home: Path, **leap: str) -> dict[str, str]:
    """The environment of a promoting host: its own LEAP_HOME and Prefect home, the admin token, and `leap`
    (LEAP_* settings by their suffix)."""
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    return {"LEAP_HOME": str(home), "PREFECT_HOME": str(home / "prefect"), "LEAP_ADMIN_TOKEN": TOKEN,
            **{f"LEAP_{key.upper()}": value for key, value in leap.items()}}


def _promoters(jobs: list[tuple[str, str, dict[str, str], float]]) -> list[dict[str, Any]]:
    """Run the push flow with `promote` in one process per (name, version, environment, clock skew), all
    released at the same moment; their outcomes, in order.

    Each host starts once the one before answers "ready" (its Prefect API up): hosts without a Prefect URL
    each start a temporary server on a random free port, and two that start at the same instant can pick
    the same port, one host's flows then landing on the other's server (a clash of one machine standing in
    for two, never of two hosts)."""
    base = {key: value for key, value in os.environ.items() if not key.startswith(("LEAP_", "PREFECT_"))}
    children: list[subprocess.Popen] = []
    try:
        for name, version, env, skew in jobs:
            children.append(subprocess.Popen([sys.executable, "-c", _PROMOTER, name, version, str(skew)], cwd=REPO,
                                             env={**base, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True))
            if children[-1].stdout.readline().strip() != "ready":
                raise RuntimeError("a promoter did not start")
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        outcomes = []
        for child in children:
            lines = [line for line in child.stdout.read().splitlines() if line.startswith("{")]
            outcomes.append(json.loads(lines[-1]) if lines else {"status": "no answer"})
        return outcomes
    finally:
        for child in children:
            child.kill()
            child.wait(10)


def _register(registry: Any, days: tuple[int, ...]) -> list[Any]:
    logged = []
    for day in days:
        readout, rls = fitted_readout(f"2025010{day}T000000-v{day}", seed=day)
        logged.append(registry.log_readout(readout, rls=rls, params={"data_hash": "faults"}, metrics={"mae": 1.0}))
    return logged


def two_promotions_separate_homes(workdir: str | Path | None = None) -> dict[str, Any]:
    """Two promoters with separate homes at once onto the same slow replicas: one order, one champion."""
    from registry.aliases import CHAMPION
    from registry.client import ReadoutRegistry
    from store.postgres import PostgresStore

    started = time.monotonic()
    with scratch_folder(workdir) as scratch, running_postgres(scratch / "pg" / "data", free_port()) as port:
        store_url = create_database(port, "leap_faults")
        store = PostgresStore(store_url)
        with MlflowServer(scratch / "mlflow") as server, replicas(2) as (targets, urls):
            registry = ReadoutRegistry(server.url, lock_path=store_url)
            first, *challengers = _register(registry, (1, 2, 3))
            name = first.name
            hosts = [_host_environment(scratch / f"host-{index}", store_url=store_url, mlflow_tracking_uri=server.url,
                                       endpoints=",".join(urls), champion_url="") for index in range(2)]
            record_passing_gate(store, name, first.version, None)
            [seeded] = _promoters([(name, str(first.version), hosts[0], 0.0)])
            for entry in challengers:  # each passed its gate against v1
                record_passing_gate(store, name, entry.version, first.version)
            for target in targets:  # slow replicas: each push takes a while, so the two promotions overlap
                target.on_push = lambda version: time.sleep(0.2)
            outcomes = _promoters([(name, str(entry.version), host, 0.0) for entry, host in zip(challengers, hosts)])
            champion = registry.get_alias(name, CHAMPION)
            serving = str(registry.load_readout(name, champion).metadata["version"]) if champion else None
            histories = [list(target.history) for target in targets]
            versions = [target.version for target in targets]
    # the second finds another champion than its gate was passed against: not promoted when it reads it
    # before asking for the lock, refused with nothing changed (restored) when it finds it under the lock
    settled = ("promoted", "not-promoted")
    survived = (seeded.get("status") == "promoted" and any(o.get("status") == "promoted" for o in outcomes)
                and all(o.get("status") in settled or o.get("restored") for o in outcomes)
                and versions == [serving, serving] and histories[0] == histories[1])
    detail = (f"two homes promoted at once: {', '.join(str(o.get('status')) for o in outcomes)}; champion v{champion}, "
              f"replicas serve {versions}, {'the same' if histories[0] == histories[1] else 'different'} order")
    return scenario_result("two_promotions_separate_homes", started, survived, detail=detail, seeded=seeded,
                           outcomes=outcomes, champion=champion, replicas_serve=versions,
                           same_order=histories[0] == histories[1])


def _runtime(state_dir: Path, champion_url: Path) -> Any:
    """A LEAP runtime (no engine: the fields of vLLM's config LEAP reads) with a state folder and the
    champion location, its admin API on a free port."""
    from serving.runtime import LeapRuntime

    hf = SimpleNamespace(hidden_size=DIM, num_hidden_layers=BENCH_LAYER + 4)
    model = SimpleNamespace(hf_text_config=hf, model=BENCH_MODEL_ID, max_model_len=4096)
    leap = {"layer": BENCH_LAYER, "policy": "leap", "rls": True, "admin_port": 0, "admin_token": TOKEN,
            "state_dir": str(state_dir), "champion_url": str(champion_url), "ready_wait_ms": 0.0,
            "channel": f"ipc://{state_dir.parent}/leap-skew-{os.getpid()}-{time.monotonic_ns()}.sock"}
    return LeapRuntime(SimpleNamespace(model_config=model, additional_config={"leap": leap},
                                       instance_id=f"skew{time.monotonic_ns() % 10**8}"))


def clock_skew(workdir: str | Path | None = None) -> dict[str, Any]:
    """The promoting host's clock an hour behind the replica's: a replica restarted after a promotion it
    missed serves the newer champion all the same (the publication sequence decides, not the clocks)."""
    from flows.settings import PipelineSettings
    from registry.client import ReadoutRegistry
    from store.stores import open_store

    started = time.monotonic()
    with scratch_folder(workdir) as scratch, MlflowServer(scratch / "mlflow") as server:
        champion_url, state, home = scratch / "champion", scratch / "replica-state", scratch / "promoter"
        store = open_store(PipelineSettings(home=home))  # the promoting host's log store, where gates are kept
        registry = ReadoutRegistry(server.url, lock_path=scratch / "aliases.lock")
        first, second = _register(registry, (1, 2))
        record_passing_gate(store, first.name, first.version, None)
        record_passing_gate(store, first.name, second.version, first.version)
        replica = _runtime(state, champion_url)
        try:
            host = _host_environment(home, mlflow_tracking_uri=server.url, champion_url=str(champion_url),
                                     endpoints=f"http://127.0.0.1:{replica.admin.port}")
            [pushed] = _promoters([(first.name, str(first.version), host, SKEW_S)])
            before = replica.readouts.version
        finally:
            replica.close()
        saved = json.loads((state / "readout.json").read_text())
        # v2 is promoted while the replica is away: published, not pushed to it
        [published] = _promoters([(first.name, str(second.version), {**host, "LEAP_ENDPOINTS": ""}, SKEW_S)])
        publication = json.loads((champion_url / f"{first.name}.json").read_text())
        restarted = _runtime(state, champion_url)
        try:
            after, source = restarted.readouts.version, restarted.describe()["source"]
        finally:
            restarted.close()
    clocks_say_saved_is_newer = float(saved["saved_at"]) > float(publication["published_at"])
    survived = (pushed.get("status") == "promoted" and published.get("status") == "promoted"
                and before == "20250101T000000-v1" and clocks_say_saved_is_newer
                and after == "20250102T000000-v2" and source == "champion")
    detail = (f"the promoting host {SKEW_S:.0f} s behind: the replica saved v1 (publication "
              f"{saved.get('sequence')}) {'after' if clocks_say_saved_is_newer else 'before'} publication "
              f"{publication.get('sequence')} by the clocks; restarted, it serves {after} from {source}")
    return scenario_result("clock_skew", started, survived, detail=detail, skew_s=SKEW_S, first=pushed, second=published,
                           saved_sequence=saved.get("sequence"), published_sequence=publication.get("sequence"),
                           clocks_say_saved_is_newer=clocks_say_saved_is_newer, served_before=before,
                           served_after_restart=after, source_after_restart=source)


SCENARIOS = {"two_promotions_separate_homes": two_promotions_separate_homes, "clock_skew": clock_skew}
"""These scenarios by name; each takes an optional `workdir` and returns its result dict."""
