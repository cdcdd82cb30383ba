"""The PostgreSQL log store against a real PostgreSQL server: the DuckDB store's API and results on the
same segments, several worker processes ingesting overlapping segments at once, and the ingest flow's
fan-out over segments as mapped tasks."""

from __future__ import annotations

import multiprocessing
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("psycopg")

import psycopg

from flows.tasks import largest_max_tokens, latest_feature_space, recorded_gate, recorded_lengths
from store.duckdb import LogStore
from store.ingest import (
    STATUS_CHECKSUM_CHANGED,
    STATUS_OK,
    STATUS_UNREADABLE,
    SegmentFile,
    complete_segments,
    ingest_folder,
    ingest_segments,
    totals,
)
from store.postgres import POSTGRES_SCHEMA_VERSION, PostgresStore
from store.stores import store_at
from tests.postgres_fixtures import postgres_port, postgres_url  # noqa: F401  (fixtures)
from tests.segment_fuzz import assert_reconciles, truncate, write_segment

GATE_TIME = datetime(2026, 1, 1, 12, 0, 0)
CORRUPT = {"null_id": 2, "nan_feature": 2, "wrong_dim_feature": 2, "zero_output_tokens": 2,
           "unknown_finish_reason": 2, "null_arrival_time": 2, "duplicate_id": 3, "nul_in_id": 1, "nul_in_domain": 2}


def _feedback(folder: Path) -> list:
    """Segments that take every path of ingest: broken rows, ids shared across segments, a second
    feature space, a dim conflict, an unreadable file and a replica sub-folder."""
    (folder / "replica-b").mkdir(parents=True)
    written = [
        write_segment(folder / "seg-0.parquet", 200, 16, seed=0, corrupt=CORRUPT, id_prefix="a-"),
        write_segment(folder / "seg-1.parquet", 150, 16, seed=1, id_prefix="a-", id_offset=120,
                      start_time=1_700_003_600.0),
        write_segment(folder / "seg-2.parquet", 60, 8, seed=2, model_fingerprint="fp-other"),
        write_segment(folder / "seg-3.parquet", 40, 12, seed=3),  # conflicts with the dim 16 stored
        write_segment(folder / "seg-4.parquet", 50, 16, seed=4),
        write_segment(folder / "replica-b" / "seg-5.parquet", 80, 16, seed=5, start_time=1_700_007_200.0),
    ]
    truncate(written[4].path, 300)
    return written


def _frames_equal(left, right) -> None:
    for name in ("request_ids", "output_tokens", "finish_reason", "domain", "max_tokens"):
        assert getattr(left, name).tolist() == getattr(right, name).tolist(), name
    assert np.array_equal(left.arrival_time, right.arrival_time)
    assert left.features.dtype == right.features.dtype == np.float32
    assert np.array_equal(left.features, right.features)


