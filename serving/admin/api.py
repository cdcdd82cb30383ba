"""The admin API of a serving process: readout push, current version and RLS stats, Prometheus metrics.

A small threaded HTTP server inside the engine-core process, beside the scheduler that uses the readout,
so a push takes effect at the next step without touching the OpenAI front end. The paths and the RLS
header are `leap_io.admin_client`'s. Everything but `/leap/health` and `/metrics` needs the admin token;
every refusal is a JSON error and leaves the old readout serving. Endpoints and status codes:
docs/serving.md ("Admin API"). No client can take the process down or lock it: bodies are capped, reads
and requests have deadlines, and concurrent requests are capped (`serving.admin.connections`).
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import re
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from leap_io.admin_client import (
    FCFS_PATH,
    FEEDBACK_FLUSH_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    READOUT_PATH,
    RLS_INFO_HEADER,
    RLS_PATH,
    SHADOW_PATH,
)
from serving.admin.connections import AdminConnections, DeadlinePassed, DeadlineReader
from serving.readout.push import PushRefused
from serving.supervise import SupervisedThread

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 64 << 20
"""The body cap when the target does not say its dim (else: what a full RLS bundle of that dim needs)."""
DEFAULT_MAX_HANDLERS = 8
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_HEAD_DEADLINE_S = 10.0
DEFAULT_BODY_DEADLINE_S = 300.0
_CHUNK = 1 << 20
_DIGITS = re.compile(r"^[0-9]{1,19}$")
_TRUE = ("1", "true", "yes", "on")
MAX_SWITCH_BODY = 4096


class AdminTarget(Protocol):
    metrics_registry: Any

    def describe(self) -> dict: ...

    def push_readout(self, body: bytes) -> dict: ...

    def flush_feedback(self) -> dict: ...

    def set_fcfs(self, on: bool, reason: str = "") -> dict: ...

    def hold_shadow(self, body: bytes) -> dict: ...


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_switch(body: bytes) -> tuple[bool, str]:
    """(on, reason) of a kill-switch body: a JSON object with a boolean "on" and an optional string
    "reason"; anything else is refused (400)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Refusal(400, f"the body is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("on"), bool):
        raise _Refusal(400, 'send {"on": true|false, "reason": "..."}')
    reason = data.get("reason", "")
    if not isinstance(reason, str):
        raise _Refusal(400, '"reason" must be a string')
    return data["on"], reason


def health_answer(target: Any) -> tuple[int, dict]:
    """(status, payload) of `/leap/health`: 200 while the target reports healthy, else 503."""
    check = getattr(target, "health", None)
    if not callable(check):
        return 200, {"status": "ok"}
    try:
        report = check()
    except Exception as exc:  # a health check that fails is an unhealthy answer
        logger.exception("admin: health check failed")
        return 503, {"status": "unhealthy", "healthy": False, "error": f"{type(exc).__name__}: {exc}"}
    report = report if isinstance(report, dict) else {"healthy": bool(report)}
    healthy = bool(report.get("healthy"))
    return (200 if healthy else 503), {"status": "ok" if healthy else "unhealthy", **report}


def quick_answer(target: Any, path: str) -> tuple[int, str, bytes] | None:
    """The unauthenticated reads answered even when every handler slot is taken; None for anything else."""
    if path == HEALTH_PATH:
        status, payload = health_answer(target)
        return status, "application/json", json.dumps(payload, default=str).encode()
    if path == METRICS_PATH:
        return 200, CONTENT_TYPE_LATEST, generate_latest(target.metrics_registry)
    return None


def body_limit(target: Any, max_body: int | None) -> int:
    """The largest push body accepted: `max_body`, else enough for a full bundle of the widest readout the
    target serves (`feature_dim`, its captured vector; else its `dim`)."""
    if max_body is not None:
        return int(max_body)
    dim = getattr(target, "feature_dim", None) or getattr(target, "dim", None)
    if isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
        from leap_io.push_bundle import max_bundle_bytes

        return max(DEFAULT_MAX_BODY, max_bundle_bytes(dim))
    return DEFAULT_MAX_BODY


CONTROL_PATHS = (READOUT_PATH, FCFS_PATH, SHADOW_PATH)
"""The POST routes that change what a replica serves: a push or rollback, the kill switch, the shadow."""


def control_request(token: str) -> Callable[[bytes], bool]:
    """Whether a request head is a POST to a control route carrying the admin token (the control lane's
    test, `serving.admin.connections`)."""
    expected = f"Bearer {token}".encode()

    def is_control(head: bytes) -> bool:
        lines = head.split(b"\r\n")
        request_line = lines[0].split(b" ")
        if len(request_line) < 2 or request_line[0] != b"POST":
            return False
        if urlsplit(request_line[1].decode("latin-1")).path not in CONTROL_PATHS:
            return False
        given = [value.strip() for name, _, value in (line.partition(b":") for line in lines[1:])
                 if name.strip().lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], expected)

    return is_control


