"""The `vllm_xargs` middleware in front of a real FastAPI app (and loaded the way vLLM loads --middleware)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from argparse import Namespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.testclient import TestClient

from serving.api_middleware import LeapExtrasMiddleware


def _app(wrap: bool = True) -> tuple[FastAPI, list[bytes]]:
    """An OpenAI-shaped app that records every body it receives and echoes its digest."""
    app = FastAPI()
    seen: list[bytes] = []

    async def echo(request: Request):
        body = await request.body()
        seen.append(body)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("stream"):
            async def events():
                for i in range(3):
                    yield f"data: {json.dumps({'chunk': i})}\n\n".encode()
                    await asyncio.sleep(0)
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"sha256": hashlib.sha256(body).hexdigest(), "len": len(body)})

    app.post("/v1/completions")(echo)
    app.post("/v1/chat/completions")(echo)
    app.post("/v1/responses")(echo)
    app.post("/v1/messages")(echo)
    app.post("/v1/embeddings")(echo)

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    if wrap:
        app.add_middleware(LeapExtrasMiddleware)
    return app, seen


GOOD = {"leap_request_id": "r-1", "leap_domain": "chat", "leap_oracle_length": 120, "session_id": "other plugin"}


def test_valid_extras_pass_through_with_the_body_byte_for_byte():
    app, seen = _app()
    body = json.dumps({"model": "m", "prompt": "hi", "vllm_xargs": GOOD}).encode()
    with TestClient(app) as client:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json() == {"sha256": hashlib.sha256(body).hexdigest(), "len": len(body)}
    assert seen == [body]


def test_bad_extras_are_400_naming_each_key_and_the_app_never_sees_them():
    app, seen = _app()
    xargs = {"leap_domain": 5, "leap_oracle_length": float("inf"), "leap_typo": 1, "other_plugin": "fine"}
    body = json.dumps({"model": "m", "messages": [], "vllm_xargs": xargs}).encode()
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == "vllm_xargs"
    assert set(error["invalid_keys"]) == {"leap_domain", "leap_oracle_length", "leap_typo"}
    assert "leap_domain: must be a string" in error["message"]
    assert "leap_oracle_length: must be finite" in error["message"]
    assert "unknown LEAP extra" in error["invalid_keys"]["leap_typo"]
    assert seen == []


def test_one_bad_key_is_named_as_the_param_and_a_non_object_is_refused():
    app, _ = _app()
    with TestClient(app) as client:
        one = client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": {"leap_tenant": ["a"]}})
        assert one.status_code == 400 and one.json()["error"]["param"] == "vllm_xargs.leap_tenant"
        odd = client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": "leap_domain=chat"})
        assert odd.status_code == 400 and "must be an object" in odd.json()["error"]["message"]
        escaped = b'{"prompt": "x", "vllm\\u005fxargs": {"leap\\u005fdomain": 5}}'
        sneaky = client.post("/v1/completions", content=escaped, headers={"content-type": "application/json"})
        assert sneaky.status_code == 400 and "leap_domain" in sneaky.json()["error"]["message"]


def test_a_streamed_response_passes_through_untouched():
    app, _ = _app()
    with TestClient(app) as client, client.stream(
            "POST", "/v1/chat/completions",
            json={"messages": [], "stream": True, "vllm_xargs": {"leap_domain": "code"}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    assert text == "".join(f"data: {json.dumps({'chunk': i})}\n\n" for i in range(3)) + "data: [DONE]\n\n"


def test_other_paths_methods_and_bodies_are_left_alone():
    app, seen = _app()
    bad = {"prompt": "x", "vllm_xargs": {"leap_domain": 5}}
    with TestClient(app) as client:
        assert client.post("/v1/embeddings", json=bad).status_code == 200  # not a generation endpoint
        assert client.get("/v1/models").json() == {"data": [{"id": "m"}]}
        assert client.post("/v1/completions", json={"prompt": "no extras"}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": None}).status_code == 200
        garbage = b"{not json vllm_xargs"
        response = client.post("/v1/completions", content=garbage)
        assert response.status_code == 200 and response.json()["len"] == len(garbage)
    assert seen[-1] == garbage and len(seen) == 4


def test_a_body_in_several_parts_is_validated_whole_and_replayed_in_order():
    app, seen = _app()
    body = json.dumps({"prompt": "p" * 1000, "vllm_xargs": {"leap_domain": "chat"}}).encode()
    parts = [body[:10], body[10:600], body[600:]]

    def call(chunks: list[bytes]) -> tuple[int, bytes]:
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                    for i, c in enumerate(chunks)]
        sent: list[dict] = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}
        asyncio.run(app(scope, receive, send))
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    status, _ = call(parts)
    assert status == 200 and seen == [body]
    bad = json.dumps({"prompt": "p" * 1000, "vllm_xargs": {"leap_domain": 5}}).encode()
    status, answer = call([bad[:700], bad[700:]])
    assert status == 400 and b"leap_domain" in answer and len(seen) == 1


def test_vllm_loads_it_from_the_middleware_flag():
    register = pytest.importorskip("vllm.entrypoints.serve.middleware.register")
    app, seen = _app(wrap=False)
    args = Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"],
                     allowed_headers=["*"], api_key=None, enable_request_id_headers=False,
                     middleware=["serving.api_middleware.LeapExtrasMiddleware"])
    register.init_entrypoints_middleware(args, app, ())
    with TestClient(app) as client:
        refused = client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": {"leap_oracle_length": -1}})
        assert refused.status_code == 400 and "leap_oracle_length" in refused.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": GOOD}).status_code == 200
    assert len(seen) == 1


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_bad_extras_are_refused_on_the_responses_and_messages_routes_too(path):
    app, seen = _app()
    with TestClient(app) as client:
        refused = client.post(path, json={"input": "x", "vllm_xargs": {"leap_oracle_length": "soon"}})
        assert refused.status_code == 400 and "leap_oracle_length" in refused.json()["error"]["message"]
        assert client.post(path, json={"input": "x", "vllm_xargs": GOOD}).status_code == 200
    assert len(seen) == 1


def test_every_json_route_of_the_installed_vllm_that_takes_extras_is_validated():
    pytest.importorskip("vllm")
    from serving.api_middleware import VALIDATED_PATHS
    from serving.vllm_compat import routes_taking_extras

    routes = routes_taking_extras()
    assert ("/v1/chat/completions", "ChatCompletionRequest") in routes  # the reading itself works
    audio = {path for path, _ in routes if path.startswith("/v1/audio/")}  # multipart forms; see VALIDATED_PATHS
    assert {path for path, _ in routes} - audio == VALIDATED_PATHS


# -- /metrics: vLLM's exposition with the runtime's appended --------------------------------------------


class _Runtime:
    """What the admin API needs to serve /metrics: a runtime's real Telemetry registry."""

    def __init__(self) -> None:
        from serving.telemetry import Telemetry

        self.telemetry = Telemetry()
        self.metrics_registry = self.telemetry.registry


