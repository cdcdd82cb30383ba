"""Readouts and their RLS state versioned in the MLflow model registry, promoted through aliases.

One registered model per serving model and layer. Each fit is one run (params, metrics, plots,
the readout file) and one model version; serving reads `champion`, the gate compares `challenger`
against it, and `previous-champion` keeps the last good version one step away for a rollback.

Everything is logged through `MlflowClient` with explicit run ids: the fluent API keeps a global
active run, which a Prefect task or a second thread would otherwise share or leak.
"""

from __future__ import annotations

import fcntl
import json
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mlflow.entities import Metric, Param
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

from registry import plots as plotting
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

_MAX_TAG_LENGTH = 5000
_ensured_uris: set[str] = set()
_ensure_guard = threading.Lock()


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


def _sanitise(text: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9._-]+", "-", text.lower())).strip("-.")


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
    one self-contained folder; other stores use their server's default.
    """

    def __init__(self, tracking_uri: str, artifact_location: str | Path | None = None) -> None:
        self.tracking_uri = tracking_uri
        db_path = _sqlite_path(tracking_uri)
        if artifact_location is None and db_path is not None:
            artifact_location = db_path.resolve().parent / "artifacts"
        if isinstance(artifact_location, Path):
            artifact_location = artifact_location.resolve().as_uri()
        self.artifact_location = artifact_location
        ensure_db(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    # ----------------------------------------------------------------- names and experiments

    @staticmethod
    def model_name(model_id: str, layer: int) -> str:
        """`leap-readout-<model id>-L<layer>`: one registered model per serving model and layer."""
        return f"leap-readout-{_sanitise(model_id)}-L{int(layer)}"

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
                    tags: Mapping[str, str] | None = None) -> RegisteredReadout:
        """Log one fitted readout as a run and register it as a new model version.

        `params` carries the data provenance (window, row counts, data hash); the readout's own
        hyper-parameters are added here. `eval_arrays` ("true", "pred" output lengths on held-out
        rows) draws the predicted-vs-true scatter and the MAE-by-bucket chart.
        """
        from leap_core.readout_format import to_bytes

        metadata = dict(readout.metadata)
        layer = int(metadata["layer"])
        name = self.model_name(str(metadata["model_id"]), layer)
        identity_tags = {
            "model_id": str(metadata["model_id"]),
            "model_fingerprint": str(metadata.get("model_fingerprint", "")),
            "layer": str(layer),
            "readout_version": str(metadata.get("version", "")),
        }
        run_tags = {**identity_tags, **{str(k): str(v) for k, v in (tags or {}).items()}}
        all_params = {
            **{str(k): v for k, v in params.items()},
            "layer": layer,
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

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        entries = [Param(_metric_key(k), str(v) if not isinstance(v, (dict, list, tuple))
                         else json.dumps(v, sort_keys=True, default=str))
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
        self.client.set_registered_model_alias(name, alias, str(version))

    def get_alias(self, name: str, alias: str) -> str | None:
        """The version an alias points at, or None when the alias or the model does not exist."""
        try:
            aliases = self.client.get_registered_model(name).aliases
        except MlflowException as error:
            if _not_found(error):
                return None
            raise
        version = aliases.get(alias)
        return None if version is None else str(version)

    def _delete_alias(self, name: str, alias: str) -> None:
        if self.get_alias(name, alias) is not None:
            self.client.delete_registered_model_alias(name, alias)

    def set_challenger(self, name: str, version: str | int) -> None:
        self.set_alias(name, CHALLENGER, version)

    def promote(self, name: str, version: str | int) -> str | None:
        """Make `version` the champion; the champion it replaces becomes `previous-champion`.

        Returns the replaced champion version (None when there was none to replace). A challenger
        alias on the promoted version is removed: it no longer waits for a gate.
        """
        version = str(version)
        self.client.get_model_version(name, version)  # fail before touching any alias
        current = self.get_alias(name, CHAMPION)
        if current is not None and current != version:
            self.set_alias(name, PREVIOUS_CHAMPION, current)
        self.set_alias(name, CHAMPION, version)
        if self.get_alias(name, CHALLENGER) == version:
            self._delete_alias(name, CHALLENGER)
        return current if current != version else None

    def rollback(self, name: str) -> str:
        """Point `champion` back at `previous-champion`, and the demoted version at
        `previous-champion` so that a mistaken rollback is itself one call to undo."""
        previous = self.get_alias(name, PREVIOUS_CHAMPION)
        if previous is None:
            raise LookupError(f"{name} has no {PREVIOUS_CHAMPION!r} version to roll back to")
        current = self.get_alias(name, CHAMPION)
        self.set_alias(name, CHAMPION, previous)
        if current is not None and current != previous:
            self.set_alias(name, PREVIOUS_CHAMPION, current)
        else:
            self._delete_alias(name, PREVIOUS_CHAMPION)
        return previous

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
        listed = {Path(info.path).name for info in
                  mlflow.artifacts.list_artifacts(artifact_uri=artifact_dir, tracking_uri=self.tracking_uri)}
        if file_name not in listed:
            return None
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=f"{artifact_dir}/{file_name}",
                                                        dst_path=folder, tracking_uri=self.tracking_uri))

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
        verdict_json = json.dumps(dict(verdict), sort_keys=True, default=str)
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
            self.client.log_text(run_id, json.dumps(_jsonable(results), sort_keys=True), RESULTS_FILE)
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


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value
