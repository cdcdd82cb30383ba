"""MLflow with authentication: a real `mlflow server --app-name basic-auth`
(study_harness.servers.MlflowServer with MlflowAuth) and the project's registry client. Without an account the registry is refused with a clear
error, with the account of LEAP_MLFLOW_USERNAME and the password file LEAP_MLFLOW_PASSWORD_FILE it
registers, reads and moves the champion, a wrong password moves nothing, and the password shows nowhere."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("mlflow")

from ops.servers import mlflow_command
from registry.aliases import CHAMPION
from registry.client import ReadoutRegistry, RegistryError, RegistryUnavailable
from study_harness.servers import MlflowAuth, MlflowServer
from tests.fleet_fixtures import champion_readout

pytestmark = pytest.mark.pipeline

ADMIN = "leap-admin"
PASSWORD = f"Pw%-{secrets.token_hex(12)}"  # `%` is special to the server's ini reader
WRONG = f"Wrong-{secrets.token_hex(12)}"
HTTP_TIMEOUT_S = 60.0  # a loaded machine can take a while; a refusal is still a refusal
_VARIABLES = ("LEAP_MLFLOW_USERNAME", "LEAP_MLFLOW_PASSWORD_FILE", "MLFLOW_TRACKING_USERNAME",
              "MLFLOW_TRACKING_PASSWORD")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One server with basic authentication for the module (it takes 10-20 s to start)."""
    auth = MlflowAuth(ADMIN, PASSWORD, auth_cache_ttl_s=300)  # a check of the right password is cached
    folder = tmp_path_factory.mktemp("mlflow-auth") / "mlflow"
    with MlflowServer(folder, start_timeout_s=120.0, auth=auth) as running:  # a busy machine starts it slowly
        yield running


