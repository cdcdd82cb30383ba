"""Readouts and their RLS state versioned in the MLflow model registry, promoted through aliases.

One registered model per serving model and layer. Each fit is one run (params, metrics, plots,
the readout file) and one model version; serving reads `champion`, the gate compares `challenger`
against it, and `previous-champion` keeps the last good version one step away for a rollback.

Everything is logged through `MlflowClient` with explicit run ids: the fluent API keeps a global
active run, which a Prefect task or a second thread would otherwise share or leak.

Failures of the tracking server are retried here, with exponential backoff, and then raised as
`RegistryUnavailable`, which says which call failed and why. Only calls that are safe to repeat are
retried (reads, alias and tag writes, artifact uploads, creating what the caller tolerates finding
already made); creating a run or a model version is not, since a request that reached the server
before the connection broke would leave a second one. MLflow's own HTTP retries (seven, with backoff
growing to minutes) are turned off by default for http URIs, so that a server that is down fails a
command in seconds rather than hanging it.

Alias writes are serialized by `AliasLock`, a file lock, rather than by a compare-and-set in MLflow:
MLflow's alias and tag writes are unconditional (last writer wins, with no version or precondition
to test), so a CAS built from them would still be a read followed by a write with a race between.
An exclusive `flock` on one file next to the registry's state holds every alias writer of the host
(the fit's challenger, promotion, rollback, the champion push) in one queue, is reentrant within a
thread, and is released by the kernel when its holder dies, so a kill -9 never leaves it stale.
It does not reach across hosts: every process that writes aliases must run where the state folder is
(which is how the stack runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from mlflow.entities import Metric, Param
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    ErrorCode,
)
from mlflow.tracking import MlflowClient

from registry import plots as plotting
from leap_io.jsonable import dumps
from leap_io.model_identity import registered_model_name
from registry.model import READOUT_FILE, RLS_STATE_FILE, save_readout_model

if TYPE_CHECKING:
    from leap_core.readout import LinearReadout
    from leap_core.rls import RLS

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous-champion"
READOUT_EXPERIMENT = "leap-readouts"
GATE_EXPERIMENT = "leap-gates"
MODEL_ARTIFACT_PATH = "model"
PLOTS_ARTIFACT_PATH = "plots"
VERDICT_FILE = "verdict.json"
RESULTS_FILE = "results.json"
RECIPE_VALIDATION_FILE = "recipe_validation.json"
"""The fit's recipe validation table, an MLflow table artifact (the UI compares it across runs)."""

_MAX_TAG_LENGTH = 5000
_ensured_uris: set[str] = set()
_ensure_guard = threading.Lock()

ALIASES = (CHAMPION, PREVIOUS_CHAMPION, CHALLENGER)
"""Every alias LEAP writes, in the order a change of several writes them: champion first."""

DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_S = 0.5
DEFAULT_LOCK_TIMEOUT_S = 120.0

# Calls not retried: a request that reached the server before the connection broke would leave a
# second run or version behind, or (log_table appends to a table already there) a table's rows twice.
_NOT_RETRIED = frozenset({"create_run", "create_model_version", "log_table"})
_TRANSIENT_CODES = frozenset({"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED",
                              "DEADLINE_EXCEEDED", "ABORTED", "IO_ERROR", "UNAVAILABLE"})


class RegistryUnavailable(RuntimeError):
    """The MLflow tracking server (or its database) did not answer a call after every retry."""


class AliasLockTimeout(RuntimeError):
    """Another process held the alias lock for longer than this one was willing to wait."""


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
    then `RegistryUnavailable` naming `what` and the last error. Other errors are raised at once."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as error:  # classified right below
            if not _transient(error):
                raise
            if attempt == retries:
                raise RegistryUnavailable(
                    f"{where} did not answer {what} after {retries + 1} attempts: "
                    f"{type(error).__name__}: {str(error)[:500]}") from error
            time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")  # pragma: no cover


