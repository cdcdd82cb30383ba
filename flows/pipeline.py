"""The retraining loop as Prefect flows: ingest -> fit -> gate -> push, each also runnable alone.

Flows are thin: they read `PipelineSettings`, call the tasks in `flows.tasks` and return a JSON-able
summary with a `status`. A challenger is promoted only with a passing gate recorded against the current
champion, and promotion and rollback are each one operation over the registry and every replica
(`flows.promotion`): either all replicas serve the new champion and the alias names it, or the earlier
state is restored and the flow fails with `PromotionFailed`. Retraining on unchanged data finds the
version it registered before and stops there: re-pushing it would reset the replicas' online
corrections for nothing. MLflow and push failures are retried with backoff and then fail the flow.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from flows.canary import canary_promote
from flows.gate_artifacts import publish_gate_verdict
from flows.promotion import PushOptions
from flows.settings import PipelineSettings
from flows.tasks import (
    compact_feature_files,
    fit_and_register,
    ingest_feedback,
    ingest_segment_batch,
    largest_max_tokens,
    latest_feature_space,
    plain,
    promote_if_passed,
    prune_feedback,
    prune_registry,
    push_champion,
    record_gate,
    recorded_gate,
    registry_of,
    registry_uri,
    rollback_champion,
    run_gate,
    select_training_window,
    store_summary,
)
from registry.aliases import CHALLENGER, CHAMPION
from registry.client import ReadoutRegistry
from store.ingest import complete_segments, deal_segments, totals
from store.stores import is_postgres, open_store, shown_location, store_location
from training.fit import NotEnoughRowsError


def model_name_for(settings: PipelineSettings, name: str | None) -> str:
    """The registered model of the latest feedback's feature space, unless named."""
    if name:
        return name
    space = latest_feature_space(open_store(settings), settings.model_fingerprint, settings.layer)
    if space is None:
        raise LookupError(f"no feedback in {shown_location(settings)} to tell which model to use; run the ingest "
                          "flow first or pass the registered model name")
    return ReadoutRegistry.model_name(space.model_id, space.layer)


INGEST_TASK_THREADS = 16
"""Threads of the ingest flow's task runner; `ingest_workers` (at most this many) of them ingest at once."""


@flow(name="leap-ingest", task_runner=ThreadPoolTaskRunner(max_workers=INGEST_TASK_THREADS))
def ingest_flow(feedback_dir: str | None = None, retry_failed: bool = False,
                workers: int | None = None) -> dict[str, Any]:
    """Ingest the complete feedback segments into the log store (`retry_failed`: try segments
    quarantined as failed again).

    On PostgreSQL the listed segments are dealt into `workers` (default `LEAP_INGEST_WORKERS`) batches,
    ingested by mapped tasks at once, each on its own connection. The DuckDB file stays one sequential
    task: it admits one writing connection at a time, so mapped tasks only queue for its lock (with
    backoff) and lose the read-ahead that overlaps reading one segment with writing the last; two
    such tasks ingested 100k rows of 576 floats at half the sequential rate (9.2k against 18.9k
    rows/s, `leap bench pipeline --workers`, on a shared 2-core machine).
    `rows_per_s` is the rows read over the ingest's wall time.
    """
    settings = PipelineSettings()
    location = feedback_dir or settings.feedback_url or settings.feedback_dir  # the bucket, when the replicas ship
    store = store_location(settings)
    workers = min(int(settings.ingest_workers if workers is None else workers), INGEST_TASK_THREADS)
    started = time.perf_counter()
    if is_postgres(store) and workers > 1:
        sources = complete_segments(str(location), endpoint_url=settings.s3_endpoint_url)
        batches = deal_segments(sources, workers)
        futures = ingest_segment_batch.map(unmapped(store), batches, unmapped(retry_failed))
        reports = [report for future in futures for report in future.result()]
        summary = {**totals(reports), **store_summary(store)}
    else:
        workers = 1
        summary = ingest_feedback(store, str(location), retry_failed, settings.s3_endpoint_url)
    seconds = time.perf_counter() - started
    summary.update(workers=workers, seconds=seconds, rows_per_s=summary["rows_read"] / seconds if seconds > 0 else 0.0)
    if settings.feedback_retention_days is not None:
        summary["pruned"] = prune_feedback(store, str(location), settings.feedback_retention_days,
                                           settings.s3_endpoint_url)
    if settings.feature_compact_below_rows is not None and not is_postgres(store):
        summary["compacted"] = compact_feature_files(store, settings.feature_compact_below_rows)
    get_run_logger().info("ingest: %s", summary)
    return {"status": "ingested", **plain(summary)}