@pytest.fixture(autouse=True)
def no_account() -> Iterator[None]:
    """Each test starts without MLflow credentials in the environment; the registry client sets them in
    os.environ itself, so they are put back by hand afterwards."""
    saved = {name: os.environ.pop(name, None) for name in _VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _password_file(folder: Path, password: str) -> Path:
    path = folder / "mlflow_password"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(password + "\n")  # as `openssl rand ... > file` leaves it
    return path


def _account(folder: Path, password: str, username: str = ADMIN) -> None:
    os.environ["LEAP_MLFLOW_USERNAME"] = username
    os.environ["LEAP_MLFLOW_PASSWORD_FILE"] = str(_password_file(folder, password))


def _registry(server: MlflowServer, folder: Path) -> ReadoutRegistry:
    """The project's registry client on the server; a refusal (401, 403) is never retried, a timeout is."""
    return ReadoutRegistry(server.url, lock_path=folder / "aliases.lock")


def _readout(tag: str, seed: int):
    readout, rls, _, _ = champion_readout(f"20250101T0000{seed:02d}-{tag}", np.random.default_rng(seed))
    return readout, rls


def _log(registry: ReadoutRegistry, tag: str, seed: int):
    readout, rls = _readout(tag, seed)
    return registry.log_readout(readout, rls=rls, params={"data_hash": tag}, metrics={"mae": 1.0})


def test_the_server_keeps_its_admin_password_private_and_never_the_default(server: MlflowServer):
    config = server.auth_config_path
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE((server.folder / "basic_auth.db").stat().st_mode) == 0o600
    text = config.read_text()
    assert f"admin_username = {ADMIN}" in text and "password1234" not in text
    assert f"admin_password = {PASSWORD.replace('%', '%%')}" in text
    assert PASSWORD not in repr(server.auth) and ADMIN in repr(server.auth)
    for refused in ("password1234", "short", f" {PASSWORD}", f"{PASSWORD}\nx"):
        with pytest.raises(ValueError):
            MlflowAuth(ADMIN, refused)
    # the default (no authentication) command is unchanged; the auth one names MLflow's app
    plain = mlflow_command("sqlite:///x.db", "/a", 5000)
    assert "--app-name" not in plain
    assert mlflow_command("sqlite:///x.db", "/a", 5000, app_name="basic-auth")[-2:] == ["--app-name", "basic-auth"]
    # health answers anyone (compose's healthcheck has no account); the API answers no one without one
    search = f"{server.url}/api/2.0/mlflow/registered-models/search"
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert httpx.get(search, timeout=HTTP_TIMEOUT_S).status_code == 401
    assert httpx.get(search, auth=(ADMIN, WRONG), timeout=HTTP_TIMEOUT_S).status_code == 401
    assert httpx.get(search, auth=(ADMIN, PASSWORD), timeout=HTTP_TIMEOUT_S).status_code == 200


def test_without_an_account_the_registry_is_refused_with_a_clear_error(server: MlflowServer, tmp_path: Path):
    registry = _registry(server, tmp_path)
    assert registry.username is None
    readout, rls = _readout("anonymous", 1)
    with pytest.raises(RegistryError) as refused:
        registry.log_readout(readout, rls=rls, params={"data_hash": "anonymous"}, metrics={"mae": 1.0})
    assert refused.value.unauthenticated and refused.value.error_code == "UNAUTHENTICATED"
    message = str(refused.value)
    assert "401" in message and "LEAP_MLFLOW_USERNAME" in message and "LEAP_MLFLOW_PASSWORD_FILE" in message
    with pytest.raises(RegistryError, match="401"):
        registry.get_alias(registry.model_name(readout.metadata["model_id"], readout.metadata["layer"]), CHAMPION)
    # nothing of it reached the server
    experiments = httpx.post(f"{server.url}/api/2.0/mlflow/experiments/search", auth=(ADMIN, PASSWORD),
                             json={"max_results": 1000}, timeout=HTTP_TIMEOUT_S).json().get("experiments", [])
    runs = httpx.post(f"{server.url}/api/2.0/mlflow/runs/search", auth=(ADMIN, PASSWORD),
                      json={"experiment_ids": [e["experiment_id"] for e in experiments],
                            "filter": "params.data_hash = 'anonymous'"}, timeout=HTTP_TIMEOUT_S)
    assert runs.status_code == 200 and runs.json().get("runs", []) == []


def test_with_the_password_file_the_registry_registers_reads_and_moves_the_champion(server: MlflowServer,
                                                                                     tmp_path: Path):
    _account(tmp_path, PASSWORD)
    registry = _registry(server, tmp_path)
    assert registry.username == ADMIN
    readout, rls = _readout("authorized", 2)
    logged = registry.log_readout(readout, rls=rls, params={"data_hash": "authorized"}, metrics={"mae": 1.0})
    registry.set_alias(logged.name, CHAMPION, logged.version)
    assert registry.get_alias(logged.name, CHAMPION) == str(logged.version)
    served = registry.load_readout(logged.name, CHAMPION)  # the file itself, through the proxied artifacts
    assert served.metadata["version"] == readout.metadata["version"]
    assert np.allclose(served.coef_, readout.coef_) and served.intercept_ == pytest.approx(readout.intercept_)
    bundle, _ = registry.push_bundle(logged.name, CHAMPION)
    assert len(bundle) > 0


def test_a_wrong_password_is_refused_and_moves_no_alias(server: MlflowServer, tmp_path: Path):
    _account(tmp_path, PASSWORD)
    registry = _registry(server, tmp_path)
    first, second = _log(registry, "first", 3), _log(registry, "second", 4)
    registry.set_alias(first.name, CHAMPION, first.version)

    _account(tmp_path, WRONG)
    intruder = _registry(server, tmp_path)
    with pytest.raises(RegistryError) as refused:
        intruder.set_alias(second.name, CHAMPION, second.version)
    assert refused.value.unauthenticated and WRONG not in str(refused.value)
    _account(tmp_path, PASSWORD, username="someone-else")
    with pytest.raises(RegistryError) as unknown:
        _registry(server, tmp_path).set_alias(second.name, CHAMPION, second.version)
    assert unknown.value.unauthenticated

    _account(tmp_path, PASSWORD)  # the file is read anew by each registry made
    assert _registry(server, tmp_path).get_alias(first.name, CHAMPION) == str(first.version)


def test_the_password_never_shows_in_the_registry_its_errors_or_logs(server: MlflowServer, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture):
    _account(tmp_path, PASSWORD)
    with caplog.at_level(logging.DEBUG):
        registry = _registry(server, tmp_path)
        logged = _log(registry, "quiet", 5)
        registry.set_alias(logged.name, CHAMPION, logged.version)
        registry.load_readout(logged.name, CHAMPION)
    assert repr(registry) == f"ReadoutRegistry('{server.url}', username='{ADMIN}')"
    assert caplog.records and PASSWORD not in caplog.text and PASSWORD not in repr(vars(registry))
    assert PASSWORD not in (server.folder / "server.log").read_text()

    # a URI that carries a password (here the wrong one, to a port nobody listens on) is masked everywhere
    os.environ.pop("LEAP_MLFLOW_PASSWORD_FILE")
    leaky = ReadoutRegistry(f"http://{ADMIN}:{WRONG}@127.0.0.1:1", lock_path=tmp_path / "other.lock", retries=0)
    assert WRONG not in repr(leaky) and f"{ADMIN}:***@127.0.0.1:1" in repr(leaky)
    with pytest.raises(RegistryUnavailable) as unavailable:
        leaky.get_alias(logged.name, CHAMPION)
    assert WRONG not in str(unavailable.value) and "***" in str(unavailable.value)


class _AccountsApi:
    """The basic-auth app's own REST API (users, passwords), signed in as one account. Spoken over HTTP:
    importing MLflow's client of it (`mlflow.server`) would load Flask into this process, whose context
    proxies break vLLM's kernel registration in later engine tests."""

    def __init__(self, server: MlflowServer, username: str, password: str) -> None:
        self.url, self.auth = server.url, (username, password)

    def _call(self, method: str, path: str, body: dict) -> None:
        answer = httpx.request(method, f"{self.url}/api/2.0/mlflow/users/{path}", json=body, auth=self.auth,
                               timeout=30)
        answer.raise_for_status()

    def create_user(self, username: str, password: str) -> None:
        self._call("POST", "create", {"username": username, "password": password})

    def update_user_password(self, username: str, password: str, current_password: str) -> None:
        self._call("PATCH", "update-password",
                   {"username": username, "password": password, "current_password": current_password})


def _app_client(server: MlflowServer, username: str, password: str) -> _AccountsApi:
    return _AccountsApi(server, username, password)


def test_a_reader_account_reads_the_champion_but_cannot_move_it(server: MlflowServer, tmp_path: Path):
    _account(tmp_path, PASSWORD)
    registry = _registry(server, tmp_path)
    first, second = _log(registry, "read-first", 6), _log(registry, "read-second", 7)
    registry.set_alias(first.name, CHAMPION, first.version)
    reader_password = f"Reader-{secrets.token_hex(8)}"
    _app_client(server, ADMIN, PASSWORD).create_user("reader", reader_password)  # only the admin may

    _account(tmp_path, reader_password, username="reader")
    reader = _registry(server, tmp_path)
    assert reader.get_alias(first.name, CHAMPION) == str(first.version)  # default_permission READ
    with pytest.raises(RegistryError) as refused:
        reader.set_alias(second.name, CHAMPION, second.version)
    assert refused.value.error_code == "PERMISSION_DENIED" and "403" in str(refused.value)
    assert _registry(server, tmp_path).get_alias(first.name, CHAMPION) == str(first.version)


def test_rotating_the_admin_password_as_docs_security_describes(server: MlflowServer, tmp_path: Path):
    rotated = f"Rotated-{secrets.token_hex(10)}"
    _app_client(server, ADMIN, PASSWORD).update_user_password(ADMIN, rotated, current_password=PASSWORD)
    try:
        _account(tmp_path, PASSWORD)  # the secret file not yet replaced: refused at once
        with pytest.raises(RegistryError) as stale:
            _registry(server, tmp_path).client.search_registered_models()
        assert stale.value.unauthenticated
        _account(tmp_path, rotated)  # the new file, read by the next registry made
        assert isinstance(_registry(server, tmp_path).client.search_registered_models(), list)
    finally:
        _app_client(server, ADMIN, rotated).update_user_password(ADMIN, PASSWORD, current_password=rotated)


def test_a_password_file_that_cannot_serve_is_a_clear_error_before_any_call(tmp_path: Path):
    os.environ["LEAP_MLFLOW_PASSWORD_FILE"] = str(tmp_path / "missing")
    os.environ["LEAP_MLFLOW_USERNAME"] = ADMIN
    with pytest.raises(RegistryError, match="cannot read the MLflow password file .*missing"):
        ReadoutRegistry("http://127.0.0.1:1", lock_path=tmp_path / "a.lock")
    _password_file(tmp_path, "   ")
    os.environ["LEAP_MLFLOW_PASSWORD_FILE"] = str(tmp_path / "mlflow_password")
    with pytest.raises(RegistryError, match="is empty"):
        ReadoutRegistry("http://127.0.0.1:1", lock_path=tmp_path / "a.lock")
    _password_file(tmp_path, PASSWORD)
    del os.environ["LEAP_MLFLOW_USERNAME"]
    with pytest.raises(RegistryError, match="LEAP_MLFLOW_USERNAME") as nameless:
        ReadoutRegistry("http://127.0.0.1:1", lock_path=tmp_path / "a.lock")
    assert PASSWORD not in str(nameless.value) and "MLFLOW_TRACKING_PASSWORD" not in os.environ
    # a store without a server takes no account: the setting is left alone there
    assert ReadoutRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}").username is None