def _vllm_metrics_app(admin_port: int | None) -> tuple[FastAPI, object]:
    """vLLM's /metrics as its API server mounts it (prometheus_client's ASGI app on its own registry), with
    the LEAP settings vLLM hands its app state."""
    import re

    from prometheus_client import CollectorRegistry, Histogram, make_asgi_app
    from starlette.routing import Mount

    registry = CollectorRegistry()
    latency = Histogram("vllm:e2e_request_latency_seconds", "e2e", registry=registry)
    latency.observe(0.25)
    app, _ = _app()
    route = Mount("/metrics", make_asgi_app(registry=registry))
    route.path_regex = re.compile("^/metrics(?P<path>.*)$")
    app.routes.append(route)
    leap = {} if admin_port is None else {"admin_port": admin_port}
    app.state.vllm_config = Namespace(additional_config={"leap": leap})
    return app, registry


def _families(text: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_carry_vllm_and_the_runtime_families_in_one_plain_text_answer():
    from serving.admin.api import AdminServer

    runtime = _Runtime()
    runtime.telemetry.finished_lengths(120.0, 97)
    admin = AdminServer(runtime, "127.0.0.1", 0, None)
    try:
        app, _ = _vllm_metrics_app(admin.port)
        with TestClient(app) as client:
            answer = client.get("/metrics", headers={"Accept-Encoding": "gzip",
                                                     "Accept": "application/openmetrics-text;version=1.0.0"})
    finally:
        admin.close()
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert "content-encoding" not in answer.headers and int(answer.headers["content-length"]) == len(answer.content)
    families = _families(answer.text)  # parses whole: no family twice, no OpenMetrics EOF in the middle
    assert families["vllm:e2e_request_latency_seconds"][-1].value == 0.25
    counts = {s.name: s.value for s in families["leap:actual_generation_tokens"]}
    assert counts["leap:actual_generation_tokens_count"] == 1 and counts["leap:actual_generation_tokens_sum"] == 97
    assert {s.labels["reason"]: s.value for s in families["leap:runtime_metrics_failures"]} == {
        reason: 0.0 for reason in ("unreachable", "timeout", "status", "too_large")}


def test_a_runtime_out_of_reach_costs_only_leaps_part_and_is_counted():
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app, _ = _vllm_metrics_app(port)
    with TestClient(app) as client:
        first, second = client.get("/metrics"), client.get("/metrics/")
    for answer in (first, second):
        assert answer.status_code == 200
        assert "vllm:e2e_request_latency_seconds_count 1.0" in answer.text
        assert "leap:predictions_total" not in answer.text
    failures = {s.labels["reason"]: s.value for s in _families(second.text)["leap:runtime_metrics_failures"]}
    assert failures["unreachable"] == 2 and failures["timeout"] == 0


def test_without_an_admin_port_metrics_are_vllms_and_other_gets_pass_untouched():
    app, _ = _vllm_metrics_app(None)
    with TestClient(app) as client:
        metrics = client.get("/metrics")
        models = client.get("/v1/models")
    assert metrics.status_code == 200 and "vllm:e2e_request_latency_seconds" in metrics.text
    assert "leap:predictions_total" not in metrics.text
    assert models.json() == {"data": [{"id": "m"}]}


# -- the caller's tenant ----------------------------------------------------------------------------------
def _tenant_app(tmp_path, **leap) -> tuple[FastAPI, list[bytes]]:
    """The echo app as vLLM's server holds it: LEAP's settings in `app.state.vllm_config`."""
    from types import SimpleNamespace

    app, seen = _app()
    app.state.vllm_config = SimpleNamespace(additional_config={"leap": leap})
    return app, seen


def test_the_tenant_is_the_callers_never_the_clients(tmp_path):
    from serving.caller_tenant import key_digest

    keys = tmp_path / "tenant-keys.json"
    keys.write_text(json.dumps({key_digest("key-of-acme"): "acme"}))
    app, seen = _tenant_app(tmp_path, tenant_keys_file=str(keys), tenant_header="x-leap-tenant")
    claim = {"prompt": "x", "vllm_xargs": {"leap_tenant": "someone-else", "leap_domain": "chat"}}
    with TestClient(app) as client:
        by_key = client.post("/v1/completions", json=claim, headers={"authorization": "Bearer key-of-acme",
                                                                     "x-leap-tenant": "gateway-says"})
        by_gateway = client.post("/v1/completions", json={"prompt": "x"}, headers={"x-leap-tenant": "beta"})
        unknown_key = client.post("/v1/completions", json=claim, headers={"authorization": "Bearer nobody"})
        two_headers = client.post("/v1/completions", json={"prompt": "x"},
                                  headers=[("x-leap-tenant", "a"), ("x-leap-tenant", "b")])
    assert [r.status_code for r in (by_key, by_gateway, unknown_key, two_headers)] == [200] * 4
    bodies = [json.loads(body) for body in seen]
    assert bodies[0]["vllm_xargs"] == {"leap_domain": "chat", "leap_tenant": "acme"}  # the key wins
    assert bodies[1]["vllm_xargs"] == {"leap_tenant": "beta"}
    assert bodies[2]["vllm_xargs"] == {"leap_domain": "chat"}  # no tenant: the client's claim is gone
    assert "vllm_xargs" not in bodies[3]  # two values: neither is believed, the body passes as it came
    assert by_key.json()["len"] == len(seen[0])  # the content length follows the new body
    assert _middleware(app).runtime_metrics.tenants_dropped._value.get() == 2


def test_without_a_tenant_rule_a_clients_tenant_is_dropped_and_counted():
    app, seen = _app()
    with TestClient(app) as client:
        escaped = b'{"prompt": "x", "vllm_xargs": {"leap\\u005ftenant": "me"}}'
        client.post("/v1/completions", content=escaped, headers={"content-type": "application/json"})
        kept = b'{"prompt":  "x", "vllm_xargs": {"leap_domain": "code"}}'
        client.post("/v1/completions", content=kept, headers={"content-type": "application/json"})
    assert json.loads(seen[0])["vllm_xargs"] == {}
    assert seen[1] == kept  # nothing to change: byte for byte
    assert _middleware(app).runtime_metrics.tenants_dropped._value.get() == 1


def _middleware(app: FastAPI) -> LeapExtrasMiddleware:
    middleware = app.middleware_stack
    while not isinstance(middleware, LeapExtrasMiddleware):
        middleware = middleware.app
    return middleware


def test_a_body_too_large_to_check_is_413_and_a_bad_keys_file_refuses_the_start(tmp_path):
    from serving.api_middleware import MAX_INSPECTED_BODY
    from serving.caller_tenant import TenantKeysError, read_tenant_keys

    app, seen = _app()
    with TestClient(app) as client:
        big = b'{"prompt": "' + b"x" * (MAX_INSPECTED_BODY + 1) + b'"}'
        assert client.post("/v1/completions", content=big).status_code == 413
    assert seen == []
    for text in ('["not", "an", "object"]', '{"abc": "t"}', json.dumps({"0" * 64: ""}), "{not json"):
        bad = tmp_path / "keys.json"
        bad.write_text(text)
        with pytest.raises(TenantKeysError):
            read_tenant_keys(bad)
