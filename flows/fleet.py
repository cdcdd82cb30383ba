"""The fleet: merge what every replica's RLS learned into one exact anchored solve, and keep every
replica on the champion.

Every replica folds its own finished requests into the state pushed with the common readout, so their
information adds up over that anchor (`leap_core.fleet_rls`). `merge_flow` reads every replica's state
(`GET /leap/rls`), merges those on the shared base, registers the result and promotes it to every
replica that answered; `reconcile_replicas` brings every replica to the champion. After the push every
replica is anchored at the merge, so no row counts twice; rows left out stay in the log store for the
next fit. `merge_refit_diff` checks the merge against a one-shot refit. Steps: docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.promotion import PushOptions, promote
from flows.push import PushFailed, push_readout, serving_version
from flows.settings import PipelineSettings
from flows.tasks import plain, registry_at, registry_of, registry_uri
from leap_core.fleet_rls import check_mergeable, merge_anchored, refit_max_abs_diff
from leap_io.admin_client import RLS_INFO_HEADER, AdminClient, AdminToken
from leap_io.model_identity import serves
from registry.aliases import CHAMPION
from registry.client import ReadoutRegistry
from registry.lookups import MERGE_ROWS_UNTIL_TAG

# ---------------------------------------------------------------------------- reading replicas

def fetch_replica_state(endpoint: str, token: AdminToken, timeout: float = 30.0) -> dict[str, Any]:
    """One replica's RLS state: {"endpoint", "status", ...}. status "ok" adds `readout` (the anchor),
    `state` (arrays), `base_version`, `rows`, `buffered`; "no-rls" (409/404), "unreachable" and
    "refused" (a body that does not validate as a push bundle of its own readout) add `error`."""
    from serving.readout.push import PushRefused, validate_push

    try:
        response = AdminClient(endpoint, token, timeout).rls()
    except httpx.HTTPError as exc:
        return {"endpoint": endpoint, "status": "unreachable", "error": f"{type(exc).__name__}: {exc}"}
    if response.status_code in (404, 409):
        return {"endpoint": endpoint, "status": "no-rls", "error": _error_of(response)}
    if response.status_code != 200:
        return {"endpoint": endpoint, "status": "unreachable" if response.status_code >= 500 else "refused",
                "error": f"HTTP {response.status_code}: {_error_of(response)}"}
    try:
        info = json.loads(response.headers.get(RLS_INFO_HEADER, "{}"))
        if not isinstance(info, dict):
            raise ValueError(f"{RLS_INFO_HEADER} is not a JSON object")
        readout, rls = validate_push(response.content, {}, None)  # the checks every push passes
        if rls is None:
            raise ValueError("the bundle carries no RLS state")
    except (PushRefused, ValueError) as exc:
        return {"endpoint": endpoint, "status": "refused", "error": f"its RLS state does not validate: {exc}"}
    base_version = str(readout.metadata.get("version", ""))
    return {"endpoint": endpoint, "status": "ok", "readout": readout, "state": rls.state_arrays(),
            "base_version": base_version, "rows": int(info.get("rows", 0)), "buffered": int(info.get("buffered", 0)),
            "serving": str(info.get("serving", ""))}


def _error_of(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text[:300]))
    except ValueError:
        return response.text[:300]


@task(name="fetch-replica-states", cache_policy=NO_CACHE)
def fetch_replica_states(endpoints: Sequence[str], token: AdminToken, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every replica's RLS state (`fetch_replica_state`), in the order of `endpoints`."""
    return [fetch_replica_state(endpoint, token, timeout) for endpoint in endpoints]


def choose_base(replicas: Sequence[Mapping[str, Any]], champion_readout_version: str | None) -> str | None:
    """The anchor most replicas with RLS state share; on a tie the champion's, then the most rows."""
    counts = Counter(r["base_version"] for r in replicas if r["status"] == "ok")
    if not counts:
        return None
    rows = Counter()
    for r in replicas:
        if r["status"] == "ok":
            rows[r["base_version"]] += r["rows"]
    return max(counts, key=lambda v: (counts[v], v == champion_readout_version, rows[v]))


def _merge_key(base_version: str, states: Sequence[Mapping[str, np.ndarray]]) -> str:
    digest = hashlib.sha256(base_version.encode())
    for part in sorted(hashlib.sha256(np.ascontiguousarray(s["A"]).tobytes()
                                      + np.ascontiguousarray(s["b"]).tobytes()).hexdigest() for s in states):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------- merging

