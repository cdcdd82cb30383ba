"""The DuckDB log store and segment ingest, against real Parquet segments and a real DuckDB file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from leap_io.feedback_schema import TRAINING_FINISH_REASONS
from store.duckdb import LogStore, StoreBusyError
from store.ingest import (
    REASON_UNREADABLE,
    STATUS_OK,
    STATUS_UNREADABLE,
    ingest_folder,
    ingest_segment,
    totals,
)
from store.validation import (
    REASON_FEATURE_DIM_CONFLICT,
    REASON_FEATURE_NOT_FINITE,
    REASON_FEATURE_WRONG_DIM,
    REASON_FINISH_BEFORE_ARRIVAL,
    REASON_INVALID_OUTPUT_TOKENS,
    REASON_INVALID_PROMPT_TOKENS,
    REASON_MISSING_ID,
    REASON_NUL_IN_TEXT,
    REASON_UNKNOWN_FINISH_REASON,
    REASON_ZERO_OUTPUT_TOKENS,
    missing_column_reason,
    null_field_reason,
)
from tests.segment_fuzz import ROW_CORRUPTIONS, truncate, write_segment
from tests.segment_fuzz import assert_reconciles as _assert_reconciles

REPO_ROOT = Path(__file__).resolve().parents[1]

EXPECTED_REASON = {
    "null_id": REASON_MISSING_ID,
    "empty_id": REASON_MISSING_ID,
    "nan_feature": REASON_FEATURE_NOT_FINITE,
    "inf_feature": REASON_FEATURE_NOT_FINITE,
    "wrong_dim_feature": REASON_FEATURE_WRONG_DIM,
    "negative_prompt_tokens": REASON_INVALID_PROMPT_TOKENS,
    "negative_output_tokens": REASON_INVALID_OUTPUT_TOKENS,
    "nan_output_tokens": REASON_INVALID_OUTPUT_TOKENS,
    "zero_output_tokens": REASON_ZERO_OUTPUT_TOKENS,
    "finish_before_arrival": REASON_FINISH_BEFORE_ARRIVAL,
    "unknown_finish_reason": REASON_UNKNOWN_FINISH_REASON,
    "null_arrival_time": null_field_reason("arrival_time"),
    "nul_in_id": REASON_NUL_IN_TEXT,
    "nul_in_domain": REASON_NUL_IN_TEXT,
}
assert set(EXPECTED_REASON) | {"duplicate_id"} == set(ROW_CORRUPTIONS)


@pytest.fixture
def store(tmp_path: Path) -> LogStore:
    return LogStore(tmp_path / "log.duckdb", busy_timeout_s=5.0)


@pytest.fixture
def feedback(tmp_path: Path) -> Path:
    folder = tmp_path / "feedback"
    folder.mkdir()
    return folder


def test_ingesting_twice_skips_and_changes_nothing(store: LogStore, feedback: Path) -> None:
    for index in range(3):
        write_segment(feedback / f"seg-{index}.parquet", 40, 8, seed=index, corrupt={"nan_feature": 2})
    first = ingest_folder(store, feedback)
    counts, ledger = store.counts(), store.ledger()

    second = ingest_folder(store, feedback)
    again = ingest_segment(store, feedback / "seg-1.parquet")

    assert [report.skipped for report in first] == [False] * 3
    assert totals(first)["accepted"] == 3 * 38
    assert all(report.skipped for report in second + [again])
    assert totals(second) == {"segments": 3, "skipped": 3, "rows_read": 0, "accepted": 0,
                              "quarantined": 0, "duplicates": 0, "failed": 0, "unreadable": 0,
                              "checksum_changed": 0, "not_trainable": {}}
    assert [report.checksum for report in second] == [report.checksum for report in first]
    assert store.counts() == counts
    assert store.ledger() == ledger  # same ingested_at: the ledger was not rewritten
    _assert_reconciles(store)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fuzzed_segment_reconciles_row_for_row(store: LogStore, feedback: Path, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    corrupt = {name: int(rng.integers(1, 5)) for name in ROW_CORRUPTIONS}
    segment = write_segment(feedback / "seg.parquet", 300, 16, seed=seed, corrupt=corrupt)

    [report] = ingest_folder(store, feedback)

    expected = {(int(row), EXPECTED_REASON[name])
                for name, rows in segment.broken_rows.items() if name != "duplicate_id" for row in rows}
    duplicates = len(segment.broken_rows["duplicate_id"])
    assert report.rows_read == 300
    assert report.quarantined == len(expected) == sum(v for k, v in corrupt.items() if k != "duplicate_id")
    assert report.duplicates == duplicates == corrupt["duplicate_id"]
    assert report.accepted == 300 - len(expected) - duplicates
    assert report.rows_read == report.accepted + report.quarantined + report.duplicates

    with store.connect(read_only=True) as con:
        quarantined = set(con.execute("SELECT row_index, reason FROM quarantine").fetchall())
        stored = dict(con.execute("SELECT request_id, output_tokens FROM requests").fetchall())
        raw = dict(con.execute("SELECT row_index, raw FROM quarantine").fetchall())
    assert quarantined == expected

    ids = segment.table.column("request_id").to_pylist()
    tokens = segment.table.column("output_tokens").to_pylist()
    clean = segment.clean_rows
    assert set(stored) == {ids[row] for row in clean}
    # First wins: the stored row of a duplicated id is its earliest (clean) occurrence.
    for row in segment.broken_rows["duplicate_id"]:
        first = ids.index(ids[row])
        assert first < row and stored[ids[row]] == tokens[first]
    nan_row = int(segment.broken_rows["nan_feature"][0])
    assert json.loads(raw[nan_row])["feature"][0] == "nan"
    assert json.loads(raw[nan_row])["request_id"] == ids[nan_row]
    _assert_reconciles(store)


def test_a_client_id_reused_by_another_replica_drops_no_row_and_the_latest_row_is_its_recorded_length(
        store: LogStore, feedback: Path) -> None:
    # two replicas' segments whose clients reused the same ids ("client-0" ...): the keys are the replicas'
    old = write_segment(feedback / "seg-a.parquet", 60, 8, seed=1, id_prefix="replica-a-", start_time=1_700_000_000.0)
    new = write_segment(feedback / "seg-b.parquet", 60, 8, seed=2, id_prefix="replica-b-", start_time=1_800_000_000.0)
    assert old.table.column("client_request_id").to_pylist() == new.table.column("client_request_id").to_pylist()

    reports = ingest_folder(store, feedback)

    assert [(r.accepted, r.duplicates) for r in reports] == [(60, 0), (60, 0)]
    with store.connect(read_only=True) as con:
        [(rows, clients)] = con.execute("SELECT count(*), count(DISTINCT client_request_id) FROM requests").fetchall()
    assert (rows, clients) == (120, 60)
    latest = {}
    for segment in (old, new):  # the newer replica's label wins where it has one
        clean = segment.table.take(segment.clean_rows)
        for cid, tokens, arrival, reason in zip(*(clean.column(name).to_pylist() for name in (
                "client_request_id", "output_tokens", "arrival_time", "finish_reason"))):
            if reason in TRAINING_FINISH_REASONS:
                latest[cid] = (tokens, arrival)
    assert any(arrival > 1_800_000_000 for _, arrival in latest.values())
    assert store.recorded_lengths(list(latest)) == latest
    _assert_reconciles(store)


def test_duplicates_across_segments_first_segment_wins(store: LogStore, feedback: Path) -> None:
    a = write_segment(feedback / "seg-a.parquet", 100, 8, seed=1, id_prefix="r-", id_offset=0)
    b = write_segment(feedback / "seg-b.parquet", 100, 8, seed=2, id_prefix="r-", id_offset=50)

    first, second = ingest_folder(store, feedback)

    assert (first.accepted, first.duplicates) == (100, 0)
    assert (second.accepted, second.duplicates, second.quarantined) == (50, 50, 0)
    with store.connect(read_only=True) as con:
        rows = con.execute("SELECT request_id, output_tokens, segment FROM requests").fetchall()
    assert len(rows) == 150
    from_a = dict(zip(a.table.column("request_id").to_pylist(), a.table.column("output_tokens").to_pylist()))
    from_b = dict(zip(b.table.column("request_id").to_pylist(), b.table.column("output_tokens").to_pylist()))
    for request_id, output_tokens, segment in rows:
        source, path = (from_a, a.path) if request_id in from_a else (from_b, b.path)
        assert output_tokens == source[request_id]
        assert segment == str(path.resolve())
    _assert_reconciles(store)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.01, 0.5, 0.99])
def test_truncated_segment_is_recorded_unreadable_and_recovers_when_fixed(
    store: LogStore, feedback: Path, keep_fraction: float
) -> None:
    path = feedback / "seg.parquet"
    write_segment(path, 50, 8, seed=3)
    original = truncate(path, int(len(path.read_bytes()) * keep_fraction))

    [broken] = ingest_folder(store, feedback)
    [repeat] = ingest_folder(store, feedback)

    assert broken.status == STATUS_UNREADABLE and not broken.skipped
    assert (broken.rows_read, broken.accepted, broken.quarantined, broken.duplicates) == (0, 0, 0, 0)
    assert repeat.skipped and repeat.status == STATUS_UNREADABLE
    with store.connect(read_only=True) as con:
        [(row_index, request_id, reason)] = con.execute(
            "SELECT row_index, request_id, reason FROM quarantine").fetchall()
    assert (row_index, request_id, reason) == (-1, None, REASON_UNREADABLE)
    assert store.counts()["requests"] == 0

    path.write_bytes(original)
    [fixed] = ingest_folder(store, feedback)

    assert fixed.status == STATUS_OK and fixed.accepted == 50 and fixed.checksum != broken.checksum
    assert store.quarantine_reasons() == {}
    assert [entry["status"] for entry in store.ledger()] == [STATUS_OK]
    _assert_reconciles(store)


class SimulatedCrash(RuntimeError):
    pass


@pytest.mark.parametrize("stage", ["requests", "features", "quarantine", "ledger"])
def test_crash_inside_a_segment_leaves_nothing_and_rerun_ingests_it_fully(
    store: LogStore, feedback: Path, stage: str
) -> None:
    write_segment(feedback / "seg-1.parquet", 60, 8, seed=1, corrupt={"zero_output_tokens": 3})
    write_segment(feedback / "seg-2.parquet", 60, 8, seed=2, corrupt={"duplicate_id": 2})
    calls = []

    def crash_in_second_segment(name: str) -> None:
        calls.append(name)
        if name == stage and calls.count(stage) == 2:
            raise SimulatedCrash(name)

    with pytest.raises(SimulatedCrash):
        ingest_folder(store, feedback, _after_stage=crash_in_second_segment)
    counts = store.counts()
    assert (counts["segments"], counts["requests"], counts["features"], counts["quarantine"]) == (1, 57, 57, 3)

    skipped, rerun = ingest_folder(store, feedback)

    assert skipped.skipped
    assert (rerun.rows_read, rerun.accepted, rerun.duplicates, rerun.quarantined) == (60, 58, 2, 0)
    assert store.counts()["requests"] == 57 + 58
    _assert_reconciles(store)


_HARD_CRASH = """
import os, sys
from store.ingest import ingest_folder
from store.duckdb import LogStore
seen = []
def die(stage):
    seen.append(stage)
    if stage == "features" and seen.count(stage) == 2:
        os._exit(17)
