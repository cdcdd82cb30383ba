"""The fault suite behind `leap bench faults`: real processes, real faults, figures that say what was lost.

One real `leap serve` replica (vLLM's OpenAI server with LEAP's scheduler, capture, middleware, admin
API and feedback writer) is started on free loopback ports and a readout of its feature space is pushed.
Against it, in this order:

1. `bad_vllm_xargs`: every kind of bad `vllm_xargs` on /v1/chat/completions and /v1/completions is a 400
   from the middleware, and the replica serves a good request afterwards (studies/experiments/faults/clients.py);
2. `malformed_admin`: requests without or with a wrong token, without, with a non-numeric, negative or
   oversized Content-Length, truncated, garbage and wrong-JSON bodies, a stalled body, a flood: each a
   4xx (or 503 for the flood), the readout unchanged;
3. `hostile_pushes`: compressed bombs (one inflating to 1 GiB), NaN and float32-overflowing weights,
   broken RLS state, corrupt length distributions (NaN edges, lengths past M or unsorted, miscounted
   bins), foreign and older readouts: each refused, the readout unchanged;
3a. `admin_slowloris`: twelve trickling connections hold what one address may; health and metrics answer
   and a flush from another address is served meanwhile (studies/experiments/faults/flood.py);
3b. `unknown_extras`: 10,000 distinct unknown `leap_*` keys, each request a 400, /metrics unchanged;
4. `push_during_rls`: pushes while traffic makes RLS publish; the pushed version always wins
   (studies/experiments/faults/load.py);
5. `abort_storm`: 10,000 streaming requests dropped by the client; LEAP's per-request state is back at
   its baseline;
6. `kill9_mid_replay`: the replica is SIGKILLed mid-replay and restarted on the same folders; it serves
   the last push (source "state") and every finished request has exactly one feedback row
   (studies/experiments/faults/crash.py);
7. `disk_full`: a fresh replica writes feedback to a 512 KiB tmpfs that fills; it serves on, counts or
   keeps every row, and writes them once the disk has room;
8. the pipeline's own fault scenarios from `experiments.faults.pipeline` (ingest killed with SIGKILL and rerun, MLflow
   down during fit, gate, push and promote, corrupt segments) and `experiments.faults.shared_parts` (S3 cut
   off while replicas ship, PostgreSQL restarted mid-ingest), folded in as they report.

Every scenario is bounded in time and loops; one that cannot run is reported as not survived with the
reason, never left out. Nothing started here outlives `run_suite` (process groups, tmpfs unmounted).
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from experiments.faults.clients import Replica, bad_vllm_xargs, hostile_pushes, malformed_admin, not_run, result
from experiments.faults.serve import Admin, ServeFailed, ServeProcess, bundle_of, fault_readout, served_model

LIVE_SCENARIOS = ("bad_vllm_xargs", "malformed_admin", "hostile_pushes", "admin_slowloris", "unknown_extras",
                  "push_during_rls", "abort_storm", "kill9_mid_replay")
"""Scenarios against the one replica the suite starts, in this order (the SIGKILL last)."""
SERVING_SCENARIOS = (*LIVE_SCENARIOS, "disk_full")
QUICK_SCENARIOS = LIVE_SCENARIOS[:5]
FLOWS_PREFIX = "flows:"
BASE_VERSION = "v10"
SUMMARY_KEYS = ("scenarios", "survived", "requests_lost", "feedback_rows_lost", "ingest_rows_lost_or_duplicated",
                "per_request_state_after_aborts", "results")


def flows_scenarios() -> dict[str, Callable[..., dict[str, Any]]]:
    """The pipeline's fault scenarios (studies/experiments/faults/pipeline.py, shared_parts.py, control_plane.py), by name."""
    from experiments.faults.control_plane import SCENARIOS as CONTROL_PLANE
    from experiments.faults.pipeline import SCENARIOS
    from experiments.faults.shared_parts import SCENARIOS as SHARED_PARTS

    return {**SCENARIOS, **SHARED_PARTS, **CONTROL_PLANE}


def scenario_source(scenario: Callable[..., Any]) -> str:
    """The file a scenario is written in, as the report names it (studies/experiments/faults/<module>.py)."""
    return scenario.__module__.replace(".", "/") + ".py"


def make_replica(serve: ServeProcess, token: str, pushed: list[str] | None = None) -> Replica:
    admin = Admin(serve.admin_url, token)
    client = httpx.Client(timeout=120.0, limits=httpx.Limits(max_connections=16))
    return Replica(serve=serve, admin=admin, model=served_model(serve.url), described=admin.readout(),
                   client=client, pushed=list(pushed or []), workdir=serve.workdir)


