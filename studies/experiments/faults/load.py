"""Scenarios 4-5 of the fault suite: a push racing RLS publishes, and a storm of aborted requests.

Both run against the live replica of scenarios 1-3 with real traffic through vLLM's OpenAI server.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from experiments.faults.clients import Replica, result
from experiments.faults.serve import (
    LOOPBACK,
    base_version,
    bundle_of,
    completed,
    fault_readout,
    openai_body,
    openai_path,
    openai_request,
    prometheus_values,
)
from leap_io.admin_client import AdminClient
from serving.readout.push import version_key


class Traffic:
    """Short chat and completion requests from `concurrency` threads until stopped (or `limit` sent)."""

    def __init__(self, replica: Replica, concurrency: int = 8, limit: int = 2000, tag: str = "traffic",
                 max_tokens: tuple[int, int] = (4, 24), seed: int = 0) -> None:
        self.replica = replica
        self.concurrency = concurrency
        self.limit = limit
        self.tag = tag
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.statuses: Counter[int] = Counter()
        self.completed_ids: list[str] = []
        self.failed_ids: list[str] = []
        self._pool: ThreadPoolExecutor | None = None
        self._client = httpx.Client(timeout=120.0, limits=httpx.Limits(max_connections=concurrency + 2))

    def _next(self) -> tuple[int, int] | None:
        with self.lock:
            if self.stop_event.is_set() or self.sent >= self.limit:
                return None
            index = self.sent
            self.sent += 1
            return index, self.rng.randint(*self.max_tokens)

    def _worker(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            index, max_tokens = job
            endpoint = "chat" if index % 2 == 0 else "completions"
            rid = f"fault-{self.tag}-{index}"
            body = openai_body(self.replica.model, endpoint, index, max_tokens, {"leap_request_id": rid})
            status, answer = openai_request(self._client, self.replica.serve.url, body, endpoint)
            with self.lock:
                self.statuses[status] += 1
                (self.completed_ids if completed(status, answer) else self.failed_ids).append(rid)

    def start(self) -> Traffic:
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"leap-fault-{self.tag}")
        for _ in range(self.concurrency):
            self._pool.submit(self._worker)
        return self

    def stop(self, timeout: float = 180.0) -> None:
        self.stop_event.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()


# ---------------------------------------------------------------------------- 4. push during RLS publishes

class VersionPoller:
    """GET /leap/readout every `interval_s`; records (time the request was sent, version, generation)."""

    def __init__(self, url: str, token: str, interval_s: float = 0.025) -> None:
        self.url = url
        self.token = token
        self.interval_s = interval_s
        self.observations: list[tuple[float, str, int]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leap-fault-poller", daemon=True)

    def _run(self) -> None:
        with AdminClient(self.url, self.token, timeout=10.0) as admin:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    described = admin.readout().json()
                    self.observations.append((sent, str(described.get("version", "")),
                                              int(described.get("generation", -1))))
                except (httpx.HTTPError, ValueError):
                    self.errors += 1
                self._stop.wait(self.interval_s)

    def start(self) -> VersionPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def _older(version: str, than: str) -> bool:
    new, old = version_key(version), version_key(than)
    return new is None or old is None or new[0] != old[0] or new[1] < old[1]


def push_during_rls(replica: Replica, pushes: int = 3, wait_for_publish_s: float = 45.0,
                    first_version: int | None = None) -> dict[str, Any]:
    """Push new versions while traffic makes RLS publish `<base>+rlsN`: after each push is acknowledged
    the replica serves the pushed version or its RLS corrections, never an older base again."""
    started = time.monotonic()
    current = base_version(replica.admin.readout().get("version"))
    key = version_key(current)
    number = first_version or ((int(key[1]) + 1) if key is not None and key[0] == "v" else 11)
    _, health = replica.admin.health()
    stale_before = health.get("counters", {}).get("dropped", {}).get("readout/stale_generation", 0)
    poller = VersionPoller(replica.admin.url, replica.admin.token).start()
    traffic = Traffic(replica, concurrency=8, limit=3000, tag="rls", seed=4).start()
    acks: list[dict[str, Any]] = []
    publishes_before_push: list[int] = []
    problems: list[str] = []
    try:
        for step in range(pushes):
            # wait until the serving base has been corrected by RLS at least once, so the push lands
            # between publishes (and the learner is busy with rows of the old anchor)
            deadline = time.monotonic() + wait_for_publish_s
            serving = replica.admin.readout().get("version", "")
            while "+rls" not in serving and time.monotonic() < deadline:
                time.sleep(0.1)
                serving = replica.admin.readout().get("version", "")
            publishes_before_push.append(int(serving.rsplit("+rls", 1)[1]) if "+rls" in serving else 0)
            version = f"v{number + step}"
            readout, rls = fault_readout(replica.described, version, seed=200 + step)
            body = bundle_of(readout, rls)
            sent = time.monotonic()
            response = replica.admin.push(body)
            acked = time.monotonic()
            right_after = replica.admin.readout().get("version", "")
            ack = {"version": version, "status": response.status_code, "serving_before": serving,
                   "serving_right_after": right_after, "sent": sent, "acked": acked}
            acks.append(ack)
            if response.status_code != 200:
                problems.append(f"push {version} answered {response.status_code}: {response.text[:200]}")
                break
            replica.pushed.append(version)
            if base_version(right_after) != version:
                problems.append(f"right after push {version} the replica served {right_after}")
        # let RLS publish on the last push too
        deadline = time.monotonic() + wait_for_publish_s
        while "+rls" not in replica.admin.readout().get("version", "") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        poller.stop()
        traffic.stop()
    final = replica.admin.readout()
    _, health = replica.admin.health()
    stale_after = health.get("counters", {}).get("dropped", {}).get("readout/stale_generation", 0)
    regressions = []
    good_acks = [a for a in acks if a["status"] == 200]
    for sent_at, version, _ in poller.observations:
        newest = None
        for ack in good_acks:
            if ack["acked"] <= sent_at:
                newest = ack["version"]
        if newest is not None and _older(base_version(version), newest):
            regressions.append((round(sent_at - started, 3), version, newest))
    rls_versions = sorted({v for _, v, _ in poller.observations if "+rls" in v})
    rls_bases = {base_version(v) for v in rls_versions}
    last = good_acks[-1]["version"] if good_acks else None
    final_ok = last is not None and base_version(final.get("version")) == last
    lost = len(traffic.failed_ids)
    exercised = all(n > 0 for n in publishes_before_push) and bool(rls_versions)
    survived = (not problems and not regressions and final_ok and lost == 0 and len(good_acks) == pushes
                and exercised)
    detail = (f"{len(good_acks)}/{pushes} pushes taken while {traffic.sent} requests ran; RLS had published "
              f"{publishes_before_push} corrections before each push; {len(rls_versions)} distinct +rls versions seen "
              f"over {len(rls_bases)} bases in {len(poller.observations)} polls; {len(regressions)} polls served an "
              f"older base after a push; final {final.get('version')}; stale RLS publishes dropped by generation: "
              f"{stale_after - stale_before}")
    if problems:
        detail += "; " + "; ".join(problems)
    if not exercised:
        detail += "; RLS did not publish before every push, so the race was not fully exercised"
    return result("push_during_rls", started, survived, detail, pushes=len(good_acks),
                  publishes_before_each_push=publishes_before_push, rls_versions_seen=len(rls_versions),
                  polls=len(poller.observations), poll_errors=poller.errors, regressions=regressions[:10],
                  stale_publishes_dropped=stale_after - stale_before, final_version=final.get("version"),
                  acks=[{k: v for k, v in a.items() if k not in ("sent", "acked")} for a in acks],
                  requests_sent=traffic.sent, requests_completed=len(traffic.completed_ids), requests_lost=lost)


# ---------------------------------------------------------------------------- 5. 10,000 aborted requests

ABORT_MODES = ("close_after_send", "close_after_head", "close_after_first_token", "client_timeout")
STATE_KINDS = ("tracked", "features", "predictions", "orphans", "awaiting_feature")


def _request_bytes(model: str, endpoint: str, index: int, max_tokens: int) -> bytes:
    body = openai_body(model, endpoint, index, max_tokens, {"leap_request_id": f"fault-abort-{index}"},
                       stream=True)
    body["ignore_eos"] = True  # it would run to max_tokens: only the abort ends it early
    payload = json.dumps(body).encode()
    head = (f"POST {openai_path(endpoint)} HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    return head + payload


async def _one_abort(port: int, data: bytes, mode: str, timeout_s: float, rng: random.Random) -> str:
    """Open one streaming request and drop the connection as `mode` says; what happened."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), timeout_s)
    except (TimeoutError, OSError):
        return "connect_failed"
    outcome = "aborted"
    try:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), timeout_s)
        if mode == "close_after_send":
            return outcome
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        if not head.startswith(b"HTTP/1.1 200"):
            return "refused"
        if mode == "close_after_head":
            return outcome
        if mode == "close_after_first_token":
            seen = b""
            while seen.count(b"data: ") < 2:  # the first event of a chat stream carries only the role
                chunk = await asyncio.wait_for(reader.read(4096), timeout_s)
                if not chunk:
                    return "ended_early"
                seen += chunk
                if b"[DONE]" in seen:
                    return "completed"
            return outcome
        # client_timeout: read until a short client-side timeout fires (or the stream ends first)
        try:
            rest = await asyncio.wait_for(reader.read(-1), rng.uniform(0.02, 0.3))
            return "completed" if b"[DONE]" in rest else "ended_early"
        except TimeoutError:
            return outcome
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return "error"
    finally:
        writer.transport.abort()  # RST: the server sees the client gone at once


