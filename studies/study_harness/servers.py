"""Servers that the tests, the fault suite and the benches start for a block, and stop after: PostgreSQL
(`running_postgres`), a moto S3 endpoint (`running_s3`), MLflow's tracking server (`MlflowServer`) and a
scratch database on a shared PostgreSQL server (`scratch_database`).

They run the same programs the stack runs (`ops.servers`: the commands, the environment, the waits), so a
check against them checks the real servers; only starting them for a block is study code, and the product
never does it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from leap_io.durable import write_text_durably
from ops.servers import (
    MLFLOW_ENVIRONMENT,
    ServerError,
    free_port,
    init_postgres,
    kill_session,
    mlflow_command,
    postgres_command,
    postgres_user,
    s3_command,
    stop,
    wait_http,
    wait_postgres,
)
from store.postgres import check_url

BASIC_AUTH_APP = "basic-auth"
"""MLflow's app that asks every request (but /health and static files) for a user and password."""
_LEGACY_MLFLOW_PASSWORD = "password1234"  # the admin password older MLflow shipped; never ours


@dataclass(frozen=True)
class MlflowAuth:
    """Basic authentication of an `mlflow server`: the admin account the server creates the first time it
    starts on an empty user database, and that database (`database_uri`; None: the sqlite file
    `basic_auth.db` in the server's folder). Once the account exists the server ignores the password
    given here: change it with MLflow's update-password API (docs/security.md). Users other than the
    admin get `default_permission` on what they did not create. The server checks a password with a slow
    hash on every request unless `auth_cache_ttl_s` > 0, for which it remembers a password that passed (a
    changed one is then still taken by another worker for up to that long). The password is never shown."""

    admin_username: str
    admin_password: str = field(repr=False)
    database_uri: str | None = None
    default_permission: str = "READ"
    auth_cache_ttl_s: int = 0

    def __post_init__(self) -> None:
        if not self.admin_username or self.admin_username != self.admin_username.strip():
            raise ValueError("MlflowAuth needs an admin username without surrounding whitespace")
        password = self.admin_password
        # an ini value loses surrounding whitespace and cannot span lines; MLflow wants 12 characters
        if len(password) < 12 or password != password.strip() or "\n" in password or "\r" in password:
            raise ValueError("MlflowAuth needs an admin password of at least 12 characters on one line, "
                             "without surrounding whitespace")
        if password == _LEGACY_MLFLOW_PASSWORD:
            raise ValueError("MlflowAuth refuses the default password older MLflow versions shipped")


def write_auth_config(path: str | Path, auth: MlflowAuth, database_uri: str) -> Path:
    """The settings file of MLflow's basic-auth app (MLFLOW_AUTH_CONFIG_PATH) at `path`, holding the admin
    password: created anew with mode 0600, so it is never readable by others, not even while written."""
    path = Path(path)
    lines = ["[mlflow]", f"default_permission = {auth.default_permission}", f"database_uri = {database_uri}",
             f"admin_username = {auth.admin_username}", f"admin_password = {auth.admin_password}",
             "authorization_function = mlflow.server.auth:authenticate_request_basic_auth",
             f"auth_cache_ttl_seconds = {int(auth.auth_cache_ttl_s)}"]
    # MLflow reads the file with configparser's interpolation, to which `%` is special
    text = "\n".join(line.replace("%", "%%") for line in lines) + "\n"
    write_text_durably(path, text, mode=0o600)  # a new file made 0600 and renamed over: never readable by others
    return path


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
        stop(process, grace_s=30.0)  # SIGTERM: PostgreSQL's smart shutdown
        log.close()


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
        stop(process, grace_s=10.0)
        if log is not subprocess.DEVNULL:
            log.close()


@contextmanager
def scratch_database(url: str) -> Iterator[str]:
    """A new, empty database on the server of `url` for the block (dropped after); yields its URL.

    For benches and checks that need a store of their own on a shared server; needs the right to
    create databases.
    """
    import uuid

    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    server = make_url(check_url(url))
    name = f"leap_scratch_{uuid.uuid4().hex[:12]}"
    params = {"host": server.host, "port": server.port, "user": server.username, "password": server.password,
              "dbname": server.database or "postgres"}
    with psycopg.connect(**{key: value for key, value in params.items() if value is not None},
                         autocommit=True) as con:
        con.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield server.set(database=name).render_as_string(hide_password=False)
        finally:
            con.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class MlflowServer:
    """An `mlflow server` for a block, on a free loopback port (or `port`): its registry in the sqlite file
    `folder/mlflow.db`, artifacts in `folder/artifacts`, its log in `folder/server.log`. With `auth` it
    asks every client for a user and password (`MlflowAuth`; its settings in `folder/basic_auth.ini`)."""

    def __init__(self, folder: str | Path, start_timeout_s: float = 45.0, port: int | None = None,
                 host: str = "127.0.0.1", auth: MlflowAuth | None = None) -> None:
        self.folder = Path(folder)
        self.db_path = self.folder / "mlflow.db"
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.auth = auth
        # the basic-auth app signs its forms' CSRF tokens with it; one per server, kept across restarts
        self._flask_secret_key = os.environ.get("MLFLOW_FLASK_SERVER_SECRET_KEY") or secrets.token_hex(32)
        self.process: subprocess.Popen | None = None

    @property
    def auth_config_path(self) -> Path:
        """The basic-auth app's settings (with `auth` only): mode 0600, written at each start."""
        return self.folder / "basic_auth.ini"

    @property
    def auth_database_uri(self) -> str | None:
        """Where the server keeps its users: `auth.database_uri`, else `folder/basic_auth.db`; None without auth."""
        if self.auth is None:
            return None
        return self.auth.database_uri or f"sqlite:///{(self.folder / 'basic_auth.db').resolve()}"

    @property
    def backend_store_uri(self) -> str:
        return f"sqlite:///{self.db_path}"

    def start(self) -> Self:
        """Start the server and return once it answers; ServerError (server stopped) when it does not."""
        from registry.client import ensure_db

        self.folder.mkdir(parents=True, exist_ok=True)
        ensure_db(self.backend_store_uri)
        environment = {**os.environ, **MLFLOW_ENVIRONMENT}
        app_name = None
        if self.auth is not None:
            app_name = BASIC_AUTH_APP
            if self.auth.database_uri is None and not (self.folder / "basic_auth.db").exists():
                # the users' password hashes: sqlite takes an empty file as a new database
                os.close(os.open(self.folder / "basic_auth.db", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            config = write_auth_config(self.auth_config_path, self.auth, str(self.auth_database_uri))
            environment["MLFLOW_AUTH_CONFIG_PATH"] = str(config.resolve())
            environment["MLFLOW_FLASK_SERVER_SECRET_KEY"] = self._flask_secret_key
            for name in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD"):  # they would override it
                environment.pop(name, None)
        command = mlflow_command(self.backend_store_uri, self.folder / "artifacts", self.port, self.host,
                                 app_name=app_name)
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder,
                                            env=environment, start_new_session=True)
        try:
            wait_http(f"{self.url}/health", self.start_timeout_s, self.process)
        except ServerError as error:
            self.stop()
            raise ServerError(f"{error}; log: {_tail(self.folder / 'server.log')}") from None
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server and its workers, SIGKILL what is left after `grace_s`."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server and its workers: it goes away as it would when its host dies."""
        if self.process is not None:
            kill_session(self.process)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
