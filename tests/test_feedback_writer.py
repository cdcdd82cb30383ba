"""The feedback writer against real files: bad rows, a bounded backlog, a full disk, replica folders.

The full-disk test mounts a real 256 KiB tmpfs (root only; skipped where mount is not permitted) and
grows it afterwards, so the writer meets a real ENOSPC and then a disk with room again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from leap_io.feedback_schema import read_segment_file
from serving.feedback.segments import LOCK_NAME, PARTIAL_SUFFIX, default_replica_id
from serving.feedback.writer import FeedbackCollector, FeedbackFlushError, FeedbackWriter

DIM = 8
REPO = Path(__file__).resolve().parents[1]


def _row(i: int, dim: int = DIM, **changes) -> dict:
    row = {
        "request_id": f"req-{i:05d}", "model_id": "m", "model_fingerprint": "fp", "layer": 3, "policy": "leap",
        "arrival_time": 1_750_000_000.0 + i, "first_token_time": 1_750_000_000.5 + i,
        "finish_time": 1_750_000_001.0 + i, "prompt_tokens": 10, "output_tokens": 5 + i % 50,
        "finish_reason": "stop", "max_tokens": 512, "decoding": "{}", "domain": "chat", "tenant": None,
        "predicted_at_admission": 12.0, "predicted_latest": 13.0, "readout_version": "v1",
        "feature": np.random.default_rng(i).standard_normal(dim).astype(np.float32),
    }
    row.update(changes)
    return row


def _writer(root: Path, replica_id: str = "r0", dim: int = DIM, **kwargs) -> FeedbackWriter:
    kwargs.setdefault("flush_seconds", 0.05)
    return FeedbackWriter(root, dim, 3, "m", "fp", replica_id=replica_id, **kwargs)


def _segment_ids(root: Path) -> list[str]:
    ids: list[str] = []
    for path in sorted(root.glob("*.parquet")):
        ids.extend(pq.read_table(path).column("request_id").to_pylist())
    return ids


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def _partials(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + PARTIAL_SUFFIX))


# ------------------------------------------------------------------------------- bad rows

def test_bad_rows_are_quarantined_with_their_reason_and_the_rest_is_written(tmp_path):
    writer = _writer(tmp_path)
    bad = [
        _row(100, domain=5),
        _row(101, feature=np.zeros(DIM + 1, dtype=np.float32)),
        _row(102, feature=None),
        _row(103, request_id=None),
        _row(104, output_tokens=2**40),
        _row(105, feature="not a vector"),
        "not a row at all",
    ]
    for i in range(10):
        writer.write(_row(i))
    for row in bad:
        assert writer.write(row)  # accepted: judged on the writer thread, never by the caller
    for i in range(10, 20):
        writer.write(_row(i))
    report = writer.flush()
    assert sorted(_segment_ids(tmp_path)) == [f"req-{i:05d}" for i in range(20)]
    assert report["rows_written"] == 20 and report["rows_quarantined"] == len(bad)
    assert report["rows_dropped"] == 0 and report["queue_depth"] == 0 and report["alive"]
    assert writer.healthy()

    [quarantine] = sorted((tmp_path / "r0" / "quarantine").glob("*.jsonl"))
    records = [json.loads(line) for line in quarantine.read_text().splitlines()]
    reasons = [r["reason"] for r in records]
    assert len(records) == len(bad)
    assert "domain" in reasons[0] and "string" in reasons[0]
    assert "9 values" in reasons[1] and "dim 8" in reasons[1]
    assert "feature is missing" in reasons[2]
    assert "request_id is missing" in reasons[3]
    assert "output_tokens" in reasons[4]
    assert "feature" in reasons[5] and "not a mapping" in reasons[6]
    assert records[1]["row"]["request_id"] == "req-00101"
    assert records[1]["feature"] == {"type": "ndarray", "shape": [DIM + 1], "dtype": "float32"}  # no values

    writer.write(_row(20))  # the writer goes on after the bad rows
    writer.flush()
    assert len(_segment_ids(tmp_path)) == 21
    assert writer.close()
    assert not writer.healthy()


class _HostileRow(dict):
    """A mapping whose every accessor raises, as a buggy caller's object might."""

    def get(self, *args):
        raise RuntimeError("get exploded")

    def items(self):
        raise RuntimeError("items exploded")


def test_a_row_whose_methods_raise_is_quarantined_and_accounted_for(tmp_path):
    writer = _writer(tmp_path)
    writer.write(_HostileRow(request_id="x"))
    writer.write(_row(1))
    report = writer.flush()
    assert report["rows_quarantined"] == 1 and report["rows_written"] == 1 and report["queue_depth"] == 0
    assert report["errors"] == 0 and writer.healthy()
    [quarantine] = (tmp_path / "r0" / "quarantine").glob("*.jsonl")
    [record] = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert "get exploded" in record["reason"] and "cannot be described" in record["row"]
    writer.close()