@task(name="merge-and-register", cache_policy=NO_CACHE)
def merge_and_register(tracking_uri: str, lock_path: str | None, name: str | None,
                       replicas: list[dict[str, Any]], snapshot_at: float | None = None) -> dict[str, Any]:
    """Choose the base, check every replica on it, merge, and register the merged version (or find the
    one registered before from the same states). Returns the merge's figures; `status` "merged",
    "nothing-to-merge", "no-base", "base-not-registered" or "base-not-champion"."""
    registry = registry_at(tracking_uri, lock_path)
    usable = [r for r in replicas if r["status"] == "ok"]
    if not usable:
        return {"status": "no-base", "reason": "no replica answered with RLS state"}
    if name is None:
        meta = usable[0]["readout"].metadata
        name = ReadoutRegistry.model_name(str(meta["model_id"]), int(meta["layer"]))
    champion = registry.get_alias(name, CHAMPION)
    champion_readout = registry.version_info(name, champion).tags.get("readout_version") if champion else None
    base_version = choose_base(replicas, champion_readout)
    base_registry = registry.find_readout(name, base_version)
    for r in replicas:
        if r["status"] == "ok" and r["base_version"] != base_version:
            r["status"], r["error"] = "other-base", f"anchored at {r['base_version']}, not at the base {base_version}"
    if base_registry is None:
        return {"status": "base-not-registered", "name": name, "base_version": base_version,
                "reason": f"no version of {name} has readout_version {base_version}; its RLS anchor is unknown"}
    if champion is not None and base_registry != champion:  # promoting it would undo the champion
        return {"status": "base-not-champion", "name": name, "base_version": base_version,
                "base_registry_version": base_registry, "champion": champion,
                "reason": f"the replicas learn around v{base_registry}, but v{champion} is the champion: "
                          "they are brought to the champion instead (their rows stay in the log store)"}
    base_readout = registry.load_readout(name, base_registry)
    base_rls = registry.load_rls_state(name, base_registry, readout=base_readout)
    if base_rls is None:
        return {"status": "base-not-registered", "name": name, "base_version": base_version,
                "reason": f"{name} v{base_registry} was registered without RLS state"}
    base_state = base_rls.state_arrays()
    merged_in = []
    for r in replicas:
        if r["status"] != "ok":
            continue
        try:
            r["rows"] = check_mergeable(base_state, [r["state"]])[0]
            merged_in.append(r)
        except ValueError as exc:  # e.g. restarted on a state of the same version but another history
            r["status"], r["error"] = "not-mergeable", str(exc)
    figures = {"name": name, "base_version": base_version, "base_registry_version": base_registry,
               "champion": champion, "rows_merged": sum(r["rows"] for r in merged_in),
               "replicas_merged": len(merged_in)}
    if figures["rows_merged"] == 0:
        return {"status": "nothing-to-merge", **figures}
    merged = merge_anchored(base_readout, base_state, [r["state"] for r in merged_in])
    merge_key = _merge_key(base_version, [r["state"] for r in merged_in])
    found = registry.find_merge(name, merge_key)
    if found is not None:
        return {"status": "merged", "reused": True, "version": found[0], "readout_version": found[1],
                "merge_key": merge_key, **figures}
    readout = merged.readout()
    readout_version = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-m{merge_key[:8]}"
    readout.metadata.update(version=readout_version, merged_from=base_version)
    rows = {r["endpoint"]: r["rows"] for r in merged_in}
    tags = {"merged_from": str(base_registry), "merged_from_readout": base_version, "merge_key": merge_key,
            "merge_rows": json.dumps(rows), "merge_replicas": json.dumps(sorted(rows)),
            # every row the merge holds finished before this time: a fit anchored at this version must
            # only add rows that arrived after it, or it counts the replicas' rows a second time
            **({MERGE_ROWS_UNTIL_TAG: f"{snapshot_at:.3f}"} if snapshot_at is not None else {})}
    logged = registry.log_readout(readout, rls=merged, params={"merged_from": base_registry, "merge_key": merge_key,
                                                               "merge_replicas": len(rows)},
                                  metrics={"rows_merged": float(figures["rows_merged"])},
                                  run_name=f"merge-{readout_version}", tags=tags, version_tags=tags)
    return {"status": "merged", "reused": False, "version": logged.version, "readout_version": readout_version,
            "merge_key": merge_key, **figures}


def merge_refit_diff(registry: ReadoutRegistry, name: str, version: str | int, X: np.ndarray,
                     lengths: np.ndarray) -> float:
    """max |theta_merged - theta_refit| of a merged version: the refit re-solves the anchored ridge problem
    on its base's registered information and the feedback rows (X, lengths) the merged replicas folded."""
    merged_readout = registry.load_readout(name, version)
    merged = registry.load_rls_state(name, version, readout=merged_readout)
    base_version = registry.version_info(name, version).tags.get("merged_from")
    if merged is None or not base_version:
        raise LookupError(f"{name} v{version} is not a merged version with RLS state")
    base_readout = registry.load_readout(name, base_version)
    base = registry.load_rls_state(name, base_version, readout=base_readout)
    return refit_max_abs_diff(merged, base_readout, base, X, lengths)


# ---------------------------------------------------------------------------- keeping replicas on the champion

