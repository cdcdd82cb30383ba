"""The admin API of a serving process: readout push, current version and RLS stats, Prometheus metrics.

A small threaded HTTP server inside the engine-core process, beside the scheduler that uses the readout,
so a push takes effect at the next step without touching the OpenAI front end. Writes need
`Authorization: Bearer <token>`; every refusal is a JSON error and leaves the old readout serving.

  GET  /leap/health            liveness
  GET  /leap/readout           current readout metadata, version, RLS stats
  POST /leap/readout           body: a leap_core readout file, or a bundle (readout + RLS anchor)
  POST /leap/feedback/flush    close the open feedback segment so ingest sees every finished request
  GET  /metrics                Prometheus text format
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

logger = logging.getLogger(__name__)

MAX_BODY = 1 << 30


class PushRefused(ValueError):
    """A pushed readout that must not serve; the message says why."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


class AdminTarget(Protocol):
    metrics_registry: Any

    def describe(self) -> dict: ...

    def push_readout(self, body: bytes) -> dict: ...

    def flush_feedback(self) -> dict: ...


def _handler(target: AdminTarget, token: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "leap-admin"

        def log_message(self, fmt: str, *args: Any) -> None:  # route to logging, not stderr
            logger.debug("admin: " + fmt, *args)

        def _reply(self, status: int, payload: dict | bytes, content_type: str = "application/json") -> None:
            body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/leap/health":
                self._reply(200, {"status": "ok"})
            elif self.path == "/leap/readout":
                self._reply(200, target.describe())
            elif self.path == "/metrics":
                self._reply(200, generate_latest(target.metrics_registry), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, {"error": f"no such endpoint: {self.path}"})

        def do_POST(self) -> None:
            if self.path not in ("/leap/readout", "/leap/feedback/flush"):
                self._reply(404, {"error": f"no such endpoint: {self.path}"})
                return
            if not token:
                self._reply(403, {"error": "pushes are disabled: no admin token is configured "
                                           "(set LEAP_ADMIN_TOKEN or LEAP_ADMIN_TOKEN_FILE)"})
                return
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._reply(401, {"error": "missing or wrong admin token"})
                return
            if self.path == "/leap/feedback/flush":
                self._reply(200, target.flush_feedback())
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                self._reply(400, {"error": f"body must be a readout file of 1..{MAX_BODY} bytes"})
                return
            body = self.rfile.read(length)
            try:
                self._reply(200, target.push_readout(body))
            except PushRefused as exc:
                self._reply(exc.status, {"error": str(exc), "serving": target.describe().get("version")})
            except Exception as exc:  # anything unexpected is still a refusal, never a half swap
                logger.exception("admin: push failed")
                self._reply(500, {"error": f"push failed: {exc}", "serving": target.describe().get("version")})

    return Handler


class AdminServer:
    """Runs the admin API on a daemon thread; `port=0` picks a free port (see `.port`)."""

    def __init__(self, target: AdminTarget, host: str, port: int, token: str | None) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(target, token))
        self._server.daemon_threads = True
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="leap-admin", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
