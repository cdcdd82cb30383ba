"""Fault scenarios of the pipeline, each a function a benchmark can call, each against real parts.

Every scenario returns {"scenario": name, "survived": bool, "seconds": ..., ...figures} and runs in a
scratch folder on loopback only, bounded in time (a scenario past `timeout_s` is reported as not
survived, never left hanging):

- `ingest_kill9`: an ingest process over many segments is killed with SIGKILL part-way; a rerun must
  leave exactly the segments' request ids in the store (`ingest_rows_lost_or_duplicated == 0`) with
  the ledger reconciling row for row.
- `mlflow_down(phase)`: a real `mlflow server` (sqlite backend, served artifacts) is killed with
  SIGKILL at a chosen moment of the fit, gate or push flow or of a promotion, from outside the flow;
  the flow must fail loudly (an exception naming MLflow), and nothing may be half done: the aliases
  (read from the server's sqlite file), the recorded gates and every replica's readout are as they
  were before.
- `corrupt_segments`: truncated, non-Parquet, wrong-schema and Arrow-readable-but-unstorable
  segments among good ones; every bad one is quarantined with its reason, every good row ingested,
  and a rerun changes nothing.

Serving replicas are real admin HTTP servers (`serving.admin.api.AdminServer`) whose target validates a
push exactly as a replica does (`serving.readout.push.validate_push`), without the engine.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from experiments.bench.ingest import (
    BENCH_FINGERPRINT,
    BENCH_LAYER,
    BENCH_MODEL_ID,
    write_synthetic_feedback,
    write_synthetic_segment,
)
from flows.settings import PipelineSettings
from ops.servers import kill_session
from registry.client import CHAMPION
from store.duckdb import LogStore
from store.ingest import ingest_folder, totals
from store.stores import Store, open_store
from study_harness.servers import MlflowServer

REPO_ROOT = Path(__file__).resolve().parents[3]
TOKEN = "fault-token"
DIM = 16
MLFLOW_PHASES = ("fit", "gate_registration", "push", "promote")


def scenario_result(scenario: str, started: float, survived: bool, **figures: Any) -> dict[str, Any]:
    return {"scenario": scenario, "survived": bool(survived), "seconds": round(time.monotonic() - started, 2),
            **figures}


@contextmanager
def scratch_folder(workdir: str | Path | None) -> Iterator[Path]:
    if workdir is not None:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="leap-fault-") as folder:
        yield Path(folder)


# ---------------------------------------------------------------------------- (a) ingest killed

_INGEST_CHILD = """
import sys
from store.ingest import ingest_folder
from store.duckdb import LogStore

def progress(stage):
    if stage == "ledger":
        print("segment", flush=True)