@task(name="reconcile-replicas", cache_policy=NO_CACHE)
def reconcile_replicas(tracking_uri: str, name: str, endpoints: Sequence[str], token: AdminToken,
                       lock_path: str | None = None, retries: int = 3, timeout: float = 30.0) -> dict[str, Any]:
    """Push the champion to every replica that does not report it (or an RLS correction of it); each
    push verified. Under the alias lock, so no promotion moves the champion meanwhile. Replicas that do
    not answer are reported, not failed: they take the published champion when they start."""

    registry = registry_at(tracking_uri, lock_path)
    with registry.alias_lock.held():
        champion = registry.get_alias(name, CHAMPION)
        if champion is None:
            return {"name": name, "champion": None, "in_step": [], "pushed": [], "unreachable": {}, "failed": {}}
        bundle = expected = None
        report: dict[str, Any] = {"name": name, "champion": champion, "in_step": [], "pushed": [],
                                  "unreachable": {}, "failed": {}}
        for endpoint in endpoints:
            try:
                reported = serving_version(endpoint, token, timeout=min(timeout, 10.0))
            except (httpx.HTTPError, ValueError) as exc:
                report["unreachable"][endpoint] = f"{type(exc).__name__}: {exc}"
                continue
            if bundle is None:
                bundle, expected = registry.push_bundle(name, champion, force=True)
            if serves(reported, expected):
                report["in_step"].append(endpoint)
                continue
            try:
                report["pushed"].append(push_readout(endpoint, token, bundle, expected, retries=retries,
                                                     timeout=timeout))
            except PushFailed as failure:
                report["failed"][endpoint] = str(failure)
        report["readout_version"] = expected
        return report


def replica_versions(endpoints: Sequence[str], token: AdminToken, timeout: float = 10.0) -> dict[str, str | None]:
    """The version each replica reports now (None: it does not answer)."""

    versions: dict[str, str | None] = {}
    for endpoint in endpoints:
        try:
            versions[endpoint] = serving_version(endpoint, token, timeout=timeout)
        except (httpx.HTTPError, ValueError):
            versions[endpoint] = None
    return versions


# ---------------------------------------------------------------------------- the flow

def _replica_report(replica: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("endpoint", "status", "base_version", "rows", "buffered", "serving", "error")
    return {key: replica[key] for key in keep if key in replica}


@flow(name="leap-merge")
def merge_flow(name: str | None = None) -> dict[str, Any]:
    """Merge the replicas' RLS states into one exact anchored solve, register it, push it to every
    replica that answers as the new champion, and bring every replica to the champion."""
    settings = PipelineSettings()
    token = settings.admin_tokens()
    lock = settings.alias_lock_location
    started = time.monotonic()
    snapshot_at = time.time()
    replicas = fetch_replica_states(settings.endpoints, token, settings.push_timeout_s)
    merged = merge_and_register(registry_uri(settings), lock, name, replicas, snapshot_at)
    reports = [_replica_report(r) for r in replicas]
    skipped = [r for r in reports if r["status"] not in ("ok", "unreachable")]
    result: dict[str, Any] = {
        **merged, "replicas": reports,
        "replicas_skipped": len(skipped), "rows_skipped": sum(int(r.get("rows", 0)) for r in skipped),
        "rows_buffered": sum(int(r.get("buffered", 0)) for r in reports),
        "unreachable": [r["endpoint"] for r in reports if r["status"] == "unreachable"],
    }
    answering = [r["endpoint"] for r in reports if r["status"] != "unreachable"]
    name = merged.get("name") or name
    if merged["status"] == "merged" and answering:
        options = PushOptions(token, retries=settings.push_retries, timeout=settings.push_timeout_s)
        registry = registry_of(settings)
        with registry.alias_lock.held():  # the champion checked and replaced in one step
            now = registry.get_alias(name, CHAMPION)
            if now != merged["champion"] and now != merged["version"]:
                result.update(status="superseded", reason=f"v{now} became the champion while the merge ran; "
                                                          f"the merge v{merged['version']} is not promoted")
            else:
                promoted = promote(registry, name, merged["version"], answering, options,
                                   settings.promotion_journal_dir, settings.champion_url)
                result["promotion"] = {key: promoted[key]
                                       for key in ("champion", "replaced", "aliases", "published")}
    if name:
        result["reconcile"] = reconcile_replicas(registry_uri(settings), name, settings.endpoints, token, lock,
                                                 settings.push_retries, settings.push_timeout_s)
    versions = replica_versions(settings.endpoints, settings.admin_tokens())
    result["versions"] = versions
    reported = [v for v in versions.values() if v is not None]
    result["versions_equal"] = bool(reported) and len(set(reported)) == 1 and len(reported) == len(versions)
    result["seconds"] = round(time.monotonic() - started, 3)
    get_run_logger().info("merge: %s, %s rows from %s replicas, versions %s", merged["status"],
                          merged.get("rows_merged"), merged.get("replicas_merged"), versions)
    return plain(result)


@flow(name="leap-reconcile")
def reconcile_flow(name: str | None = None) -> dict[str, Any]:
    """Push the champion to every replica that does not serve it (after replicas start, or any time)."""
    from flows.pipeline import model_name_for

    settings = PipelineSettings()
    name = model_name_for(settings, name)
    return plain(reconcile_replicas(registry_uri(settings), name, settings.endpoints, settings.admin_tokens(),
                                     settings.alias_lock_location, settings.push_retries, settings.push_timeout_s))
