"""Scenarios of the fault suite that try to lock or bloat one live replica from outside.

- `admin_slowloris`: twelve connections to the admin API from one address, each sending one header line
  every two seconds, as a client that wants to hold every handler would. Meanwhile `/leap/health` and
  `/metrics` answer 200 every time. A flush with the token, sent from another loopback address as a control
  plane on another host would, is served. Each trickling connection is cut off at the head deadline or
  refused at once. The replica then serves a good request.
- `unknown_extras`: 10,000 distinct unknown `leap_*` keys (100 requests of 100 keys each) are refused with
  400 by the API middleware. `/metrics` does not grow, and the readout is unchanged.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

import httpx

from experiments.faults.clients import Replica, result
from experiments.faults.serve import openai_body, openai_path
from leap_io.admin_client import FEEDBACK_FLUSH_PATH, AdminClient, admin_headers

TRICKLERS = 12
TRICKLE_EVERY_S = 2.0
OTHER_HOST = "127.0.0.2"  # the whole 127/8 is loopback on Linux: another source address on this machine


def _trickle(port: int, stop: threading.Event, outcomes: list[str]) -> None:
    """Hold a connection by sending a header line every TRICKLE_EVERY_S until the server answers or closes."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.sendall(b"GET /leap/readout HTTP/1.1\r\nHost: leap\r\n")
            while not stop.is_set():
                conn.settimeout(TRICKLE_EVERY_S)
                try:
                    answer = conn.recv(4096)
                except TimeoutError:
                    conn.sendall(b"X-Trickle: 1\r\n")
                    continue
                outcomes.append(answer.split(b"\r\n", 1)[0].decode(errors="replace") if answer else "closed")
                return
            outcomes.append("still held")
    except OSError as exc:  # a reset while writing is the server cutting the connection too
        outcomes.append(type(exc).__name__)


def admin_slowloris(replica: Replica, hold_s: float = 16.0) -> dict[str, Any]:
    """Twelve trickling connections against the admin API; health, metrics and the control plane go on."""
    started = time.monotonic()
    before = replica.admin.anchor()
    port = replica.serve.admin_port
    stop, outcomes = threading.Event(), []
    hogs = [threading.Thread(target=_trickle, args=(port, stop, outcomes), daemon=True) for _ in range(TRICKLERS)]
    for hog in hogs:
        hog.start()
    time.sleep(1.0)  # every trickler connected: this address's share of the handlers is held
    other = httpx.Client(transport=httpx.HTTPTransport(local_address=OTHER_HOST), timeout=30)
    try:  # the control plane, from another host, while the flood holds
        flushed: int | str = other.post(f"{replica.admin.url}{FEEDBACK_FLUSH_PATH}", content=b"",
                                        headers=admin_headers(replica.admin.token)).status_code
    except httpx.HTTPError as exc:
        flushed = f"no answer: {exc}"
    finally:
        other.close()
    health: list[int] = []
    metrics: list[int] = []
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        try:
            health.append(AdminClient(replica.admin.url, None, timeout=5).health().status_code)
            metrics.append(AdminClient(replica.admin.url, None, timeout=5).metrics().status_code)
        except httpx.HTTPError:
            health.append(-1)
        time.sleep(0.5)
    stop.set()
    for hog in hogs:
        hog.join(TRICKLE_EVERY_S + 5)
    refusals = _refusals(replica.admin.metrics())
    good = replica.good_request("slowloris")
    after = replica.admin.anchor()
    cut = [o for o in outcomes if o.startswith(("HTTP/1.0 408", "HTTP/1.0 503")) or o.endswith("Error")]
    survived = (set(health) == {200} and set(metrics) <= {200} and flushed == 200 and len(cut) == TRICKLERS
                and good and after == before and replica.alive())
    detail = (f"{TRICKLERS} trickling connections for {hold_s:.0f}s: health {sorted(set(health))} over "
              f"{len(health)} probes, metrics {sorted(set(metrics))}, a flush from {OTHER_HOST} {flushed}, "
              f"{len(cut)} cut off or refused ({sorted(set(outcomes))}); refusals {refusals}; good request after: {good}")
    return result("admin_slowloris", started, survived, detail, health_probes=len(health),
                  health_statuses=sorted(set(health)), flush_from_another_host=flushed, cut_off=len(cut),
                  trickler_outcomes=sorted(set(outcomes)), refusals=refusals, readout_unchanged=after == before,
                  requests_lost=int(not good))


def _refusals(metrics_text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'leap:admin_refused_total\{reason="([^"]+)"\} ([0-9.e+]+)', metrics_text)}


def unknown_extras(replica: Replica, requests: int = 100, keys_per_request: int = 100) -> dict[str, Any]:
    """`requests` x `keys_per_request` distinct unknown `leap_*` keys: each request a 400, /metrics unchanged."""
    started = time.monotonic()
    before = replica.admin.anchor()
    size_before = len(replica.admin.metrics().splitlines())
    statuses: dict[int, int] = {}
    named = 0
    for i in range(requests):
        xargs = {f"leap_unknown_{i * keys_per_request + k}": k for k in range(keys_per_request)}
        body = openai_body(replica.model, "chat", i, 4, xargs)
        try:
            response = replica.client.post(f"{replica.serve.url}{openai_path('chat')}", json=body)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            named += int(response.status_code == 400 and f"leap_unknown_{i * keys_per_request}" in response.text)
        except httpx.HTTPError:
            statuses[-1] = statuses.get(-1, 0) + 1
    size_after = len(replica.admin.metrics().splitlines())
    good = replica.good_request("unknown-extras")
    after = replica.admin.anchor()
    survived = (statuses == {400: requests} and named == requests and size_after <= size_before + 8 and good
                and after == before and replica.alive())
    detail = (f"{requests * keys_per_request} distinct unknown leap_* keys in {requests} requests: statuses "
              f"{statuses}, each naming its keys: {named}; /metrics lines {size_before} -> {size_after}; "
              f"good request after: {good}")
    return result("unknown_extras", started, survived, detail, distinct_keys=requests * keys_per_request,
                  statuses={str(k): v for k, v in sorted(statuses.items())}, metrics_lines_before=size_before,
                  metrics_lines_after=size_after, readout_unchanged=after == before, requests_lost=int(not good))
