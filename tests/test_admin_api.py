"""The admin HTTP server against hostile clients: real sockets on 127.0.0.1, no client library where a
client library would refuse to send the malformed request."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from serving.admin.api import DEFAULT_MAX_BODY, AdminServer, body_limit
from serving.feedback.writer import FeedbackFlushError
from serving.readout.push import validate_push

TOKEN = "admin-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIM = 8


class Target:
    """An admin target like the runtime: validates pushes with the real validator and keeps the readout."""

    def __init__(self, dim: int = DIM) -> None:
        self.dim = dim
        self.metrics_registry = CollectorRegistry()
        self.readout: LinearReadout | None = None
        self.flush_error: Exception | None = None
        self.describe_error: Exception | None = None

    def describe(self) -> dict:
        if self.describe_error is not None:
            raise self.describe_error
        version = "" if self.readout is None else self.readout.metadata.get("version", "")
        return {"version": version, "dim": self.dim}

    def push_readout(self, body: bytes) -> dict:
        self.readout, _ = validate_push(body, {"dim": self.dim, "layer": 1, "model_fingerprint": "fp"}, self.readout)
        return {"version": self.readout.metadata["version"]}

    def flush_feedback(self) -> dict:
        if self.flush_error is not None:
            raise self.flush_error
        return {"flushed": True}


class HealthTarget(Target):
    def __init__(self) -> None:
        super().__init__()
        self.report: object = {"healthy": True, "feedback": {"alive": True}}

    def health(self) -> dict:
        if isinstance(self.report, Exception):
            raise self.report
        return self.report


def _readout_bytes(version: str = "v1") -> bytes:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(50, DIM))
    readout = LinearReadout(max_tokens=256).fit(features, rng.integers(1, 256, 50))
    readout.metadata.update(model_id="m", model_fingerprint="fp", layer=1, version=version)
    return to_bytes(readout)


@pytest.fixture
def serve():
    servers = []

    def start(target=None, **kwargs):
        target = target or Target()
        server = AdminServer(target, "127.0.0.1", 0, TOKEN, **kwargs)
        servers.append(server)
        return target, server, f"http://127.0.0.1:{server.port}"

    yield start
    for server in servers:
        server.close()


def _raw(port: int, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict]:
    """Send a hand-written request; (status, JSON body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(head.encode() + body)
        data = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, json.loads(payload) if payload else {}


def _post_head(length_header: str) -> str:
    return (f"POST /leap/readout HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"{length_header}Connection: close\r\n\r\n")


@pytest.mark.parametrize("value", ["abc", "-5", "1e3", "+7", "5_0", " ", "99999999999999999999999"])
def test_a_content_length_that_is_not_a_count_is_400_and_the_server_carries_on(serve, value):
    _, server, url = serve()
    status, body = _raw(server.port, _post_head(f"Content-Length: {value}\r\n"))
    assert status == 400 and "Content-Length" in body["error"]
    assert httpx.get(f"{url}/leap/readout", headers=AUTH).status_code == 200


def test_a_push_without_a_length_or_with_a_chunked_body_is_411(serve):
    _, server, _ = serve()
    status, body = _raw(server.port, _post_head(""))
    assert status == 411 and "Content-Length" in body["error"]
    status, body = _raw(server.port, _post_head("Transfer-Encoding: chunked\r\n"), b"5\r\nhello\r\n0\r\n\r\n")
    assert status == 411 and "chunked" in body["error"]


def test_a_body_over_the_cap_is_413_before_it_is_read(serve):
    _, server, _ = serve(max_body=1 << 20)
    started = time.monotonic()
    status, body = _raw(server.port, _post_head(f"Content-Length: {1 << 30}\r\n"), timeout=5)
    assert status == 413 and str(1 << 20) in body["error"]
    assert time.monotonic() - started < 2  # answered without waiting for a GiB


def test_the_default_cap_fits_a_full_bundle_of_the_targets_dim(serve):
    assert body_limit(Target(dim=8), None) == DEFAULT_MAX_BODY
    wide = body_limit(Target(dim=4096), None)
    assert wide > 2 * 4097 ** 2 * 8  # P and A of an RLS anchor at dim 4096
    assert body_limit(object(), None) == DEFAULT_MAX_BODY
    _, server, _ = serve()
    status, _ = _raw(server.port, _post_head(f"Content-Length: {DEFAULT_MAX_BODY + 1}\r\n"), timeout=5)
    assert status == 413


def test_a_stalled_body_times_out_with_408_instead_of_holding_a_thread(serve):
    _, server, url = serve(request_timeout=0.5)
    started = time.monotonic()
    status, body = _raw(server.port, _post_head("Content-Length: 100\r\n"), b"PK" + b"x" * 8, timeout=10)
    assert status == 408 and "10 of 100 bytes" in body["error"]
    assert time.monotonic() - started < 5
    assert httpx.get(f"{url}/leap/readout", headers=AUTH).status_code == 200


def test_concurrent_requests_beyond_the_cap_get_503_and_the_slots_come_back(serve):
    _, server, url = serve(max_handlers=2, max_per_address=2, request_timeout=10)
    hogs = []
    for _ in range(2):  # two clients that send half a request and wait
        hog = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        hog.sendall(b"GET /leap/readout HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n")
        hogs.append(hog)
    time.sleep(0.3)
    refused = httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=5)
    assert refused.status_code == 503 and "busy" in refused.json()["error"]
    assert refused.headers["Retry-After"] == "1"
    assert server.refused_busy >= 1
    for hog in hogs:
        hog.sendall(b"\r\n")
        assert b"200" in hog.recv(100)
        hog.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_many_clients_at_once_never_take_the_server_down(serve):
    _, _, url = serve(max_handlers=4)
    statuses: list[int] = []

    def hit():
        try:
            statuses.append(httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=10).status_code)
        except httpx.HTTPError:
            statuses.append(-1)

    threads = [threading.Thread(target=hit) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(statuses) <= {200, 503} and 200 in statuses
    assert httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=5).status_code == 200


