"""Fault scenarios of the pipeline, each a function a benchmark can call, each against real parts.

Every scenario returns {"scenario": name, "survived": bool, "seconds": ..., ...figures} and runs in a
scratch folder on loopback only, bounded in time (a scenario past `timeout_s` is reported as not
survived, never left hanging):

- `ingest_kill9`: an ingest process over many segments is killed with SIGKILL part-way; a rerun must
  leave exactly the segments' request ids in the store (`ingest_rows_lost_or_duplicated == 0`) with
  the ledger reconciling row for row.
- `mlflow_down(phase)`: a real `mlflow server` (sqlite backend, served artifacts) is stopped with
  SIGKILL at a chosen moment of the fit, the gate's registration, the champion push or a promotion;
  the step must fail loudly (an exception naming MLflow), and nothing may be half done: the aliases
  (read from the server's sqlite file) and every replica's readout are as they were before.
- `corrupt_segments`: truncated, non-Parquet, wrong-schema and Arrow-readable-but-unstorable
  segments among good ones; every bad one is quarantined with its reason, every good row ingested,
  and a rerun changes nothing.

Serving replicas are real admin HTTP servers (`serving.admin.AdminServer`) whose target validates a
push exactly as a replica does (`serving.push.validate_push`), without the engine.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from experiments.bench.ingest import (
    BENCH_FINGERPRINT,
    BENCH_LAYER,
    BENCH_MODEL_ID,
    write_synthetic_segment,
)
from store.ingest import ingest_folder, totals
from store.duckdb import LogStore

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fault-token"
DIM = 16
MLFLOW_PHASES = ("fit", "gate_registration", "push", "promote")


def _result(scenario: str, started: float, survived: bool, **figures: Any) -> dict[str, Any]:
    return {"scenario": scenario, "survived": bool(survived), "seconds": round(time.monotonic() - started, 2),
            **figures}


@contextmanager
def _scratch(workdir: str | Path | None) -> Iterator[Path]:
    if workdir is not None:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="leap-fault-") as folder:
        yield Path(folder)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process this module started (and its children: it leads its own session)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


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


def _segment_ids(folder: Path) -> list[str]:
    ids: list[str] = []
    for path in sorted(folder.glob("*.parquet")):
        ids += pq.read_table(path, columns=["request_id"]).column("request_id").to_pylist()
    return ids


def _ledger_reconciles(store: LogStore) -> bool:
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
    with _scratch(workdir) as scratch:
        folder = scratch / "feedback"
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        weights = rng.standard_normal(dim)
        for index in range(segments):
            write_synthetic_segment(folder / f"segment-{index:05d}.parquet", index * rows_per_segment,
                                    rows_per_segment, weights, rng, abort_fraction=0.05)
        expected = _segment_ids(folder)
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
            _kill_group(child)
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
        reconciles = _ledger_reconciles(store)
        survived = (killed and not finished and problem == 0 and reconciles
                    and summary["skipped"] == before_rerun["segments"]
                    and time.monotonic() - started < timeout_s)
        return _result("ingest_kill9", started, survived, ingest_rows_lost_or_duplicated=problem, rows_lost=lost,
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
    with _scratch(workdir) as scratch:
        folder = scratch / "feedback"
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        weights = rng.standard_normal(dim)
        for index in range(good_segments):
            write_synthetic_segment(folder / f"seg-{2 * index:03d}-good.parquet", index * rows_per_segment,
                                    rows_per_segment, weights, rng)
        good_ids = set(_segment_ids(folder))

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
                    and _ledger_reconciles(store))
        return _result("corrupt_segments", started, survived, segments=len(reports),
                       bad_segments=len(expected), good_rows=len(good_ids), rows_ingested=len(stored),
                       good_rows_lost=len(good_ids - stored), misjudged=misjudged,
                       quarantine_reasons=store.quarantine_reasons(), failed=summary["failed"],
                       unreadable=summary["unreadable"], rerun_all_skipped=all(r.skipped for r in again))


# ---------------------------------------------------------------------------- (b) MLflow down


class ReplicaTarget:
    """A serving replica's admin target without the engine: a push is validated exactly as a replica
    validates it (`serving.push.validate_push`), then swapped in. `on_push(version)` runs after a push
    is taken, before the answer goes out: a scenario stops MLflow there."""

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
        from serving.push import validate_push

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
    from serving.admin import AdminServer

    targets = [ReplicaTarget(dim) for _ in range(count)]
    servers = [AdminServer(target, "127.0.0.1", 0, TOKEN) for target in targets]
    try:
        yield targets, [f"http://127.0.0.1:{server.port}" for server in servers]
    finally:
        for server in servers:
            server.close()


class MlflowServer:
    """A real `mlflow server` subprocess on a free loopback port, with a sqlite backend in `folder`."""

    def __init__(self, folder: str | Path, start_timeout_s: float = 45.0, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.db_path = self.folder / "mlflow.db"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None

    def start(self) -> Self:
        import httpx

        from registry.client import ensure_db

        self.folder.mkdir(parents=True, exist_ok=True)
        ensure_db(f"sqlite:///{self.db_path}")
        program = Path(sys.executable).with_name("mlflow")
        command = [str(program) if program.exists() else "mlflow", "server",
                   "--backend-store-uri", f"sqlite:///{self.db_path}",
                   "--artifacts-destination", str(self.folder / "artifacts"),
                   "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        log = open(self.folder / "server.log", "ab")  # noqa: SIM115 - the child writes to it while it runs
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        cwd=self.folder)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}; see {self.folder}/server.log")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer within {self.start_timeout_s:.0f}s")

    def stop(self) -> None:
        """SIGKILL: the server goes away as it would when its host dies."""
        if self.process is not None:
            _kill_group(self.process)

    def aliases(self, name: str) -> dict[str, str]:
        """The aliases as stored in the server's database, read without MLflow (the server may be down)."""
        with sqlite3.connect(self.db_path) as con:
            rows = con.execute("SELECT alias, version FROM registered_model_aliases WHERE name = ?", [name]).fetchall()
        return {alias: str(version) for alias, version in rows}

    def versions(self, name: str) -> int:
        with sqlite3.connect(self.db_path) as con:
            return con.execute("SELECT count(*) FROM model_versions WHERE name = ?", [name]).fetchone()[0]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fitted_readout(version: str, seed: int, dim: int = DIM):
    """A small readout of the bench feature space, with its RLS anchor, under `version`."""
    from leap_core.rls import fit_readout_with_anchor

    rng = np.random.default_rng(seed)
    features = rng.normal(size=(200, dim)).astype(np.float32)
    lengths = np.clip(np.exp(4 + 0.5 * features[:, 0]), 1, 512).round()
    metadata = dict(model_id=BENCH_MODEL_ID, model_fingerprint=BENCH_FINGERPRINT, layer=BENCH_LAYER, version=version)
    return fit_readout_with_anchor(features, lengths, alpha=1.0, max_tokens=512, metadata=metadata)