ingest_folder(LogStore(sys.argv[1]), sys.argv[2], _after_stage=die)
"""


def test_process_killed_mid_segment_loses_only_that_segment(store: LogStore, feedback: Path) -> None:
    for index in range(3):
        write_segment(feedback / f"seg-{index}.parquet", 80, 8, seed=index)
    store.counts()  # create the schema

    crashed = subprocess.run([sys.executable, "-c", _HARD_CRASH, str(store.path), str(feedback)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)

    assert crashed.returncode == 17, crashed.stderr
    assert store.counts()["requests"] == 80 and len(store.ledger()) == 1
    reports = ingest_folder(store, feedback)
    assert [report.skipped for report in reports] == [True, False, False]
    assert [report.accepted for report in reports] == [0, 80, 80]
    assert store.counts()["requests"] == 240
    _assert_reconciles(store)


def test_training_frame_returns_exactly_what_was_written(store: LogStore, feedback: Path) -> None:
    segments = [
        write_segment(feedback / f"seg-{index}.parquet", 120, 12, seed=index, id_prefix=f"a{index}-",
                      start_time=1_700_000_000.0 + 3600 * index, corrupt={"inf_feature": 5})
        for index in range(2)
    ]
    write_segment(feedback / "seg-other.parquet", 30, 4, seed=9, model_fingerprint="fp-other")
    ingest_folder(store, feedback)

    frame = store.training_frame(model_fingerprint="fp-fuzz", layer=20)

    written = {}
    for segment in segments:
        table = segment.table.take(segment.clean_rows)
        features = table.column("feature").combine_chunks().flatten().to_numpy().reshape(-1, 12)
        for request_id, feature, tokens, domain, arrival in zip(
                table.column("request_id").to_pylist(), features, table.column("output_tokens").to_pylist(),
                table.column("domain").to_pylist(), table.column("arrival_time").to_pylist()):
            written[request_id] = (feature, tokens, domain, arrival)
    assert frame.features.dtype == np.float32 and frame.features.shape == (len(written), 12)
    assert frame.features.flags.c_contiguous
    assert sorted(frame.request_ids) == sorted(written)
    assert np.array_equal(frame.features, np.stack([written[i][0] for i in frame.request_ids]))
    assert frame.output_tokens.tolist() == [written[i][1] for i in frame.request_ids]
    assert frame.domain.tolist() == [written[i][2] for i in frame.request_ids]
    assert np.all(np.diff(frame.arrival_time) >= 0)

    since, until = 1_700_000_000.0 + 1800, 1_700_000_000.0 + 5400
    window = store.training_frame(since=since, until=until, domains=["code", "math"],
                                  model_fingerprint="fp-fuzz", layer=20)
    expected = {i for i, (_, _, domain, arrival) in written.items()
                if since <= arrival < until and domain in ("code", "math")}
    assert set(window.request_ids) == expected and len(expected) > 0
    assert window.features.shape == (len(expected), 12)

    other = store.training_frame(model_fingerprint="fp-other")
    assert other.features.shape == (30, 4)
    with pytest.raises(ValueError, match="mixes feature dims"):
        store.training_frame()
    assert store.training_frame(model_fingerprint="nobody").features.shape[0] == 0


def test_dims_are_checked_against_segment_metadata_and_the_store(store: LogStore, feedback: Path) -> None:
    mislabelled = write_segment(feedback / "seg-1.parquet", 20, 8, seed=1, corrupt={"metadata_dim": 6})
    report = ingest_segment(store, mislabelled.path)
    assert (report.accepted, report.quarantined) == (0, 20)
    assert store.quarantine_reasons() == {REASON_FEATURE_WRONG_DIM: 20}

    ingest_segment(store, write_segment(feedback / "seg-2.parquet", 20, 8, seed=2).path)
    clash = ingest_segment(store, write_segment(feedback / "seg-3.parquet", 20, 6, seed=3).path)
    other_layer = ingest_segment(store, write_segment(feedback / "seg-4.parquet", 20, 6, seed=4, layer=7).path)

    assert (clash.accepted, clash.quarantined) == (0, 20)
    assert store.quarantine_reasons()[REASON_FEATURE_DIM_CONFLICT] == 20
    assert other_layer.accepted == 20
    _assert_reconciles(store)


def test_missing_optional_columns_are_null_and_missing_required_ones_quarantine(
    store: LogStore, feedback: Path
) -> None:
    lean = write_segment(feedback / "seg-1.parquet", 25, 8, seed=1, corrupt={"drop_columns": ["domain", "tenant"]})
    assert "domain" not in lean.table.column_names
    write_segment(feedback / "seg-2.parquet", 25, 8, seed=2, corrupt={"drop_columns": ["finish_reason"]})

    first, second = ingest_folder(store, feedback)

    assert first.accepted == 25
    with store.connect(read_only=True) as con:
        assert con.execute("SELECT count(*) FROM requests WHERE domain IS NULL AND tenant IS NULL").fetchone() == (25,)
    assert (second.accepted, second.quarantined) == (0, 25)
    assert store.quarantine_reasons() == {missing_column_reason("finish_reason"): 25}


def test_ingest_folder_reads_only_complete_segments_in_name_order(store: LogStore, feedback: Path) -> None:
    for name in ["b.parquet", "a.parquet", "c.parquet"]:
        write_segment(feedback / name, 10, 4, seed=ord(name[0]))
    (feedback / ".d.parquet.tmp").write_bytes(b"half written")
    (feedback / "e.parquet.tmp").write_bytes(b"half written")

    reports = ingest_folder(store, feedback)

    assert [Path(report.segment).name for report in reports] == ["a.parquet", "b.parquet", "c.parquet"]
    assert store.counts()["segments_unreadable"] == 0


_HOLDER = """
import sys, time, duckdb
con = duckdb.connect(sys.argv[1])
print("holding", flush=True)
if float(sys.argv[2]) < 0:
    sys.stdin.readline()