def test_the_same_segments_give_the_same_store_in_duckdb_and_postgresql(tmp_path: Path, postgres_url: str) -> None:
    feedback = tmp_path / "feedback"
    _feedback(feedback)
    duck, pg = LogStore(tmp_path / "log.duckdb"), store_at(postgres_url)
    assert isinstance(pg, PostgresStore)
    duck_reports, pg_reports = ingest_folder(duck, feedback), ingest_folder(pg, feedback)

    assert [r.status for r in pg_reports] == [r.status for r in duck_reports]
    assert STATUS_UNREADABLE in {r.status for r in pg_reports}
    assert totals(pg_reports) == totals(duck_reports)
    assert totals(pg_reports)["duplicates"] > 3  # within seg-0, and seg-1's ids stored from seg-0
    assert pg.counts() == duck.counts()
    assert pg.quarantine_reasons() == duck.quarantine_reasons()
    assert pg.finish_reasons() == duck.finish_reasons()
    no_time = [{k: v for k, v in row.items() if k != "ingested_at"} for row in duck.ledger()]
    assert [{k: v for k, v in row.items() if k != "ingested_at"} for row in pg.ledger()] == no_time
    assert pg.stored_dims() == {("fp-fuzz", 20, "last@20"): 16, ("fp-other", 20, "last@20"): 8}
    assert_reconciles(pg)

    for selection in ({"model_fingerprint": "fp-fuzz", "layer": 20}, {"model_fingerprint": "fp-other"},
                      {"model_fingerprint": "fp-fuzz", "since": 1_700_001_800.0, "until": 1_700_005_400.0,
                       "domains": ["code", "math"], "recipe": "last@20"},
                      {"model_fingerprint": "nobody"}):
        _frames_equal(pg.training_frame(**selection), duck.training_frame(**selection))
    with pytest.raises(ValueError, match="mixes feature dims"):
        pg.training_frame()

    space = latest_feature_space(pg)
    assert space == latest_feature_space(duck) and space.model_fingerprint == "fp-fuzz"
    assert largest_max_tokens(pg, space) == largest_max_tokens(duck, space) == 4096
    wanted = [f"client-{i}" for i in range(40)] + ["never-served"]  # the fuzz segments' client ids
    recorded = recorded_lengths(duck, wanted, "fp-fuzz")
    assert len(recorded) > 30 and recorded_lengths(pg, wanted, "fp-fuzz") == recorded
    newest = duck.newest_since(50, model_fingerprint="fp-fuzz")
    assert newest is not None and pg.newest_since(50, model_fingerprint="fp-fuzz") == newest
    assert duck.newest_since(10**9) is None and pg.newest_since(10**9) is None
    for store in (duck, pg):
        assert recorded_gate(store, "m", "2", "1") is None
        store.record_gate("key", GATE_TIME, "m", "2", "1", True, '{"passed": true}', "{}", "run")
        store.record_gate("key", GATE_TIME, "m", "2", "1", False, '{"passed": false}', "{}", "other")
        assert recorded_gate(store, "m", "2", "1") == {"gate_key": "key", "verdict": {"passed": True},
                                                      "gate_run_id": "run"}
        assert store.gate_run("key") == (True, "run") and store.gate_run("nope") == (False, None)

    # a rerun changes nothing; new content at an ingested path is quarantined, never ingested
    before = pg.counts()
    assert all(r.skipped for r in ingest_folder(pg, feedback))
    assert pg.counts() == before
    write_segment(feedback / "seg-2.parquet", 60, 8, seed=99, model_fingerprint="fp-other")
    changed = [r for r in ingest_folder(pg, feedback) if not r.skipped]
    assert [r.status for r in changed] == [STATUS_CHECKSUM_CHANGED] == [
        r.status for r in ingest_folder(duck, feedback) if not r.skipped]
    assert pg.counts() == duck.counts() and pg.counts()["segments_changed"] == 1
    assert_reconciles(pg)


def _worker(url: str, paths: list[str], start, results) -> None:
    start.wait(30)
    reports = ingest_segments(PostgresStore(url), [SegmentFile(Path(path)) for path in paths])
    results.put([(r.segment, r.skipped, r.status, r.rows_read, r.accepted, r.quarantined, r.duplicates)
                 for r in reports])


def test_two_processes_ingesting_overlapping_segments_lose_and_duplicate_nothing(
        tmp_path: Path, postgres_url: str) -> None:
    folder = tmp_path / "feedback"
    folder.mkdir()
    # consecutive segments share 500 request ids; every segment also has broken rows
    segments = [write_segment(folder / f"seg-{k}.parquet", 1500, 32, seed=10 + k, id_prefix="p-", id_offset=1000 * k,
                              corrupt={"nan_feature": 5, "zero_output_tokens": 5}) for k in range(8)]
    paths = [str(segment.path) for segment in segments]
    PostgresStore(postgres_url).counts()  # the schema, before both workers start
    context = multiprocessing.get_context("spawn")  # fresh interpreters: a fork would inherit the exit hooks of whatever the test process loaded
    start, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_worker, args=(postgres_url, order, start, results))
               for order in (paths[:6], paths[2:][::-1])]  # six segments each, four of them in common
    for worker in workers:
        worker.start()
    outcome = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0

    ingested: dict[str, list] = {}
    for reports in outcome:
        assert any(not skipped for _, skipped, *_ in reports)
        for segment, skipped, status, *counts in reports:
            if not skipped:
                assert status == STATUS_OK
                ingested.setdefault(segment, []).append(counts)
    assert sorted(ingested) == sorted(str(Path(p).resolve()) for p in paths)
    assert all(len(counts) == 1 for counts in ingested.values())  # each segment written by one worker

    store = PostgresStore(postgres_url)
    assert_reconciles(store)
    clean = {}
    for segment in segments:
        rows = segment.table.take(segment.clean_rows)
        features = rows.column("feature").combine_chunks().flatten().to_numpy().reshape(-1, 32)
        for request_id, feature in zip(rows.column("request_id").to_pylist(), features):
            clean.setdefault(request_id, {})[str(segment.path.resolve())] = feature
    counts = store.counts()
    assert counts["requests"] == counts["features"] == len(clean)
    assert counts["rows_read"] == 8 * 1500 and counts["rows_quarantined"] == 8 * 10
    assert counts["rows_duplicate"] == sum(len(found) - 1 for found in clean.values()) > 0
    frame = store.training_frame()
    with store.connect() as con:
        stored_from = dict(con.execute("SELECT request_id, segment FROM requests").fetchall())
    assert sorted(frame.request_ids) == sorted(clean)
    for request_id, feature in zip(frame.request_ids, frame.features):
        assert np.array_equal(feature, clean[request_id][stored_from[request_id]])