@flow(name="leap-fit")
def fit_flow(since: float | None = None, until: float | None = None, alpha: str | None = None,
             anchor: str | None = None, recipes: list[str] | None = None,
             targets: list[str] | None = None) -> dict[str, Any]:
    """Fit a readout on the feedback window [since, until) (unix seconds) and register it as challenger
    (`anchor` "champion": as a correction of the champion's RLS state, see `fit_and_register`).

    The window is the latest feature space's: one model fingerprint, layer and capture recipe.
    `recipes` (default `LEAP_RECIPES`): candidate recipes the fit chooses among by validation; `targets`
    (default `LEAP_TARGETS`): candidate regression targets, chosen with the recipe."""
    settings = PipelineSettings()
    store = open_store(settings)
    space = latest_feature_space(store, settings.model_fingerprint, settings.layer)
    if space is None:
        return {"status": "no-data", "reason": f"no feedback in {shown_location(settings)}"}
    if since is None and settings.train_window_hours is not None:
        since = time.time() - 3600.0 * settings.train_window_hours
    try:
        frame = select_training_window(store_location(settings), space, since, until, settings.domains,
                                       settings.min_rows, settings.train_max_rows)
        result = fit_and_register(frame, registry_uri(settings), space, alpha or settings.alpha,
                                  settings.target, settings.max_tokens, settings.test_fraction,
                                  window={"since": since, "until": until, "domains": settings.domains,
                                          "max_rows": settings.train_max_rows},
                                  fallback_max_tokens=largest_max_tokens(store, space),
                                  lock_path=settings.alias_lock_location,
                                  anchor=anchor or settings.fit_anchor,
                                  recipes=settings.recipes if recipes is None else recipes,
                                  targets=settings.targets if targets is None else targets)
    except NotEnoughRowsError as exc:
        return {"status": "not-enough-data", "reason": str(exc), "min_rows": settings.min_rows}
    get_run_logger().info("fit: %s v%s (reused: %s)", result["name"], result["version"], result["reused"])
    return {"status": "reused" if result["reused"] else "fitted", **plain(result)}


@flow(name="leap-gate")
def gate_flow(version: str | None = None, name: str | None = None, force: bool = False) -> dict[str, Any]:
    """Gate the challenger (or `version`) against the champion by live replay and record the verdict.

    A verdict already recorded for the same challenger and champion is returned unless `force`. Either
    way the run publishes the verdict as Prefect artifacts (`flows.gate_artifacts`).
    """
    settings = PipelineSettings()
    name = model_name_for(settings, name)
    registry = registry_of(settings)
    challenger = str(version) if version else registry.get_alias(name, CHALLENGER)
    champion = registry.get_alias(name, CHAMPION)
    base = {"name": name, "challenger": challenger, "champion": champion}
    if challenger is None:
        return {"status": "no-challenger", **base}
    if challenger == champion:
        return {"status": "already-champion", **base}
    store = open_store(settings)
    if not force:
        recorded = recorded_gate(store, name, challenger, champion)
        if recorded is not None:
            artifacts = publish_gate_verdict(name, challenger, champion, recorded["verdict"], registry_uri(settings))
            return {"status": "recorded", **base, **recorded, "artifacts": artifacts}
    gate = run_gate(settings, name, challenger, champion)
    logged = record_gate(store_location(settings), registry_uri(settings), name, challenger, champion,
                         gate["results"], gate["verdict"])
    logged["artifacts"] = publish_gate_verdict(name, challenger, champion, gate["verdict"], registry_uri(settings))
    get_run_logger().info("gate: %s v%s vs %s: %s", name, challenger, champion or "fcfs", gate["verdict"]["reason"])
    summaries = {policy: {k: v for k, v in figures.items() if k not in ("ptl", "output_tokens")}
                 for policy, figures in gate["results"].items()}
    return plain({"status": "gated", **base, "verdict": gate["verdict"], "results": summaries,
                  "dropped": gate["dropped"], **logged})


