"""The local stack: MLflow, Prefect and the serving process as detached processes on loopback.

`up(..., fleet=N)` starts the fleet instead (ops/stack_fleet.py): PostgreSQL, an S3 server, MLflow and
Prefect on them, two Prefect process workers on the work pool `leap` and N serving replicas. A service
may name others that must answer before it starts (`after`) and work to do first (`prepare`: a
database, a bucket, the work pool); `up` starts each one as soon as what it waits for answers.

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
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

from flows.settings import PipelineSettings
from leap_io.pidfiles import alive, pid_file, pid_line, service_pid
from ops.servers import MLFLOW_ENVIRONMENT, mlflow_command, program
from ops.service import Service

SERVICES = ("mlflow", "prefect", "serving")


class StackError(RuntimeError):
    """A service could not be started (port taken, process exited); the message says which and why."""


def service_specs(settings: PipelineSettings) -> dict[str, Service]:
    """The services of this home's stack, in start order: the fleet's while `up --fleet` recorded one."""
    from ops import stack_fleet as fleet

    layout = fleet.read_layout(settings)
    if layout is not None:
        return fleet.fleet_specs(settings, layout)
    return _single_specs(settings)


def _single_specs(settings: PipelineSettings) -> dict[str, Service]:
    host = settings.stack_host
    mlflow_dir = settings.mlflow_dir
    serve = [program("leap"), "serve", "--host", host, "--port", str(settings.serving_port),
             "--admin-port", str(settings.admin_port), "--feedback-dir", str(settings.feedback_dir),
             "--max-model-len", str(settings.max_model_len)]
    if settings.model_path is not None:
        serve += ["--model", str(settings.model_path)]

    def prepare_mlflow() -> None:
        from registry.client import ensure_db

        (mlflow_dir / "artifacts").mkdir(parents=True, exist_ok=True)
        ensure_db(settings.mlflow_sqlite_uri)

    def prepare_serving() -> None:
        settings.token()  # the replica and the push flow must read the same token file

    return {  # prefect boots while mlflow's schema is prepared here
        "prefect": Service(
            "prefect",
            [program("prefect"), "server", "start", "--host", host, "--port", str(settings.prefect_port)],
            url=f"http://{host}:{settings.prefect_port}", health_url=f"{settings.prefect_api_url}/health",
            ports=(settings.prefect_port,), start_timeout_s=90.0,
            env={"PREFECT_HOME": str(settings.home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "PREFECT_API_URL": settings.prefect_api_url}),
        "mlflow": Service(
            "mlflow",
            mlflow_command(settings.mlflow_sqlite_uri, mlflow_dir / "artifacts", settings.mlflow_port, host),
            url=settings.mlflow_server_url, health_url=f"{settings.mlflow_server_url}/health",
            ports=(settings.mlflow_port,), start_timeout_s=90.0,
            env=dict(MLFLOW_ENVIRONMENT), prepare=prepare_mlflow),
        "serving": Service(
            "serving", serve, url=f"http://{host}:{settings.serving_port}/v1",
            # vLLM answers /health once the engine serves; LEAP's admin API is up before that
            health_url=f"http://{host}:{settings.serving_port}/health",
            ports=(settings.serving_port, settings.admin_port),
            start_timeout_s=600.0, admin_url=f"http://{host}:{settings.admin_port}",
            env={"LEAP_HOME": str(settings.home), "LEAP_ADMIN_TOKEN_FILE": str(settings.admin_token_file)},
            prepare=prepare_serving),
    }


# ---------------------------------------------------------------------------- processes

def log_file(stack_dir: Path, name: str) -> Path:
    return Path(stack_dir) / f"{name}.log"


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


def healthy(service: Service) -> bool:
    """Whether the service answers: its own check, else an HTTP 200 from its health URL."""
    if service.check is not None:
        try:
            return bool(service.check())
        except Exception:
            return False
    return answers(service.health_url)


def _spawn(service: Service, stack_dir: Path, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, **service.env}
    with open(log_file(stack_dir, service.name), "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(service.argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(list(service.argv), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=service.cwd or cwd,
                                   start_new_session=True, user=service.user)
    pid_file(stack_dir, service.name).write_text(pid_line(process.pid))
    return process


def _note(stack_dir: Path, name: str, line: str) -> None:
    with open(log_file(stack_dir, name), "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n".encode())


def _ended(process: subprocess.Popen) -> str:
    code = process.returncode
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _names(names: Iterable[str] | None, specs: dict[str, Service]) -> list[str]:
    """The chosen services in start order (all of them for None)."""
    chosen = list(specs if names is None else names)
    unknown = sorted(set(chosen) - set(specs))
    if unknown:
        raise ValueError(f"unknown services {unknown}; choose from {list(specs)}")
    return [name for name in specs if name in chosen]


# ---------------------------------------------------------------------------- commands

def status(settings: PipelineSettings, names: Iterable[str] | None = None) -> dict[str, Any]:
    """{"services": {name: {"healthy", "url", "pid", ...}}, "replicas": [...], "healthy": all of them healthy}.

    `replicas` has one entry per serving service among `names`: its admin URL, whether it is up, the
    readout version it serves and its live rolling Spearman and MAE (the admin API's /leap/readout and
    /metrics), so a fleet that disagrees on its version shows it here. `fleet` is the recorded layout
    (None for the single-machine stack).
    """
    from ops import stack_fleet as fleet

    specs = service_specs(settings)
    services, replicas = {}, []
    for name in _names(names, specs):
        spec = specs[name]
        up_now = healthy(spec)
        services[name] = {"healthy": up_now, "url": spec.url, "health_url": spec.health_url,
                          "pid": service_pid(settings.stack_dir, name),
                          "log": str(log_file(settings.stack_dir, name))}
        if spec.admin_url is not None:
            replicas.append({"name": name, "url": spec.url, "up": up_now,
                             **fleet.replica_report(spec.admin_url, settings.token(), name)})
    layout = fleet.read_layout(settings)
    versions = sorted({str(r["version"]) for r in replicas if r.get("version")})  # "": no readout served
    return {"services": services, "replicas": replicas, "versions": versions,
            "fleet": None if layout is None else {**layout.__dict__, "env_file": str(fleet.env_path(settings))},
            "healthy": all(s["healthy"] for s in services.values())}


def _wait_set(names: list[str], specs: dict[str, Service]) -> list[str]:
    """`names` and everything they wait for, in start order."""
    needed, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(specs[name].after)
    return [name for name in specs if name in needed]


def up(settings: PipelineSettings, names: Iterable[str] | None = None, wait: bool = True,
       timeout_s: float | None = None, fleet: int | None = None) -> dict[str, Any]:
    """Start the services that are not running, then wait until all of them answer (when `wait`).

    `fleet=N` records the fleet layout with N serving replicas first (ops/stack_fleet.py); without it a
    recorded fleet is started again as recorded, unless none of its services runs, in which case the
    single-machine stack is started instead. A running service is left alone, so `up` twice starts
    nothing the second time. A service waits for those it names in `after` (started too when they do
    not run); `wait=False` returns once every chosen service has been started. Raises StackError when
    a port is held by a process the stack did not start, or a service exits or times out starting.
    """
    from ops import stack_fleet as fleet_module

    stack_dir = settings.stack_dir
    stack_dir.mkdir(parents=True, exist_ok=True)
    if fleet is not None:
        layout = fleet_module.read_layout(settings)
        running = [name for name in (service_specs(settings) if layout else {})
                   if service_pid(stack_dir, name) is not None]
        if layout is not None and layout.replicas != fleet and running:
            raise StackError(f"a fleet with {layout.replicas} replicas runs ({', '.join(running)}); "
                             f"`leap stack down` first to change it to {fleet}")
        if layout is None and any(service_pid(stack_dir, name) is not None for name in _single_specs(settings)):
            raise StackError("the single-machine stack runs; `leap stack down` before `leap stack up --fleet`")
        fleet_module.write_layout(settings, fleet_module.plan_layout(settings, fleet))
    elif fleet_module.read_layout(settings) is not None and not any(
            service_pid(stack_dir, name) is not None for name in service_specs(settings)):
        fleet_module.forget_layout(settings)
    specs = service_specs(settings)
    chosen = _names(names, specs)
    involved = _wait_set(chosen, specs)
    to_start = [name for name in involved if service_pid(stack_dir, name) is None]
    deadlines = {name: time.monotonic() + (timeout_s or specs[name].start_timeout_s) for name in involved}
    started: list[str] = []
    processes: dict[str, subprocess.Popen] = {}
    restarted: list[str] = []
    pending = set(involved)
    while to_start or (wait and pending):
        answering = {name for name in pending if healthy(specs[name])}
        pending -= answering
        for name in list(to_start):
            spec = specs[name]
            if any(dep in pending for dep in spec.after):
                continue
            to_start.remove(name)
            pid_file(stack_dir, name).unlink(missing_ok=True)
            taken = [port for port in spec.ports if _port_taken(settings.stack_host, port)]
            if taken:
                raise StackError(f"{name}: port {taken[0]} is in use by a process the stack did not start; "
                                 f"stop it or choose another port (LEAP_*_PORT)")
            if spec.prepare is not None:
                try:
                    spec.prepare()
                except Exception as exc:  # a database, bucket or pool that cannot be made stops `up` here
                    raise StackError(f"{name}: preparing failed: {type(exc).__name__}: {exc}") from exc
            processes[name] = _spawn(spec, stack_dir, settings.home)
            deadlines[name] = time.monotonic() + (timeout_s or spec.start_timeout_s)
            if name not in started:
                started.append(name)
        for name in sorted(pending):
            if name in to_start:
                if time.monotonic() > deadlines[name]:
                    raise StackError(f"{name} waited too long for {', '.join(specs[name].after)}")
                continue
            process = processes.get(name)
            if process is not None and process.poll() is not None:
                ended = _ended(process)
                if process.returncode < 0 and name not in restarted:
                    # a signal from outside (the OOM killer, an operator) during start-up: one more try
                    restarted.append(name)
                    _note(stack_dir, name, f"{ended} while starting; starting it once more")
                    to_start.append(name)
                    continue
                raise StackError(f"{name} {ended} while starting; last log lines:\n"
                                 f"{_log_tail(log_file(stack_dir, name))}")
            # our own child is judged by its exit status alone: reading its pid file would reap it
            # (`leap_io.pidfiles.alive`) and lose the status, and with it the one restart a signal earns
            if process is None and service_pid(stack_dir, name) is None:
                raise StackError(f"{name} stopped running while starting; last log lines:\n"
                                 f"{_log_tail(log_file(stack_dir, name))}")
            if time.monotonic() > deadlines[name]:
                raise StackError(f"{name} did not answer {specs[name].health_url} in time; "
                                 f"see {log_file(stack_dir, name)}")
        if to_start or (wait and pending):
            time.sleep(0.5)
    return {"started": started, "restarted": restarted, **status(settings, chosen)}


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


def stop_process(pid: int, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> str:
    """`sig` (SIGTERM) to the process group a service leads, SIGKILL what is left after `grace_s`."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return "gone"
    if pgid != pid:  # not a session leader the stack started: signal only that process
        pgid = None
    send = (lambda sig: _signal_group(pgid, sig)) if pgid is not None else (lambda sig: os.kill(pid, sig))
    send(sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not alive(pid) and (pgid is None or not group_alive(pgid)):
            return "terminated"
        time.sleep(0.2)
    try:
        send(signal.SIGKILL)
    except ProcessLookupError:
        pass
    for _ in range(50):
        if not alive(pid):
            break
        time.sleep(0.1)
    return "killed"


def stop_waves(names: Sequence[str], specs: dict[str, Service]) -> list[list[str]]:
    """`names` (in start order) in the waves `down` stops them in: each wave holds the services that no
    service still running in a later wave waits for (`after`), so a database outlives what writes to it."""
    left, waves = list(names), []
    while left:
        needed = {dep for name in left for dep in specs[name].after}
        wave = [name for name in reversed(left) if name not in needed] or [left[-1]]
        waves.append(wave)
        left = [name for name in left if name not in wave]
    return waves


def down(settings: PipelineSettings, names: Iterable[str] | None = None, grace_s: float = 15.0) -> dict[str, Any]:
    """Stop the services the stack started and remove their pid files: those that wait for others first,
    each wave at once (`stop_waves`). Once none of a fleet's services runs, its recorded layout and env file
    go too (its data folders stay)."""
    from concurrent.futures import ThreadPoolExecutor

    from ops import stack_fleet as fleet

    specs = service_specs(settings)

    def stop(name: str) -> str:
        pid = service_pid(settings.stack_dir, name)
        outcome = "not running" if pid is None else stop_process(pid, grace_s, specs[name].stop_signal)
        pid_file(settings.stack_dir, name).unlink(missing_ok=True)
        return outcome

    stopped = {}
    waves = stop_waves(_names(names, specs), specs)
    with ThreadPoolExecutor(max_workers=max([len(wave) for wave in waves], default=1)) as pool:
        for wave in waves:
            stopped.update(zip(wave, pool.map(stop, wave)))
    result = {"stopped": stopped, **status(settings, names)}
    if fleet.read_layout(settings) is not None and all(service_pid(settings.stack_dir, name) is None
                                                       for name in specs):
        fleet.forget_layout(settings)
    return result
