"""Prefect with basic authentication, as infra/compose.yaml runs it: a real `prefect server start` with an
auth string refuses the API without it and serves LEAP's deployment calls with it.

Compose cannot run here; this checks the two settings compose relies on against the installed Prefect, and
that every compose service that talks to Prefect carries the client's half.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

pytest.importorskip("prefect")

from ops.servers import free_port, program, stop, wait_http

COMPOSE = Path(__file__).resolve().parents[1] / "infra" / "compose.yaml"
AUTH = "admin:a-long-prefect-password"


@pytest.fixture(scope="module")
def prefect_with_auth(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-auth")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_API_AUTH_STRING": AUTH}
    env.pop("PREFECT_API_URL", None)
    with open(home / "server.log", "wb") as log:
        process = subprocess.Popen([program("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", timeout_s=180.0, process=process)
        yield f"http://127.0.0.1:{port}/api", home
    finally:
        stop(process)


def _client_call(api: str, home: Path, auth: str | None) -> subprocess.CompletedProcess:
    """A fresh process lists flows through Prefect's own client, as a worker or `leap deploy` would."""
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home / "client")}
    env.pop("PREFECT_API_AUTH_STRING", None)
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
    code = ("import asyncio\nfrom prefect.client.orchestration import get_client\n"
            "async def main():\n    async with get_client() as c:\n        print(len(await c.read_flows()))\n"
            "asyncio.run(main())\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_api_refuses_requests_without_the_auth_string_and_serves_them_with_it(prefect_with_auth):
    api, home = prefect_with_auth
    assert httpx.get(f"{api}/health", timeout=10).status_code == 200  # compose's healthcheck needs no account
    assert httpx.post(f"{api}/flows/filter", json={}, timeout=10).status_code == 401
    user, password = AUTH.split(":", 1)
    assert httpx.post(f"{api}/flows/filter", json={}, auth=(user, "wrong"), timeout=10).status_code == 401
    assert httpx.post(f"{api}/flows/filter", json={}, auth=(user, password), timeout=10).status_code == 200
    allowed = _client_call(api, home, AUTH)
    assert allowed.returncode == 0 and allowed.stdout.strip() == "0", allowed.stderr[-2000:]
    refused = _client_call(api, home, None)
    assert refused.returncode != 0 and "401" in refused.stderr


def test_compose_gives_the_server_its_string_and_every_client_the_same_one():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    server = services["prefect-server"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"]
    assert server.startswith("admin:${PREFECT_API_PASSWORD")
    clients = {name: s["environment"] for name, s in services.items()
               if isinstance(s.get("environment"), dict) and "PREFECT_API_URL" in s["environment"]}
    assert {"prefect-deploy", "prefect-worker-0"} <= set(clients)
    for name, env in clients.items():
        assert env.get("PREFECT_API_AUTH_STRING") == "admin:${PREFECT_API_PASSWORD}", name
