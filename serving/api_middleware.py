"""ASGI middleware for vLLM's OpenAI server: refuse bad `leap_*` request extras with HTTP 400, set the
caller's tenant, and serve LEAP's metrics beside vLLM's on the serving port.

Engine-core ignores a bad `vllm_xargs` key with a warning, so the client only learns of its mistake if
the front end refuses it: the JSON body of every POST route that takes `vllm_xargs` (`VALIDATED_PATHS`)
is checked with `serving.request_extras.parse_leap_extras`; a bad one is a 400 naming every bad key, and
a body too large to check is a 413. The tenant is the authenticated caller's (`serving.caller_tenant`):
a `leap_tenant` the client sent is dropped (counted in `leap:client_tenant_dropped_total`) and the
caller's is set, the body then passed on re-encoded; any other body passes through replayed exactly. GET `/metrics` is vLLM's exposition with
the engine-core runtime's `leap:*` families appended, read from the admin port on loopback
(`RuntimeMetrics`): a scraper of vLLM reads both, and a runtime out of reach costs only LEAP's part
(counted in `leap:runtime_metrics_failures_total{reason}`), never vLLM's.

  vllm serve ... --middleware serving.api_middleware.LeapExtrasMiddleware
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, generate_latest

from serving.caller_tenant import TenantRule
from serving.request_extras import parse_leap_extras

logger = logging.getLogger(__name__)

VALIDATED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/v1/completions/render", "/v1/chat/completions/render", "/v1/responses/render", "/v1/messages/render",
})
"""Every JSON route of vLLM's API servers whose request takes `vllm_xargs` (checked against the installed
vLLM's routers by a test). The audio routes take them too, inside a multipart form: audio models are not
served with LEAP, and those bodies pass unread."""
MAX_INSPECTED_BODY = 32 << 20
"""A larger body on a validated route is refused (413): what it holds could not be checked."""

METRICS_PATH = "/metrics"
RUNTIME_METRICS_TIMEOUT_S = 2.0
MAX_RUNTIME_METRICS = 16 << 20
"""The most bytes of LEAP exposition appended (a larger answer is refused and counted as too_large)."""
FAILURE_REASONS = ("unreachable", "timeout", "status", "too_large")

Scope = dict[str, Any]
Message = dict[str, Any]


def error_body(errors: dict[str, str]) -> bytes:
    """vLLM's ErrorResponse shape: {"error": {"message", "type", "param", "code"}}."""
    errors = {key: str(reason).removeprefix("Value error, ") for key, reason in errors.items()}  # pydantic's prefix
    keys = sorted(errors)
    message = "invalid vllm_xargs: " + "; ".join(f"{key}: {errors[key]}" for key in keys)
    param = f"vllm_xargs.{keys[0]}" if len(keys) == 1 and keys[0] != "vllm_xargs" else "vllm_xargs"
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400,
                                 "invalid_keys": {key: errors[key] for key in keys}}}).encode()


class Inspection(NamedTuple):
    errors: dict[str, str]  # {bad key: reason} of the request's `vllm_xargs`
    body: bytes | None = None  # the body to pass on instead; None: pass it on as it came
    dropped_tenant: bool = False  # the client had sent a `leap_tenant`


def inspect_body(body: bytes, tenant: str | None) -> Inspection:
    """Check a request body's `vllm_xargs`, drop a client's `leap_tenant` and set the caller's `tenant`."""
    if tenant is None and b"vllm_xargs" not in body and b"\\u" not in body:  # keys may be spelt with escapes
        return Inspection({})
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return Inspection({})  # not JSON: the server answers that itself
    if not isinstance(request, dict):
        return Inspection({})
    xargs = request.get("vllm_xargs")
    if "vllm_xargs" in request:
        _, errors = parse_leap_extras(xargs)
        if errors:
            return Inspection(errors)
    sent = isinstance(xargs, dict) and "leap_tenant" in xargs
    if not sent and tenant is None:
        return Inspection({})
    xargs = {key: value for key, value in (xargs or {}).items() if key != "leap_tenant"}
    if tenant is not None:
        xargs["leap_tenant"] = tenant
    request["vllm_xargs"] = xargs
    return Inspection({}, json.dumps(request).encode(), sent)


def tenant_rule(app: Any) -> TenantRule:
    """The tenant rule of the LEAP settings vLLM passed this server (none outside vLLM's app)."""
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    if config is None:
        return TenantRule()
    from serving.config import leap_config_from_vllm

    leap = leap_config_from_vllm(config)
    return TenantRule.from_settings(leap.tenant_header, leap.tenant_keys_file)


def admin_metrics_url(app: Any) -> str | None:
    """The runtime's admin `/metrics` on loopback, from the LEAP settings vLLM passed this server; None
    when the runtime runs no admin server (or this is not vLLM's app)."""
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    if config is None:
        return None
    from serving.config import leap_config_from_vllm

    leap = leap_config_from_vllm(config)
    if not leap.admin_port:  # unset, or 0 (a free port this process cannot learn)
        return None
    host = leap.admin_host if leap.admin_host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{leap.admin_port}{METRICS_PATH}"