class _AdminHandler(BaseHTTPRequestHandler):
    """One admin request; `AdminServer` binds the target, the token and the limits on a subclass."""

    server_version = "leap-admin"
    target: AdminTarget
    token: str | None = None
    max_body: int | None = None
    timeout: float = DEFAULT_REQUEST_TIMEOUT_S  # every read and write on the socket
    head_deadline_s: float = DEFAULT_HEAD_DEADLINE_S
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S
    server: AdminConnections

    def setup(self) -> None:
        super().setup()
        self._answered = False
        self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""  # until a head is parsed
        self._reader = DeadlineReader(self.connection, self.timeout)
        self._reader.deadline = time.monotonic() + self.head_deadline_s
        self.rfile = io.BufferedReader(self._reader)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self._reader.deadline = None  # the head is in; a push sets the body's own deadline
        return parsed

    def handle_one_request(self) -> None:
        super().handle_one_request()  # answers nothing and closes when the head's deadline passes
        if self._reader.expired and not self._answered:
            self.server.count("head_deadline")
            self._reply(408, {"error": f"the request head did not arrive within {self.head_deadline_s:.0f}s"})

    def log_message(self, fmt: str, *args: Any) -> None:  # route to logging, not stderr
        logger.debug("admin: " + fmt, *args)

    def _reply(self, status: int, payload: dict | bytes, content_type: str = "application/json",
               headers: dict[str, str] | None = None) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload, default=str).encode()
        self._answered = True
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if status == 503:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(body)
        except OSError as exc:  # the client went away; nothing to answer
            logger.debug("admin: could not answer %s: %s", self.path, exc)
        self.close_connection = True

    def _serving(self) -> Any:
        try:
            return self.target.describe().get("version")
        except Exception:
            return None

    def _guarded(self, work) -> None:
        try:
            work()
        except _Refusal as refusal:
            self._reply(refusal.status, {"error": str(refusal)})
        except Exception as exc:  # a request never takes the server down
            logger.exception("admin: %s %s failed", self.command, self.path)
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _get(self) -> None:
        path = urlsplit(self.path).path
        if path == HEALTH_PATH:
            self._health()
        elif path == READOUT_PATH:
            if self._authorized():  # versions, recipes, sources and RLS figures are the operators' business
                self._reply(200, self.target.describe())
        elif path == METRICS_PATH:
            self._reply(200, generate_latest(self.target.metrics_registry), CONTENT_TYPE_LATEST)
        elif path == RLS_PATH:
            self._rls()
        else:
            self._reply(404, {"error": f"no such endpoint: {path}"})

    def _health(self) -> None:
        self._reply(*health_answer(self.target))

    def _authorized(self) -> bool:
        """Whether the request carries the admin token; answers 403/401 itself when not."""
        if not self.token:
            self._reply(403, {"error": "this needs the admin token, and none is configured "
                                       "(set LEAP_ADMIN_TOKEN or LEAP_ADMIN_TOKEN_FILE)"})
            return False
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            self._reply(401, {"error": "missing or wrong admin token"})
            return False
        return True

    def _rls(self) -> None:
        if not self._authorized():
            return
        state = getattr(self.target, "rls_state", None)
        if not callable(state):
            self._reply(404, {"error": "this replica keeps no RLS state"})
            return
        try:
            body, info = state()
        except LookupError as exc:  # nothing learns here now: a state, not a failure
            self._reply(409, {"error": str(exc), "serving": self._serving()})
            return
        self._reply(200, body, "application/octet-stream", {RLS_INFO_HEADER: json.dumps(info, default=str)})

    def _post(self) -> None:
        split = urlsplit(self.path)
        if split.path not in (READOUT_PATH, FEEDBACK_FLUSH_PATH, FCFS_PATH, SHADOW_PATH):
            self._reply(404, {"error": f"no such endpoint: {split.path}"})
            return
        if not self._authorized():
            return
        if split.path == FEEDBACK_FLUSH_PATH:
            try:
                self._reply(200, self.target.flush_feedback())
            except Exception as exc:
                logger.error("admin: feedback flush failed: %s", exc)
                self._reply(500, {"flushed": False, "error": f"feedback flush failed: {exc}"})
            return
        body = self._read_body(MAX_SWITCH_BODY if split.path == FCFS_PATH else None, empty_ok=split.path == SHADOW_PATH)
        if split.path == FCFS_PATH:
            self._reply(200, self.target.set_fcfs(*parse_switch(body)))
            return
        force = parse_qs(split.query).get("force", [""])[-1].strip().lower() in _TRUE
        if force:
            from leap_io.push_bundle import BundleError, with_force

            try:
                body = with_force(body)
            except BundleError as exc:
                raise _Refusal(exc.status, f"refused: {exc}") from exc
        try:
            if split.path == SHADOW_PATH:
                self._reply(200, self.target.hold_shadow(body))
            else:
                self._reply(200, self.target.push_readout(body))
        except PushRefused as exc:
            self._reply(exc.status, {"error": str(exc), "serving": self._serving()})
        except Exception as exc:  # anything unexpected is still a refusal, never a half swap
            logger.exception("admin: push failed")
            self._reply(500, {"error": f"push failed: {exc}", "serving": self._serving()})

    def _read_body(self, limit: int | None = None, empty_ok: bool = False) -> bytes:
        if self.headers.get("Transfer-Encoding", "").strip():
            raise _Refusal(411, "send the readout with a Content-Length; chunked bodies are not accepted")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise _Refusal(411, "a push needs a Content-Length header")
        raw = raw.strip()
        if not _DIGITS.match(raw):
            raise _Refusal(400, f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
        length = int(raw)
        limit = limit or body_limit(self.target, self.max_body)
        if length == 0:
            if empty_ok:  # a shadow let go
                return b""
            raise _Refusal(400, "the body is empty; send a readout file or bundle")
        if length > limit:
            raise _Refusal(413, f"the body has {length} bytes; this replica accepts at most {limit}")
        self._reader.deadline = time.monotonic() + self.body_deadline_s
        parts, received = [], 0
        try:
            while received < length:
                chunk = self.rfile.read1(min(_CHUNK, length - received))
                if not chunk:
                    raise _Refusal(400, f"the body ended after {received} of {length} bytes")
                parts.append(chunk)
                received += len(chunk)
        except DeadlinePassed as exc:
            self.server.count("body_deadline")
            raise _Refusal(408, f"the body did not arrive within {self.body_deadline_s:.0f}s "
                                f"({received} of {length} bytes)") from exc
        except TimeoutError as exc:
            raise _Refusal(408, f"the body stalled for {self.timeout:.0f}s after {received} of {length} "
                                f"bytes") from exc
        return b"".join(parts)


class AdminServer:
    """Runs the admin API on a daemon thread; `port=0` picks a free port (see `.port`).

    `max_body` caps a push body (default: what a full RLS bundle of the target's dim needs, at least
    64 MiB); `max_handlers` caps concurrent requests and `max_per_address` those from one address
    (default: half of `max_handlers`); `request_timeout` bounds every socket read and write;
    `head_deadline` bounds the arrival of the whole request head and `body_deadline` the whole upload of
    a push.
    """

    def __init__(self, target: AdminTarget, host: str, port: int, token: str | None, *,
                 max_body: int | None = None, max_handlers: int = DEFAULT_MAX_HANDLERS,
                 max_per_address: int | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
                 head_deadline: float = DEFAULT_HEAD_DEADLINE_S,
                 body_deadline: float = DEFAULT_BODY_DEADLINE_S) -> None:
        if max_handlers < 1:
            raise ValueError("max_handlers must be >= 1")
        handler = type("Handler", (_AdminHandler,), {"target": target, "token": token, "max_body": max_body,
                                                     "timeout": request_timeout, "head_deadline_s": head_deadline,
                                                     "body_deadline_s": body_deadline})
        per_address = max_per_address if max_per_address is not None else max(1, max_handlers // 2)
        self._server = AdminConnections((host, port), handler, max_handlers, per_address,
                                        lambda path: quick_answer(target, path),
                                        is_control=control_request(token) if token else None)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = SupervisedThread("leap-admin", self._server.serve_forever).start()

    @property
    def refused_busy(self) -> int:
        """Connections refused because every slot, or the address's share of them, was taken."""
        counts = self._server.counts()
        return counts.get("busy", 0) + counts.get("per_address", 0)

    def refusals(self) -> dict[str, int]:
        """Refusals by reason (busy, per_address, refusal_queue_full, head_deadline, body_deadline)."""
        return self._server.counts()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.stop()


class AdminRefusalCollector:
    """`leap:admin_refused_total{reason}`: the admin API's refusals, scraped from `AdminServer.refusals()`."""

    def __init__(self, server: AdminServer) -> None:
        self._server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("leap:admin_refused", "Admin API connections refused or cut off, by reason",
                                     labels=["reason"])
        for reason, count in sorted(self._server.refusals().items()):
            family.add_metric([reason], count)
        yield family
