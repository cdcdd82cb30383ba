"""Operations on the fleet that are not versions (the kill switch), kept as MLflow runs: the registry's history.

Each operation is one finished run in the experiment `leap-operations`, its action, reason and outcome as
tags and its full report as a JSON artifact, so the MLflow UI lists who switched the fleet to FCFS, when
and why, beside the readouts and gates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from leap_io.jsonable import dumps

OPERATIONS_EXPERIMENT = "leap-operations"
REPORT_FILE = "operation.json"
_MAX_TAG = 5000


class OperationsMixin:
    """`log_operation` and `operations` on a `ReadoutRegistry`."""

    def log_operation(self, action: str, reason: str, report: Mapping[str, Any]) -> str:
        """Record one operation (for example "fcfs-on"); returns its run id."""
        tags = {"action": action, "reason": reason[:_MAX_TAG],
                **{key: str(value)[:_MAX_TAG] for key, value in report.items()
                   if isinstance(value, (str, int, float, bool))}}
        run = self.client.create_run(self._experiment_id(OPERATIONS_EXPERIMENT), run_name=action, tags=tags)
        try:
            self.client.log_text(run.info.run_id, dumps(dict(report), nonfinite="keep", sort_keys=True, default=str),
                                 REPORT_FILE)
        finally:
            self.client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id

    def operations(self, max_results: int = 100) -> list[dict[str, str]]:
        """The operations recorded, newest first: each run's tags with its `run_id` and `time` (ms)."""
        experiment = self.client.get_experiment_by_name(OPERATIONS_EXPERIMENT)
        if experiment is None:
            return []
        runs = self.client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                                       max_results=max_results)
        return [{**{k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
                 "run_id": run.info.run_id, "time": str(run.info.start_time)} for run in runs]
