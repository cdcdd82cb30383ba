"""Writing runs: a fitted readout as a run and a new model version, a gate as a run that judges one.

Each fit is one run (params, metrics, plots, the readout file, the pyfunc model) and one model version
of the registered model of its serving model and layer; each gate is one run in its own experiment,
linked from the challenger version's tags.
"""

from __future__ import annotations

import re
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mlflow.entities import Metric, Param

from leap_io.jsonable import dumps
from leap_io.model_identity import registered_model_name
from registry import plots as plotting
from registry import rls_file as rls_file_format
from registry.calls import RegistryError
from registry.gate_report import shadow_metrics
from registry.model import READOUT_FILE, RLS_STATE_FILE, save_readout_model

if TYPE_CHECKING:
    from leap_core.readout import LinearReadout
    from leap_core.rls import RLS

READOUT_EXPERIMENT = "leap-readouts"
GATE_EXPERIMENT = "leap-gates"
MODEL_ARTIFACT_PATH = "model"
PLOTS_ARTIFACT_PATH = "plots"
VERDICT_FILE = "verdict.json"
RESULTS_FILE = "results.json"
RECIPE_VALIDATION_FILE = "recipe_validation.json"
"""The fit's recipe validation table, an MLflow table artifact (the UI compares it across runs)."""

_MAX_TAG_LENGTH = 5000


@dataclass(frozen=True)
class RegisteredReadout:
    """Where a logged readout lives: registered model name, version and the run that produced it."""

    name: str
    version: str
    run_id: str


