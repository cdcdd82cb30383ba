"""Feedback in object storage against a real S3 server (moto's, from ops/servers.py): locations are
validated, segments are uploaded, verified and only then deleted, an unreachable bucket keeps them on disk
until it answers, a replica SIGKILLed mid-stream loses no durable row when it restarts, and ingest reads
each replica's prefix with its replica id.

The writer is driven directly (serving.feedback.writer.FeedbackWriter, as in test_feedback_writer.py); the
runtime test builds a LeapRuntime without an engine (tests/runtime_fixtures.py).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from leap_io.object_store import ObjectStore
from leap_io.s3_locations import ObjectURLError, check_endpoint, parse_s3_url
from ops.servers import free_port
from serving.config import LeapConfig
from serving.feedback.segments import PARTIAL_SUFFIX
from serving.feedback.shipper import FeedbackShipper, ShipperCollector
from serving.feedback.writer import FeedbackWriter
from store.duckdb import LogStore
from store.ingest import complete_segments, ingest_folder, totals
from study_harness.servers import running_s3
from tests.object_feedback_fixtures import (  # noqa: F401  (fixtures)
    DIM,
    LAYER,
    bucket,
    eventually,
    feedback_row,
    s3_endpoint,
    s3_env,
)
from tests.runtime_fixtures import DIM as RUNTIME_DIM
from tests.runtime_fixtures import build  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[1]


def _writer(folder: Path, replica: str, **kwargs) -> FeedbackWriter:
    kwargs.setdefault("flush_seconds", 0.01)
    return FeedbackWriter(folder, DIM, LAYER, "m", "fp", replica_id=replica, **kwargs)


def _keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    return [info.key for info in ObjectStore(endpoint).list(bucket, prefix)]


def _stored(store: LogStore) -> list[tuple[str, str]]:
    with store.connect() as con:
        return con.execute("SELECT request_id, replica_id FROM requests ORDER BY request_id").fetchall()


# ------------------------------------------------------------------------------------ locations

def test_locations_and_endpoints_are_validated_with_a_reason():
    assert parse_s3_url("s3://leap-feedback") == parse_s3_url("s3://leap-feedback/")
    assert parse_s3_url("s3://leap-feedback").prefix == ""
    location = parse_s3_url(" s3://leap.feedback-1/fleet/prod/ ")
    assert (location.bucket, location.prefix) == ("leap.feedback-1", "fleet/prod")
    assert location.key("r0", "seg.parquet") == "fleet/prod/r0/seg.parquet"
    assert location.url("fleet/prod/r0/seg.parquet") == "s3://leap.feedback-1/fleet/prod/r0/seg.parquet"
    bad = {
        "/var/lib/leap/feedback": "not an object-storage location",
        "s3://ab/x": "3-63 characters",
        "s3://Leap/x": "lowercase",
        "s3://-leap/x": "starting and ending",
        "s3://le..ap/x": "'..'",
        "s3://10.0.0.1/x": "IP address",
        "s3://leap/a//b": "prefix segment ''",
        "s3://leap/a/../b": "prefix segment '..'",
        "s3://leap/a b": "prefix segment 'a b'",
        "s3://leap/x?versionId=1": "'?'",
        "s3://leap/x\n": None,  # stripped: a trailing newline of a variable is not an error
    }
    for url, reason in bad.items():
        if reason is None:
            assert parse_s3_url(url).prefix == "x"
            continue
        with pytest.raises(ObjectURLError, match=reason.replace("?", r"\?").replace(".", r"\.")):
            parse_s3_url(url)
    with pytest.raises(ObjectURLError):
        location.key("../escape")
    assert check_endpoint(" http://127.0.0.1:9000/ ") == "http://127.0.0.1:9000"
    assert check_endpoint("") is None
    for endpoint in ("minio:9000", "ftp://minio:9000", "http://:9000", "http://minio:99999"):
        with pytest.raises(ObjectURLError):
            check_endpoint(endpoint)

    # the serving settings refuse the same, and a URL without the local spool folder
    config = LeapConfig(feedback_dir="/tmp/spool", feedback_url="s3://leap-feedback/fleet/", s3_endpoint_url=None)
    assert config.feedback_url == "s3://leap-feedback/fleet"
    with pytest.raises(ValidationError, match="prefix segment"):
        LeapConfig(feedback_dir="/tmp/spool", feedback_url="s3://leap-feedback/a//b")
    # an engine that writes no feedback (the gate's, a replay's) may see the fleet's URL: it ships nothing
    assert LeapConfig(feedback_dir=None, feedback_url="s3://leap-feedback/fleet").feedback_dir is None
    with pytest.raises(ValidationError, match="http:// or https://"):
        LeapConfig(feedback_dir="/tmp/spool", feedback_url="s3://leap-feedback", s3_endpoint_url="minio:9000")


# ---------------------------------------------------------------------------------- shipping

def test_segments_are_uploaded_verified_and_deleted_and_only_this_replicas(tmp_path, s3_env, bucket):
    folder = tmp_path / "feedback"
    mine = _writer(folder, "r0", max_rows=10)
    other = _writer(folder, "r0-77", max_rows=10)  # another replica in a shared folder, a similar id
    for i in range(25):
        mine.write(feedback_row(i))
        other.write(feedback_row(i, prefix="other"))
    mine.flush()
    other.flush()
    local = {p.name: p.read_bytes() for p in folder.glob("*-r0-0*.parquet")}
    theirs = sorted(p.name for p in folder.glob("*-r0-77-*.parquet"))
    assert len(local) == 3 and len(theirs) == 3

    url = f"s3://{bucket}/fleet"
    shipper = FeedbackShipper(folder, mine.replica_id, url, endpoint_url=s3_env)
    assert [p.name for p in shipper.pending()] == sorted(local)
    stats = shipper.ship()
    assert stats["segments_shipped"] == 3 and stats["failures"] == 0 and stats["pending_segments"] == 0
    assert stats["bytes_shipped"] == sum(len(data) for data in local.values())
    store = ObjectStore(s3_env)
    assert _keys(s3_env, bucket) == [f"fleet/r0/{name}" for name in sorted(local)]
    for name, data in local.items():
        assert store.get(bucket, f"fleet/r0/{name}") == data  # the bytes that were on disk
        assert not (folder / name).exists()  # deleted once verified
    assert sorted(p.name for p in folder.glob("*-r0-77-*.parquet")) == theirs  # never another replica's

    metrics = CollectorRegistry()
    metrics.register(ShipperCollector(shipper))
    text = generate_latest(metrics).decode()
    assert "leap:feedback_segments_shipped_total 3.0" in text
    assert "leap:feedback_ship_pending_segments 0.0" in text

    # killed between the upload and the delete: the restart uploads the same bytes to the same key,
    # and ingest reads that segment once
    first = sorted(local)[0]
    (folder / first).write_bytes(local[first])
    FeedbackShipper(folder, "r0", url, endpoint_url=s3_env).ship()
    assert _keys(s3_env, bucket) == [f"fleet/r0/{name}" for name in sorted(local)]
    log = LogStore(tmp_path / "log.duckdb")
    summary = totals(ingest_folder(log, url))  # the endpoint from LEAP_S3_ENDPOINT_URL
    assert (summary["segments"], summary["rows_read"], summary["accepted"], summary["duplicates"]) == (3, 25, 25, 0)
    assert _stored(log) == [(f"req-{i:06d}", "r0") for i in range(25)]
    mine.close()
    other.close()


def test_an_unreachable_bucket_keeps_segments_on_disk_counted_and_ships_them_when_it_answers(tmp_path, s3_env):
    port = free_port()  # nothing listens here yet
    endpoint = f"http://127.0.0.1:{port}"
    folder = tmp_path / "feedback"
    writer = _writer(folder, "r0", max_rows=5)
    shipper = FeedbackShipper(folder, "r0", "s3://leap-later/fleet", endpoint_url=endpoint, interval_s=0.05,
                              backoff_s=0.05, max_backoff_s=0.2).start()
    for i in range(20):
        writer.write(feedback_row(i))
    writer.flush()
    assert eventually(lambda: shipper.failures >= 3)
    stats = shipper.stats()
    assert stats["pending_segments"] == 4 and stats["segments_shipped"] == 0 and stats["failing"]
    assert stats["alive"] and stats["healthy"]  # down S3 is a counted failure, not a dead thread
    assert "Could not connect" in stats["last_error"]
    assert len(list(folder.glob("*-r0-*.parquet"))) == 4  # nothing lost meanwhile
    text = generate_latest(_registry(shipper)).decode()
    assert "leap:feedback_ship_failing 1.0" in text and "leap:feedback_ship_pending_segments 4.0" in text

    with running_s3(port=port):  # the endpoint comes up (empty: the shipper creates its bucket)
        assert eventually(lambda: shipper.segments_shipped == 4)
        stats = shipper.stats()
        assert stats["pending_segments"] == 0 and not stats["failing"] and stats["failures"] >= 3
        assert len(_keys(endpoint, "leap-later", "fleet/r0/")) == 4
        for i in range(20, 23):  # and keeps shipping
            writer.write(feedback_row(i))
        writer.flush()
        shipper.wake()
        assert eventually(lambda: shipper.segments_shipped == 5)
        rows = totals(ingest_folder(LogStore(tmp_path / "log.duckdb"), "s3://leap-later/fleet", endpoint_url=endpoint))
        assert (rows["rows_read"], rows["accepted"]) == (23, 23)
    # down again at shutdown: close gives up at its deadline and leaves the segment for the next start
    writer.write(feedback_row(23))
    writer.close()
    assert shipper.close(deadline_s=2.0) is False
    assert len(shipper.pending()) == 1


def _registry(shipper: FeedbackShipper) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ShipperCollector(shipper))
    return registry


# ------------------------------------------------------------------------------- a real kill

_REPLICA = """
import sys, time
from serving.feedback.writer import FeedbackWriter
from serving.feedback.shipper import FeedbackShipper
from tests.object_feedback_fixtures import DIM, LAYER, feedback_row

