"""Fault scenarios where a shared part of the fleet goes away: its S3 store or its PostgreSQL server.

- `s3_down_while_shipping`: a replica's feedback writer and shipper write through a TCP proxy to a real
  S3 endpoint (moto). The proxy drops every connection for a while, as a network outage would, while rows
  keep coming. The segments wait on the replica's disk, counted as pending, and are shipped once S3
  answers. Every row written is then ingested from the bucket exactly once (`feedback_rows_lost` 0).
- `postgres_restart_mid_ingest`: the PostgreSQL server of the log store is restarted while an ingest
  run writes to it (every session ended at once, as a fast restart does, then the server stopped). The run fails loudly. A rerun leaves exactly the segments' request ids in the store,
  with the ledger reconciling row for row (`ingest_rows_lost_or_duplicated` 0).
- `mlflow_artifacts_full`: MLflow's artifact store (a tmpfs) is full when a readout is registered. The
  registration fails loudly, no version is made and the champion alias stays; once there is room, the
  same registration goes through.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from experiments.faults.pipeline import (
    ledger_reconciles,
    scenario_result,
    scratch_folder,
    segment_ids,
    synthetic_feedback,
)
from ops.servers import create_database, free_port, s3_environment
from store.duckdb import LogStore
from store.ingest import ingest_folder, totals
from study_harness.servers import running_postgres, running_s3

DIM, LAYER = 8, 3


class _Proxy(socketserver.ThreadingTCPServer):
    """A TCP proxy to `target` that can be cut (every connection dropped, new ones refused) and restored."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = threading.Event()
        self.up.set()
        self.dropped = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Pipe)
        threading.Thread(target=self.serve_forever, name="leap-fault-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def cut(self) -> None:
        self.up.clear()
        with self._lock:
            for conn in list(self._open):
                with _quiet():
                    conn.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.up.set()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


class _Pipe(socketserver.BaseRequestHandler):
    server: _Proxy

    def handle(self) -> None:
        if not self.server.up.is_set():
            self.server.dropped += 1
            return  # closed at once: the client sees its connection reset or closed
        with socket.create_connection(self.server.target, timeout=30) as upstream:
            with self.server._lock:
                self.server._open.update((self.request, upstream))
            try:
                pump = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
                pump.start()
                _copy(self.request, upstream)
                pump.join(30)
            finally:
                with self.server._lock:
                    self.server._open.difference_update((self.request, upstream))


def _copy(source: socket.socket, sink: socket.socket) -> None:
    with _quiet():
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with _quiet():
        sink.shutdown(socket.SHUT_WR)


def _row(i: int) -> dict:
    return {
        "request_id": f"ship-{i:06d}", "model_id": "m", "model_fingerprint": "fp", "layer": LAYER, "policy": "leap",
        "arrival_time": 1_750_000_000.0 + i, "first_token_time": 1_750_000_000.5 + i,
        "finish_time": 1_750_000_001.0 + i, "prompt_tokens": 10, "output_tokens": 5 + i % 50,
        "finish_reason": "stop", "max_tokens": 512, "decoding": "{}", "domain": "chat", "tenant": None,
        "predicted_at_admission": 12.0, "predicted_latest": 13.0, "readout_version": "v1",
        "feature": np.random.default_rng(i).standard_normal(DIM).astype(np.float32),
    }


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block (the credentials a replica and a worker get), then as before."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def s3_down_while_shipping(workdir: str | Path | None = None, *, rows: int = 300, outage_s: float = 3.0,
                           timeout_s: float = 90.0) -> dict[str, Any]:
    """Ship through an outage of S3; every row written is ingested from the bucket once."""
    from serving.feedback.shipper import FeedbackShipper
    from serving.feedback.writer import FeedbackWriter

    started = time.monotonic()
    with scratch_folder(workdir) as scratch, running_s3() as endpoint, _environment(s3_environment(endpoint)):
        host, port = endpoint.removeprefix("http://").split(":")
        proxy = _Proxy((host, int(port)))
        folder, url = scratch / "spool", "s3://leap-outage/fleet"
        writer = FeedbackWriter(folder, DIM, LAYER, "m", "fp", replica_id="r0", max_rows=25, flush_rows=5)
        shipper = FeedbackShipper(folder, "r0", url, endpoint_url=proxy.url, interval_s=0.05, backoff_s=0.05,
                                  max_backoff_s=0.3).start()
        try:
            third = rows // 3
            for i in range(third):
                writer.write(_row(i))
            writer.flush()
            shipped_before = _until(lambda: shipper.stats()["pending_segments"] == 0, 20)
            proxy.cut()
            for i in range(third, 2 * third):  # rows keep coming while S3 cannot be reached
                writer.write(_row(i))
            writer.flush()
            failing = _until(lambda: shipper.stats()["failing"], outage_s + 10)
            time.sleep(outage_s)
            pending_in_outage = shipper.stats()["pending_segments"]
            proxy.restore()
            for i in range(2 * third, rows):
                writer.write(_row(i))
            writer.close()
            shipped = shipper.close(deadline_s=30.0)
        finally:
            proxy.shutdown()
            proxy.server_close()
        store = LogStore(scratch / "log.duckdb")
        summary = totals(ingest_folder(store, url, endpoint_url=endpoint))
        with store.connect(read_only=True) as con:
            stored = {row[0] for row in con.execute("SELECT request_id FROM requests").fetchall()}
        written = {f"ship-{i:06d}" for i in range(rows)}
        lost = len(written - stored)
        survived = (shipped_before and failing and pending_in_outage > 0 and shipped and lost == 0
                    and summary["duplicates"] == 0 and len(stored) == rows
                    and time.monotonic() - started < timeout_s)
        return scenario_result("s3_down_while_shipping", started, survived, feedback_rows_lost=lost, rows_written=rows,
                       rows_ingested=len(stored), pending_segments_in_outage=pending_in_outage,
                       connections_dropped=proxy.dropped, shipper_failing_in_outage=failing, shipped_after=shipped,
                       duplicates=summary["duplicates"])