class _RetryingClient:
    """An `MlflowClient` whose calls are retried on transient failures (see `call_with_retry`)."""

    def __init__(self, client: MlflowClient, retries: int, backoff_s: float, where: str) -> None:
        self._client = client
        self._retries, self._backoff_s, self._where = retries, backoff_s, where

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute) or name.startswith("_") or name in _NOT_RETRIED:
            return attribute

        @functools.wraps(attribute)
        def retried(*args: Any, **kwargs: Any) -> Any:
            return call_with_retry(lambda: attribute(*args, **kwargs), f"{name}()", retries=self._retries,
                                   backoff_s=self._backoff_s, where=self._where)

        return retried


class AliasLock:
    """An exclusive file lock that every alias writer of a registry takes (see the module docstring).

    Reentrant within a thread; other threads of the process wait on an in-process lock first, since
    `flock` would let two threads of one process deadlock on separate descriptors. One instance per
    path and process (`for_path`).
    """

    _instances: ClassVar[dict[str, AliasLock]] = {}
    _instances_guard = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        self._guard = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    @classmethod
    def for_path(cls, path: str | Path) -> AliasLock:
        path = Path(path).resolve()
        with cls._instances_guard:
            lock = cls._instances.get(str(path))
            if lock is None:
                lock = cls._instances[str(path)] = cls(path)
            return lock

    def _take_file(self, deadline: float, timeout_s: float) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for whoever waits
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    holder = self.path.read_text().strip() if self.path.exists() else "?"
                    raise AliasLockTimeout(f"the alias lock {self.path} stayed held (by pid {holder or '?'}) "
                                           f"for {timeout_s:.1f}s; no alias was written") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except BaseException:
                os.close(fd)
                raise

    @contextmanager
    def held(self, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Iterator[AliasLock]:
        """Hold the lock (waiting up to `timeout_s`, then AliasLockTimeout) for the `with` block."""
        deadline = time.monotonic() + timeout_s
        if not self._guard.acquire(timeout=timeout_s):
            raise AliasLockTimeout(f"another thread held the alias lock {self.path} for {timeout_s:.1f}s")
        try:
            if self._depth == 0:
                self._fd = self._take_file(deadline, timeout_s)
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    os.close(self._fd)
                    self._fd = None
        finally:
            self._guard.release()


class AliasLockHandle:
    """One registry's view of the shared `AliasLock`: the same lock, with its own patience."""

    def __init__(self, lock: AliasLock, timeout_s: float) -> None:
        self.lock, self.timeout_s = lock, timeout_s

    @property
    def path(self) -> Path:
        return self.lock.path

    def held(self) -> contextlib.AbstractContextManager[AliasLock]:
        return self.lock.held(self.timeout_s)


def default_lock_path(tracking_uri: str) -> Path:
    """Next to a sqlite database; for a server, one file per server URI in the temporary folder."""
    db_path = _sqlite_path(tracking_uri)
    if db_path is not None:
        return db_path.resolve().parent / "aliases.lock"
    digest = hashlib.sha256(tracking_uri.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"leap-mlflow-aliases-{digest}.lock"


@dataclass(frozen=True)
class RegisteredReadout:
    """Where a logged readout lives: registered model name, version and the run that produced it."""

    name: str
    version: str
    run_id: str


@dataclass(frozen=True)
class ReadoutVersion:
    """One model version as listed, with the aliases that point at it."""

    name: str
    version: str
    run_id: str
    aliases: tuple[str, ...]
    tags: dict[str, str] = field(default_factory=dict)
    created_ms: int = 0


def _sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///relative` or `sqlite:////absolute` URI; None otherwise."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    path = tracking_uri[len(prefix):].split("?", 1)[0]
    return Path(path) if path else None


def ensure_db(tracking_uri: str) -> None:
    """Create or upgrade a sqlite MLflow schema once, under a file lock, before concurrent use.

    MLflow creates missing tables lazily in each process; two processes doing that on a new file at
    once collide. Non-sqlite URIs are left to their server.
    """
    db_path = _sqlite_path(tracking_uri)
    if db_path is None:
        return
    db_path = db_path.resolve()
    key = str(db_path)
    with _ensure_guard:
        if key in _ensured_uris and db_path.exists():
            return
        from mlflow.store.db import utils as db_utils

        db_path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db_path}"
        with open(db_path.with_name(db_path.name + ".lock"), "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                engine = db_utils.create_sqlalchemy_engine(uri)
                try:
                    if db_utils._is_empty_database(engine):
                        db_utils._initialize_tables(engine)
                    elif db_utils._get_schema_version(engine) != db_utils._get_latest_schema_revision():
                        db_utils._upgrade_db(engine)
                finally:
                    engine.dispose()
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        _ensured_uris.add(key)


def _metric_key(key: str) -> str:
    """MLflow keys allow letters, digits, `_ - . / ` and space; domains come from free text."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]+", "_", str(key))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _not_found(error: MlflowException) -> bool:
    return error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


def _already_exists(error: MlflowException) -> bool:
    return error.error_code == ErrorCode.Name(RESOURCE_ALREADY_EXISTS)


class ReadoutRegistry:
    """Log, register, promote and load LEAP readouts in one MLflow tracking store.

    `artifact_location` defaults to an `artifacts` folder next to a sqlite database, so a store is
    one self-contained folder; other stores use their server's default. `retries` and `backoff_s`
    (default `$LEAP_MLFLOW_RETRIES`, `$LEAP_MLFLOW_BACKOFF_S`, else 3 and 0.5 s) bound how long a
    call waits for the server; `lock_path` is the alias lock's file (default `default_lock_path`).
    """

    def __init__(self, tracking_uri: str, artifact_location: str | Path | None = None, *,
                 lock_path: str | Path | None = None, retries: int | None = None,
                 backoff_s: float | None = None, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> None:
        self.tracking_uri = tracking_uri
        db_path = _sqlite_path(tracking_uri)
        if artifact_location is None and db_path is not None:
            artifact_location = db_path.resolve().parent / "artifacts"
        if isinstance(artifact_location, Path):
            artifact_location = artifact_location.resolve().as_uri()
        self.artifact_location = artifact_location
        self.retries = int(os.environ.get("LEAP_MLFLOW_RETRIES", DEFAULT_RETRIES)) if retries is None else retries
        self.backoff_s = (float(os.environ.get("LEAP_MLFLOW_BACKOFF_S", DEFAULT_BACKOFF_S))
                          if backoff_s is None else backoff_s)
        if tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # ours are bounded; see above
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        self.alias_lock = AliasLockHandle(AliasLock.for_path(lock_path or default_lock_path(tracking_uri)),
                                          lock_timeout_s)
        self._retry(lambda: ensure_db(tracking_uri), "creating the sqlite schema")
        self.client = _RetryingClient(MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri),
                                      self.retries, self.backoff_s, f"MLflow at {tracking_uri}")

    def _retry(self, call: Callable[[], Any], what: str) -> Any:
        return call_with_retry(call, what, retries=self.retries, backoff_s=self.backoff_s,
                               where=f"MLflow at {self.tracking_uri}")

    # ----------------------------------------------------------------- names and experiments

    @staticmethod
    def model_name(model_id: str, layer: int) -> str:
        """`leap-readout-<model id>-L<layer>`: one registered model per serving model and layer."""
        return registered_model_name(model_id, layer)

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self.artifact_location)
        except MlflowException as error:  # another process created it first
            if not _already_exists(error):
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _ensure_registered_model(self, name: str, tags: Mapping[str, str]) -> None:
        try:
            self.client.create_registered_model(name, tags=dict(tags))
        except MlflowException as error:
            if not _already_exists(error):
                raise

    # ----------------------------------------------------------------- logging a readout

    def log_readout(self, readout: LinearReadout, *, rls: RLS | None = None, params: Mapping[str, Any],
                    metrics: Mapping[str, float], eval_arrays: Mapping[str, Any] | None = None,
                    experiment: str = READOUT_EXPERIMENT, run_name: str | None = None,
                    tags: Mapping[str, str] | None = None,
                    validation: Sequence[Mapping[str, Any]] | None = None) -> RegisteredReadout:
        """Log one fitted readout as a run and register it as a new model version.

        `params` carries the data provenance (window, row counts, data hash); the readout's own
        hyper-parameters are added here. `eval_arrays` ("true", "pred" output lengths on held-out
        rows) draws the predicted-vs-true scatter and the MAE-by-bucket chart. `validation` (the
        fit's recipe choice, one row per candidate recipe) is logged as the MLflow table
        `RECIPE_VALIDATION_FILE`, with a `chosen` column marking the readout's recipe. The run and
        the version are tagged with the readout's `recipe` (`last@<layer>` when it records none).
        """
        from leap_core.readout_format import to_bytes
        from leap_core.recipes import readout_recipe

        metadata = dict(readout.metadata)
        layer = int(metadata["layer"])
        name = self.model_name(str(metadata["model_id"]), layer)
        recipe = str(readout_recipe(metadata))
        identity_tags = {
            "model_id": str(metadata["model_id"]),
            "model_fingerprint": str(metadata.get("model_fingerprint", "")),
            "layer": str(layer),
            "recipe": recipe,
            "readout_version": str(metadata.get("version", "")),
        }
        run_tags = {**identity_tags, **{str(k): str(v) for k, v in (tags or {}).items()}}
        all_params = {
            **{str(k): v for k, v in params.items()},
            "layer": layer,
            "recipe": recipe,
            "alpha": readout.alpha,
            "target": readout.target,
            "max_tokens": readout.max_tokens,
            "dim": readout.dim_,
            "n_params": readout.n_params_,
            "rls": rls is not None,
        }
        run = self.client.create_run(self._experiment_id(experiment), run_name=run_name,
                                     tags=run_tags)
        run_id = run.info.run_id
        try:
            self._log_params(run_id, all_params)
            self._log_metrics(run_id, metrics)
            if validation:
                self._log_validation(run_id, validation, recipe)
            with tempfile.TemporaryDirectory(prefix="leap-readout-") as tmp:
                run_files = Path(tmp) / "run"
                run_files.mkdir()
                readout_file = run_files / READOUT_FILE
                readout_file.write_bytes(to_bytes(readout))
                if eval_arrays is not None:
                    self._write_readout_plots(eval_arrays, readout.max_tokens,
                                              run_files / PLOTS_ARTIFACT_PATH)
                self.client.log_artifacts(run_id, str(run_files))
                # The RLS state is (d+1)^2 floats twice over: stored once, inside the model.
                rls_file = None
                if rls is not None:
                    rls_file = Path(tmp) / RLS_STATE_FILE
                    np.savez(rls_file, **rls.state_arrays())
                    self._log_metrics(run_id, {f"rls.{k}": v for k, v in rls.stats().items()
                                               if _is_number(v)})
                # the training mean is a typical hidden state, and reveals nothing the readout does not
                example = np.asarray(readout.mean_).reshape(1, -1)
                model_dir = save_readout_model(Path(tmp) / "pyfunc", readout_file, readout.dim_, rls_file,
                                               input_example=example)
                self.client.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACT_PATH)
            self._ensure_registered_model(name, {"model_id": identity_tags["model_id"],
                                                 "layer": identity_tags["layer"]})
            version_tags = {**identity_tags, **{f"metric.{k}": f"{float(v):.6g}"
                                                for k, v in metrics.items() if _is_number(v)}}
            source = f"{self.client.get_run(run_id).info.artifact_uri}/{MODEL_ARTIFACT_PATH}"
            version = self.client.create_model_version(name, source=source, run_id=run_id,
                                                       tags=version_tags)
            self.client.set_tag(run_id, "registered_version", str(version.version))
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, "FINISHED")
        return RegisteredReadout(name=name, version=str(version.version), run_id=run_id)

    def _log_validation(self, run_id: str, validation: Sequence[Mapping[str, Any]], recipe: str) -> None:
        import pandas as pd

        columns = ["recipe", "alpha", "spearman", "mae", "n", "dim"]
        table = pd.DataFrame([dict(row) for row in validation])
        table = table[[c for c in columns if c in table.columns] + [c for c in table.columns if c not in columns]]
        table["chosen"] = table["recipe"].astype(str) == recipe
        self.client.log_table(run_id, data=table, artifact_file=RECIPE_VALIDATION_FILE)

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        entries = [Param(_metric_key(k), str(v) if not isinstance(v, (dict, list, tuple))
                         else dumps(v, nonfinite="keep", sort_keys=True, default=str))
                   for k, v in params.items()]
        for start in range(0, len(entries), 100):  # the store's per-batch limit on params
            self.client.log_batch(run_id, params=entries[start:start + 100])

    def _log_metrics(self, run_id: str, metrics: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(_metric_key(k), float(v), now, 0) for k, v in metrics.items() if _is_number(v)]
        for start in range(0, len(entries), 1000):
            self.client.log_batch(run_id, metrics=entries[start:start + 1000])

    @staticmethod
    def _write_readout_plots(eval_arrays: Mapping[str, Any], max_tokens: int, folder: Path) -> list[Path]:
        if not plotting.available():
            warnings.warn("matplotlib is not installed; the run is logged without plots", stacklevel=3)
            return []
        return list(plotting.readout_plots(eval_arrays["true"], eval_arrays["pred"], max_tokens,
                                           folder).values())

    # ----------------------------------------------------------------- aliases

    def set_alias(self, name: str, alias: str, version: str | int) -> None:
        with self.alias_lock.held():
            self.client.set_registered_model_alias(name, alias, str(version))

    def get_alias(self, name: str, alias: str) -> str | None:
        """The version an alias points at, or None when the alias or the model does not exist."""
        return self.aliases(name).get(alias)

    def aliases(self, name: str) -> dict[str, str]:
        """Every alias of a registered model and its version, read at once ({} for no such model)."""
        try:
            aliases = self.client.get_registered_model(name).aliases
        except MlflowException as error:
            if _not_found(error):
                return {}
            raise
        return {str(alias): str(version) for alias, version in aliases.items()}

    def _delete_alias(self, name: str, alias: str) -> None:
        with self.alias_lock.held():
            if self.get_alias(name, alias) is not None:
                self.client.delete_registered_model_alias(name, alias)

    def apply_aliases(self, name: str, target: Mapping[str, str | int | None], *,
                      before_write: Callable[[], None] | None = None) -> list[str]:
        """Point each alias of `target` at its version (None: remove it), champion first; returns the
        aliases that changed. Every version is checked to exist before any alias moves, and all of it
        runs under the alias lock. A failure part-way leaves the aliases written so far: callers that
        need all or nothing restore the aliases they read before (see `flows.promotion`), and
        `before_write` is called once before the first write, so they know whether any was tried."""
        order = [alias for alias in ALIASES if alias in target] + [a for a in target if a not in ALIASES]
        with self.alias_lock.held():
            for alias in order:
                if target[alias] is not None:
                    self.client.get_model_version(name, str(target[alias]))  # fail before touching any alias
            current = self.aliases(name)
            changed: list[str] = []
            for alias in order:
                version = target[alias]
                if (current.get(alias) is None) if version is None else (current.get(alias) == str(version)):
                    continue
                if before_write is not None and not changed:
                    before_write()
                changed.append(alias)
                if version is None:
                    self.client.delete_registered_model_alias(name, alias)
                else:
                    self.client.set_registered_model_alias(name, alias, str(version))
            return changed

    def set_challenger(self, name: str, version: str | int) -> None:
        self.set_alias(name, CHALLENGER, version)

    @staticmethod
    def promotion_target(current: Mapping[str, str], version: str | int) -> dict[str, str | None]:
        """The aliases after promoting `version`: it is champion, the champion it replaces is
        previous-champion, and a challenger alias on it is removed (it no longer waits for a gate)."""
        version = str(version)
        champion = current.get(CHAMPION)
        previous = champion if champion is not None and champion != version else current.get(PREVIOUS_CHAMPION)
        challenger = current.get(CHALLENGER)
        return {CHAMPION: version, PREVIOUS_CHAMPION: previous,
                CHALLENGER: None if challenger == version else challenger}

    @staticmethod
    def rollback_target(name: str, current: Mapping[str, str]) -> dict[str, str | None]:
        """The aliases after a rollback: previous-champion is champion again, and the demoted version
        becomes previous-champion, so that a mistaken rollback is itself one rollback to undo."""
        previous = current.get(PREVIOUS_CHAMPION)
        if previous is None:
            raise LookupError(f"{name} has no {PREVIOUS_CHAMPION!r} version to roll back to")
        champion = current.get(CHAMPION)
        return {CHAMPION: previous,
                PREVIOUS_CHAMPION: champion if champion is not None and champion != previous else None,
                CHALLENGER: current.get(CHALLENGER)}

    def promote(self, name: str, version: str | int) -> str | None:
        """Make `version` the champion; the champion it replaces becomes `previous-champion`.

        Returns the replaced champion version (None when there was none to replace). A challenger
        alias on the promoted version is removed: it no longer waits for a gate. This moves aliases
        only; `flows.promotion.promote` also moves the replicas, all or nothing.
        """
        version = str(version)
        with self.alias_lock.held():
            current = self.aliases(name)
            self.apply_aliases(name, self.promotion_target(current, version))
        champion = current.get(CHAMPION)
        return champion if champion != version else None

    def rollback(self, name: str) -> str:
        """Point `champion` back at `previous-champion`, and the demoted version at
        `previous-champion` so that a mistaken rollback is itself one call to undo. Aliases only;
        `flows.promotion.rollback` also pushes the restored champion to the replicas."""
        with self.alias_lock.held():
            target = self.rollback_target(name, self.aliases(name))
            self.apply_aliases(name, target)
        return str(target[CHAMPION])

    def _resolve(self, name: str, alias_or_version: str | int) -> ModelVersion:
        text = str(alias_or_version)
        if text.isdigit():
            return self.client.get_model_version(name, text)
        return self.client.get_model_version_by_alias(name, text)

    def list_versions(self, name: str) -> list[ReadoutVersion]:
        """All versions of a registered model, newest first, with their aliases."""
        aliases: dict[str, list[str]] = {}
        for alias, version in self.client.get_registered_model(name).aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        versions = self.client.search_model_versions(f"name = '{name}'")
        return sorted(
            (ReadoutVersion(name=name, version=str(v.version), run_id=v.run_id or "",
                            aliases=tuple(sorted(aliases.get(str(v.version), []))), tags=dict(v.tags),
                            created_ms=int(v.creation_timestamp or 0))
             for v in versions),
            key=lambda v: int(v.version), reverse=True,
        )

    # ----------------------------------------------------------------- loading

    def _download_model_file(self, name: str, alias_or_version: str | int, file_name: str,
                             folder: str) -> Path | None:
        import mlflow.artifacts

        source = self._resolve(name, alias_or_version).source
        artifact_dir = f"{source}/artifacts"
        listed = {Path(info.path).name for info in self._retry(
            lambda: mlflow.artifacts.list_artifacts(artifact_uri=artifact_dir, tracking_uri=self.tracking_uri),
            f"listing {artifact_dir}")}
        if file_name not in listed:
            return None
        return Path(self._retry(
            lambda: mlflow.artifacts.download_artifacts(artifact_uri=f"{artifact_dir}/{file_name}",
                                                        dst_path=folder, tracking_uri=self.tracking_uri),
            f"downloading {file_name} of {name}@{alias_or_version}"))

    def load_readout(self, name: str, alias_or_version: str | int,
                     expect: Mapping[str, Any] | None = None) -> LinearReadout:
        """The readout of a version or alias, validated against `expect` (model fingerprint, layer,
        ...) so a readout fitted on another model or layer is refused instead of mis-scheduling."""
        from leap_core.readout_format import from_bytes

        with tempfile.TemporaryDirectory(prefix="leap-readout-") as tmp:
            path = self._download_model_file(name, alias_or_version, READOUT_FILE, tmp)
            if path is None:
                raise FileNotFoundError(f"{name}@{alias_or_version} has no {READOUT_FILE}")
            return from_bytes(path.read_bytes(), expect=None if expect is None else dict(expect))

    def load_rls_state(self, name: str, alias_or_version: str | int,
                       readout: LinearReadout | None = None,
                       expect: Mapping[str, Any] | None = None) -> RLS | None:
        """The RLS corrector stored with a version (None when it was logged without one)."""
        from leap_core.rls import RLS

        with tempfile.TemporaryDirectory(prefix="leap-rls-") as tmp:
            path = self._download_model_file(name, alias_or_version, RLS_STATE_FILE, tmp)
            if path is None:
                return None
            with np.load(path) as stored:
                arrays = {key: stored[key] for key in stored.files}
        if readout is None:
            readout = self.load_readout(name, alias_or_version, expect=expect)
        return RLS.from_state_arrays(readout, arrays)

    # ----------------------------------------------------------------- gate runs

    def log_gate(self, name: str, challenger_version: str | int, champion_version: str | int | None,
                 results: Mapping[str, Mapping[str, Any]], verdict: Mapping[str, Any],
                 plots: Mapping[str, str | Path] | None = None,
                 experiment: str = GATE_EXPERIMENT) -> str:
        """Log one challenger-vs-champion comparison; returns its run id.

        `results` maps each policy to its figures: numbers become metrics `<policy>.<key>`, other
        values params. The verdict is a tag on the run and on the challenger version, and a JSON
        artifact.
        """
        verdict_json = dumps(dict(verdict), nonfinite="keep", sort_keys=True, default=str)
        run_tags = {
            "registered_model": name,
            "challenger_version": str(challenger_version),
            "champion_version": "" if champion_version is None else str(champion_version),
            "verdict": verdict_json[:_MAX_TAG_LENGTH],
        }
        run = self.client.create_run(self._experiment_id(experiment),
                                     run_name=f"gate-{name}-v{challenger_version}", tags=run_tags)
        run_id = run.info.run_id
        try:
            metrics: dict[str, float] = {}
            params: dict[str, Any] = {}
            for policy, figures in results.items():
                for key, value in figures.items():
                    if _is_number(value):
                        metrics[f"{policy}.{key}"] = float(value)
                    elif not isinstance(value, (list, tuple, np.ndarray)):
                        params[f"{policy}.{key}"] = value
            for key, value in verdict.items():
                if _is_number(value) or isinstance(value, bool):
                    metrics[f"verdict.{key}"] = float(value)
            self._log_params(run_id, params)
            self._log_metrics(run_id, metrics)
            self.client.log_text(run_id, verdict_json, VERDICT_FILE)
            self.client.log_text(run_id, dumps(results, nonfinite="keep", sort_keys=True), RESULTS_FILE)
            for path in (plots or {}).values():
                self.client.log_artifact(run_id, str(path), PLOTS_ARTIFACT_PATH)
            self.client.set_model_version_tag(name, str(challenger_version), "gate_run_id", run_id)
            self.client.set_model_version_tag(name, str(challenger_version), "gate_verdict",
                                              verdict_json[:_MAX_TAG_LENGTH])
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def list_artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        """Every artifact file of a run, as paths relative to its artifact root."""
        found: list[str] = []
        for info in self.client.list_artifacts(run_id, path):
            if info.is_dir:
                found.extend(self.list_artifacts(run_id, info.path))
            else:
                found.append(info.path)
        return sorted(found)


