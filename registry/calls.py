"""Every MLflow call of the registry: retried while the server may come back, then failed in the registry's words.

Failures of the tracking server are retried with exponential backoff and then raised as
`RegistryUnavailable`, which says which call failed and why. Only calls that are safe to repeat are
retried (reads, alias and tag writes, artifact uploads, creating what the caller tolerates finding
already made); creating a run or a model version is not, since a request that reached the server
before the connection broke would leave a second one.

A call MLflow refuses (no such model or version, a name already taken, an invalid value) is raised
as `RegistryError`, with MLflow's error code kept: no caller of the registry handles an MLflow type.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    PERMISSION_DENIED,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    UNAUTHENTICATED,
    ErrorCode,
)
from mlflow.tracking import MlflowClient

from leap_io.redact import redact_text

DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5

# Calls not retried: a request that reached the server before the connection broke would leave a
# second run, version or logged model behind, or (log_table appends to a table already there) a table's rows twice.
_NOT_RETRIED = frozenset({"create_run", "create_model_version", "log_table", "create_logged_model"})
_TRANSIENT_CODES = frozenset({"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED",
                              "DEADLINE_EXCEEDED", "ABORTED", "IO_ERROR", "UNAVAILABLE"})


_ALIAS_NOT_FOUND = re.compile(r"Registered model alias \S+ not found")


class RegistryUnavailable(RuntimeError):
    """The MLflow tracking server (or its database) did not answer a call after every retry."""


class RegistryError(RuntimeError):
    """MLflow refused a call of the registry; `error_code` is MLflow's (e.g. RESOURCE_DOES_NOT_EXIST)."""

    def __init__(self, message: str, error_code: str) -> None:
        super().__init__(message)
        self.error_code = error_code

    @property
    def not_found(self) -> bool:
        """The model, version, alias or run named does not exist (MLflow answers a missing alias of a model
        that exists with INVALID_PARAMETER_VALUE, "Registered model alias champion not found.")."""
        if self.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return True
        return (self.error_code == ErrorCode.Name(INVALID_PARAMETER_VALUE)
                and _ALIAS_NOT_FOUND.search(str(self)) is not None)

    @property
    def already_exists(self) -> bool:
        """What the call would create is there already (another process made it first)."""
        return self.error_code == ErrorCode.Name(RESOURCE_ALREADY_EXISTS)

    @property
    def unauthenticated(self) -> bool:
        """The server asks for an account (HTTP 401): none was given, or its password is wrong."""
        return self.error_code == ErrorCode.Name(UNAUTHENTICATED)


_HINTS = {
    ErrorCode.Name(UNAUTHENTICATED): " (HTTP 401: the server wants an MLflow account: set LEAP_MLFLOW_USERNAME and "
                                     "LEAP_MLFLOW_PASSWORD_FILE, and check the password in that file)",
    ErrorCode.Name(PERMISSION_DENIED): " (HTTP 403: the MLflow account LEAP_MLFLOW_USERNAME may not do this)",
}


def _refused(error: MlflowException, what: str, where: str) -> RegistryError:
    code = str(error.error_code)
    return RegistryError(redact_text(f"{where} refused {what}{_HINTS.get(code, '')}: {error}"), code)


def _transient(error: BaseException) -> bool:
    """A failure that another try may not meet: the server down or overloaded, the database locked."""
    if isinstance(error, MlflowException):
        return error.error_code in _TRANSIENT_CODES
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    try:
        import requests
        import sqlalchemy.exc
    except ImportError:  # pragma: no cover - both come with mlflow
        return False
    return isinstance(error, (requests.RequestException, sqlalchemy.exc.OperationalError))


def call_with_retry(call: Callable[[], Any], what: str, *, retries: int = DEFAULT_RETRIES,
                    backoff_s: float = DEFAULT_BACKOFF_S, where: str = "MLflow") -> Any:
    """`call()`, tried again after backoff_s, 2 * backoff_s, ... on transient failures, `retries` times;
    then `RegistryUnavailable` naming `what` and the last error. A refusal is `RegistryError` at once,
    other errors are raised as they are."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as error:  # classified right below
            if not _transient(error):
                if isinstance(error, MlflowException):
                    raise _refused(error, what, where) from error
                raise
            if attempt == retries:
                raise RegistryUnavailable(redact_text(
                    f"{where} did not answer {what} after {retries + 1} attempts: "
                    f"{type(error).__name__}: {str(error)[:500]}")) from error
            time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")  # pragma: no cover


class RetryingClient:
    """An `MlflowClient` whose calls are retried on transient failures (see `call_with_retry`); the
    calls that must not be repeated are made once, their refusals raised as `RegistryError` too."""

    def __init__(self, client: MlflowClient, retries: int, backoff_s: float, where: str) -> None:
        self._client = client
        self._retries, self._backoff_s, self._where = retries, backoff_s, where

    def retry(self, call: Callable[[], Any], what: str) -> Any:
        """`call()` (an MLflow call of another kind, e.g. an artifact download) under the same retries."""
        return call_with_retry(call, what, retries=self._retries, backoff_s=self._backoff_s, where=self._where)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute) or name.startswith("_"):
            return attribute

        @functools.wraps(attribute)
        def once(*args: Any, **kwargs: Any) -> Any:
            try:
                return attribute(*args, **kwargs)
            except MlflowException as error:
                raise _refused(error, f"{name}()", self._where) from error

        @functools.wraps(attribute)
        def retried(*args: Any, **kwargs: Any) -> Any:
            return self.retry(lambda: attribute(*args, **kwargs), f"{name}()")

        return once if name in _NOT_RETRIED else retried
