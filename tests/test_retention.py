"""Ingested segments leave the feedback location once old enough; what the store lacks stays."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from leap_io.object_store import ObjectStore
from store.duckdb import LogStore
from store.ingest import STATUS_CHECKSUM_CHANGED, complete_segments, ingest_folder, totals
from store.retention import prune_ingested
from tests.object_feedback_fixtures import bucket, s3_endpoint, s3_env  # noqa: F401  (fixtures)
from tests.segment_fuzz import write_segment

LATER = datetime.now(UTC) + timedelta(hours=2)


def test_only_segments_whose_rows_are_all_stored_are_removed_and_only_when_old_enough(tmp_path: Path):
    store, feedback = LogStore(tmp_path / "log.duckdb"), tmp_path / "feedback"
    feedback.mkdir()
    for index in range(3):
        write_segment(feedback / f"seg-{index}.parquet", 40, 8, seed=index)
    (feedback / "bad.parquet").write_bytes(b"not a segment")
    ingest_folder(store, feedback)
    write_segment(feedback / "seg-2.parquet", 41, 8, seed=9)  # new content at an ingested path
    counts = store.counts()

    recent = prune_ingested(store, complete_segments(feedback), older_than_s=3600)
    assert recent["removed"] == 0 and recent["kept_recent"] == 2
    pruned = prune_ingested(store, complete_segments(feedback), older_than_s=3600, now=LATER)
    assert pruned == {"removed": 2, "kept_new_or_changed": 1, "kept_recent": 0, "kept_not_ingested": 1,
                      "remove_failed": 0}
    assert sorted(path.name for path in feedback.iterdir()) == ["bad.parquet", "seg-2.parquet"]
    assert store.counts() == counts  # the rows stay; only the files left

    later = ingest_folder(store, feedback)  # the changed content is still caught, nothing is ingested twice
    assert totals(later)["accepted"] == 0 and STATUS_CHECKSUM_CHANGED in {r.status for r in later}
    write_segment(feedback / "seg-3.parquet", 40, 8, seed=3)
    assert totals(ingest_folder(store, feedback))["accepted"] == 40


def test_the_ingest_flows_task_prunes_a_bucket(tmp_path: Path, s3_env, bucket):
    from flows.tasks import prune_feedback

    objects = ObjectStore(s3_env)
    for index in range(2):
        segment = write_segment(tmp_path / f"seg-{index}.parquet", 30, 8, seed=index)
        objects.put(bucket, f"fleet/replica-0/seg-{index}.parquet", segment.path.read_bytes())
    url, location = f"s3://{bucket}/fleet", str(tmp_path / "log.duckdb")
    assert totals(ingest_folder(LogStore(location), url, endpoint_url=s3_env))["accepted"] == 60
    assert prune_feedback.fn(location, url, 1.0, s3_env)["kept_recent"] == 2  # ingested just now
    assert prune_feedback.fn(location, url, 0.0, s3_env)["removed"] == 2
    assert complete_segments(url, endpoint_url=s3_env) == []
    assert LogStore(location).counts()["requests"] == 60