@flow(name="leap-push")
def push_flow(version: str | None = None, name: str | None = None, promote: bool = False,
              canary: int = 0) -> dict[str, Any]:
    """Push the champion to every replica; with `promote`, make the challenger (or `version`) the
    champion on every replica and in the registry, all or nothing, which needs a passing gate recorded
    against the current champion. With `canary` N, the challenger serves on N replicas first and their
    live figures against the rest's promote it or roll them back (`flows.canary`)."""
    settings = PipelineSettings()
    name = model_name_for(settings, name)
    lock = settings.alias_lock_location
    if not promote:
        pushed = push_champion(registry_uri(settings), name, settings.endpoints, settings.admin_tokens(),
                               version=version, retries=settings.push_retries, timeout=settings.push_timeout_s,
                               lock_path=lock)
        return plain({"status": "pushed", **pushed})
    registry = registry_of(settings)
    candidate = str(version) if version else registry.get_alias(name, CHALLENGER)
    champion = registry.get_alias(name, CHAMPION)
    if candidate is None:
        return {"status": "no-challenger", "name": name, "champion": champion}
    recorded = recorded_gate(open_store(settings), name, candidate, champion)
    if recorded is None or not recorded["verdict"].get("passed"):
        reason = "no gate recorded against the current champion" if recorded is None else recorded["verdict"]["reason"]
        return {"status": "not-promoted", "name": name, "challenger": candidate, "champion": champion,
                "reason": reason}
    if canary:
        return plain(_canary(settings, registry, name, candidate, champion, canary))
    promoted = promote_if_passed(registry_uri(settings), name, candidate, recorded["verdict"],
                                 settings.endpoints, settings.admin_tokens(), str(settings.promotion_journal_dir), lock,
                                 settings.push_retries, settings.push_timeout_s, settings.champion_url,
                                 gated_against=champion)
    get_run_logger().info("push: %s v%s serving on %d replicas, promoted", name, candidate, len(promoted["pushed"]))
    return plain({**promoted, "status": "promoted"})


def _canary(settings: PipelineSettings, registry: ReadoutRegistry, name: str, candidate: str,
            champion: str | None, canaries: int) -> dict[str, Any]:
    if champion is None:
        return {"status": "not-promoted", "name": name, "challenger": candidate, "champion": None,
                "reason": "a canary is judged against the champion on the rest of the fleet, and there is none"}
    location = str(settings.feedback_url or settings.feedback_dir)
    store = store_location(settings)
    result = canary_promote(
        registry, open_store(settings), name, candidate, champion, settings.endpoints, canaries,
        PushOptions(settings.admin_tokens(), retries=settings.push_retries, timeout=settings.push_timeout_s),
        str(settings.promotion_journal_dir),
        lambda: ingest_feedback(store, location, False, settings.s3_endpoint_url)["accepted"],
        window_s=settings.canary_window_s, min_rows=settings.canary_min_rows, poll_s=settings.canary_poll_s,
        ptl_bound=settings.canary_ptl_bound, champion_url=settings.champion_url)
    get_run_logger().info("canary: %s v%s %s: %s", name, candidate, result["status"], result["reason"])
    return result


@flow(name="leap-rollback")
def rollback_flow(name: str | None = None) -> dict[str, Any]:
    """Make previous-champion the champion again: the aliases move and the restored champion is pushed
    to every replica, all or nothing (the demoted version becomes previous-champion)."""
    settings = PipelineSettings()
    name = model_name_for(settings, name)
    result = rollback_champion(registry_uri(settings), name, settings.endpoints, settings.admin_tokens(),
                               str(settings.promotion_journal_dir), settings.alias_lock_location,
                               settings.push_retries, settings.push_timeout_s, settings.champion_url)
    get_run_logger().info("rollback: %s v%s is champion again on %d replicas", name, result["version"],
                          len(result["pushed"]))
    return plain(result)


@flow(name="leap-retrain")
def retrain_flow(force_gate: bool = False, canary: int = 0) -> dict[str, Any]:
    """Ingest new feedback, fit, gate the challenger, and push and promote it when it passes (on `canary`
    replicas first, judged live, when set: `flows.canary`); then prune the registry's old versions
    (`registry_keep_versions`)."""
    summary: dict[str, Any] = {"ingest": ingest_flow()}
    fit = fit_flow()
    summary["fit"] = fit
    if fit["status"] not in ("fitted", "reused"):
        return {"status": fit["status"], **summary}
    if fit["version"] == fit.get("champion"):
        status = "unchanged"
    else:
        gate = gate_flow(version=fit["version"], name=fit["name"], force=force_gate)
        summary["gate"] = gate
        if (gate.get("verdict") or {}).get("passed"):
            summary["push"] = push_flow(version=fit["version"], name=fit["name"], promote=True, canary=canary)
            status = summary["push"]["status"]
        else:
            status = "rejected"
    settings = PipelineSettings()
    if settings.registry_keep_versions is not None:
        summary["registry_pruned"] = prune_registry(registry_uri(settings), fit["name"],
                                                    settings.registry_keep_versions, settings.alias_lock_location)
    return {"status": status, **summary}