def test_stats_has_exactly_the_documented_keys_and_feeds_prometheus(tmp_path):
    writer = _writer(tmp_path)
    writer.write(_row(1))
    writer.write(_row(2, domain=7))
    writer.flush()
    stats = writer.stats()
    assert set(stats) == {"rows_written", "rows_dropped", "drop_reasons", "rows_quarantined", "queue_depth",
                          "alive", "errors", "disk_full", "writing_fails", "last_error"}
    assert not stats["disk_full"] and stats["last_error"] is None
    registry = CollectorRegistry()
    registry.register(FeedbackCollector(writer))
    text = generate_latest(registry).decode()
    assert "leap:feedback_rows_written_total 1.0" in text
    assert "leap:feedback_rows_quarantined_total 1.0" in text
    assert "leap:feedback_writer_alive 1.0" in text
    assert "leap:feedback_disk_full 0.0" in text
    writer.close()
    assert writer.write(_row(3)) is False
    assert writer.stats()["drop_reasons"] == {"closed": 1}


class _SlowFeature:
    """A feature whose conversion waits for the test: the writer thread is busy while rows pile up."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __array__(self, dtype=None, copy=None):
        self.entered.set()
        self.release.wait(10)
        return np.zeros(DIM, dtype=np.float32)


def test_the_backlog_is_bounded_and_rows_beyond_it_are_counted(tmp_path):
    writer = _writer(tmp_path, max_queue_rows=5)
    slow = _SlowFeature()
    assert writer.write(_row(0, feature=slow))
    assert slow.entered.wait(5)
    accepted = [writer.write(_row(i)) for i in range(1, 9)]
    assert accepted == [True] * 4 + [False] * 4  # the slow row holds one of the five places
    stats = writer.stats()
    assert stats["queue_depth"] == 5
    assert stats["rows_dropped"] == 4 and stats["drop_reasons"] == {"queue_full": 4}
    slow.release.set()
    writer.flush()
    assert sorted(_segment_ids(tmp_path)) == [f"req-{i:05d}" for i in range(5)]
    assert writer.stats()["queue_depth"] == 0
    writer.close()


# ------------------------------------------------------------------------------- a full disk

@pytest.fixture
def tiny_disk(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                              check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def grow(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, timeout=30)

    try:
        yield folder, grow
    finally:
        if subprocess.run(["umount", str(folder)], check=False, capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True, timeout=30)


def test_a_full_disk_keeps_rows_for_a_retry_counts_overflow_and_loses_nothing_written(tiny_disk):
    folder, grow = tiny_disk
    dim = 1024  # 4 KiB of feature per row: the 256 KiB disk is full after a few dozen rows
    writer = _writer(folder, dim=dim, flush_rows=8, max_queue_rows=120, max_rows=100_000)
    accepted = []
    for i in range(80):
        if writer.write(_row(i, dim=dim)):
            accepted.append(f"req-{i:05d}")
    _wait(lambda: writer.stats()["errors"] > 0)
    assert writer.healthy() and writer.stats()["alive"]
    with pytest.raises(FeedbackFlushError, match="waiting for the disk|not converted"):
        writer.flush()
    for i in range(80, 400):
        if writer.write(_row(i, dim=dim)):
            accepted.append(f"req-{i:05d}")
    stats = writer.stats()
    assert stats["drop_reasons"].get("disk_full", 0) > 0
    assert set(stats["drop_reasons"]) == {"disk_full"}
    assert stats["disk_full"] and stats["writing_fails"] and "No space left" in stats["last_error"]
    assert stats["queue_depth"] <= 120
    assert len(accepted) + stats["rows_dropped"] == 400
    assert writer.healthy()

    grow("32m")
    report = writer.flush(timeout=30)
    ids = _segment_ids(folder)
    assert len(ids) == len(set(ids))  # a batch cut short by the full disk is not written twice
    assert sorted(ids) == sorted(accepted)
    assert report["rows_written"] == len(accepted) and report["queue_depth"] == 0
    assert not report["disk_full"] and not report["writing_fails"]
    assert _partials(folder / "r0") == []
    assert not list(folder.glob(".*.tmp"))
    assert writer.close()


# ------------------------------------------------------------------------------- replica folders

def test_a_restarting_replica_leaves_another_replicas_open_segment_alone(tmp_path):
    first = _writer(tmp_path, "serving-0", flush_rows=1, max_seconds=3600)
    for i in range(5):
        first.write(_row(i))
    _wait(lambda: first.stats()["rows_written"] == 5)
    [open_segment] = _partials(tmp_path / "serving-0")

    second = _writer(tmp_path, "serving-1")  # starts (or restarts) while serving-0 has a segment open
    assert open_segment.exists()
    assert second.recovered_rows == 0 and second.adopted_rows == 0
    for i in range(5, 10):
        first.write(_row(i))
        second.write(_row(100 + i))
    first.flush()
    second.flush()
    ids = _segment_ids(tmp_path)
    assert sorted(ids) == sorted([f"req-{i:05d}" for i in range(10)] + [f"req-{100 + i:05d}" for i in range(5, 10)])
    assert first.stats()["errors"] == 0 and first.healthy()
    assert all("serving-0" in p.name or "serving-1" in p.name for p in tmp_path.glob("*.parquet"))
    first.close()
    second.close()


def test_a_replica_id_in_use_by_a_live_writer_gets_its_own_folder(tmp_path):
    first = _writer(tmp_path, "same")
    second = _writer(tmp_path, "same", lock_wait_s=0.1)
    assert first.replica_id == "same"
    assert second.replica_id.startswith("same-") and second.replica_dir != first.replica_dir
    first.write(_row(1))
    second.write(_row(2))
    first.flush()
    second.flush()
    assert sorted(_segment_ids(tmp_path)) == ["req-00001", "req-00002"]
    first.close()
    second.close()
    third = _writer(tmp_path, "same", lock_wait_s=0.1)  # free again once the first writer closed
    assert third.replica_id == "same"
    third.close()


def test_the_default_replica_id_comes_from_the_environment_or_the_host(monkeypatch):
    monkeypatch.setenv("LEAP_REPLICA_ID", "serving-7/../x")
    assert default_replica_id() == "serving-7_.._x"
    monkeypatch.delenv("LEAP_REPLICA_ID")
    assert default_replica_id(port=8011).endswith("-8011")


_CRASH = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from serving.feedback.writer import FeedbackWriter
    root, replica, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    w = FeedbackWriter(root, 8, 3, "m", "fp", flush_rows=1, flush_seconds=0.02, max_seconds=3600,
                       replica_id=replica)
    for i in range(n):
        w.write({"request_id": f"{replica}-{i}", "feature": np.zeros(8, dtype=np.float32)})
    while w.stats()["rows_written"] < n:
        time.sleep(0.01)
    os._exit(0)  # a crash: no close, the segment stays an open stream
""")