def training_frame(n: int = 300, dim: int = DIM, seed: int = 3):
    """A learnable training frame of the bench feature space, all rows `stop`."""
    from store.duckdb import TrainingFrame

    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, dim)).astype(np.float32)
    lengths = np.clip(np.exp(4 + 0.5 * features[:, 0]), 1, 512).round().astype(np.int64)
    return TrainingFrame(np.asarray([f"r-{i:05d}" for i in range(n)], dtype=object), features, lengths,
                         np.asarray(["stop"] * n, dtype=object), np.asarray(["chat"] * n, dtype=object),
                         1_750_000_000.0 + np.arange(n, dtype=np.float64), np.full(n, 512, dtype=np.int64))


def mlflow_down(phase: str, workdir: str | Path | None = None, *, n_replicas: int = 2,
                timeout_s: float = 60.0) -> dict[str, Any]:
    """Stop MLflow (SIGKILL) during one pipeline step and check it fails loudly with nothing half done.

    phase "fit": the server is gone when the fit registers its readout; "gate_registration": when the
    gate's verdict is recorded; "push": when the champion is pushed; "promote": the moment the first
    replica takes the challenger, i.e. after every bundle was fetched and before any alias moves.
    Before the step the registry holds champion v1 (served by every replica) and challenger v2.
    """
    from flows.promotion import PromotionFailed, PushOptions, promote
    from flows.tasks import FeatureSpace, fit_and_register, push_champion, record_gate
    from registry.client import CHAMPION, ReadoutRegistry

    if phase not in MLFLOW_PHASES:
        raise ValueError(f"phase must be one of {MLFLOW_PHASES}, got {phase!r}")
    started = time.monotonic()
    with _scratch(workdir) as scratch, ExitStack() as stack:
        server = stack.enter_context(MlflowServer(scratch / "mlflow"))
        targets, urls = stack.enter_context(replicas(n_replicas))
        lock_path = scratch / "aliases.lock"
        registry = ReadoutRegistry(server.url, lock_path=lock_path, retries=2, backoff_s=0.2)
        params = {"data_hash": "fault"}
        logged = []
        for seed, version in enumerate(("20250101T000000-v1", "20250102T000000-v2"), start=1):
            readout, rls = fitted_readout(version, seed)
            logged.append(registry.log_readout(readout, rls=rls, params=params, metrics={"spearman": 0.5}))
        first, second = logged
        name = first.name
        options = PushOptions(TOKEN, retries=1, timeout=10.0, backoff_s=0.1)
        promote(registry, name, first.version, urls, options, scratch / "promotions")
        registry.set_challenger(name, second.version)
        aliases_before = server.aliases(name)
        versions_before = server.versions(name)
        serving_before = [target.version for target in targets]
        setup_s = time.monotonic() - started

        error: BaseException | None = None
        restored = None
        try:
            if phase == "promote":
                def stop_mlflow(version: str) -> None:
                    targets[0].on_push = None
                    server.stop()

                targets[0].on_push = stop_mlflow
                promote(registry, name, second.version, urls, options, scratch / "promotions")
            else:
                server.stop()
                if phase == "fit":
                    space = FeatureSpace(BENCH_MODEL_ID, BENCH_FINGERPRINT, BENCH_LAYER)
                    fit_and_register.fn(training_frame(), server.url, space, alpha=1.0, max_tokens=512,
                                        lock_path=str(lock_path))
                elif phase == "gate_registration":
                    record_gate.fn(str(scratch / "store.duckdb"), server.url, name, second.version,
                                   first.version, {"challenger": {"mean_ptl": 0.9}}, {"passed": True, "reason": "x"})
                else:
                    push_champion.fn(server.url, name, urls, TOKEN, retries=1, timeout=10.0,
                                     lock_path=str(lock_path))
        except PromotionFailed as failure:
            error, restored = failure, failure.restored
        except Exception as failure:  # noqa: BLE001  (any loud failure counts; which one is reported)
            error = failure
        failed_loudly = error is not None and "mlflow" in f"{type(error).__name__} {error}".lower()
        aliases_after = server.aliases(name)
        serving_after = [target.version for target in targets]
        gates_recorded = 0
        if (scratch / "store.duckdb").exists():
            with LogStore(scratch / "store.duckdb").connect(read_only=True) as con:
                gates_recorded = con.execute("SELECT count(*) FROM gates").fetchall()[0][0]
        journal_left = any((scratch / "promotions").glob("*.json")) if (scratch / "promotions").exists() else False
        nothing_half_done = (aliases_after == aliases_before and serving_after == serving_before
                             and server.versions(name) == versions_before and gates_recorded == 0
                             and not journal_left and aliases_after.get(CHAMPION) == first.version)
        survived = failed_loudly and nothing_half_done and time.monotonic() - started < timeout_s
        return _result(f"mlflow_down_{phase}", started, survived, phase=phase, failed_loudly=failed_loudly,
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
