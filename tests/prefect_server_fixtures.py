"""A real `prefect server start` on a free loopback port, with its UI and its event services, for the tests
that need what the test harness's server leaves out (the harness serves the API alone)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ops.servers import free_port, program, stop, wait_http


@dataclass(frozen=True)
class PrefectServer:
    url: str  # the UI's root
    api_url: str
    home: Path

    def env(self) -> dict[str, str]:
        """A client process's environment: this server's API, a Prefect home of its own."""
        env = {**os.environ, "PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home / "client"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_AUTH_STRING", None)
        return env


@contextmanager
def prefect_server(home: Path, timeout_s: float = 180.0) -> Iterator[PrefectServer]:
    """Start the server with its sqlite database under `home`; stopped (and reaped) on exit."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "true", "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}  # else :4200
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING"):
        env.pop(name, None)
    with open(home / "server.log", "wb") as log:
        process = subprocess.Popen([program("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", timeout_s=timeout_s, process=process)
        yield PrefectServer(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api", home)
    finally:
        stop(process)