async def _storm(port: int, model: str, total: int, concurrency: int, deadline: float, max_tokens: int,
                 seed: int) -> tuple[int, dict[str, Counter]]:
    rng = random.Random(seed)
    outcomes: dict[str, Counter] = {mode: Counter() for mode in ABORT_MODES}
    counter = {"next": 0}

    async def worker() -> None:
        while time.monotonic() < deadline:
            index = counter["next"]
            if index >= total:
                return
            counter["next"] = index + 1
            mode = ABORT_MODES[index % len(ABORT_MODES)]
            endpoint = "chat" if (index // len(ABORT_MODES)) % 2 == 0 else "completions"
            data = _request_bytes(model, endpoint, index, max_tokens)  # its own leap_request_id
            outcome = await _one_abort(port, data, mode, 60.0, rng)
            outcomes[mode][outcome] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counter["next"], outcomes


def _engine_idle(replica: Replica, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """Wait until vLLM reports no running or waiting request; its last figures."""
    deadline = time.monotonic() + timeout_s
    figures: dict[str, float] = {}
    while True:
        try:
            text = httpx.get(f"{replica.serve.url}/metrics", timeout=10).text
            running = sum(prometheus_values(text, "vllm:num_requests_running").values())
            waiting = sum(prometheus_values(text, "vllm:num_requests_waiting").values())
            figures = {"running": running, "waiting": waiting}
            if running == 0 and waiting == 0:
                return True, figures
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return False, figures
        time.sleep(0.5)


def _state(replica: Replica) -> dict[str, int]:
    _, health = replica.admin.health()
    return dict(health.get("counters", {}).get("state", {}))


def _gauges(replica: Replica) -> dict[str, float]:
    values = prometheus_values(replica.admin.metrics(), "leap:tracked_state")
    return {label.split('"')[1]: value for label, value in values.items() if '"' in label}


def abort_storm(replica: Replica, total: int = 10_000, concurrency: int = 64, time_budget_s: float = 600.0,
                max_tokens: int = 128, settle_s: float = 60.0) -> dict[str, Any]:
    """`total` streaming requests dropped by the client at four moments (right after sending, after the
    response head, after the first token, at a short client timeout), `concurrency` at a time; then the
    per-request state must be back at its baseline."""
    started = time.monotonic()
    idle, _ = _engine_idle(replica, settle_s)
    baseline = _state(replica)
    baseline_gauges = _gauges(replica)
    _, health = replica.admin.health()
    dropped_before = dict(health.get("counters", {}).get("dropped", {}))
    storm_started = time.monotonic()
    ran, outcomes = asyncio.run(_storm(replica.serve.port, replica.model, total, concurrency,
                                       storm_started + time_budget_s, max_tokens, seed=5))
    storm_s = time.monotonic() - storm_started
    drained, engine_figures = _engine_idle(replica, settle_s)
    # the tracker may still be pruning late arrivals: give it a few seconds to reach the baseline
    deadline = time.monotonic() + 20.0
    after = _state(replica)
    while any(after.get(k, 0) > baseline.get(k, 0) for k in STATE_KINDS) and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _state(replica)
    good = replica.good_request("after-aborts")  # also makes the engine step, which refreshes the gauges
    time.sleep(1.5)
    replica.good_request("after-aborts-2")
    after = _state(replica)
    after_gauges = _gauges(replica)
    _, health = replica.admin.health()
    dropped_after = dict(health.get("counters", {}).get("dropped", {}))
    dropped = {k: v - dropped_before.get(k, 0) for k, v in dropped_after.items() if v != dropped_before.get(k, 0)}
    back = {kind: after.get(kind, 0) <= baseline.get(kind, 0) for kind in STATE_KINDS}
    from serving.config import LeapConfig

    finished_cap = LeapConfig.model_fields["finished_memory"].default
    bounded = after.get("finished_memory", 0) <= finished_cap
    totals = Counter()
    for counts in outcomes.values():
        totals.update(counts)
    alive = replica.alive()
    back_to_baseline = all(back.values()) and bounded
    survived = back_to_baseline and good and alive and drained and ran == total
    rate = ran / storm_s if storm_s > 0 else 0.0
    detail = (f"{ran} of {total} streaming requests dropped by the client in {storm_s:.0f}s ({rate:.0f}/s, "
              f"{concurrency} at a time; outcomes {dict(totals)}); engine idle after: {drained}; per-request state "
              f"{ {k: after.get(k) for k in STATE_KINDS} } vs baseline { {k: baseline.get(k) for k in STATE_KINDS} }; "
              f"recently-finished memory {after.get('finished_memory')} (bounded at {finished_cap}); good request "
              f"after: {good}")
    if ran < total:
        detail += f"; only {ran} ran within the {time_budget_s:.0f}s budget"
    if not idle:
        detail += "; the engine was not idle before the storm"
    state_report = {"baseline": baseline, "after": after, "back_to_baseline": back_to_baseline,
                    "compared": list(STATE_KINDS), "per_kind": back,
                    "finished_memory_cap": finished_cap, "gauges_baseline": baseline_gauges,
                    "gauges_after": after_gauges, "aborts_run": ran}
    return result("abort_storm", started, survived, detail, aborts_requested=total, aborts_run=ran,
                  concurrency=concurrency, storm_s=round(storm_s, 1), aborts_per_s=round(rate, 1),
                  outcomes={mode: dict(c) for mode, c in outcomes.items()}, engine_after=engine_figures,
                  leap_dropped_during=dropped, per_request_state=state_report,
                  requests_lost=0 if good else 1)