def metric_key(key: str) -> str:
    """MLflow keys allow letters, digits, `_ - . / ` and space; domains come from free text."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]+", "_", str(key))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


class RunsMixin:
    """Logging readouts and gates (part of `registry.client.ReadoutRegistry`)."""

    client: Any
    artifact_location: str | None

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=self.artifact_location)
        except RegistryError as error:  # another process created it first
            if not error.already_exists:
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _ensure_registered_model(self, name: str, tags: Mapping[str, str]) -> None:
        try:
            self.client.create_registered_model(name, tags=dict(tags))
        except RegistryError as error:
            if not error.already_exists:
                raise

    # ----------------------------------------------------------------- a readout

    def log_readout(self, readout: LinearReadout, *, rls: RLS | None = None, params: Mapping[str, Any],
                    metrics: Mapping[str, float], eval_arrays: Mapping[str, Any] | None = None,
                    experiment: str = READOUT_EXPERIMENT, run_name: str | None = None,
                    tags: Mapping[str, str] | None = None,
                    validation: Sequence[Mapping[str, Any]] | None = None,
                    version_tags: Mapping[str, str] | None = None) -> RegisteredReadout:
        """Log one fitted readout as a run and register it as a new model version.

        `params` carries the data provenance (window, row counts, data hash); the readout's own
        hyper-parameters are added here. `eval_arrays` ("true", "pred" output lengths on held-out
        rows) draws the predicted-vs-true scatter and the MAE-by-bucket chart. `validation` (the
        fit's recipe choice, one row per candidate recipe) is logged as the MLflow table
        `RECIPE_VALIDATION_FILE`, with a `chosen` column marking the readout's recipe. The run and
        the version are tagged with the readout's `recipe` (`last@<layer>` when it records none);
        `tags` go on the run, `version_tags` on the version as well (what lookups read from it).
        """
        from leap_core.recipes import readout_recipe

        metadata = dict(readout.metadata)
        layer = int(metadata["layer"])
        name = registered_model_name(str(metadata["model_id"]), layer)
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
                self._log_validation(run_id, validation, recipe, str(readout.target))
            self._log_model_files(run_id, readout, rls, eval_arrays)
            self._ensure_registered_model(name, {"model_id": identity_tags["model_id"],
                                                 "layer": identity_tags["layer"]})
            all_version_tags = {**identity_tags, **{f"metric.{k}": f"{float(v):.6g}"
                                                    for k, v in metrics.items() if is_number(v)},
                                **{str(k): str(v) for k, v in (version_tags or {}).items()}}
            source = f"{self.client.get_run(run_id).info.artifact_uri}/{MODEL_ARTIFACT_PATH}"
            version = self.client.create_model_version(name, source=source, run_id=run_id,
                                                       tags=all_version_tags)
            self.client.set_tag(run_id, "registered_version", str(version.version))
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, "FINISHED")
        return RegisteredReadout(name=name, version=str(version.version), run_id=run_id)

    def _log_model_files(self, run_id: str, readout: LinearReadout, rls: RLS | None,
                         eval_arrays: Mapping[str, Any] | None) -> None:
        """The readout file and its plots at the run's root, and the pyfunc model under `model/`."""
        from leap_core.readout_format import to_bytes

        with tempfile.TemporaryDirectory(prefix="leap-readout-") as tmp:
            run_files = Path(tmp) / "run"
            run_files.mkdir()
            readout_file = run_files / READOUT_FILE
            readout_file.write_bytes(to_bytes(readout))
            if eval_arrays is not None:
                self._write_readout_plots(eval_arrays, readout.max_tokens, run_files / PLOTS_ARTIFACT_PATH)
            self.client.log_artifacts(run_id, str(run_files))
            # The RLS state is (d+1)^2 floats twice over: stored once, inside the model.
            rls_file = None
            if rls is not None:
                rls_file = Path(tmp) / RLS_STATE_FILE
                rls_file_format.save(rls_file, rls.state_arrays())  # P and A as upper triangles
                self._log_metrics(run_id, {f"rls.{k}": v for k, v in rls.stats().items() if is_number(v)})
            # the training mean is a typical hidden state, and reveals nothing the readout does not
            example = np.asarray(readout.mean_).reshape(1, -1)
            model_dir = save_readout_model(Path(tmp) / "pyfunc", readout_file, readout.dim_, rls_file,
                                           input_example=example)
            self.client.log_artifacts(run_id, str(model_dir), MODEL_ARTIFACT_PATH)

    def _log_validation(self, run_id: str, validation: Sequence[Mapping[str, Any]], recipe: str,
                        target: str | None = None) -> None:
        """The validation table (one row per candidate recipe and target), the served row marked `chosen`."""
        import pandas as pd

        columns = ["recipe", "target", "alpha", "spearman", "mae", "n", "dim"]
        table = pd.DataFrame([dict(row) for row in validation])
        table = table[[c for c in columns if c in table.columns] + [c for c in table.columns if c not in columns]]
        table["chosen"] = table["recipe"].astype(str) == recipe
        if target is not None and "target" in table.columns:
            table["chosen"] &= table["target"].astype(str) == target
        self.client.log_table(run_id, data=table, artifact_file=RECIPE_VALIDATION_FILE)

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        entries = [Param(metric_key(k), str(v) if not isinstance(v, (dict, list, tuple))
                         else dumps(v, nonfinite="keep", sort_keys=True, default=str))
                   for k, v in params.items()]
        for start in range(0, len(entries), 100):  # the store's per-batch limit on params
            self.client.log_batch(run_id, params=entries[start:start + 100])

    def _log_metrics(self, run_id: str, metrics: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        entries = [Metric(metric_key(k), float(v), now, 0) for k, v in metrics.items() if is_number(v)]
        for start in range(0, len(entries), 1000):
            self.client.log_batch(run_id, metrics=entries[start:start + 1000])

    @staticmethod
    def _write_readout_plots(eval_arrays: Mapping[str, Any], max_tokens: int, folder: Path) -> list[Path]:
        if not plotting.available():
            warnings.warn("matplotlib is not installed; the run is logged without plots", stacklevel=4)
            return []
        return list(plotting.readout_plots(eval_arrays["true"], eval_arrays["pred"], max_tokens,
                                           folder).values())

    # ----------------------------------------------------------------- a gate

    def log_gate(self, name: str, challenger_version: str | int, champion_version: str | int | None,
                 results: Mapping[str, Mapping[str, Any]], verdict: Mapping[str, Any],
                 plots: Mapping[str, str | Path] | None = None,
                 experiment: str = GATE_EXPERIMENT, tags: Mapping[str, str] | None = None) -> str:
        """Log one challenger-vs-champion comparison; returns its run id.

        `results` maps each policy to its figures: numbers become metrics `<policy>.<key>`, other
        values params. The verdict is a tag on the run and on the challenger version, and a JSON
        artifact. `tags` go on the run too (`find_gate` looks a gate up by its `gate_key` tag).
        """
        verdict_json = dumps(dict(verdict), nonfinite="keep", sort_keys=True, default=str)
        run_tags = {
            "registered_model": name,
            "challenger_version": str(challenger_version),
            "champion_version": "" if champion_version is None else str(champion_version),
            "verdict": verdict_json[:_MAX_TAG_LENGTH],
            **{str(k): str(v) for k, v in (tags or {}).items()},
        }
        run = self.client.create_run(self._experiment_id(experiment),
                                     run_name=f"gate-{name}-v{challenger_version}", tags=run_tags)
        run_id = run.info.run_id
        try:
            metrics: dict[str, float] = {}
            params: dict[str, Any] = {}
            for policy, figures in results.items():
                for key, value in figures.items():
                    if is_number(value):
                        metrics[f"{policy}.{key}"] = float(value)
                    elif not isinstance(value, (list, tuple, np.ndarray)):
                        params[f"{policy}.{key}"] = value
            for key, value in verdict.items():
                if is_number(value) or isinstance(value, bool):
                    metrics[f"verdict.{key}"] = float(value)
            metrics.update(shadow_metrics(verdict.get("shadow")))
            self._log_params(run_id, params)
            self._log_metrics(run_id, metrics)
            self.client.log_text(run_id, verdict_json, VERDICT_FILE)
            self.client.log_text(run_id, dumps(results, nonfinite="keep", sort_keys=True), RESULTS_FILE)
            for path in (plots or {}).values():
                self.client.log_artifact(run_id, str(path), PLOTS_ARTIFACT_PATH)
            self._log_gate_report(run_id, name, str(challenger_version), champion_version, results, verdict)
            self.client.set_model_version_tag(name, str(challenger_version), "gate_run_id", run_id)
            self.client.set_model_version_tag(name, str(challenger_version), "gate_verdict",
                                              verdict_json[:_MAX_TAG_LENGTH])
        except BaseException:
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def _log_gate_report(self, run_id: str, name: str, version: str, champion_version: str | int | None,
                         results: Mapping[str, Mapping[str, Any]], verdict: Mapping[str, Any]) -> None:
        """The paired table, the arms' latency CDF, and the verdict report on the version
        (`registry.gate_publish`: its description, tags and logged model's metrics)."""
        from registry import gate_report
        from registry.gate_publish import publish_verdict

        table = gate_report.paired_table(results, str(verdict.get("bar", "")))
        if table is not None:
            self.client.log_table(run_id, data=table, artifact_file=gate_report.PAIRED_TABLE_FILE)
        latencies = {policy: figures["ptl"] for policy, figures in results.items() if figures.get("ptl")}
        if latencies and plotting.available():
            with tempfile.TemporaryDirectory() as tmp:
                cdf = plotting.latency_cdf(latencies, tmp, gate_report.CDF_FILE,
                                           xlabel="per-token latency (s per token, every repeat)")
                self.client.log_artifact(run_id, str(cdf), PLOTS_ARTIFACT_PATH)
        report = gate_report.verdict_report(verdict, None if champion_version is None else str(champion_version))
        publish_verdict(self.client, run_id, name, version, report)
