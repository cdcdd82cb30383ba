"""ASGI middleware for vLLM's OpenAI server: refuse bad `leap_*` request extras with HTTP 400.

Engine-core ignores a bad `vllm_xargs` key with a warning (it must never fail a request there); the
client only learns of its mistake if the API front end refuses it. This middleware reads the JSON body
of every POST route that takes `vllm_xargs` (`VALIDATED_PATHS`: completions, chat, responses, messages),
validates them with `serving.request_extras.parse_leap_extras` and answers 400 with an OpenAI-style
error naming every bad key and why. Everything else (other paths and methods, bodies that are not JSON objects, requests
without LEAP keys, and every response, streamed or not) passes through untouched; the body is replayed
to the app exactly as it arrived.

  vllm serve ... --middleware serving.api_middleware.LeapExtrasMiddleware
"""

from __future__ import annotations

import json
from typing import Any

from serving.request_extras import parse_leap_extras

VALIDATED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
    "/v1/completions/render", "/v1/chat/completions/render", "/v1/responses/render", "/v1/messages/render",
})
"""Every JSON route of vLLM's API servers whose request takes `vllm_xargs` (checked against the installed
vLLM's routers by a test). The audio routes take them too, inside a multipart form: audio models are not
served with LEAP, and those bodies pass unread."""
MAX_INSPECTED_BODY = 32 << 20
"""A larger body is passed on without a look (the server applies its own limits to it)."""

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


def _problems(body: bytes) -> dict[str, str]:
    """{bad key: reason} of the request's `vllm_xargs`; {} when there is nothing of ours to refuse."""
    if b"vllm_xargs" not in body and b"\\u" not in body:  # a key may be spelt with JSON escapes
        return {}
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}  # not JSON: the server answers that itself
    if not isinstance(request, dict) or "vllm_xargs" not in request:
        return {}
    _, errors = parse_leap_extras(request["vllm_xargs"])
    return errors


class LeapExtrasMiddleware:
    """Pure ASGI middleware (vLLM adds a class given to --middleware with `app.add_middleware`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
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
        complete = not more and messages[-1]["type"] == "http.request"
        if complete:
            errors = _problems(b"".join(m.get("body", b"") for m in messages))
            if errors:
                await self._refuse(send, errors)
                return

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send: Any, errors: dict[str, str]) -> None:
        body = error_body(errors)
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