def _guarded(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one scenario; an exception is its result (not survived, with the traceback's last line)."""
    started = time.monotonic()
    try:
        return run()
    except Exception as exc:
        tail = traceback.format_exc().strip().splitlines()[-3:]
        return result(name, started, False, f"the scenario raised {type(exc).__name__}: {exc} ({' | '.join(tail)})",
                      ran=False)


class Suite:
    """Runs the scenarios in order on one workdir; `close()` stops everything it started."""

    def __init__(self, workdir: Path, *, quick: bool, aborts: int, abort_concurrency: int,
                 abort_budget_s: float, slow_admin: bool, say: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.quick = quick
        self.aborts = aborts
        self.abort_concurrency = abort_concurrency
        self.abort_budget_s = abort_budget_s
        self.slow_admin = slow_admin
        self.say = say
        self.token = secrets.token_urlsafe(24)
        self.processes: list[ServeProcess] = []
        self.replica: Replica | None = None
        self.setup_error: str | None = None
        self.start_s: float | None = None

    # -- the replica ------------------------------------------------------------------------------
    def _serve(self, name: str, feedback_dir: Path, **kwargs: Any) -> ServeProcess:
        serve = ServeProcess(self.workdir / name, feedback_dir=feedback_dir, state_dir=self.workdir / "state",
                             token=self.token, name=name, **kwargs)
        self.processes.append(serve)
        return serve

    def start_replica(self) -> Replica | None:
        self.say("starting leap serve (compiles the model: about a minute)")
        serve = self._serve("replica", self.workdir / "feedback")
        try:
            serve.start()
            replica = make_replica(serve, self.token)
            readout, rls = fault_readout(replica.described, BASE_VERSION, seed=1)
            response = replica.admin.push(bundle_of(readout, rls))
            if response.status_code != 200:
                raise RuntimeError(f"the base push {BASE_VERSION} was refused: {response.status_code} {response.text}")
            replica.pushed.append(BASE_VERSION)
            replica.described = replica.admin.readout()
        except (ServeFailed, RuntimeError, httpx.HTTPError, OSError, KeyError) as exc:
            self.setup_error = f"the replica did not start: {exc}"
            serve.stop(grace_s=10)
            return None
        self.start_s = serve.started_s
        self.say(f"replica up in {serve.started_s:.0f}s on :{serve.port} (admin :{serve.admin_port}); "
                 f"serving {replica.described.get('version')}")
        self.replica = replica
        return replica

    def restart_replica(self) -> Replica:
        assert self.replica is not None
        serve = self.replica.serve
        serve.start()
        self.replica.client.close()
        self.replica = make_replica(serve, self.token, self.replica.pushed)
        return self.replica

    def start_disk_replica(self, folder: Path) -> Replica:
        serve = self._serve("replica-diskfull", folder)
        serve.start()
        return make_replica(serve, self.token)

    def stop_replica(self, replica: Replica) -> None:
        replica.client.close()
        replica.serve.stop()

    def close(self) -> None:
        if self.replica is not None:
            with contextlib.suppress(Exception):
                self.replica.client.close()
        for serve in self.processes:
            with contextlib.suppress(Exception):
                serve.stop(grace_s=20)

    # -- the scenarios -----------------------------------------------------------------------------
    def run(self, selected: list[str]) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        live = [name for name in selected if name in LIVE_SCENARIOS]
        if live:
            self.start_replica()
            down: str | None = self.setup_error
            for name in live:
                if down is not None:
                    results.append(not_run(name, down))
                    continue
                self.say(f"scenario {name}")
                outcome = _guarded(name, lambda name=name: self._live(name))
                if name == live[0] and self.start_s is not None:
                    outcome["replica_start_s"] = round(self.start_s, 1)
                results.append(outcome)
                self.say(f"  {'survived' if outcome['survived'] else 'FAILED'} in {outcome['seconds']}s: "
                         f"{outcome['detail'][:300]}")
                if name != "kill9_mid_replay" and (self.replica is None or not self.replica.alive()):
                    down = f"the replica is down after {name}"
            if self.replica is not None:
                self.stop_replica(self.replica)
                self.replica = None
        if "disk_full" in selected:
            from experiments.faults.crash import disk_full

            self.say("scenario disk_full (starts a second replica on a tmpfs)")
            outcome = _guarded("disk_full", lambda: disk_full(
                self.start_disk_replica, self.stop_replica, self.workdir / "feedback-tmpfs",
                n=96 if self.quick else 160))
            results.append(outcome)
            self.say(f"  {'survived' if outcome['survived'] else 'FAILED'} in {outcome['seconds']}s: "
                     f"{outcome['detail'][:300]}")
        flows = [name for name in selected if name.startswith(FLOWS_PREFIX)]
        if flows:
            try:
                available = flows_scenarios()
            except Exception as exc:
                available, reason = {}, f"the pipeline's fault scenarios did not load: {type(exc).__name__}: {exc}"
            else:
                reason = "not among the pipeline's fault scenarios (flows_scenarios)"
            for name in flows:
                key = name[len(FLOWS_PREFIX):]
                scenario = available.get(key)
                if scenario is None:
                    results.append(not_run(key, reason))
                    continue
                source = scenario_source(scenario)
                self.say(f"scenario {key} ({source})")
                folder = self.workdir / "flows" / key
                outcome = _guarded(key, lambda scenario=scenario, folder=folder: scenario(workdir=folder))
                outcome.setdefault("detail", _flows_detail(outcome))
                outcome["source"] = source
                results.append(outcome)
                self.say(f"  {'survived' if outcome['survived'] else 'FAILED'} in {outcome.get('seconds')}s")
        return results

    def _live(self, name: str) -> dict[str, Any]:
        replica = self.replica
        assert replica is not None
        if name == "bad_vllm_xargs":
            return bad_vllm_xargs(replica)
        if name == "malformed_admin":
            return malformed_admin(replica, slow=self.slow_admin)
        if name == "hostile_pushes":
            return hostile_pushes(replica)
        if name == "admin_slowloris":
            from experiments.faults.flood import admin_slowloris

            return admin_slowloris(replica)
        if name == "unknown_extras":
            from experiments.faults.flood import unknown_extras

            return unknown_extras(replica)
        if name == "push_during_rls":
            from experiments.faults.load import push_during_rls

            return push_during_rls(replica, pushes=2 if self.quick else 3)
        if name == "abort_storm":
            from experiments.faults.load import abort_storm

            return abort_storm(replica, total=self.aborts, concurrency=self.abort_concurrency,
                               time_budget_s=self.abort_budget_s)
        if name == "kill9_mid_replay":
            from experiments.faults.crash import kill9_mid_replay

            outcome, restarted = kill9_mid_replay(replica, self.restart_replica, n=96 if self.quick else 160)
            if restarted is None:
                self.replica = None
            return outcome
        raise ValueError(name)


def _flows_detail(outcome: dict[str, Any]) -> str:
    keep = ("error", "ingest_rows_lost_or_duplicated", "rows_expected", "failed_loudly", "restored", "misjudged",
            "good_rows_lost", "segments_committed_before_kill")
    return "; ".join(f"{key}={outcome[key]}" for key in keep if key in outcome) or "see the figures"


def all_scenarios(include_flows: bool = True) -> list[str]:
    names = list(SERVING_SCENARIOS)
    if include_flows:
        try:
            names += [FLOWS_PREFIX + name for name in flows_scenarios()]
        except Exception:
            names.append(FLOWS_PREFIX + "ingest_kill9")
    return names


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> int:
        return int(sum(int(r.get(key) or 0) for r in results))

    storm = next((r for r in results if r.get("scenario") == "abort_storm"), None)
    state = (storm or {}).get("per_request_state") or {"ran": False, "back_to_baseline": False,
                                                       "baseline": {}, "after": {}}
    return {"scenarios": len(results), "survived": sum(1 for r in results if r.get("survived")),
            "requests_lost": total("requests_lost"), "feedback_rows_lost": total("feedback_rows_lost"),
            "ingest_rows_lost_or_duplicated": total("ingest_rows_lost_or_duplicated"),
            "per_request_state_after_aborts": state, "results": results}


def run_suite(*, quick: bool = False, aborts: int | None = None, only: Iterable[str] | None = None,
              workdir: str | Path | None = None, keep: bool = False, abort_concurrency: int = 64,
              abort_budget_s: float | None = None, slow_admin: bool | None = None,
              say: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Run the scenarios (all by default; `only` names some, flows ones as `flows:<name>`) and summarize.

    `quick` lowers the sizes (1,000 aborts instead of 10,000, shorter replays, no 30 s stalled body);
    `aborts` overrides the abort count either way.
    """
    selected = list(only) if only else all_scenarios()
    unknown = [n for n in selected if n not in SERVING_SCENARIOS and not n.startswith(FLOWS_PREFIX)]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {all_scenarios()}")
    order = {name: i for i, name in enumerate(SERVING_SCENARIOS)}
    selected.sort(key=lambda n: order.get(n, len(order)))
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="leap-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    suite = Suite(root, quick=quick, aborts=aborts if aborts is not None else (1000 if quick else 10_000),
                  abort_concurrency=abort_concurrency,
                  abort_budget_s=abort_budget_s if abort_budget_s is not None else (180.0 if quick else 900.0),
                  slow_admin=(not quick) if slow_admin is None else slow_admin, say=say)
    try:
        results = suite.run(selected)
    finally:
        suite.close()
        if not keep and workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return summarize(results)