def _crash(root: Path, replica: str, n: int) -> Path:
    subprocess.run([sys.executable, "-c", _CRASH, str(root), replica, str(n)], check=True, cwd=REPO,
                   timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    [partial] = _partials(root / replica)
    return partial


def test_a_crashed_replica_recovers_its_own_segment_on_restart(tmp_path):
    partial = _crash(tmp_path, "crashy", 7)
    writer = _writer(tmp_path, "crashy")
    assert writer.recovered_rows == 7
    assert not partial.exists()
    assert sorted(_segment_ids(tmp_path)) == sorted(f"crashy-{i}" for i in range(7))
    writer.close()


def test_a_dead_replicas_segment_is_adopted_only_once_stale_and_a_live_ones_never(tmp_path):
    orphan = _crash(tmp_path, "gone", 4)
    live = _writer(tmp_path, "held", flush_rows=1, max_seconds=3600)
    live.write(_row(1))
    _wait(lambda: live.stats()["rows_written"] == 1)
    [held] = _partials(tmp_path / "held")

    fresh = _writer(tmp_path, "newcomer")
    assert orphan.exists() and fresh.adopted_rows == 0  # too recent: it may belong to a restarting replica
    fresh.close()

    hours_ago = time.time() - 7200
    os.utime(orphan, (hours_ago, hours_ago))
    os.utime(held, (hours_ago, hours_ago))
    later = _writer(tmp_path, "newcomer")
    assert later.adopted_rows == 4 and not orphan.exists()
    assert held.exists()  # stale, but its writer holds the lock
    live.flush()
    assert sorted(_segment_ids(tmp_path)) == sorted([f"gone-{i}" for i in range(4)] + ["req-00001"])
    assert (tmp_path / "gone" / LOCK_NAME).exists()
    later.close()
    live.close()


def test_a_segment_removed_under_the_writer_is_still_converted(tmp_path):
    writer = _writer(tmp_path, flush_rows=1, max_seconds=3600)
    for i in range(3):
        writer.write(_row(i))
    _wait(lambda: writer.stats()["rows_written"] == 3)
    [partial] = _partials(tmp_path / "r0")
    partial.unlink()  # what another replica's recovery did to an open segment before replica folders
    writer.write(_row(3))
    writer.flush()
    assert sorted(_segment_ids(tmp_path)) == [f"req-{i:05d}" for i in range(4)]
    assert writer.healthy()
    writer.write(_row(4))
    writer.flush()
    assert len(_segment_ids(tmp_path)) == 5
    writer.close()


def test_segments_rotate_by_rows_into_the_shared_folder(tmp_path):
    writer = _writer(tmp_path, max_rows=10, flush_rows=4)
    for i in range(25):
        writer.write(_row(i))
    writer.flush()
    segments = sorted(tmp_path.glob("*.parquet"))
    assert [pq.read_metadata(p).num_rows for p in segments] == [10, 10, 5]
    table = read_segment_file(segments[0])
    assert table.schema.metadata[b"leap.dim"] == str(DIM).encode()
    assert table.schema.metadata[b"leap.replica_id"] == b"r0"  # ingest attributes the rows by it
    np.testing.assert_array_equal(np.stack(table.column("feature").to_numpy(zero_copy_only=False))[3],
                                  _row(3)["feature"])
    writer.close()