ingest_folder(LogStore(sys.argv[1]), sys.argv[2], _after_stage=progress)
print("done", flush=True)
"""


def synthetic_feedback(scratch: Path, names: list[str], rows_per_segment: int, dim: int, seed: int,
                        abort_fraction: float = 0.0) -> Path:
    """`scratch/feedback` holding one synthetic segment under each of `names`, their rows numbered on."""
    folder = scratch / "feedback"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(dim)
    for index, name in enumerate(names):
        write_synthetic_segment(folder / name, index * rows_per_segment, rows_per_segment, weights, rng,
                                abort_fraction=abort_fraction)
    return folder


def segment_ids(folder: Path) -> list[str]:
    ids: list[str] = []
    for path in sorted(folder.glob("*.parquet")):
        ids += pq.read_table(path, columns=["request_id"]).column("request_id").to_pylist()
    return ids


def ledger_reconciles(store: LogStore) -> bool:
    counts = store.counts()
    return (counts["rows_read"] == counts["rows_accepted"] + counts["rows_quarantined"] + counts["rows_duplicate"]
            and counts["requests"] == counts["features"] == counts["rows_accepted"])


def ingest_kill9(workdir: str | Path | None = None, *, segments: int = 24, rows_per_segment: int = 1500,
                 dim: int = 32, kill_after_segments: int | None = None, seed: int = 0,
                 timeout_s: float = 60.0) -> dict[str, Any]:
    """Kill an ingest run with SIGKILL after `kill_after_segments` committed segments (default: half,
    so the kill lands inside the next one's transaction), rerun it, and compare the store's request
    ids with the segments' ids."""
    started = time.monotonic()
    kill_after = segments // 2 if kill_after_segments is None else kill_after_segments
    with scratch_folder(workdir) as scratch:
        folder = synthetic_feedback(scratch, [f"segment-{index:05d}.parquet" for index in range(segments)],
                                     rows_per_segment, dim, seed, abort_fraction=0.05)
        expected = segment_ids(folder)
        store = LogStore(scratch / "store.duckdb")
        store.counts()  # the schema, outside the child's run

        child = subprocess.Popen([sys.executable, "-c", _INGEST_CHILD, str(store.path), str(folder)],
                                 cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True)
        committed, finished = 0, False
        try:
            deadline = time.monotonic() + timeout_s / 2
            for line in child.stdout:
                if line.strip() == "done":
                    finished = True
                    break
                committed += 1
                if committed >= kill_after or time.monotonic() > deadline:
                    break
        finally:
            kill_session(child)
        killed = child.returncode == -signal.SIGKILL
        before_rerun = store.counts()

        reports = ingest_folder(store, folder)
        summary = totals(reports)
        with store.connect(read_only=True) as con:
            [(stored, distinct)] = con.execute("SELECT count(*), count(DISTINCT request_id) FROM requests").fetchall()
            stored_ids = {row[0] for row in con.execute("SELECT request_id FROM requests").fetchall()}
        expected_ids = set(expected)
        lost = len(expected_ids - stored_ids)
        phantom = len(stored_ids - expected_ids)
        duplicated = int(stored - distinct) + (len(expected) - len(expected_ids))
        problem = lost + phantom + duplicated
        reconciles = ledger_reconciles(store)
        survived = (killed and not finished and problem == 0 and reconciles
                    and summary["skipped"] == before_rerun["segments"]
                    and time.monotonic() - started < timeout_s)
        return scenario_result("ingest_kill9", started, survived, ingest_rows_lost_or_duplicated=problem, rows_lost=lost,
                       rows_duplicated=duplicated, rows_unknown=phantom, rows_expected=len(expected),
                       segments=segments, segments_committed_before_kill=before_rerun["segments"],
                       rows_committed_before_kill=before_rerun["requests"], killed_by_sigkill=killed,
                       rerun_skipped=summary["skipped"], rerun_accepted=summary["accepted"],
                       ledger_reconciles=reconciles)


# ---------------------------------------------------------------------------- (c) corrupt segments


def corrupt_segments(workdir: str | Path | None = None, *, good_segments: int = 4, rows_per_segment: int = 500,
                     dim: int = DIM, seed: int = 0) -> dict[str, Any]:
    """Good segments with bad ones between them; every bad one quarantined with its reason, every good
    row ingested once, and a rerun that changes nothing."""
    from leap_io.feedback_schema import segment_metadata

    started = time.monotonic()
    with scratch_folder(workdir) as scratch:
        folder = synthetic_feedback(scratch, [f"seg-{2 * index:03d}-good.parquet" for index in range(good_segments)],
                                     rows_per_segment, dim, seed)
        good_ids = set(segment_ids(folder))

        template = folder / "seg-000-good.parquet"
        data = template.read_bytes()
        expected: dict[str, str] = {}

        def bad(name: str, reason: str) -> Path:
            expected[name] = reason
            return folder / name

        bad("seg-001-truncated.parquet", "unreadable_segment").write_bytes(data[: len(data) // 2])
        bad("seg-003-not-parquet.parquet", "unreadable_segment").write_bytes(b"PAR1 this is not a segment")
        pq.write_table(pa.table({"foo": [1, 2, 3]}), bad("seg-005-wrong-schema.parquet", "missing_column:request_id"))
        # Arrow reads it; DuckDB refuses its non-UTF-8 bytes while the segment is written
        table = pq.read_table(template)
        domains = pa.array([b"\xff\xfe"] + [b"chat"] * (table.num_rows - 1), pa.binary())
        table = table.set_column(table.schema.get_field_index("domain"), "domain",
                                 pa.Array.from_buffers(pa.string(), table.num_rows, domains.buffers()))
        table = table.set_column(0, "request_id", pa.array([f"utf8-{i}" for i in range(table.num_rows)]))
        pq.write_table(table, bad("seg-007-not-utf8.parquet", "segment_error"))
        # the metadata's layer does not fit int32, and the rows have none of their own
        overflow = pq.read_table(template).slice(0, 3)
        overflow = overflow.set_column(0, "request_id", pa.array([f"layer-{i}" for i in range(3)]))
        overflow = overflow.set_column(overflow.schema.get_field_index("layer"), "layer", pa.nulls(3, pa.int32()))
        overflow = overflow.replace_schema_metadata(segment_metadata(dim, 3_000_000_000, BENCH_MODEL_ID,
                                                                     BENCH_FINGERPRINT))
        pq.write_table(overflow, bad("seg-009-layer-overflow.parquet", "bad_metadata:layer"))

        store = LogStore(scratch / "store.duckdb")
        reports = ingest_folder(store, folder)
        again = ingest_folder(store, folder)
        with store.connect(read_only=True) as con:
            stored = {row[0] for row in con.execute("SELECT request_id FROM requests").fetchall()}
            quarantined = con.execute("SELECT segment, reason FROM quarantine").fetchall()
        reasons_by_segment: dict[str, set[str]] = {}
        for segment, reason in quarantined:
            reasons_by_segment.setdefault(Path(segment).name, set()).add(reason)
        misjudged = {name: sorted(reasons_by_segment.get(name, set())) for name, reason in expected.items()
                     if reason not in reasons_by_segment.get(name, set())}
        summary = totals(reports)
        survived = (stored == good_ids and not misjudged and all(r.skipped for r in again)
                    and ledger_reconciles(store))
        return scenario_result("corrupt_segments", started, survived, segments=len(reports),
                       bad_segments=len(expected), good_rows=len(good_ids), rows_ingested=len(stored),
                       good_rows_lost=len(good_ids - stored), misjudged=misjudged,
                       quarantine_reasons=store.quarantine_reasons(), failed=summary["failed"],
                       unreadable=summary["unreadable"], rerun_all_skipped=all(r.skipped for r in again))


# ---------------------------------------------------------------------------- (b) MLflow down


class ReplicaTarget:
    """A serving replica's admin target without the engine: a push is validated exactly as a replica
    validates it (`serving.readout.push.validate_push`), then swapped in. `on_push(version)` runs after a push
    is taken, before the answer goes out: a scenario kills MLflow there."""

    def __init__(self, dim: int = DIM, layer: int = BENCH_LAYER, fingerprint: str = BENCH_FINGERPRINT) -> None:
        from prometheus_client import CollectorRegistry

        self.dim, self.layer, self.fingerprint = dim, layer, fingerprint
        self.readout = None
        self.metrics_registry = CollectorRegistry()
        self.on_push: Callable[[str], None] | None = None
        self.history: list[str] = []

    @property
    def version(self) -> str:
        return "" if self.readout is None else str(self.readout.metadata.get("version", ""))

    def describe(self) -> dict:
        return {"version": self.version, "layer": self.layer, "dim": self.dim,
                "model_fingerprint": self.fingerprint}

    def push_readout(self, body: bytes) -> dict:
        from serving.readout.push import validate_push

        expect = {"layer": self.layer, "dim": self.dim, "model_fingerprint": self.fingerprint}
        readout, _ = validate_push(body, expect, self.readout)
        previous = self.version
        self.readout = readout
        self.history.append(self.version)
        if self.on_push is not None:
            self.on_push(self.version)
        return {"version": self.version, "previous": previous}

    def flush_feedback(self) -> dict:
        return {"flushed": 0}


@contextmanager
def replicas(count: int, dim: int = DIM) -> Iterator[tuple[list[ReplicaTarget], list[str]]]:
    """`count` replica admin servers on 127.0.0.1; yields their targets and URLs."""
    from serving.admin.api import AdminServer

    targets = [ReplicaTarget(dim) for _ in range(count)]
    servers = [AdminServer(target, "127.0.0.1", 0, TOKEN) for target in targets]
    try:
        yield targets, [f"http://127.0.0.1:{server.port}" for server in servers]
    finally:
        for server in servers:
            server.close()


def fitted_readout(version: str, seed: int, dim: int = DIM):
    """A small readout of the bench feature space, with its RLS anchor, under `version`."""
    from leap_core.rls import fit_readout_with_anchor

    rng = np.random.default_rng(seed)
    features = rng.normal(size=(200, dim)).astype(np.float32)
    lengths = np.clip(np.exp(4 + 0.5 * features[:, 0]), 1, 512).round()
    metadata = dict(model_id=BENCH_MODEL_ID, model_fingerprint=BENCH_FINGERPRINT, layer=BENCH_LAYER, version=version)
    return fit_readout_with_anchor(features, lengths, alpha=1.0, max_tokens=512, metadata=metadata)


@contextmanager
def pipeline_environment(**values: Any) -> Iterator[PipelineSettings]:
    """Pipeline settings made of `values` and the defaults alone, as the LEAP_* variables the flows read
    for the block (every LEAP_* variable of this process is hidden meanwhile, and back afterwards)."""
    saved = dict(os.environ)
    try:
        for key in [key for key in os.environ if key.startswith("LEAP_")]:
            del os.environ[key]
        settings = PipelineSettings(**values)
        for field, value in settings.model_dump(mode="json", exclude_none=True).items():
            os.environ[f"LEAP_{field.upper()}"] = json.dumps(value) if isinstance(value, list) else str(value)
        yield settings
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def record_passing_gate(store: Store, name: str, challenger: str, champion: str | None) -> None:
    """A passing gate of `challenger` against `champion` in the log store, where the push flow looks for
    one before it promotes: the gate flow's replay needs the serving engine, which these scenarios run
    without."""
    verdict = {"passed": True, "reason": "passed: recorded by the fault scenario", "bar": "champion"}
    store.record_gate(f"fault-{challenger}-{champion}", datetime.now(UTC).replace(tzinfo=None), name, challenger,
                      champion, True, json.dumps(verdict), json.dumps({}), None)


def _gates_recorded(store: Store) -> int:
    with store.connect(read_only=True) as con:
        return con.execute("SELECT count(*) FROM gates").fetchall()[0][0]


def _stored_aliases(db_path: Path, name: str) -> dict[str, str]:
    """The aliases as stored in the MLflow server's database, read without MLflow (the server may be down)."""
    with sqlite3.connect(db_path) as con:
        rows = con.execute("SELECT alias, version FROM registered_model_aliases WHERE name = ?", [name]).fetchall()
    return {alias: str(version) for alias, version in rows}


def _stored_versions(db_path: Path, name: str) -> int:
    with sqlite3.connect(db_path) as con:
        return con.execute("SELECT count(*) FROM model_versions WHERE name = ?", [name]).fetchone()[0]


def _champion_and_challenger(settings: PipelineSettings) -> tuple[str, str, str]:
    """(registered model, champion v1, challenger v2): v1 promoted by the push flow onto every replica,
    v2 registered as challenger with a passing gate against v1; feedback of their feature space in the
    log store, for the fit flow to fit on."""
    from flows.pipeline import push_flow
    from registry.client import ReadoutRegistry

    write_synthetic_feedback(settings.feedback_dir, 300, DIM, segment_rows=300, max_tokens=512)
    store = open_store(settings)
    ingest_folder(store, settings.feedback_dir)
    registry = ReadoutRegistry(settings.mlflow_tracking_uri, lock_path=settings.alias_lock_location)
    logged = []
    for seed, version in enumerate(("20250101T000000-v1", "20250102T000000-v2"), start=1):
        readout, rls = fitted_readout(version, seed)
        logged.append(registry.log_readout(readout, rls=rls, params={"data_hash": "fault"},
                                           metrics={"spearman": 0.5}))
    name, first, second = logged[0].name, logged[0].version, logged[1].version
    record_passing_gate(store, name, first, None)
    promoted = push_flow(version=first, name=name, promote=True)
    if promoted.get("status") != "promoted":
        raise RuntimeError(f"the push flow did not promote the first champion: {promoted}")
    registry.set_challenger(name, second)
    record_passing_gate(store, name, second, first)
    return name, first, second


def _run_step(phase: str, name: str, challenger: str, server: MlflowServer, first_replica: ReplicaTarget) -> None:
    """The pipeline step of `phase`, run by its flow, with MLflow killed from outside the flow."""
    from flows.pipeline import fit_flow, gate_flow, push_flow

    if phase == "promote":
        def kill_mlflow(version: str) -> None:
            first_replica.on_push = None
            server.kill()

        first_replica.on_push = kill_mlflow
        push_flow(name=name, promote=True)
        return
    server.kill()
    if phase == "fit":
        fit_flow()
    elif phase == "gate_registration":
        gate_flow(version=challenger, name=name, force=True)
    else:
        push_flow(name=name)


def mlflow_down(phase: str, workdir: str | Path | None = None, *, n_replicas: int = 2,
                timeout_s: float = 120.0) -> dict[str, Any]:
    """Kill MLflow (SIGKILL) during one step of the pipeline, run by its flow, and check that the step
    fails loudly with nothing half done.

    phase "fit": the server is gone when the fit flow registers its readout; "gate_registration": when
    the gate flow looks up the champion to replay against and record its verdict with; "push": when the
    push flow pushes the champion; "promote": the moment the first replica takes the challenger during
    the push flow's promotion, i.e. after every bundle was fetched and before any alias moves.
    Before the step the registry holds champion v1 (served by every replica) and challenger v2. The
    flows run in this process; the first one in a process without a Prefect server starts Prefect's
    temporary server, which `timeout_s` leaves room for.
    """
    if phase not in MLFLOW_PHASES:
        raise ValueError(f"phase must be one of {MLFLOW_PHASES}, got {phase!r}")
    started = time.monotonic()
    with scratch_folder(workdir) as scratch, ExitStack() as stack:
        server = stack.enter_context(MlflowServer(scratch / "mlflow"))
        targets, urls = stack.enter_context(replicas(n_replicas))
        settings = stack.enter_context(pipeline_environment(
            home=scratch, mlflow_tracking_uri=server.url, endpoints=urls, admin_token=TOKEN, push_retries=1,
            push_timeout_s=10.0, mlflow_retries=2, mlflow_backoff_s=0.2))
        name, first, second = _champion_and_challenger(settings)
        store = open_store(settings)
        aliases_before = _stored_aliases(server.db_path, name)
        versions_before = _stored_versions(server.db_path, name)
        gates_before = _gates_recorded(store)
        serving_before = [target.version for target in targets]
        setup_s = time.monotonic() - started

        error: BaseException | None = None
        try:
            _run_step(phase, name, second, server, targets[0])
        except Exception as failure:
            error = failure
        restored = getattr(error, "restored", None)  # a failed promotion says whether it put everything back
        failed_loudly = error is not None and "mlflow" in f"{type(error).__name__} {error}".lower()
        aliases_after = _stored_aliases(server.db_path, name)
        serving_after = [target.version for target in targets]
        journal = settings.promotion_journal_dir
        journal_left = journal.exists() and any(journal.glob("*.json"))
        nothing_half_done = (aliases_after == aliases_before and serving_after == serving_before
                             and _stored_versions(server.db_path, name) == versions_before
                             and _gates_recorded(store) == gates_before and not journal_left
                             and aliases_after.get(CHAMPION) == first)
        survived = failed_loudly and nothing_half_done and time.monotonic() - started < timeout_s
        return scenario_result(f"mlflow_down_{phase}", started, survived, phase=phase, failed_loudly=failed_loudly,
                       error=None if error is None else f"{type(error).__name__}: {str(error)[:400]}",
                       restored=restored, aliases_before=aliases_before, aliases_after=aliases_after,
                       serving_before=serving_before, serving_after=serving_after,
                       pushes_seen=[target.history for target in targets], journal_left=journal_left,
                       setup_s=round(setup_s, 2))


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "ingest_kill9": ingest_kill9,
    "corrupt_segments": corrupt_segments,
    **{f"mlflow_down_{phase}": (lambda phase=phase, **kwargs: mlflow_down(phase, **kwargs))
       for phase in MLFLOW_PHASES},
}
"""Every scenario by name; each takes an optional `workdir` and returns its result dict."""


def run_all(workdir: str | Path | None = None) -> list[dict[str, Any]]:
    """Every scenario, one after another (each in its own sub-folder of `workdir` when given)."""
    results = []
    for name, scenario in SCENARIOS.items():
        results.append(scenario(workdir=None if workdir is None else Path(workdir) / name))
    return results
