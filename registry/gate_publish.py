"""The gate's verdict on the challenger version itself, where a reviewer of the registry looks.

The version's description ends with the verdict report's markdown table (`registry.gate_report`), each of
its figures is a version tag (`leap.gate.ratio`, `leap.gate.outcome`, ...) so versions can be searched and
sorted by them, and its numbers are metrics of the version's logged model (MLflow 3's LoggedModel), linked
to the gate run that measured them. A version registered without a logged model gets one, made from the
run that fitted it, so every gated version has its figures in the same place.
"""

from __future__ import annotations

import time
from typing import Any

from mlflow.entities import Metric

from registry.gate_report import TAG_PREFIX, VerdictReport, with_verdict

LOGGED_MODEL_NAME = "readout"
LOGGED_MODEL_TAG = "leap.logged_model_id"
"""The version tag naming the logged model its gate figures are metrics of."""


def publish_verdict(client: Any, gate_run_id: str, name: str, version: str, report: VerdictReport) -> str | None:
    """Write `report` onto version `version` of `name`: description section, tags, logged-model metrics.
    Returns the logged model's id (None when the version has no run to make one from)."""
    current = client.get_model_version(name, version)
    client.update_model_version(name, version, description=with_verdict(current.description, report.markdown()))
    tags = report.tags()
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    for key in current.tags:  # an earlier gate's figure this verdict does not have (e.g. shadow figures)
        if key.startswith(TAG_PREFIX) and key not in tags:
            client.delete_model_version_tag(name, version, key)
    model_id = version_logged_model(client, current)
    if model_id is None:
        return None
    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, 0, model_id=model_id) for key, value in report.metrics().items()]
    if metrics:
        client.log_batch(gate_run_id, metrics=metrics)
    return model_id


def version_logged_model(client: Any, version: Any) -> str | None:
    """The logged model of `version`: its own `model_id`, the one named by its tag, else a new READY one
    made from the version's run (tagged with the version, and the version tagged with it)."""
    if getattr(version, "model_id", None):
        return str(version.model_id)
    if version.tags.get(LOGGED_MODEL_TAG):
        return str(version.tags[LOGGED_MODEL_TAG])
    if not version.run_id:
        return None
    experiment_id = client.get_run(version.run_id).info.experiment_id
    model = client.create_logged_model(experiment_id, name=LOGGED_MODEL_NAME, source_run_id=version.run_id,
                                       tags={"registered_model": version.name,
                                             "registered_version": str(version.version)},
                                       model_type="leap-readout")
    client.finalize_logged_model(model.model_id, "READY")
    client.set_model_version_tag(version.name, str(version.version), LOGGED_MODEL_TAG, model.model_id)
    return str(model.model_id)