def postgres_restart_mid_ingest(workdir: str | Path | None = None, *, segments: int = 24,
                                rows_per_segment: int = 1500, dim: int = 32, seed: int = 3,
                                timeout_s: float = 120.0) -> dict[str, Any]:
    """Restart PostgreSQL under an ingest run; the rerun stores every row exactly once."""
    import psycopg

    from store.postgres import PostgresStore

    started = time.monotonic()
    with scratch_folder(workdir) as scratch:
        folder = synthetic_feedback(scratch, [f"segment-{index:05d}.parquet" for index in range(segments)],
                                     rows_per_segment, dim, seed, abort_fraction=0.05)
        expected = segment_ids(folder)
        data, port = scratch / "pg" / "data", free_port()
        outcome: dict[str, Any] = {}
        with running_postgres(data, port):
            url = create_database(port, "leap_faults")
            PostgresStore(url).counts()  # the schema, before the clock

            def ingest() -> None:
                try:
                    outcome["reports"] = ingest_folder(PostgresStore(url), folder)
                except Exception as error:
                    outcome["error"] = error

            run = threading.Thread(target=ingest, name="leap-fault-ingest", daemon=True)
            run.start()
            libpq = url.replace("postgresql+psycopg://", "postgresql://", 1)

            def committed() -> int:
                with psycopg.connect(libpq) as con:
                    return int(con.execute("SELECT count(*) FROM ingest_ledger").fetchone()[0])

            mid_run = _until(lambda: committed() >= 2 or not run.is_alive(), 60) and run.is_alive()
            with psycopg.connect(libpq, autocommit=True) as con:  # as a restart does: every session ends now
                con.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        # leaving the block stops the server; the run, if it tries again meanwhile, finds it down
        run.join(60)
        failed_loudly = "error" in outcome and "reports" not in outcome
        with running_postgres(data, port):
            store = PostgresStore(url)
            before = store.counts()
            rerun = totals(ingest_folder(store, folder))
            with psycopg.connect(libpq) as con:
                stored, distinct = con.execute("SELECT count(*), count(DISTINCT request_id) FROM requests").fetchone()
                stored_ids = {row[0] for row in con.execute("SELECT request_id FROM requests").fetchall()}
            reconciles = ledger_reconciles(store)
        expected_ids = set(expected)
        lost, phantom = len(expected_ids - stored_ids), len(stored_ids - expected_ids)
        duplicated = int(stored) - int(distinct)
        problem = lost + phantom + duplicated
        survived = (mid_run and failed_loudly and before["segments"] < segments and problem == 0 and reconciles
                    and time.monotonic() - started < timeout_s)
        error = outcome.get("error")
        return scenario_result("postgres_restart_mid_ingest", started, survived, ingest_rows_lost_or_duplicated=problem,
                       rows_lost=lost, rows_duplicated=duplicated, rows_expected=len(expected),
                       segments_committed_before_restart=before["segments"], failed_loudly=failed_loudly,
                       error=None if error is None else f"{type(error).__name__}: {str(error)[:300]}",
                       rerun_accepted=rerun["accepted"], rerun_skipped=rerun["skipped"], ledger_reconciles=reconciles)