class RuntimeMetrics:
    """Reads the runtime's exposition for the serving port's `/metrics`, counting every failure by reason."""

    def __init__(self, timeout_s: float = RUNTIME_METRICS_TIMEOUT_S, max_bytes: int = MAX_RUNTIME_METRICS) -> None:
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.registry = CollectorRegistry()
        self.failures = Counter("leap:runtime_metrics_failures", "Scrapes of the serving port whose LEAP part "
                                "could not be read from the runtime, by reason", ["reason"], registry=self.registry)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason=reason)
        self.tenants_dropped = Counter("leap:client_tenant_dropped", "Requests whose client-sent leap_tenant was "
                                       "dropped: the tenant is the authenticated caller's", registry=self.registry)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy

    def read(self, url: str | None) -> bytes:
        """LEAP's exposition at `url` (b"" when there is none or it failed), then this reader's own counts."""
        text = b""
        if url is not None:
            try:
                text = self._fetch(url)
            except TimeoutError:
                self._fail("timeout", url)
            except urllib.error.HTTPError as exc:
                self._fail("status", url, exc.code)
            except (urllib.error.URLError, OSError) as exc:
                reason = "timeout" if isinstance(getattr(exc, "reason", None), TimeoutError) else "unreachable"
                self._fail(reason, url, exc)
            except ValueError as exc:
                self._fail("too_large", url, exc)
        if text and not text.endswith(b"\n"):
            text += b"\n"
        return text + generate_latest(self.registry)

    def _fetch(self, url: str) -> bytes:
        with self._opener.open(url, timeout=self.timeout_s) as answer:
            body = answer.read(self.max_bytes + 1)
        if len(body) > self.max_bytes:
            raise ValueError(f"more than {self.max_bytes} bytes")
        return body

    def _fail(self, reason: str, url: str, detail: object = "") -> None:
        self.failures.labels(reason=reason).inc()
        logger.warning("LEAP metrics not appended to /metrics: %s from %s (%s)", reason, url, detail)


def _without(headers: list, names: tuple[bytes, ...]) -> list:
    return [(key, value) for key, value in headers if key.lower() not in names]


class LeapExtrasMiddleware:
    """Pure ASGI middleware (vLLM adds a class given to --middleware with `app.add_middleware`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.runtime_metrics = RuntimeMetrics()
        self._metrics_url: tuple[str | None] | None = None  # resolved at the first scrape
        self._tenants: TenantRule | None = None  # resolved at the first request

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        method = scope.get("method")
        if scope.get("type") != "http" or method not in ("POST", "GET"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if method == "GET":
            if path.rstrip("/") == METRICS_PATH:
                await self._metrics(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if path.rstrip("/") not in VALIDATED_PATHS:
            await self.app(scope, receive, send)
            return

        messages: list[Message] = []
        size = 0
        more = True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away; let the app see that
            size += len(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if size > MAX_INSPECTED_BODY:
                break
        if size > MAX_INSPECTED_BODY:
            await self._answer(send, 413, json.dumps({"error": {
                "message": f"a request body over {MAX_INSPECTED_BODY} bytes cannot be checked",
                "type": "BadRequestError", "code": 413}}).encode())
            return
        if not more and messages[-1]["type"] == "http.request":
            body = b"".join(m.get("body", b"") for m in messages)
            tenant = self._tenant_rule(scope).tenant(scope.get("headers", []))
            found = inspect_body(body, tenant)
            if found.errors:
                await self._answer(send, 400, error_body(found.errors))
                return
            if found.dropped_tenant:
                self.runtime_metrics.tenants_dropped.inc()
            if found.body is not None:
                messages = [{"type": "http.request", "body": found.body, "more_body": False}]
                headers = _without(list(scope.get("headers", [])), (b"content-length", b"transfer-encoding"))
                scope = {**scope, "headers": [*headers, (b"content-length", str(len(found.body)).encode())]}

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _metrics(self, scope: Scope, receive: Any, send: Any) -> None:
        """vLLM's `/metrics` in the plain text format, uncompressed, with LEAP's families appended."""
        headers = _without(list(scope.get("headers", [])), (b"accept", b"accept-encoding"))
        inner = {**scope, "headers": [*headers, (b"accept", b"text/plain;version=0.0.4")]}
        start: Message | None = None
        parts: list[bytes] = []

        async def keep(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(inner, receive, keep)
        if start is None:
            return  # vLLM answered nothing; neither do we
        body = b"".join(parts)
        if start.get("status") == 200:
            if self._metrics_url is None:
                try:
                    self._metrics_url = (admin_metrics_url(scope.get("app")),)
                except Exception as exc:  # the settings do not read: vLLM's part still answers
                    logger.warning("LEAP metrics not appended to /metrics: %s", exc)
                    self._metrics_url = (None,)
            if body and not body.endswith(b"\n"):
                body += b"\n"
            body += await asyncio.to_thread(self.runtime_metrics.read, self._metrics_url[0])
        kept = _without(list(start.get("headers", [])), (b"content-length", b"content-encoding"))
        await send({**start, "headers": [*kept, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _tenant_rule(self, scope: Scope) -> TenantRule:
        if self._tenants is None:
            try:
                self._tenants = tenant_rule(scope.get("app"))
            except Exception as exc:  # a bad keys file: no request is given a tenant, none keeps its own
                logger.error("LEAP: no tenant is set on requests: %s", exc)
                self._tenants = TenantRule()
        return self._tenants

    @staticmethod
    async def _answer(send: Any, status: int, body: bytes) -> None:
        """A JSON answer of the middleware's own (400 naming the bad extras, 413)."""
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