folder, url, endpoint = sys.argv[1:4]
writer = FeedbackWriter(folder, DIM, LAYER, "m", "fp", replica_id="r0", max_rows=100, flush_rows=4,
                        flush_seconds=0.005, max_seconds=3600)
shipper = FeedbackShipper(folder, writer.replica_id, url, endpoint_url=endpoint, interval_s=0.02).start()
i = 0
while i < 350:
    writer.write(feedback_row(i))
    i += 1
while writer.rows_written < 350 or shipper.segments_shipped < 3:
    time.sleep(0.005)
print("ready", writer.rows_written, flush=True)
while True:  # writing on, until the kill
    writer.write(feedback_row(i))
    i += 1
    if i % 4 == 0:
        print("durable", writer.rows_written, flush=True)
    time.sleep(0.002)
"""


def test_a_replica_killed_mid_stream_loses_no_durable_row_after_a_restart(tmp_path, s3_env, bucket):
    folder, url = tmp_path / "feedback", f"s3://{bucket}/fleet"
    child = subprocess.Popen([sys.executable, "-c", _REPLICA, str(folder), url, s3_env], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(child.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        assert eventually(lambda: any(line.startswith("ready") for line in lines), timeout=30), child.stderr.read()
        assert eventually(lambda: sum(line.startswith("durable") for line in lines) >= 5, timeout=10)
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: rows are being written and fsynced
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    reader.join(5)
    assert child.returncode == -signal.SIGKILL
    durable = max(int(line.split()[1]) for line in lines if line.split()[0] in ("ready", "durable"))
    assert durable > 350
    assert len(_keys(s3_env, bucket, "fleet/r0/")) >= 3  # shipped before the kill
    assert list((folder / "r0").glob("*" + PARTIAL_SUFFIX))  # the open stream the kill left

    # the restart with the same replica id: the writer recovers its stream, the shipper ships everything
    writer = _writer(folder, "r0", max_rows=100)
    assert writer.replica_id == "r0" and writer.recovered_rows > 0
    shipper = FeedbackShipper(folder, "r0", url, interval_s=0.02).start()
    assert writer.close()
    assert shipper.close(deadline_s=10.0)
    assert not list(folder.glob("*.parquet")) and not list((folder / "r0").glob("*" + PARTIAL_SUFFIX))

    log = LogStore(tmp_path / "log.duckdb")
    reports = ingest_folder(log, url)
    summary = totals(reports)
    n = summary["rows_read"]
    assert n >= durable  # every row durable before the kill
    assert (summary["accepted"], summary["duplicates"], summary["quarantined"]) == (n, 0, 0)  # none twice
    assert _stored(log) == [(f"req-{i:06d}", "r0") for i in range(n)]  # in order, none missing
    assert all(r.segment.startswith(f"s3://{bucket}/fleet/r0/feedback-") for r in reports)
    assert totals(ingest_folder(log, url))["rows_read"] == 0  # a rerun reads nothing again


# ------------------------------------------------------------------------------ two replicas

def test_two_replicas_ship_under_their_own_prefixes_and_ingest_keeps_their_ids(tmp_path, s3_env, bucket):
    url = f"s3://{bucket}/fleet"
    for replica, count in (("serving-0", 30), ("serving-1", 17)):
        folder = tmp_path / replica  # each replica's own local spool
        writer = _writer(folder, replica, max_rows=8)
        for i in range(count):
            writer.write(feedback_row(i, prefix=replica))
        assert writer.close()
        assert FeedbackShipper(folder, replica, url).close(deadline_s=10.0)
    keys = _keys(s3_env, bucket)
    assert {key.split("/")[1] for key in keys} == {"serving-0", "serving-1"}
    ObjectStore(s3_env).put(bucket, "fleet/serving-1/.hidden.parquet", b"not a segment")
    ObjectStore(s3_env).put(bucket, "fleet/serving-1/quarantine/x.parquet", b"not a segment")
    ObjectStore(s3_env).put(bucket, "fleet/quarantine/x.parquet", b"not a segment")

    log = LogStore(tmp_path / "log.duckdb")
    reports = ingest_folder(log, url, endpoint_url=s3_env)
    assert len(reports) == len(keys) == 4 + 3
    assert {(r.segment.split("/")[4], r.replica_id) for r in reports} == {("serving-0", "serving-0"),
                                                                          ("serving-1", "serving-1")}
    stored = _stored(log)
    assert stored == sorted([(f"serving-0-{i:06d}", "serving-0") for i in range(30)]
                            + [(f"serving-1-{i:06d}", "serving-1") for i in range(17)])
    assert totals(ingest_folder(log, "s3://leap-no-such-bucket/fleet", endpoint_url=s3_env))["segments"] == 0
    # a listed segment is plain values: it travels to another process (a mapped task) and reads there
    source = complete_segments(url)[0]
    assert pickle.loads(pickle.dumps(source)) == source
    assert source.endpoint_url == s3_env and source.read_bytes()[:4] == b"PAR1"


def test_the_runtime_ships_its_writers_segments_and_reports_them(tmp_path, s3_env, bucket, build):
    url = f"s3://{bucket}/fleet"
    runtime = build(feedback_dir=str(tmp_path / "feedback"), feedback_url=url, s3_endpoint_url=s3_env,
                    admin_port=None)
    assert runtime.shipper is not None and runtime.shipper.destination.url() == f"{url}/{runtime.recorder.writer.replica_id}"
    for i in range(3):
        runtime.recorder.writer.write({**feedback_row(i, dim=RUNTIME_DIM), "layer": runtime.layer})
    report = runtime.flush_feedback()
    assert report["shipper"]["segments_shipped"] == 1 and report["shipper"]["pending_segments"] == 0
    health = runtime.health()
    assert health["healthy"] and health["threads"]["feedback_shipper"]["alive"]
    assert "leap:feedback_segments_shipped_total 1.0" in generate_latest(runtime.metrics_registry).decode()
    assert 'leap:thread_alive{thread="feedback_shipper"} 1.0' in generate_latest(runtime.metrics_registry).decode()
    assert len(_keys(s3_env, bucket, f"fleet/{runtime.recorder.writer.replica_id}/")) == 1


def test_an_engine_without_a_spool_folder_ships_nothing_and_says_why(tmp_path, s3_env, bucket, build, caplog):
    """The fleet's LEAP_FEEDBACK_URL reaches every engine of the machine, the gate's in-process engine too;
    one that writes no feedback starts, warns, and ships nothing."""
    with caplog.at_level("WARNING", logger="serving.runtime"):
        runtime = build(feedback_dir=None, feedback_url=f"s3://{bucket}/fleet", s3_endpoint_url=s3_env,
                        admin_port=None)
    assert runtime.recorder.writer is None and runtime.shipper is None
    assert any("writes no feedback" in record.getMessage() for record in caplog.records)
    assert runtime.health()["healthy"]
    assert _keys(s3_env, bucket, "fleet/") == []
