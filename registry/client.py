"""Readouts and their RLS state versioned in the MLflow model registry, promoted through aliases.

One registered model per serving model and layer; each fit is one run and one model version. Serving
reads `champion`, the gate compares `challenger` against it, and `previous-champion` keeps a rollback one
step away. `ReadoutRegistry` is the one door to MLflow, put together from `registry.runs`,
`registry.loading`, `registry.lookups`, `registry.aliases` (under `registry.locking`) and
`registry.retention`. Everything is logged through `MlflowClient` with explicit run ids, since the
fluent API's global active run would leak across Prefect tasks and threads; calls are retried, then fail
as `RegistryUnavailable` or `RegistryError` (`registry.calls`). This module is the registry's public face.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlflow.tracking import MlflowClient

from leap_io.model_identity import registered_model_name
from leap_io.redact import redact_url
from registry.aliases import ALIASES, CHALLENGER, CHAMPION, PREVIOUS_CHAMPION, AliasMixin
from registry.calls import (
    RegistryError,
    RegistryUnavailable,
    RetryingClient,
    call_with_retry,
)
from registry.loading import LoadingMixin
from registry.locking import DEFAULT_LOCK_TIMEOUT_S, AliasLock, AliasLockHandle, AliasLockTimeout, default_lock_path
from registry.lookups import LookupMixin
from registry.operations import OperationsMixin
from registry.retention import RetentionMixin
from registry.runs import RunsMixin
from registry.tracking import ensure_db, sqlite_path

__all__ = ["ALIASES", "CHALLENGER", "CHAMPION", "PREVIOUS_CHAMPION", "AliasLockTimeout", "ReadoutRegistry",
           "RegistryError", "RegistryUnavailable", "apply_credentials", "ensure_db"]

USERNAME_VARIABLE = "LEAP_MLFLOW_USERNAME"
PASSWORD_FILE_VARIABLE = "LEAP_MLFLOW_PASSWORD_FILE"


def apply_credentials() -> str | None:
    """Hand MLflow's client the account of `$LEAP_MLFLOW_USERNAME`, its password read from the file
    `$LEAP_MLFLOW_PASSWORD_FILE` (a compose secret; surrounding whitespace dropped), as the
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD variables it reads on every request; returns the
    username, or None (and changes nothing) when no password file is set. The file is read anew each time,
    so a registry made after a rotation uses the new password. The password itself is never in a message.
    Raises RegistryError (UNAUTHENTICATED) when the file cannot be read or is empty, or no username is set."""
    from leap_io.settings import read_settings

    settings = read_settings()
    path = settings.mlflow_password_file
    if not path:
        return None
    username = (settings.mlflow_username or "").strip()
    if not username:
        raise RegistryError(f"{PASSWORD_FILE_VARIABLE} is set but {USERNAME_VARIABLE} is not: "
                            "name the MLflow account whose password the file holds", "UNAUTHENTICATED")
    try:
        password = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not text"
        raise RegistryError(f"cannot read the MLflow password file {path} ({PASSWORD_FILE_VARIABLE}): {reason}",
                            "UNAUTHENTICATED") from None
    if not password:
        raise RegistryError(f"the MLflow password file {path} ({PASSWORD_FILE_VARIABLE}) is empty",
                            "UNAUTHENTICATED")
    os.environ["MLFLOW_TRACKING_USERNAME"] = username
    os.environ["MLFLOW_TRACKING_PASSWORD"] = password
    return username


class ReadoutRegistry(RunsMixin, LoadingMixin, LookupMixin, AliasMixin, RetentionMixin, OperationsMixin):
    """Log, register, promote and load LEAP readouts in one MLflow tracking store.

    `artifact_location` defaults to an `artifacts` folder next to a sqlite database, so a store is
    one self-contained folder; other stores use their server's default. `retries` and `backoff_s`
    (default `$LEAP_MLFLOW_RETRIES`, `$LEAP_MLFLOW_BACKOFF_S`, else 3 and 0.5 s) bound how long a
    call waits for the server; `lock_path` is the alias lock's file (default `default_lock_path`).
    MLflow's own HTTP retries (seven, with backoff growing to minutes) are turned off by default for
    http URIs, so that a server that is down fails a command in seconds rather than hanging it.
    """

    def __init__(self, tracking_uri: str, artifact_location: str | Path | None = None, *,
                 lock_path: str | Path | None = None, retries: int | None = None,
                 backoff_s: float | None = None, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        self.tracking_uri = tracking_uri
        db_path = sqlite_path(tracking_uri)
        if artifact_location is None and db_path is not None:
            artifact_location = db_path.resolve().parent / "artifacts"
        if isinstance(artifact_location, Path):
            artifact_location = artifact_location.resolve().as_uri()
        self.artifact_location = artifact_location
        if retries is None or backoff_s is None:
            from leap_io.settings import read_settings

            settings = read_settings()
            retries = settings.mlflow_retries if retries is None else retries
            backoff_s = settings.mlflow_backoff_s if backoff_s is None else backoff_s
        self.retries = retries
        self.backoff_s = backoff_s
        if tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # ours are bounded; see above
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
            self.username = apply_credentials()  # the account asked for by a server with authentication
        else:
            self.username = None
        self.alias_lock = AliasLockHandle(AliasLock.for_path(lock_path or default_lock_path(tracking_uri)),
                                          lock_timeout_s)
        where = f"MLflow at {redact_url(tracking_uri)}"  # never a password in an error message
        # before the client: MLflow creates a sqlite schema in each process that opens it, and two collide
        call_with_retry(lambda: ensure_db(tracking_uri), "creating the sqlite schema", retries=self.retries,
                        backoff_s=self.backoff_s, where=where)
        self.client = RetryingClient(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri),
                                     self.retries, self.backoff_s, where)

    def __repr__(self) -> str:
        account = f", username={self.username!r}" if self.username else ""
        return f"ReadoutRegistry({redact_url(self.tracking_uri)!r}{account})"

    @staticmethod
    def model_name(model_id: str, layer: int) -> str:
        """`leap-readout-<model id>-L<layer>`: one registered model per serving model and layer."""
        return registered_model_name(model_id, layer)
