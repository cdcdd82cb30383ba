"""Scenarios 6-7 of the fault suite: a replica killed with SIGKILL mid-replay, and a full feedback disk.

Feedback is checked where ingest reads it: the complete Parquet segments at the top of the feedback
folder (a crashed replica's open stream becomes one when it restarts on the same folder and admin port),
and the per-replica quarantine files. A request "finished" when its client got a complete answer.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from experiments.faults.clients import Replica, result
from experiments.faults.load import Traffic
from experiments.faults.serve import (
    ServeFailed,
    base_version,
    bundle_of,
    completed,
    fault_readout,
    openai_body,
    openai_request,
)

FLUSH_WINDOW_S = 0.05
"""The feedback writer's `flush_seconds`: rows finished within it before a SIGKILL may not be on disk yet."""


def feedback_rows(folder: str | Path) -> tuple[Counter, Counter, int]:
    """(rows per client request id in complete segments, quarantined rows per client request id,
    unreadable segments)."""
    import pyarrow.parquet as pq

    rows: Counter[str] = Counter()
    quarantined: Counter[str] = Counter()
    unreadable = 0
    folder = Path(folder)
    for path in sorted(folder.glob("*.parquet")):
        try:
            rows.update(pq.read_table(path, columns=["client_request_id"]).column("client_request_id").to_pylist())
        except Exception:
            unreadable += 1
    for path in sorted(folder.glob("*/quarantine/*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line).get("row")
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("client_request_id"):
                quarantined[str(row["client_request_id"])] += 1
    return rows, quarantined, unreadable


# ---------------------------------------------------------------------------- 6. SIGKILL mid-replay

class Replay:
    """`n` requests with their own ids from `concurrency` threads, stoppable at once (`halt`)."""

    def __init__(self, replica: Replica, n: int, concurrency: int, tag: str, seed: int = 6) -> None:
        import random

        self.replica = replica
        self.n = n
        self.concurrency = concurrency
        self.tag = tag
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.next = 0
        self.halted = False
        self.in_flight: dict[str, float] = {}
        self.outcome: dict[str, tuple[bool, float, int]] = {}  # id -> (complete, wall time answered, status)
        self.tokens: dict[str, int] = {}  # id -> completion tokens the client got
        self.client = httpx.Client(timeout=180.0, limits=httpx.Limits(max_connections=concurrency + 2))
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"leap-fault-{tag}")

    def _worker(self) -> None:
        while True:
            with self.lock:
                if self.halted or self.next >= self.n:
                    return
                index = self.next
                self.next += 1
                rid = f"fault-{self.tag}-{index}"
                self.in_flight[rid] = time.time()
                max_tokens = self.rng.randint(8, 48)
            endpoint = "chat" if index % 2 == 0 else "completions"
            body = openai_body(self.replica.model, endpoint, index, max_tokens, {"leap_request_id": rid})
            status, answer = openai_request(self.client, self.replica.serve.url, body, endpoint)
            answered = time.time()
            with self.lock:
                self.in_flight.pop(rid, None)
                self.outcome[rid] = (completed(status, answer), answered, status)
                if isinstance(answer, dict):
                    self.tokens[rid] = int((answer.get("usage") or {}).get("completion_tokens") or 0)

    def start(self) -> Replay:
        for _ in range(self.concurrency):
            self.pool.submit(self._worker)
        return self

    def completed_count(self) -> int:
        with self.lock:
            return sum(ok for ok, _, _ in self.outcome.values())

    def halt(self) -> set[str]:
        """Stop sending; the ids in flight at this moment."""
        with self.lock:
            self.halted = True
            return set(self.in_flight)

    def join(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def kill9_mid_replay(replica: Replica, restart: Callable[[], Replica], n: int = 160, concurrency: int = 12,
                     kill_after: int | None = None, time_budget_s: float = 300.0) -> tuple[dict[str, Any], Replica | None]:
    """SIGKILL the replica (API server and engine core) while a replay runs, restart it on the same
    feedback folder, state folder and ports: it must serve the last pushed readout (source "state"),
    and every request whose client got a complete answer must have exactly one feedback row.

    Returns (result, the restarted replica or None)."""
    started = time.monotonic()
    if not replica.pushed:  # the replica must have a push of its own to restore
        readout, rls = fault_readout(replica.described, "v10", seed=300)
        response = replica.admin.push(bundle_of(readout, rls))
        if response.status_code == 200:
            replica.pushed.append("v10")
    last_pushed = replica.pushed[-1] if replica.pushed else None
    kill_after = kill_after or max(1, n // 2)
    replay = Replay(replica, n, concurrency, tag="kill9").start()
    deadline = time.monotonic() + time_budget_s / 2
    while time.monotonic() < deadline:
        with replay.lock:
            in_flight = len(replay.in_flight)
        if replay.completed_count() >= kill_after and in_flight > 0:
            break
        time.sleep(0.02)
    at_kill = replay.halt()
    killed_at = replica.serve.kill9()
    replay.join()
    finished = {rid: answered for rid, (ok, answered, _) in replay.outcome.items() if ok}
    lost_requests = sorted(rid for rid, (ok, _, _) in replay.outcome.items() if not ok and rid not in at_kill)
    finished_in_flight = sum(1 for rid in at_kill if replay.outcome.get(rid, (False,))[0])

    restarted: Replica | None = None
    restart_s = None
    error = None
    try:
        began = time.monotonic()
        restarted = restart()
        restart_s = time.monotonic() - began
    except (ServeFailed, httpx.HTTPError, OSError) as exc:
        error = f"restart failed: {exc}"
    if restarted is None:
        return result("kill9_mid_replay", started, False, error or "restart failed", requests_sent=replay.next,
                      finished_before_kill=len(finished), in_flight_at_kill=len(at_kill),
                      requests_lost=len(lost_requests), feedback_rows_lost=None), None

    described = restarted.admin.readout()
    source, version = described.get("source"), str(described.get("version", ""))
    flush = restarted.admin.flush()
    rows, quarantined, unreadable = feedback_rows(restarted.serve.feedback_dir)
    missing = [rid for rid in finished if rows[rid] == 0 and quarantined[rid] == 0]
    in_window = [rid for rid in missing if killed_at - finished[rid] <= FLUSH_WINDOW_S + 0.25]
    single_token = [rid for rid in missing if replay.tokens.get(rid, 0) <= 1]
    duplicated = {rid: count for rid, count in rows.items() if count > 1}
    in_flight_with_row = sum(1 for rid in at_kill if rows[rid] > 0)
    good = restarted.good_request("after-restart")
    restored = source == "state" and last_pushed is not None and base_version(version) == last_pushed
    survived = (restored and not lost_requests and not missing and not duplicated and good and not unreadable
                and flush.status_code == 200 and len(at_kill) > 0)
    detail = (f"SIGKILL after {len(finished)} of {replay.next} sent requests finished, {len(at_kill)} in flight; "
              f"restart in {restart_s:.0f}s serves {version} from {source} (last push {last_pushed}); "
              f"{len(finished) - len(missing)}/{len(finished)} finished requests have their feedback row, "
              f"{len(missing)} missing ({len(in_window)} of them finished within {FLUSH_WINDOW_S * 1000:.0f} ms of the kill, "
              f"the writer's flush interval); {len(duplicated)} ids with more than one row; "
              f"{in_flight_with_row} of the in-flight requests also left a row; good request after: {good}")
    if lost_requests:
        detail += f"; {len(lost_requests)} requests not in flight got no answer: {lost_requests[:5]}"
    return result("kill9_mid_replay", started, survived, detail, requests_sent=replay.next,
                  finished_before_kill=len(finished), in_flight_at_kill=len(at_kill),
                  in_flight_finished_anyway=finished_in_flight, requests_lost=len(lost_requests),
                  feedback_rows_lost=len(missing), rows_lost_within_flush_window=len(in_window),
                  rows_lost_of_single_token_requests=len(single_token),
                  missing_ids=missing[:20], feedback_rows_duplicated=len(duplicated),
                  in_flight_with_row=in_flight_with_row, unreadable_segments=unreadable,
                  restart_s=round(restart_s or 0.0, 1), restored_source=source, restored_version=version,
                  last_pushed=last_pushed, flush_status=flush.status_code), restarted


# ---------------------------------------------------------------------------- 7. full feedback disk

def mount_tmpfs(folder: Path, size: str) -> str | None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


def remount(folder: Path, size: str) -> str | None:
    done = subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], capture_output=True, text=True,
                          timeout=30)
    return None if done.returncode == 0 else done.stderr.strip()


def unmount(folder: Path) -> None:
    for args in (["umount", str(folder)], ["umount", "-l", str(folder)]):
        try:
            if subprocess.run(args, capture_output=True, timeout=30).returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            continue


def _feedback_health(replica: Replica) -> tuple[int, dict]:
    status, health = replica.admin.health()
    return status, dict(health.get("threads", {}).get("feedback", {}))


def disk_full(start_replica: Callable[[Path], Replica], stop_replica: Callable[[Replica], None], folder: Path,
              n: int = 160, size: str = "512k", free_kib: int = 96) -> dict[str, Any]:
    """One replica writes its feedback to a 512 KiB tmpfs that fills up under traffic (a ballast file
    leaves `free_kib` free). The replica must serve every request, keep or count every row (health shows
    the failing writes), and write the kept rows once the disk has room again."""
    started = time.monotonic()
    mount_error = mount_tmpfs(folder, size)
    if mount_error is not None:
        return result("disk_full", started, False, f"could not mount a tmpfs at {folder}: {mount_error}", ran=False)
    replica = None
    try:
        ballast = folder / "ballast.bin"
        total_kib = int(size.rstrip("kK")) if size.lower().endswith("k") else 512
        try:
            with open(ballast, "wb") as sink:
                sink.write(bytes(max(0, total_kib - free_kib) * 1024))
        except OSError:
            pass
        replica = start_replica(folder)
        traffic = Traffic(replica, concurrency=12, limit=n, tag="diskfull", max_tokens=(8, 32), seed=7).start()
        deadline = time.monotonic() + 600
        while traffic.sent < n and time.monotonic() < deadline:
            time.sleep(0.2)
        traffic.stop()
        finished = set(traffic.completed_ids)
        # the writer retries with a backoff; give it a moment to meet the full disk again
        full_status, full_health = _feedback_health(replica)
        wait_until = time.monotonic() + 15
        while not (full_health.get("errors") or full_health.get("rows_dropped")) and time.monotonic() < wait_until:
            time.sleep(0.5)
            full_status, full_health = _feedback_health(replica)
        flush_full = replica.admin.flush()
        df_full = shutil.disk_usage(folder)
        served_while_full = replica.good_request("while-disk-full")

        # room again: the kept rows must reach the disk
        ballast.unlink(missing_ok=True)
        remount_error = remount(folder, "16m")
        room_deadline = time.monotonic() + 45
        room_status, room_health = _feedback_health(replica)
        while room_health.get("queue_depth", 0) > 0 and time.monotonic() < room_deadline:
            time.sleep(0.5)
            room_status, room_health = _feedback_health(replica)
        flush_room = replica.admin.flush()
        room_status, room_health = _feedback_health(replica)
        rows, quarantined, unreadable = feedback_rows(folder)
        ours = [rid for rid in finished]
        missing = [rid for rid in ours if rows[rid] == 0 and quarantined[rid] == 0]
        dropped = int(room_health.get("rows_dropped") or 0)
        lost = max(0, len(missing) - dropped)
        duplicated = sum(1 for rid in ours if rows[rid] > 1)
        alive = replica.alive()
        reported = bool(full_health.get("errors")) or bool(full_health.get("drop_reasons", {}).get("disk_full"))
        survived = (len(traffic.failed_ids) == 0 and served_while_full and reported and lost == 0 and not duplicated
                    and alive and flush_room.status_code == 200 and not unreadable and remount_error is None)
        detail = (f"{len(finished)}/{traffic.sent} requests served on a full feedback disk "
                  f"({df_full.free // 1024} KiB free); health while full: status {full_status}, writer errors "
                  f"{full_health.get('errors')}, rows waiting {full_health.get('queue_depth')}, dropped "
                  f"{full_health.get('drop_reasons')}; flush while full answered {flush_full.status_code}; after "
                  f"room again: {len(ours) - len(missing)}/{len(ours)} rows on disk, {dropped} counted as dropped "
                  f"({room_health.get('drop_reasons')}), {lost} lost, flush {flush_room.status_code}")
        return result("disk_full", started, survived, detail, requests_sent=traffic.sent,
                      requests_completed=len(finished), requests_lost=len(traffic.failed_ids),
                      feedback_rows_lost=lost, feedback_rows_on_disk=len(ours) - len(missing),
                      feedback_rows_dropped=dropped, drop_reasons=room_health.get("drop_reasons"),
                      feedback_rows_duplicated=duplicated, health_while_full={"status": full_status, **full_health},
                      health_after_room={"status": room_status, **room_health},
                      flush_while_full=flush_full.status_code, flush_after_room=flush_room.status_code,
                      unreadable_segments=unreadable)
    except (ServeFailed, httpx.HTTPError, OSError) as exc:
        return result("disk_full", started, False, f"{type(exc).__name__}: {exc}")
    finally:
        if replica is not None:
            stop_replica(replica)
        unmount(folder)
