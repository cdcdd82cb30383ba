"""Shadow scoring: a challenger held on every replica beside the champion, and the figures its rows give.

`hold_fleet` sends a registered version's readout (without RLS state: a shadow never learns) to each
replica's `POST /leap/shadow` (`serving.readout.shadow`, through `leap_io.admin_client`), or an empty body
to let it go; a replica that does not answer is reported and the others hold it all the same. The hold is recorded in the registry's history
(`registry.operations`).

`shadow_evidence` reads the stored rows that replicas wrote while the readout was in shadow, keeps those
whose length is a training label (`leap_io.labels`), and gives the paired figures with intervals
(`leap_core.shadow_figures`); fewer than `min_rows` give none, with the reason. The gate takes them into
its verdict (`leap_core.gate_verdict`), and its MLflow run and report carry them.
"""

from __future__ import annotations

from typing import Any

import httpx

from flows.settings import PipelineSettings
from leap_core.shadow_figures import shadow_figures
from leap_io.admin_client import AdminClient, AdminToken
from leap_io.labels import label_mask


def hold_replica(endpoint: str, token: AdminToken, body: bytes, timeout: float) -> dict[str, Any]:
    """One replica's answer (`{"shadow": version, "previous": ...}`), or `error`."""
    try:
        answer = AdminClient(endpoint, token, timeout).hold_shadow(body)
        if answer.status_code != 200:
            return {"error": f"HTTP {answer.status_code}: {answer.text[:300]}"}
        state = answer.json()
        return state if isinstance(state, dict) else {"error": f"the replica answered {str(state)[:200]}"}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def hold_fleet(name: str, version: str | None, settings: PipelineSettings | None = None) -> dict[str, Any]:
    """Hold `version` of `name` in shadow on every replica of `settings.endpoints` (None: let go)."""
    from registry.client import ReadoutRegistry

    settings = settings or PipelineSettings()
    registry = ReadoutRegistry(settings.mlflow_tracking_uri, retries=settings.mlflow_retries,
                               backoff_s=settings.mlflow_backoff_s)
    body, readout_version = b"", None
    if version is not None:
        from leap_core.readout_format import to_bytes
        from leap_io.push_bundle import make_bundle

        readout = registry.load_readout(name, version)
        body, readout_version = make_bundle(to_bytes(readout), None), str(readout.metadata.get("version", ""))
    token = settings.admin_tokens()
    replicas = {endpoint: hold_replica(endpoint, token, body, settings.push_timeout_s)
                for endpoint in settings.endpoints}
    failed = sorted(endpoint for endpoint, state in replicas.items()
                    if "error" in state or state.get("shadow") != readout_version)
    report: dict[str, Any] = {"status": "held" if version is not None else "released", "name": name,
                              "version": version, "readout_version": readout_version, "replicas": replicas,
                              "failed": failed, "replicas_holding": len(replicas) - len(failed)}
    if failed:
        report["status"] = "partial"
    try:
        report["recorded_run_id"] = registry.log_operation(
            "shadow-hold" if version is not None else "shadow-release", f"{name} v{version}",
            {"failed": len(failed), "report": report})
    except Exception as exc:
        report["record_error"] = f"{type(exc).__name__}: {exc}"
    return report


def shadow_evidence(store: Any, readout: Any, min_rows: int, since: float | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """The paired figures of `readout` (a challenger) held in shadow, over the stored rows whose length is a
    label; `{"figures": None, "reason": ...}` when there are fewer than `min_rows`."""
    version = str(readout.metadata.get("version", ""))
    rows = store.shadow_rows(version, since=since)
    budget = int(readout.max_tokens)
    labelled = label_mask(rows, budget)
    n = int(labelled.sum())
    report: dict[str, Any] = {"readout_version": version, "rows": int(labelled.size), "labelled_rows": n}
    if n < min_rows:
        return {**report, "figures": None,
                "reason": f"{n} labelled rows in shadow, {min_rows} needed for shadow figures"}
    figures = shadow_figures(rows["output_tokens"][labelled], rows["served"][labelled], rows["shadow"][labelled],
                             seed=seed)
    return {**report, "figures": figures, "reason": None}
