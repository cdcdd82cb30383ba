"""Ingest under bad input: one segment's failure never aborts a run, blocks later runs or loses rows.

Real Parquet segments (some broken in ways Parquet and Arrow accept but later stages refuse), a real
DuckDB file, and the real training and gate code reading what was stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pytest

from flows.tasks import recorded_lengths
from leap_io.feedback_schema import TRAINING_FINISH_REASONS
from store.duckdb import SCHEMA_VERSION, LogStore
from store.ingest import (
    REASON_CHECKSUM_CHANGED,
    REASON_SEGMENT_ERROR,
    STATUS_CHECKSUM_CHANGED,
    STATUS_FAILED,
    STATUS_OK,
    ingest_folder,
    totals,
)
from store.validation import bad_metadata_reason
from tests.segment_fuzz import assert_reconciles, write_segment
from training.fit import NotEnoughRowsError, fit_readout, select_window, time_split

ALL_REASONS = ("stop", "length", "abort", "error", "repetition")


@pytest.fixture
def store(tmp_path: Path) -> LogStore:
    return LogStore(tmp_path / "log.duckdb", busy_timeout_s=5.0)


@pytest.fixture
def feedback(tmp_path: Path) -> Path:
    folder = tmp_path / "feedback"
    folder.mkdir()
    return folder


def _stored_ids(store: LogStore) -> list[str]:
    with store.connect(read_only=True) as con:
        return sorted(row[0] for row in con.execute("SELECT request_id FROM requests").fetchall())


def _ids(segment) -> list[str]:
    return segment.table.column("request_id").to_pylist()


# ---------------------------------------------------------------------------- one bad segment


def test_layer_metadata_above_int32_quarantines_the_rows_that_need_it_and_the_run_goes_on(
    store: LogStore, feedback: Path
) -> None:
    good = write_segment(feedback / "seg-0.parquet", 30, 8, seed=0)
    write_segment(feedback / "seg-1.parquet", 30, 8, seed=1,
                  corrupt={"null_layer": 4, "metadata_layer": 3_000_000_000})
    after = write_segment(feedback / "seg-2.parquet", 30, 8, seed=2)

    first = ingest_folder(store, feedback)
    second = ingest_folder(store, feedback)

    assert [(r.status, r.accepted, r.quarantined) for r in first] == [(STATUS_OK, 30, 0), (STATUS_OK, 26, 4),
                                                                       (STATUS_OK, 30, 0)]
    assert store.quarantine_reasons() == {bad_metadata_reason("layer"): 4}
    assert all(r.skipped for r in second)
    assert set(_ids(good)) | set(_ids(after)) <= set(_stored_ids(store))
    assert_reconciles(store)


@pytest.mark.parametrize("transaction_rows", [0, 10_000])
def test_a_segment_duckdb_refuses_is_quarantined_alone_and_later_runs_skip_it(
    store: LogStore, feedback: Path, transaction_rows: int
) -> None:
    """Invalid UTF-8 in `domain`: Arrow reads it, DuckDB refuses it on insert. In a transaction group
    the segments before it are written again, once each, and those after it go on."""
    segments = [write_segment(feedback / f"seg-{i}.parquet", 25, 8, seed=i) for i in range(4)]
    write_segment(feedback / "seg-2.parquet", 25, 8, seed=2, corrupt={"invalid_utf8": {"domain": 3}})

    reports = ingest_folder(store, feedback, transaction_rows=transaction_rows)

    assert [r.status for r in reports] == [STATUS_OK, STATUS_OK, STATUS_FAILED, STATUS_OK]
    assert [r.accepted for r in reports] == [25, 25, 0, 25]
    failed = reports[2]
    assert failed.reason == REASON_SEGMENT_ERROR and "unicode" in failed.error.lower()
    summary = totals(reports)
    assert summary["failed"] == 1 and summary["accepted"] == 75
    expected = sorted(set(_ids(segments[0])) | set(_ids(segments[1])) | set(_ids(segments[3])))
    assert _stored_ids(store) == expected  # nothing lost, nothing twice
    assert store.quarantine_reasons() == {REASON_SEGMENT_ERROR: 1}
    with store.connect(read_only=True) as con:
        [(raw,)] = con.execute("SELECT raw FROM quarantine WHERE reason = ?", [REASON_SEGMENT_ERROR]).fetchall()
    detail = json.loads(raw)
    assert detail["stage"] == "write" and detail["rows"] == 25
    assert store.counts()["segments_failed"] == 1
    assert_reconciles(store)

    again = ingest_folder(store, feedback, transaction_rows=transaction_rows)
    assert all(r.skipped for r in again) and again[2].status == STATUS_FAILED
    retried = ingest_folder(store, feedback, retry_failed=True)
    assert [r.skipped for r in retried] == [True, True, False, True] and retried[2].status == STATUS_FAILED
    assert store.quarantine_reasons() == {REASON_SEGMENT_ERROR: 1}  # replaced, not added
    assert_reconciles(store)


def test_a_failing_segment_in_a_group_with_a_skipped_one_keeps_every_report_in_place(
    store: LogStore, feedback: Path
) -> None:
    write_segment(feedback / "seg-2.parquet", 20, 8, seed=2)
    ingest_folder(store, feedback)
    write_segment(feedback / "seg-1.parquet", 20, 8, seed=1)
    write_segment(feedback / "seg-3.parquet", 20, 8, seed=3, corrupt={"invalid_utf8": {"domain": 1}})
    write_segment(feedback / "seg-4.parquet", 20, 8, seed=4)

    reports = ingest_folder(store, feedback, transaction_rows=10_000)

    assert [(Path(r.segment).name, r.status, r.skipped, r.accepted) for r in reports] == [
        ("seg-1.parquet", STATUS_OK, False, 20), ("seg-2.parquet", STATUS_OK, True, 0),
        ("seg-3.parquet", STATUS_FAILED, False, 0), ("seg-4.parquet", STATUS_OK, False, 20)]
    assert store.counts()["requests"] == 60
    assert_reconciles(store)


def test_a_segment_arrow_cannot_judge_is_quarantined_and_a_repaired_file_is_ingested(
    store: LogStore, feedback: Path
) -> None:
    """Invalid UTF-8 in `request_id`: Arrow's string kernels raise while the segment is judged."""
    write_segment(feedback / "seg-0.parquet", 20, 8, seed=0)
    write_segment(feedback / "seg-1.parquet", 20, 8, seed=1, corrupt={"invalid_utf8": {"request_id": 2}})

    first = ingest_folder(store, feedback)

    assert [r.status for r in first] == [STATUS_OK, STATUS_FAILED]
    assert "utf8" in first[1].error.lower()
    with store.connect(read_only=True) as con:
        [(raw,)] = con.execute("SELECT raw FROM quarantine").fetchall()
    assert json.loads(raw)["stage"] == "judge"

    repaired = write_segment(feedback / "seg-1.parquet", 20, 8, seed=1)
    fixed = ingest_folder(store, feedback)

    assert fixed[1].status == STATUS_OK and fixed[1].accepted == 20
    assert store.quarantine_reasons() == {}
    assert set(_ids(repaired)) <= set(_stored_ids(store))
    assert [entry["status"] for entry in store.ledger()] == [STATUS_OK, STATUS_OK]
    assert_reconciles(store)


