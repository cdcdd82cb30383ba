"""A run costs what is new: a segment whose stamp (size, modification time, inode; an object's size and
ETag) is unchanged since its content was checked is skipped without being read, and one whose stamp
changed is read and checked as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import store.ingest as ingest
from leap_io.object_store import ObjectStore
from store.duckdb import LogStore
from store.ingest import STATUS_CHECKSUM_CHANGED, STATUS_OK, ingest_folder, totals
from tests.object_feedback_fixtures import bucket, s3_endpoint, s3_env  # noqa: F401  (fixtures)
from tests.segment_fuzz import write_segment


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The segments read from disk, in order."""
    seen: list[str] = []
    original = ingest.SegmentFile.read_bytes

    def counted(self):
        seen.append(self.path.name)
        return original(self)

    monkeypatch.setattr(ingest.SegmentFile, "read_bytes", counted)
    return seen


def test_a_later_run_reads_only_what_changed(tmp_path: Path, reads: list[str]):
    store, feedback = LogStore(tmp_path / "log.duckdb"), tmp_path / "feedback"
    feedback.mkdir()
    for index in range(3):
        write_segment(feedback / f"seg-{index}.parquet", 40, 8, seed=index)
    first = ingest_folder(store, feedback)
    assert reads == ["seg-0.parquet", "seg-1.parquet", "seg-2.parquet"]
    counts = store.counts()

    reads.clear()
    second = ingest_folder(store, feedback)
    assert reads == []  # nothing read, nothing hashed
    assert [(r.skipped, r.status, r.checksum) for r in second] == [(True, STATUS_OK, r.checksum) for r in first]
    assert store.counts() == counts

    # new content at an ingested path (another size and time): read, caught, and then skipped by its stamp
    write_segment(feedback / "seg-1.parquet", 41, 8, seed=9)
    write_segment(feedback / "seg-3.parquet", 40, 8, seed=3)
    reads.clear()
    third = ingest_folder(store, feedback)
    assert reads == ["seg-1.parquet", "seg-3.parquet"]
    assert totals(third)["checksum_changed"] == 1 and totals(third)["accepted"] == 40
    reads.clear()
    fourth = ingest_folder(store, feedback)
    assert reads == []
    assert [r.status for r in fourth] == [STATUS_OK, STATUS_CHECKSUM_CHANGED, STATUS_OK, STATUS_OK]


def test_a_store_without_stamps_checks_each_segment_once_more_then_skips_it(tmp_path: Path, reads: list[str]):
    store, feedback = LogStore(tmp_path / "log.duckdb"), tmp_path / "feedback"
    feedback.mkdir()
    for index in range(2):
        write_segment(feedback / f"seg-{index}.parquet", 30, 8, seed=index)
    ingest_folder(store, feedback)
    with store.connect() as con:  # as a store from before stamps were recorded
        con.execute("DELETE FROM segment_stamps")
    os.utime(feedback / "seg-0.parquet")  # touched, same content
    reads.clear()
    again = ingest_folder(store, feedback)
    assert reads == ["seg-0.parquet", "seg-1.parquet"] and all(r.skipped for r in again)
    reads.clear()
    assert all(r.skipped for r in ingest_folder(store, feedback)) and reads == []


def test_segments_in_a_bucket_are_skipped_by_their_listed_etag(tmp_path: Path, s3_env, bucket, monkeypatch):
    objects = ObjectStore(s3_env)
    for index in range(2):
        segment = write_segment(tmp_path / f"seg-{index}.parquet", 30, 8, seed=index)
        objects.put(bucket, f"fleet/replica-{index}/seg-{index}.parquet", segment.path.read_bytes())
    store, url = LogStore(tmp_path / "log.duckdb"), f"s3://{bucket}/fleet"
    gets: list[str] = []
    original = ObjectStore.get

    def counted(self, bucket_name, key):
        gets.append(key)
        return original(self, bucket_name, key)

    monkeypatch.setattr(ObjectStore, "get", counted)
    assert totals(ingest_folder(store, url, endpoint_url=s3_env))["accepted"] == 60 and len(gets) == 2
    gets.clear()
    assert all(r.skipped for r in ingest_folder(store, url, endpoint_url=s3_env)) and gets == []
    objects.put(bucket, "fleet/replica-0/seg-0.parquet",
                write_segment(tmp_path / "other.parquet", 31, 8, seed=7).path.read_bytes())  # a new upload
    gets.clear()
    changed = ingest_folder(store, url, endpoint_url=s3_env)
    assert gets == ["fleet/replica-0/seg-0.parquet"] and totals(changed)["checksum_changed"] == 1


def test_the_growth_bench_times_each_run_beside_a_full_read_and_prints_its_keys():
    import json

    from typer.testing import CliRunner

    from leap_cli.main import app

    outcome = CliRunner().invoke(app, ["bench", "ingest-growth", "--history-rows", "3000", "--runs", "2",
                                       "--rows-per-run", "1000", "--segment-rows", "1000", "--dim", "8",
                                       "--registry-dim", "16", "--json"])
    assert outcome.exit_code == 0, outcome.output
    figures = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert figures["history_rows"] == 3000 and figures["rows_stored"] == 5000
    assert len(figures["per_run_s"]) == len(figures["full_read_s"]) == 2
    assert figures["last_over_first"] == pytest.approx(figures["per_run_s"][1] / figures["per_run_s"][0], rel=0.02)
    # the state one version stores: P and A (dim x dim, float64) dominate
    assert figures["registry_bytes_per_version"] > 2 * 16 * 16 * 8