def mlflow_artifacts_full(workdir: str | Path | None = None, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """MLflow's artifact store is full when a readout is registered: the registration fails loudly with no
    version made and the aliases as they were; once there is room, the same registration goes through."""
    from experiments.faults.crash import mount_tmpfs, unmount
    from experiments.faults.pipeline import fitted_readout
    from registry.aliases import CHAMPION
    from registry.client import ReadoutRegistry
    from study_harness.servers import MlflowServer

    started = time.monotonic()
    with scratch_folder(workdir) as scratch:
        artifacts = scratch / "mlflow" / "artifacts"
        mount_error = mount_tmpfs(artifacts, "16m")
        if mount_error is not None:
            return scenario_result("mlflow_artifacts_full", started, False, error=f"could not mount a tmpfs: {mount_error}",
                           ran=False)
        try:
            with MlflowServer(scratch / "mlflow") as server:
                registry = ReadoutRegistry(server.url, retries=1, backoff_s=0.1)
                readout, rls = fitted_readout("20250101T000000-v1", seed=1)
                first = registry.log_readout(readout, rls=rls, params={"data_hash": "fault"}, metrics={"spearman": 0.5})
                registry.set_alias(first.name, CHAMPION, first.version)
                ballast = artifacts / "ballast"
                with _quiet(), open(ballast, "wb") as handle:  # fill what is left of the disk
                    while True:
                        handle.write(b"\0" * 4096)
                        handle.flush()
                versions_before = len(registry.list_versions(first.name))
                aliases_before = registry.get_alias(first.name, CHAMPION)
                readout, rls = fitted_readout("20250102T000000-v2", seed=2)
                error: BaseException | None = None
                try:
                    registry.log_readout(readout, rls=rls, params={"data_hash": "fault"}, metrics={"spearman": 0.5})
                except Exception as failure:
                    error = failure
                versions_after = len(registry.list_versions(first.name))
                champion_after = registry.get_alias(first.name, CHAMPION)
                ballast.unlink()
                again = registry.log_readout(readout, rls=rls, params={"data_hash": "fault"}, metrics={"spearman": 0.5})
        finally:
            unmount(artifacts)
        failed_loudly = error is not None
        nothing_half_done = versions_after == versions_before and champion_after == aliases_before
        survived = (failed_loudly and nothing_half_done and again.version is not None
                    and time.monotonic() - started < timeout_s)
        return scenario_result("mlflow_artifacts_full", started, survived, failed_loudly=failed_loudly,
                       error=None if error is None else f"{type(error).__name__}: {str(error)[:300]}",
                       versions_before=versions_before, versions_after=versions_after,
                       champion_before=str(aliases_before), champion_after=str(champion_after),
                       registered_once_there_was_room=str(again.version))

SCENARIOS = {"s3_down_while_shipping": s3_down_while_shipping,
             "postgres_restart_mid_ingest": postgres_restart_mid_ingest,
             "mlflow_artifacts_full": mlflow_artifacts_full}
"""These scenarios by name; each takes an optional `workdir` and returns its result dict."""