# ---------------------------------------------------------------------------- changed content


def test_changed_content_of_an_ingested_segment_is_quarantined_never_ingested(
    store: LogStore, feedback: Path
) -> None:
    path = feedback / "seg.parquet"
    original = write_segment(path, 40, 8, seed=1, corrupt={"nan_feature": 2})
    [first] = ingest_folder(store, feedback)
    ledger, stored = store.ledger(), _stored_ids(store)
    original_bytes = path.read_bytes()

    # same path, other content: half the ids overlap the first content, half are new
    write_segment(path, 40, 8, seed=7, id_prefix="s1-", id_offset=20)
    [changed] = ingest_folder(store, feedback)

    assert changed.status == STATUS_CHECKSUM_CHANGED and not changed.skipped
    assert changed.reason == REASON_CHECKSUM_CHANGED and changed.checksum != first.checksum
    assert (changed.rows_read, changed.accepted) == (0, 0)
    assert _stored_ids(store) == stored and len(stored) == 38  # no new row, none lost
    assert store.ledger() == ledger  # the first content's counts still describe the stored rows
    assert store.quarantine_reasons() == {"feature_not_finite": 2, REASON_CHECKSUM_CHANGED: 1}
    [record] = store.changed_segments()
    assert (record["checksum"], record["ingested_checksum"]) == (changed.checksum, first.checksum)
    assert_reconciles(store)

    [later] = ingest_folder(store, feedback)
    assert later.skipped and later.status == STATUS_CHECKSUM_CHANGED
    assert store.quarantine_reasons()[REASON_CHECKSUM_CHANGED] == 1

    path.write_bytes(original_bytes)  # the original content is back: it was ingested
    [back] = ingest_folder(store, feedback)
    assert back.skipped and back.status == STATUS_OK
    assert set(_stored_ids(store)) == set(np.asarray(_ids(original))[original.clean_rows].tolist())
    assert_reconciles(store)