else:
    time.sleep(float(sys.argv[2]))
con.close()
"""


def _hold(path: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_store_busy_error_names_the_file_when_another_process_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "log.duckdb"
    LogStore(path).counts()
    holder = _hold(path, -1)
    try:
        waiting = LogStore(path, busy_timeout_s=0.4)
        started = time.monotonic()
        with pytest.raises(StoreBusyError) as error:
            waiting.counts()
        assert time.monotonic() - started >= 0.4
        assert str(path) in str(error.value) and "lock" in str(error.value)
    finally:
        holder.communicate("\n", timeout=30)
    assert LogStore(path, busy_timeout_s=0.4).counts()["requests"] == 0


def test_connect_waits_for_another_process_to_release_the_file(tmp_path: Path) -> None:
    path = tmp_path / "log.duckdb"
    LogStore(path).counts()
    holder = _hold(path, 0.8)
    started = time.monotonic()
    try:
        assert LogStore(path, busy_timeout_s=60).counts()["requests"] == 0
    finally:
        holder.wait(timeout=30)
    assert time.monotonic() - started >= 0.5
    assert holder.returncode == 0 and os.path.exists(path)


@pytest.mark.parametrize("transaction_rows", [0, 10_000])
def test_dim_conflict_with_a_segment_of_the_same_run_keeps_the_order_of_reasons(
    store: LogStore, feedback: Path, transaction_rows: int
) -> None:
    write_segment(feedback / "seg-1.parquet", 20, 8, seed=1)
    write_segment(feedback / "seg-2.parquet", 20, 6, seed=2,
                  corrupt={"null_id": 2, "zero_output_tokens": 3, "nan_feature": 2})

    first, second = ingest_folder(store, feedback, transaction_rows=transaction_rows)

    assert (first.accepted, second.accepted, second.quarantined) == (20, 0, 20)
    # A missing id is checked before the dims; zero tokens and NaN features after them.
    assert store.quarantine_reasons() == {REASON_MISSING_ID: 2, REASON_FEATURE_DIM_CONFLICT: 18}
    _assert_reconciles(store)


@pytest.mark.parametrize(("transaction_rows", "committed"), [(1_000, 0), (100, 2)])
def test_grouped_transactions_roll_back_whole_segments_and_rerun_completes(
    store: LogStore, feedback: Path, tmp_path: Path, transaction_rows: int, committed: int
) -> None:
    for index in range(3):
        write_segment(feedback / f"seg-{index}.parquet", 60, 8, seed=index, corrupt={"nan_feature": 1})
    calls = []

    def crash_in_third_segment(name: str) -> None:
        calls.append(name)
        if name == "features" and calls.count(name) == 3:
            raise SimulatedCrash(name)

    with pytest.raises(SimulatedCrash):
        ingest_folder(store, feedback, transaction_rows=transaction_rows, _after_stage=crash_in_third_segment)
    counts = store.counts()
    assert (counts["segments"], counts["requests"], counts["quarantine"]) == (committed, 59 * committed, committed)

    reports = ingest_folder(store, feedback, transaction_rows=transaction_rows)

    assert [report.skipped for report in reports] == [True] * committed + [False] * (3 - committed)
    one_by_one = LogStore(tmp_path / "one-by-one.duckdb")
    ingest_folder(one_by_one, feedback)
    with store.connect(read_only=True) as con:
        grouped_rows = sorted(con.execute("SELECT request_id, output_tokens FROM requests").fetchall())
    with one_by_one.connect(read_only=True) as con:
        single_rows = sorted(con.execute("SELECT request_id, output_tokens FROM requests").fetchall())
    assert grouped_rows == single_rows and len(grouped_rows) == 3 * 59
    _assert_reconciles(store)


def test_process_killed_while_large_segments_bypass_the_wal_loses_only_that_segment(
    store: LogStore, feedback: Path
) -> None:
    # 5000 rows fill whole row groups, which DuckDB writes straight into the database file.
    segments = [write_segment(feedback / f"seg-{index}.parquet", 5000, 4, seed=index, id_prefix=f"big{index}-")
                for index in range(3)]
    store.counts()

    crashed = subprocess.run([sys.executable, "-c", _HARD_CRASH, str(store.path), str(feedback)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)

    assert crashed.returncode == 17, crashed.stderr
    counts = store.counts()
    assert (counts["segments"], counts["requests"], counts["features"]) == (1, 5000, 5000)
    frame = store.training_frame()
    written = segments[0].table.column("feature").combine_chunks().flatten().to_numpy().reshape(-1, 4)
    order = np.argsort(segments[0].table.column("request_id").to_numpy(zero_copy_only=False))
    assert np.array_equal(frame.features[np.argsort(frame.request_ids)], written[order])

    reports = ingest_folder(store, feedback)
    assert [report.accepted for report in reports] == [0, 5000, 5000]
    assert store.counts()["features"] == 15000
    _assert_reconciles(store)


def test_a_fit_window_capped_at_the_newest_rows_holds_exactly_those(store: LogStore, feedback: Path) -> None:
    from flows.tasks import select_training_window
    from training.spec import FeatureSpace

    write_segment(feedback / "seg-a.parquet", 120, 8, seed=1)
    ingest_folder(store, feedback)
    everything = store.training_frame()
    space = FeatureSpace(None, "fp-fuzz", 20, "last@20")

    capped = select_training_window.fn(str(store.path), space, None, None, None, min_rows=2, max_rows=40)

    newest = np.sort(everything.arrival_time)[-40:]
    assert np.array_equal(np.sort(capped.arrival_time), newest)  # distinct arrival times: exactly 40
    whole = select_training_window.fn(str(store.path), space, None, None, None, min_rows=2, max_rows=None)
    assert len(whole.request_ids) == len(everything.request_ids) > 40