def test_health_follows_the_targets_own_health(serve):
    target, _, url = serve(HealthTarget())
    ok = httpx.get(f"{url}/leap/health")
    assert ok.status_code == 200 and ok.json()["feedback"] == {"alive": True}
    target.report = {"healthy": False, "feedback": {"alive": False}}
    sick = httpx.get(f"{url}/leap/health")
    assert sick.status_code == 503 and sick.json()["status"] == "unhealthy"
    target.report = RuntimeError("the predictor thread is gone")
    broken = httpx.get(f"{url}/leap/health")
    assert broken.status_code == 503 and "predictor thread" in broken.json()["error"]
    _, _, plain = serve(Target())
    assert httpx.get(f"{plain}/leap/health").json() == {"status": "ok"}


def test_a_failed_flush_is_an_error_answer_not_a_dropped_connection(serve):
    target, _, url = serve()
    target.flush_error = FeedbackFlushError("12 rows are still waiting for the disk; last error: ENOSPC")
    response = httpx.post(f"{url}/leap/feedback/flush", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 500
    assert response.json()["flushed"] is False and "12 rows" in response.json()["error"]


def test_an_error_in_describe_is_a_500_answer(serve):
    target, _, url = serve()
    target.describe_error = KeyError("version")
    response = httpx.get(f"{url}/leap/readout", headers=AUTH)
    assert response.status_code == 500 and "KeyError" in response.json()["error"]


def test_a_push_with_a_query_string_reaches_the_push_endpoint(serve):
    target, _, url = serve()
    response = httpx.post(f"{url}/leap/readout?force=1", content=_readout_bytes("v1"),
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and target.readout.metadata["version"] == "v1"
    wrong = httpx.post(f"{url}/leap/readout", content=b"junk", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def _trickle(port: int, stop: threading.Event, answers: list, every_s: float) -> None:
    """A client that sends one header line every `every_s` seconds, as a slow-loris attacker does."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"GET /leap/readout HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n")
            while not stop.is_set():
                conn.sendall(b"X-Trickle: 1\r\n")
                stop.wait(every_s)
                conn.settimeout(0.01)
                try:
                    data = conn.recv(4096)
                except TimeoutError:
                    data = None
                conn.settimeout(30)
                if data is not None:
                    answers.append(data.split(b"\r\n", 1)[0])
                    return
    except OSError as exc:
        answers.append(type(exc).__name__.encode())


def test_trickling_clients_are_cut_off_at_the_head_deadline_and_health_is_answered_meanwhile(serve):
    _, server, url = serve(HealthTarget(), max_handlers=8, head_deadline=1.5)
    stop, answers = threading.Event(), []
    hogs = [threading.Thread(target=_trickle, args=(server.port, stop, answers, 0.3), daemon=True)
            for _ in range(12)]
    for hog in hogs:
        hog.start()
    time.sleep(0.5)  # all twelve connected: four hold this address's slots, eight wait at the refuser
    health = [httpx.get(f"{url}/leap/health", timeout=5) for _ in range(3)]
    metrics = httpx.get(f"{url}/metrics", timeout=5)
    assert [answer.status_code for answer in health] == [200, 200, 200]
    assert health[0].json()["feedback"] == {"alive": True}
    assert metrics.status_code == 200 and "text/plain" in metrics.headers["Content-Type"]
    for hog in hogs:
        hog.join(10)
    stop.set()
    assert len(answers) == 12, answers
    # each is cut off with its answer (a reset only when the client wrote just as the server closed)
    assert set(answers) <= {b"HTTP/1.0 408 Request Timeout", b"HTTP/1.0 503 Service Unavailable",
                            b"ConnectionResetError", b"BrokenPipeError"}, answers
    refusals = server.refusals()
    assert refusals["head_deadline"] == 4 and refusals["per_address"] >= 8
    from prometheus_client import generate_latest

    from serving.admin.api import AdminRefusalCollector

    registry = CollectorRegistry()
    registry.register(AdminRefusalCollector(server))
    assert 'leap:admin_refused_total{reason="head_deadline"} 4.0' in generate_latest(registry).decode()
    assert httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=5).status_code == 200


def test_one_address_holds_at_most_its_share_of_the_handlers(serve):
    _, server, url = serve(max_handlers=4, max_per_address=2, request_timeout=10)
    hogs = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(2)]
    for hog in hogs:
        hog.sendall(b"GET /leap/readout HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n")
    time.sleep(0.3)
    refused = httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=5)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert server.refusals() == {"per_address": 1}
    for hog in hogs:
        hog.sendall(b"\r\n")
        assert b"200" in hog.recv(100)
        hog.close()


def test_a_request_line_that_never_ends_is_408_at_the_head_deadline(serve):
    _, server, url = serve(head_deadline=0.5, request_timeout=10)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"GET /leap/rea")
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.0 408") and time.monotonic() - started < 5
    assert server.refusals() == {"head_deadline": 1}
    assert httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=5).status_code == 200


def test_every_read_but_health_and_metrics_needs_the_token(serve):
    _, _, url = serve()
    assert httpx.get(f"{url}/leap/readout").status_code == 401
    assert httpx.get(f"{url}/leap/readout", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/leap/rls").status_code == 401
    assert httpx.get(f"{url}/leap/readout", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/leap/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    tokenless = AdminServer(Target(), "127.0.0.1", 0, None)  # no token: nothing but health and metrics
    try:
        bare = f"http://127.0.0.1:{tokenless.port}"
        assert httpx.get(f"{bare}/leap/readout").status_code == 403
        assert httpx.get(f"{bare}/metrics").status_code == 200
    finally:
        tokenless.close()


def test_a_flood_from_many_addresses_never_locks_out_a_push_with_the_token(serve):
    """Every handler held by half-sent requests from four loopback addresses: a push with the token is
    served by the control lane, while the same push without it, and any other request, is refused."""
    target, server, url = serve(max_handlers=4, max_per_address=1, request_timeout=10, head_deadline=20)
    hogs = []
    for i in range(2, 10):  # 127.0.0.2 ... 127.0.0.9: every slot taken, the rest refused and waiting
        hog = socket.socket()
        hog.bind((f"127.0.0.{i}", 0))
        hog.connect(("127.0.0.1", server.port))
        hog.sendall(b"GET /leap/readout HTTP/1.1\r\nHost: x\r\n")
        hogs.append(hog)
    time.sleep(0.3)
    try:
        pushed = httpx.post(f"{url}/leap/readout", content=_readout_bytes("v-lane"), headers=AUTH, timeout=10)
        assert pushed.status_code == 200, pushed.text
        assert target.readout.metadata["version"] == "v-lane"
        anonymous = httpx.post(f"{url}/leap/readout", content=_readout_bytes("v-x"), timeout=10)
        wrong = httpx.post(f"{url}/leap/readout", content=_readout_bytes("v-x"), timeout=10,
                           headers={"Authorization": "Bearer not-the-token"})
        read = httpx.get(f"{url}/leap/readout", headers=AUTH, timeout=10)  # not a control request
        assert (anonymous.status_code, wrong.status_code, read.status_code) == (503, 503, 503)
        assert target.readout.metadata["version"] == "v-lane"
        assert server.refusals()["control_lane"] == 1
    finally:
        for hog in hogs:
            hog.close()


def test_the_control_test_reads_the_method_route_and_the_one_token():
    from serving.admin.api import control_request

    is_control = control_request(TOKEN)
    auth = f"Authorization: Bearer {TOKEN}".encode()
    assert is_control(b"POST /leap/readout?force=1 HTTP/1.1\r\nHost: x\r\n" + auth)
    assert is_control(b"POST /leap/fcfs HTTP/1.1\r\n" + auth)
    assert not is_control(b"GET /leap/readout HTTP/1.1\r\n" + auth)
    assert not is_control(b"POST /leap/feedback/flush HTTP/1.1\r\n" + auth)
    assert not is_control(b"POST /leap/readout HTTP/1.1\r\nAuthorization: Bearer other")
    assert not is_control(b"POST /leap/readout HTTP/1.1\r\n" + auth + b"\r\nAuthorization: Bearer other")
    assert not is_control(b"POST")