# ---------------------------------------------------------------------------- finish reasons


def test_finish_reasons_outside_training_are_stored_counted_and_never_trained_on(
    store: LogStore, feedback: Path
) -> None:
    segment = write_segment(feedback / "seg.parquet", 400, 8, seed=3, finish_reasons=ALL_REASONS)
    reasons = segment.table.column("finish_reason").to_pylist()
    expected = {reason: reasons.count(reason) for reason in ("abort", "error", "repetition")}
    assert all(expected.values())

    [report] = ingest_folder(store, feedback)

    assert (report.accepted, report.quarantined) == (400, 0)
    assert dict(report.not_trainable) == expected
    assert totals([report])["not_trainable"] == expected
    assert store.finish_reasons() == {reason: reasons.count(reason) for reason in set(reasons)}

    frame = select_window(store, min_rows=10)
    train, test = time_split(frame)
    fit = fit_readout(train, test, alpha=1.0, model_id="m", model_fingerprint="fp-fuzz", layer=20, version="v")
    trainable = sum(reasons.count(reason) for reason in TRAINING_FINISH_REASONS)
    assert fit.params["n_train"] + fit.params["n_test"] == trainable
    for reason, count in expected.items():
        assert fit.params[f"n_excluded_{reason}"] == count
    assert fit.params["n_aborted_excluded"] == sum(expected.values())

    with pytest.raises(NotEnoughRowsError, match="repetition"):
        select_window(store, min_rows=trainable + 1)
    ids = segment.table.column("client_request_id").to_pylist()  # looked up by the client's id
    recorded = recorded_lengths(store, ids)
    assert set(recorded) == {ids[i] for i, reason in enumerate(reasons) if reason in TRAINING_FINISH_REASONS}


# ---------------------------------------------------------------------------- replica sub-folders


def test_replica_sub_folders_are_read_with_their_replica_id_and_top_level_segments_still_are(
    store: LogStore, feedback: Path
) -> None:
    top = write_segment(feedback / "seg-top.parquet", 10, 4, seed=1)
    (feedback / "replica-a").mkdir()
    (feedback / "replica-b").mkdir()
    a = write_segment(feedback / "replica-a" / "seg-1.parquet", 10, 4, seed=2)
    b = write_segment(feedback / "replica-b" / "seg-1.parquet", 10, 4, seed=3)  # same name, other replica
    (feedback / "replica-a" / "seg-2.arrows.partial").write_bytes(b"an open stream")
    (feedback / "replica-a" / ".seg-3.parquet.tmp").write_bytes(b"half written")
    for ignored in ("quarantine", ".hidden", "replica-a/deeper"):
        (feedback / ignored).mkdir()
        write_segment(feedback / ignored / "seg-9.parquet", 10, 4, seed=9)

    reports = ingest_folder(store, feedback)

    assert [(Path(r.segment).relative_to(feedback.resolve()).as_posix(), r.replica_id) for r in reports] == [
        ("seg-top.parquet", None), ("replica-a/seg-1.parquet", "replica-a"), ("replica-b/seg-1.parquet", "replica-b")]
    assert all(r.status == STATUS_OK and r.accepted == 10 for r in reports)
    with store.connect(read_only=True) as con:
        rows = dict(con.execute("SELECT request_id, replica_id FROM requests").fetchall())
    assert rows == {**{i: None for i in _ids(top)}, **{i: "replica-a" for i in _ids(a)},
                    **{i: "replica-b" for i in _ids(b)}}
    assert all(r.skipped for r in ingest_folder(store, feedback))
    assert ingest_folder(store, feedback / "not-yet-created") == []
    assert_reconciles(store)