@pytest.fixture(scope="module")
def prefect_server():
    pytest.importorskip("prefect")
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def test_the_ingest_flow_maps_batches_of_segments_over_workers_on_postgresql(
        tmp_path: Path, postgres_url: str, prefect_server) -> None:
    from flows.pipeline import ingest_flow
    from tests.flow_fixtures import pipeline_home

    home = tmp_path / "home"
    for replica in ("r1", "r2"):
        (home / "feedback" / replica).mkdir(parents=True)
    with pipeline_home(home, LEAP_STORE_URL=postgres_url, LEAP_INGEST_WORKERS="2"):
        written = [write_segment(home / "feedback" / replica / f"seg-{k}.parquet", 300, 16, seed=20 + k,
                                 corrupt={"nan_feature": 3})
                   for k, replica in enumerate(["r1", "r1", "r2", "r2", "r2"])]
        assert len(complete_segments(home / "feedback")) == 5
        first = ingest_flow()
        again = ingest_flow()
    assert first["status"] == "ingested" and first["workers"] == 2 and first["rows_per_s"] > 0
    assert (first["segments"], first["rows_read"], first["accepted"], first["quarantined"]) == (5, 1500, 1485, 15)
    assert first["store"]["requests"] == 1485 and first["store"]["segments"] == 5
    assert (again["skipped"], again["accepted"]) == (5, 0)
    stored = PostgresStore(postgres_url)
    assert sorted(stored.training_frame().request_ids) == sorted(
        rid for segment in written for rid in segment.table.take(segment.clean_rows).column("request_id").to_pylist())
    assert {row["segment"].split("/")[-2] for row in stored.ledger()} == {"r1", "r2"}


def test_a_version_2_store_keeps_its_rows_ids_as_the_clients_ids(tmp_path: Path, postgres_url: str) -> None:
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    write_segment(feedback / "seg-0.parquet", 30, 8, seed=0, id_prefix="old-")
    ingest_folder(store_at(postgres_url), feedback)
    url = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as con:  # the tables as version 2 left them: the key was the client's id
        con.execute("ALTER TABLE requests DROP COLUMN client_request_id")
        con.execute("ALTER TABLE requests DROP COLUMN shadow_predicted")
        con.execute("ALTER TABLE requests DROP COLUMN shadow_version")
        con.execute("ALTER TABLE requests DROP COLUMN client_arrival_time")
        con.execute("UPDATE store_meta SET value = '2' WHERE key = 'schema_version'")

    store = store_at(postgres_url)
    assert store.schema_version() == POSTGRES_SCHEMA_VERSION == 5
    assert store.shadow_rows("any")["shadow"].size == 0  # version 4's columns are there, NULL for old rows
    with psycopg.connect(url) as con:  # and version 5's
        assert con.execute("SELECT count(*) FROM requests WHERE client_arrival_time IS NULL").fetchone()[0] > 20
    with psycopg.connect(url) as con:
        rows = con.execute("SELECT request_id, client_request_id FROM requests").fetchall()
    assert len(rows) > 20 and all(key == client for key, client in rows)
    assert set(store.recorded_lengths([key for key, _ in rows])) <= {key for key, _ in rows}
    assert store.recorded_lengths([key for key, _ in rows])
