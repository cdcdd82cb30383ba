"""The local stack: MLflow, Prefect and the serving process as detached processes on loopback.

Each service runs in its own session (so `down` can signal the whole process group, workers included)
with a pid file and a log under `<home>/stack/`. A pid file only counts while its process is alive and
still runs the service's program, so a stale file from a reboot or a reused pid never blocks `up`.
Health is what each service answers over HTTP, never the mere existence of a process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flows.settings import PipelineSettings

SERVICES = ("mlflow", "prefect", "serving")
_START_ORDER = ("prefect", "mlflow", "serving")  # prefect boots while mlflow's schema is prepared here
_PROGRAM_MARKERS = {"mlflow": ("mlflow",), "prefect": ("prefect",), "serving": ("leap", "vllm")}


class StackError(RuntimeError):
    """A service could not be started (port taken, process exited); the message says which and why."""


@dataclass(frozen=True)
class Service:
    """How to start one service and how to tell that it answers."""

    name: str
    argv: Sequence[str]
    url: str
    health_url: str
    ports: tuple[int, ...]
    start_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)


def _program(name: str) -> str:
    """A console script of this environment (beside the running interpreter), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def service_specs(settings: PipelineSettings) -> dict[str, Service]:
    host = settings.stack_host
    mlflow_dir = settings.mlflow_dir
    serve = [_program("leap"), "serve", "--host", host, "--port", str(settings.serving_port),
             "--admin-port", str(settings.admin_port), "--feedback-dir", str(settings.feedback_dir),
             "--max-model-len", str(settings.max_model_len)]
    if settings.model_path is not None:
        serve += ["--model", str(settings.model_path)]
    return {
        "mlflow": Service(
            "mlflow",
            [_program("mlflow"), "server", "--backend-store-uri", settings.mlflow_sqlite_uri,
             "--artifacts-destination", str(mlflow_dir / "artifacts"), "--host", host,
             "--port", str(settings.mlflow_port), "--workers", "1"],
            url=settings.mlflow_server_url, health_url=f"{settings.mlflow_server_url}/health",
            ports=(settings.mlflow_port,), start_timeout_s=90.0,
            env={"MLFLOW_DISABLE_TELEMETRY": "true"}),
        "prefect": Service(
            "prefect",
            [_program("prefect"), "server", "start", "--host", host, "--port", str(settings.prefect_port)],
            url=f"http://{host}:{settings.prefect_port}", health_url=f"{settings.prefect_api_url}/health",
            ports=(settings.prefect_port,), start_timeout_s=90.0,
            env={"PREFECT_HOME": str(settings.home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "PREFECT_API_URL": settings.prefect_api_url}),
        "serving": Service(
            "serving", serve, url=f"http://{host}:{settings.serving_port}/v1",
            # vLLM answers /health once the engine serves; LEAP's admin API is up before that
            health_url=f"http://{host}:{settings.serving_port}/health",
            ports=(settings.serving_port, settings.admin_port),
            start_timeout_s=600.0,
            env={"LEAP_HOME": str(settings.home), "LEAP_ADMIN_TOKEN_FILE": str(settings.admin_token_file)}),
    }


# ---------------------------------------------------------------------------- processes

def pid_file(stack_dir: Path, name: str) -> Path:
    return Path(stack_dir) / f"{name}.pid"


def log_file(stack_dir: Path, name: str) -> Path:
    return Path(stack_dir) / f"{name}.log"


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reaps it if it is our own exited child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _runs_program(pid: int, name: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc here: trust the pid file
    return any(marker in cmdline for marker in _PROGRAM_MARKERS.get(name, (name,)))


def service_pid(stack_dir: str | Path, name: str) -> int | None:
    """The pid of a running service started by the stack, or None (a stale pid file counts as none)."""
    path = pid_file(Path(stack_dir), name)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) and _runs_program(pid, name) else None


def answers(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _spawn(service: Service, stack_dir: Path, cwd: Path) -> int:
    env = {**os.environ, **service.env}
    with open(log_file(stack_dir, service.name), "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(service.argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(list(service.argv), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    pid_file(stack_dir, service.name).write_text(f"{process.pid}\n")
    return process.pid


def _names(names: Iterable[str] | None) -> list[str]:
    chosen = list(SERVICES if names is None else names)
    unknown = sorted(set(chosen) - set(SERVICES))
    if unknown:
        raise ValueError(f"unknown services {unknown}; choose from {list(SERVICES)}")
    return chosen


# ---------------------------------------------------------------------------- commands

def status(settings: PipelineSettings, names: Iterable[str] | None = None) -> dict[str, Any]:
    """{"services": {name: {"healthy", "url", "pid", ...}}, "healthy": all of them healthy}."""
    specs = service_specs(settings)
    services = {}
    for name in _names(names):
        spec = specs[name]
        services[name] = {"healthy": answers(spec.health_url), "url": spec.url, "health_url": spec.health_url,
                          "pid": service_pid(settings.stack_dir, name),
                          "log": str(log_file(settings.stack_dir, name))}
    return {"services": services, "healthy": all(s["healthy"] for s in services.values())}


def up(settings: PipelineSettings, names: Iterable[str] | None = None, wait: bool = True,
       timeout_s: float | None = None) -> dict[str, Any]:
    """Start the services that are not running, then wait until all of them answer (when `wait`).

    A running service is left alone, so `up` twice starts nothing the second time. Raises StackError
    when a port is held by a process the stack did not start, or a service exits while starting.
    """
    names = _names(names)
    specs = service_specs(settings)
    stack_dir = settings.stack_dir
    stack_dir.mkdir(parents=True, exist_ok=True)
    started: list[str] = []
    for name in sorted(names, key=_START_ORDER.index):
        spec = specs[name]
        if service_pid(stack_dir, name) is not None:
            continue
        pid_file(stack_dir, name).unlink(missing_ok=True)
        taken = [port for port in spec.ports if _port_taken(settings.stack_host, port)]
        if taken:
            raise StackError(f"{name}: port {taken[0]} is in use by a process the stack did not start; "
                             f"stop it or choose another port (LEAP_*_PORT)")
        if name == "mlflow":
            from registry.client import ensure_db

            (settings.mlflow_dir / "artifacts").mkdir(parents=True, exist_ok=True)
            ensure_db(settings.mlflow_sqlite_uri)
        elif name == "serving":
            settings.token()  # the replica and the push flow must read the same token file
        _spawn(spec, stack_dir, settings.home)
        started.append(name)

    if wait:
        pending = set(names)
        deadlines = {name: time.monotonic() + (timeout_s or specs[name].start_timeout_s) for name in names}
        while pending:
            for name in sorted(pending):
                if answers(specs[name].health_url):
                    pending.discard(name)
                elif service_pid(stack_dir, name) is None:
                    tail = _log_tail(log_file(stack_dir, name))
                    raise StackError(f"{name} exited while starting; last log lines:\n{tail}")
                elif time.monotonic() > deadlines[name]:
                    raise StackError(f"{name} did not answer {specs[name].health_url} in time; "
                                     f"see {log_file(stack_dir, name)}")
            if pending:
                time.sleep(0.5)
    return {"started": started, **status(settings, names)}


def group_alive(pgid: int) -> bool:
    """Whether any process of the group `pgid` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop_process(pid: int, grace_s: float = 15.0) -> str:
    """SIGTERM the process group a service leads, SIGKILL what is left after `grace_s`."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return "gone"
    if pgid != pid:  # not a session leader the stack started: signal only that process
        pgid = None
    send = (lambda sig: _signal_group(pgid, sig)) if pgid is not None else (lambda sig: os.kill(pid, sig))
    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid) and (pgid is None or not group_alive(pgid)):
            return "terminated"
        time.sleep(0.2)
    try:
        send(signal.SIGKILL)
    except ProcessLookupError:
        pass
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    return "killed"


def down(settings: PipelineSettings, names: Iterable[str] | None = None, grace_s: float = 15.0) -> dict[str, Any]:
    """Stop the services the stack started (in reverse order) and remove their pid files."""
    stopped = {}
    for name in reversed(_names(names)):
        pid = service_pid(settings.stack_dir, name)
        stopped[name] = "not running" if pid is None else stop_process(pid, grace_s)
        pid_file(settings.stack_dir, name).unlink(missing_ok=True)
    return {"stopped": stopped, **status(settings, names)}