def _writer_rows(start: int, n: int, dim: int) -> list[dict]:
    rng = np.random.default_rng(start)
    return [{"request_id": f"w-{i:05d}", "model_id": "m", "model_fingerprint": "fp-w", "layer": 3,
             "policy": "leap", "arrival_time": 1_750_000_000.0 + i, "first_token_time": 1_750_000_000.1 + i,
             "finish_time": 1_750_000_001.0 + i, "prompt_tokens": 12, "output_tokens": 7 + i % 5,
             "finish_reason": ALL_REASONS[i % len(ALL_REASONS)], "max_tokens": 64, "decoding": "{}",
             "domain": "chat", "tenant": None, "predicted_at_admission": None, "predicted_latest": None,
             "readout_version": "", "feature": rng.normal(size=dim).astype(np.float32)}
            for i in range(start, start + n)]


def test_segments_of_the_real_feedback_writer_are_ingested_with_their_replica(
    store: LogStore, feedback: Path
) -> None:
    """Two replicas' writers share one feedback folder; their open streams, locks and quarantine
    folders sit beside the segments and are never read."""
    from serving.feedback.writer import FeedbackWriter

    writers = {name: FeedbackWriter(feedback, 4, 3, "m", "fp-w", replica_id=name, flush_rows=1)
               for name in ("replica-a", "host-b-8001")}
    for offset, writer in enumerate(writers.values()):
        for row in _writer_rows(100 * offset, 20, 4):
            assert writer.write(row)
    for writer in writers.values():
        writer.close()

    reports = ingest_folder(store, feedback)

    assert sorted((r.replica_id, r.accepted, r.status) for r in reports) == [
        ("host-b-8001", 20, STATUS_OK), ("replica-a", 20, STATUS_OK)]
    assert sum(sum(r.not_trainable.values()) for r in reports) == 24  # 3 of each 5 reasons
    with store.connect(read_only=True) as con:
        replicas = dict(con.execute("SELECT replica_id, count(*) FROM requests GROUP BY ALL").fetchall())
    assert replicas == {"replica-a": 20, "host-b-8001": 20}
    assert_reconciles(store)


def test_a_top_level_segment_without_replica_metadata_takes_the_replica_in_its_writer_name(
    store: LogStore, feedback: Path
) -> None:
    write_segment(feedback / "feedback-20260101T000000-host-a-8001-000003-0f1e2d.parquet", 5, 4, seed=1)
    write_segment(feedback / "other-name.parquet", 5, 4, seed=2)

    reports = ingest_folder(store, feedback)

    assert [r.replica_id for r in reports] == ["host-a-8001", None]


_V1_DDL = (
    """CREATE TABLE requests (request_id VARCHAR PRIMARY KEY, model_id VARCHAR,
      model_fingerprint VARCHAR NOT NULL, layer INTEGER NOT NULL, policy VARCHAR, arrival_time DOUBLE NOT NULL,
      first_token_time DOUBLE, finish_time DOUBLE NOT NULL, prompt_tokens INTEGER NOT NULL,
      output_tokens INTEGER NOT NULL, finish_reason VARCHAR NOT NULL, max_tokens INTEGER, decoding VARCHAR,
      domain VARCHAR, tenant VARCHAR, predicted_at_admission FLOAT, predicted_latest FLOAT,
      readout_version VARCHAR, segment VARCHAR NOT NULL, ingested_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE features (request_id VARCHAR PRIMARY KEY, dim INTEGER NOT NULL, layer INTEGER NOT NULL,
      model_fingerprint VARCHAR NOT NULL, feature FLOAT[] NOT NULL)""",
    """CREATE TABLE quarantine (segment VARCHAR NOT NULL, row_index BIGINT NOT NULL, request_id VARCHAR,
      reason VARCHAR NOT NULL, raw JSON, quarantined_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE ingest_ledger (segment VARCHAR PRIMARY KEY, checksum VARCHAR NOT NULL, rows_read BIGINT NOT NULL,
      rows_accepted BIGINT NOT NULL, rows_quarantined BIGINT NOT NULL, rows_duplicate BIGINT NOT NULL,
      ingested_at TIMESTAMP NOT NULL, status VARCHAR NOT NULL,
      CHECK (rows_read = rows_accepted + rows_quarantined + rows_duplicate))""",
)


def test_a_version_1_store_is_migrated_on_first_read_and_keeps_its_rows(tmp_path: Path, feedback: Path) -> None:
    """The tables exactly as version 1 created them, with one ingested request."""
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    for ddl in _V1_DDL:
        con.execute(ddl)
    con.execute("INSERT INTO requests (request_id, model_fingerprint, layer, arrival_time, finish_time, "
                "prompt_tokens, output_tokens, finish_reason, segment, ingested_at) "
                "VALUES ('old-1', 'fp-fuzz', 20, 1.0, 2.0, 3, 4, 'stop', '/old.parquet', now())")
    con.execute("INSERT INTO features VALUES ('old-1', 4, 20, 'fp-fuzz', [1, 2, 3, 4])")
    con.execute("INSERT INTO ingest_ledger VALUES ('/old.parquet', 'abc', 1, 1, 0, 0, now(), 'ok')")
    con.close()

    store = LogStore(path, busy_timeout_s=5.0)
    counts = store.counts()  # a reader: migrates once, then reads

    assert (counts["requests"], counts["segments"], counts["segments_changed"]) == (1, 1, 0)
    assert store.schema_version() == SCHEMA_VERSION
    (feedback / "replica-x").mkdir()
    write_segment(feedback / "replica-x" / "seg.parquet", 10, 4, seed=5)
    [report] = ingest_folder(store, feedback)
    assert report.accepted == 10
    with store.connect(read_only=True) as con:
        replicas = dict(con.execute("SELECT replica_id, count(*) FROM requests GROUP BY ALL").fetchall())
    assert replicas == {None: 1, "replica-x": 10}
    assert LogStore(path).schema_version() == SCHEMA_VERSION


# ---------------------------------------------------------------------------- the fault scenarios


def test_fault_scenario_ingest_killed_with_sigkill_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    from experiments.faults.pipeline import ingest_kill9

    result = ingest_kill9(tmp_path, segments=12, rows_per_segment=800, dim=16)

    assert result["survived"], result
    assert result["killed_by_sigkill"] and result["ingest_rows_lost_or_duplicated"] == 0
    assert 0 < result["segments_committed_before_kill"] < 12
    assert result["rerun_skipped"] == result["segments_committed_before_kill"]
    assert result["rows_committed_before_kill"] + result["rerun_accepted"] == result["rows_expected"] == 12 * 800


def test_fault_scenario_corrupt_segments_are_quarantined_and_good_ones_ingested(tmp_path: Path) -> None:
    from experiments.faults.pipeline import corrupt_segments

    result = corrupt_segments(tmp_path)

    assert result["survived"], result
    assert result["good_rows_lost"] == 0 and result["misjudged"] == {}
    assert result["quarantine_reasons"] == {"bad_metadata:layer": 3, "missing_column:request_id": 3,
                                            REASON_SEGMENT_ERROR: 1, "unreadable_segment": 2}
