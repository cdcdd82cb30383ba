"""The steps of the retraining loop as small Prefect tasks, each safe to run again.

Rerunning any step converges instead of duplicating: ingest skips segments already in the ledger, a fit
on the same rows with the same settings returns the version registered before, a recorded gate is
found by its content key, promotion only happens on a passing verdict and is all or nothing across
the registry and the replicas (`flows.promotion`), and a push is verified by the version the replica
reports. MLflow calls are retried with backoff by the registry client and then fail loudly;
every task that writes an alias or pushes takes the alias lock (`lock_path`). Tasks whose inputs are feature arrays skip Prefect's input
hashing (NO_CACHE), which would otherwise hash megabytes per call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.gate import gate_verdict, replay_gate
from store.ingest import IngestReport, SegmentSource, ingest_folder, ingest_segments, totals
from flows.promotion import PushOptions, readout_bundle
from flows.promotion import promote as promote_everywhere
from flows.promotion import rollback as rollback_everywhere
from flows.push import PushFailed, push_readout
from flows.settings import PipelineSettings
from store.duckdb import TrainingFrame, canonical_recipe
from store.stores import Store, open_store, store_at
from training.fit import NotEnoughRowsError, fit_readout, select_window, time_split
from leap_core.recipes import Recipe
from leap_core.rls import RLS
from leap_io.jsonable import dumps, to_jsonable
from leap_io.object_store import is_object_url
from registry.client import (
    CHAMPION,
    GATE_EXPERIMENT,
    READOUT_EXPERIMENT,
    ReadoutRegistry,
)

@dataclass(frozen=True)
class FeatureSpace:
    """Whose hidden states a readout reads: the serving model, the captured layer and the capture recipe
    of the rows (`leap_core.recipes`; rows that record none, and an empty `recipe`, are `last@<layer>`)."""

    model_id: str
    model_fingerprint: str
    layer: int
    recipe: str = ""

    def __post_init__(self) -> None:
        recipe = canonical_recipe(self.recipe) if self.recipe else str(Recipe.last(self.layer))
        object.__setattr__(self, "recipe", recipe)


def plain(value: Any) -> Any:
    """numpy scalars and arrays as JSON values, recursively (flow results must be JSON-able); NaN stays NaN."""
    return to_jsonable(value, nonfinite="keep")


def _key(payload: Any) -> str:
    return hashlib.sha256(dumps(payload, nonfinite="keep", sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------- the log store

def latest_feature_space(store: Store, model_fingerprint: str | None = None, layer: int | None = None,
                         recipe: str | None = None) -> FeatureSpace | None:
    """The feature space (fingerprint, layer, capture recipe) of the most recent feedback, optionally
    narrowed; None for an empty store."""
    row = store.latest_feature_space(model_fingerprint, layer, recipe)
    if row is None:
        return None
    model_id, fingerprint, found_layer, found_recipe = row
    return FeatureSpace(model_id=model_id or fingerprint, model_fingerprint=fingerprint, layer=int(found_layer),
                        recipe=found_recipe)


def largest_max_tokens(store: Store, space: FeatureSpace) -> int | None:
    return store.largest_max_tokens(space.model_fingerprint, space.layer, space.recipe)


def covered_recipes(candidates: Sequence[str] | None, capture: str, dim: int) -> tuple[list[str], list[str]]:
    """(covered, not covered): the candidate recipes a capture of `dim` floats holds every block of
    (`Recipe.columns`), canonical names in the given order without repeats, and the others."""
    covered: list[str] = []
    missing: list[str] = []
    if not candidates:
        return covered, missing
    hidden = Recipe.parse(capture).hidden_for(int(dim))
    for name in dict.fromkeys(canonical_recipe(c) for c in candidates):
        (covered if Recipe.parse(name).covered_by(capture, hidden) else missing).append(name)
    return covered, missing


def recorded_lengths(store: Store, request_ids: Sequence[str],
                     model_fingerprint: str | None = None) -> dict[str, tuple[int, float]]:
    """(output_tokens, arrival_time) the store recorded for those request ids (of one model when given).

    Only rows finished by a training-label reason (stop, length) count: an aborted, errored or
    repetition-cut request's length is where it was cut off, which no replay should take as its length.
    """
    return store.recorded_lengths(request_ids, model_fingerprint)


def gate_slice(store: Store, prompts: Sequence[Mapping[str, Any]], size: int, seed: int,
               model_fingerprint: str | None = None,
               held_out_fraction: float = 0.2) -> tuple[list[dict], dict[str, int]]:
    """A reproducible sample of `size` served prompts, and their recorded lengths, from the held-out part.

    The fit splits the feedback by time and trains on the oldest rows; the gate replays only prompts
    among the newest `held_out_fraction`, so a challenger is never judged on its own training requests.
    """
    recorded = recorded_lengths(store, [p["id"] for p in prompts], model_fingerprint)
    if recorded:
        arrivals = np.asarray([arrival for _, arrival in recorded.values()])
        cutoff = float(np.quantile(arrivals, 1.0 - held_out_fraction))
        recorded = {rid: value for rid, value in recorded.items() if value[1] >= cutoff}
    lengths = {rid: value[0] for rid, value in recorded.items()}
    known = sorted((p for p in prompts if p["id"] in lengths), key=lambda p: p["id"])
    if not known:
        raise LookupError("no gate prompt has a recorded output length in the log store; serve or replay "
                          "these prompts first, or point LEAP_GATE_PROMPTS at prompts that were served")
    order = np.random.default_rng(seed).permutation(len(known))[:size]
    chosen = [dict(known[i]) for i in sorted(order)]
    return chosen, {p["id"]: lengths[p["id"]] for p in chosen}


def recorded_gate(store: Store, name: str, challenger: str, champion: str | None) -> dict | None:
    """The latest gate recorded for this challenger against this champion, or None."""
    return store.recorded_gate(name, str(challenger), None if champion is None else str(champion))


# ---------------------------------------------------------------------------- tasks

def registry_at(tracking_uri: str, lock_path: str | None = None) -> ReadoutRegistry:
    """The registry client of a task; `lock_path` is the alias lock every alias writer shares."""
    return ReadoutRegistry(tracking_uri, lock_path=lock_path)


@task(name="ingest-feedback", retries=2, retry_delay_seconds=5)
def ingest_feedback(store_location: str, feedback_dir: str, retry_failed: bool = False,
                    s3_endpoint_url: str | None = None) -> dict[str, Any]:
    """Ingest every complete feedback segment into the store at `store_location` (`store.stores`);
    segments already in the ledger are skipped, and a segment that fails is quarantined (counted in
    `failed`) without stopping the others. `feedback_dir` may be an s3://bucket/prefix URL (read at
    `s3_endpoint_url`)."""
    store = store_at(store_location)
    if not is_object_url(feedback_dir):
        Path(feedback_dir).mkdir(parents=True, exist_ok=True)
    summary = totals(ingest_folder(store, feedback_dir, retry_failed=retry_failed, endpoint_url=s3_endpoint_url))
    return {**summary, "store": store.counts(), "finish_reasons": store.finish_reasons()}


@task(name="ingest-segments", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
def ingest_segment_batch(store_location: str, sources: Sequence[SegmentSource],
                         retry_failed: bool = False) -> list[IngestReport]:
    """Ingest one batch of listed segments, one of the ingest flow's mapped tasks; one report per
    segment. A retry skips what the first try committed."""
    return ingest_segments(store_at(store_location), sources, retry_failed=retry_failed)


def store_summary(store_location: str) -> dict[str, Any]:
    """What the ingest summary reports about the store after a run."""
    store = store_at(store_location)
    return {"store": store.counts(), "finish_reasons": store.finish_reasons()}


@task(name="select-training-window", cache_policy=NO_CACHE)
def select_training_window(store_location: str, space: FeatureSpace, since: float | None, until: float | None,
                           domains: list[str] | None, min_rows: int) -> TrainingFrame:
    """The finished requests of one feature space (fingerprint, layer and capture recipe) arriving in
    [since, until)."""
    return select_window(store_at(store_location), since=since, until=until, domains=domains,
                         model_fingerprint=space.model_fingerprint, layer=space.layer, recipe=space.recipe,
                         min_rows=min_rows)


def window_hash(frame: TrainingFrame) -> str:
    """Identifies the rows of a window: a request id's features and length never change once stored."""
    digest = hashlib.sha256()
    for rid in frame.request_ids:
        digest.update(str(rid).encode())
        digest.update(b"\0")
    digest.update(np.ascontiguousarray(frame.output_tokens, dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


def _registered_fit(registry: ReadoutRegistry, name: str, fit_key: str) -> tuple[str, str] | None:
    """(version, run id) of a finished fit logged with this key whose version still exists."""
    experiment = registry.client.get_experiment_by_name(READOUT_EXPERIMENT)
    if experiment is None:
        return None
    runs = registry.client.search_runs(
        [experiment.experiment_id],
        filter_string=f"params.fit_key = '{fit_key}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"])
    for run in runs:
        version = run.data.tags.get("registered_version")
        if version is None:
            continue
        try:
            registry.client.get_model_version(name, version)
        except MlflowException:  # the version was deleted since
            continue
        return version, run.info.run_id
    return None


def _champion_budget(registry: ReadoutRegistry, name: str) -> tuple[int | None, str | None]:
    """The champion's output budget and target: a challenger must match them to be pushable."""
    if registry.get_alias(name, CHAMPION) is None:
        return None, None
    readout = registry.load_readout(name, CHAMPION)
    return int(readout.max_tokens), str(readout.target)


@task(name="fit-and-register", cache_policy=NO_CACHE)
def fit_and_register(frame: TrainingFrame, tracking_uri: str, space: FeatureSpace, alpha: str | float = "auto",
                     target: str = "sqrt", max_tokens: int | None = None, test_fraction: float = 0.2,
                     window: Mapping[str, Any] | None = None, fallback_max_tokens: int | None = None,
                     lock_path: str | None = None, anchor: str = "none",
                     recipes: Sequence[str] | None = None) -> dict[str, Any]:
    """Fit a readout on `frame`, register it and point `challenger` at it.

    anchor "champion": correct the champion's RLS state with the window's training rows (one exact
    batch update, equal to a ridge solve on the champion's rows and these), so a window smaller than
    the champion's training set refines it instead of replacing it; with no champion, a plain fit.

    recipes: candidate feature recipes; those the capture recipe of the rows (`space.recipe`) covers
    are validated on the newest rows of the training split and the best is fitted (`fit_readout`).
    The run logs them (`recipe_candidates`, and `recipe_candidates_not_covered`), the validation table
    (`recipe_validation.json`, an MLflow table) and the chosen recipe's `validation_spearman`. None,
    none covered, or an anchored fit (the champion fixes the recipe): the capture recipe, no choice.

    A fit of the same rows with the same settings returns the version registered then (the alias is
    set again unless that version is already the champion). The output budget defaults to the
    champion's, since serving refuses a readout whose budget or target differs from the one it runs.
    """
    alpha = "auto" if str(alpha).strip().lower() == "auto" else float(alpha)
    registry = registry_at(tracking_uri, lock_path)
    name = registry.model_name(space.model_id, space.layer)
    champion_budget, champion_target = _champion_budget(registry, name)
    budget = max_tokens or champion_budget or fallback_max_tokens
    if budget is None:
        raise ValueError("no output budget: set LEAP_MAX_TOKENS (no champion and no max_tokens in the window)")
    if champion_target is not None and champion_target != target:
        raise ValueError(f"the champion's target is {champion_target!r}; a {target!r} challenger would be refused")
    if anchor not in ("none", "champion"):
        raise ValueError(f"anchor must be 'none' or 'champion', got {anchor!r}")
    champion = registry.get_alias(name, CHAMPION)
    anchored = anchor == "champion" and champion is not None
    if anchored:  # the champion's RLS state already holds the rows up to its cut: add only later ones
        cut = information_until(registry, name, champion)
        if cut is not None:
            frame = frame.take(np.asarray(frame.arrival_time) > cut)
            if len(frame.request_ids) < 2:
                raise NotEnoughRowsError(f"the champion v{champion} already holds every row of the window that "
                                         f"arrived up to {cut:.3f}; {len(frame.request_ids)} arrived after")
    rows_hash = window_hash(frame)
    candidates, not_covered = covered_recipes(recipes, space.recipe, np.asarray(frame.features).shape[1])
    if anchored:
        candidates = []  # the anchor keeps the champion's recipe
    # keys added only when set, so the fits of before recipes keep their keys
    fit_settings = {"window_hash": rows_hash, "alpha": str(alpha), "target": target, "max_tokens": int(budget),
                    "test_fraction": float(test_fraction), "model_fingerprint": space.model_fingerprint,
                    "layer": space.layer, **({"anchor": f"champion-{champion}"} if anchored else {}),
                    **({"capture_recipe": space.recipe} if space.recipe != str(Recipe.last(space.layer)) else {}),
                    **({"recipes": candidates} if candidates else {})}
    fit_key = _key(fit_settings)
    found = _registered_fit(registry, name, fit_key)
    if found is not None:
        version, run_id = found
        if version != champion:
            registry.set_challenger(name, version)
        run = registry.client.get_run(run_id)
        return {"name": name, "version": version, "run_id": run_id, "reused": True, "fit_key": fit_key,
                "window_hash": rows_hash, "rows": len(frame.request_ids), "champion": champion,
                "recipe": run.data.params.get("recipe", space.recipe), "metrics": dict(run.data.metrics)}

    train, test = time_split(frame, test_fraction)
    readout_version = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{fit_key[:8]}"
    anchor_rls = None
    if anchored:
        anchor_rls = registry.load_rls_state(name, champion, readout=registry.load_readout(name, champion))
        if anchor_rls is None:
            raise ValueError(f"champion {champion} of {name} has no RLS state to anchor at")
    fit = fit_readout(train, test, alpha=alpha, target=target, max_tokens=int(budget), model_id=space.model_id,
                      model_fingerprint=space.model_fingerprint, layer=space.layer, version=readout_version,
                      anchor=anchor_rls, capture_recipe=space.recipe, recipes=candidates or None)
    rls = fit.rls_state
    if isinstance(rls, Mapping):
        rls = RLS.from_state_arrays(fit.readout, dict(rls))
    params = {**dict(fit.params), **{f"requested_{k}": v for k, v in (window or {}).items()},
              "fit_key": fit_key, "window_hash": rows_hash, "alpha_requested": str(alpha),
              "anchor": f"champion v{champion}" if anchored else "none",
              "test_fraction": float(test_fraction), "capture_recipe": space.recipe,
              "recipe": fit.params.get("recipe", space.recipe), "recipe_candidates": ",".join(candidates),
              "recipe_choice": "anchor" if anchored else "validation" if candidates else "capture",
              **({"recipe_candidates_not_covered": ",".join(not_covered)} if not_covered else {})}
    metrics = dict(fit.metrics)
    validation = [dict(row) for row in fit.validation] if fit.validation else None
    if validation:
        chosen = next((row for row in validation if row["recipe"] == params["recipe"]), None)
        if chosen is not None:
            metrics["validation_spearman"] = float(chosen["spearman"])
    # the newest arrival whose row this version's RLS state holds (its training split's rows)
    rows_until = f"{float(np.max(train.arrival_time)):.3f}" if len(train.arrival_time) else None
    tags = {"fit_key": fit_key, **({ROWS_UNTIL_TAG: rows_until} if rows_until else {})}
    logged = registry.log_readout(fit.readout, rls=rls, params=params, metrics=metrics,
                                  eval_arrays=fit.eval_arrays, run_name=f"fit-{readout_version}",
                                  tags=tags, validation=validation)
    if rows_until:
        registry.client.set_model_version_tag(name, logged.version, ROWS_UNTIL_TAG, rows_until)
    registry.set_challenger(name, logged.version)
    return {"name": name, "version": logged.version, "run_id": logged.run_id, "reused": False,
            "fit_key": fit_key, "window_hash": rows_hash, "rows": len(frame.request_ids),
            "readout_version": readout_version, "champion": champion, "recipe": params["recipe"],
            "validation": plain(validation),
            "metrics": plain({k: v for k, v in metrics.items() if isinstance(v, (int, float, np.number))})}


ROWS_UNTIL_TAG = "rows_until"
"""Version tag: the newest arrival time (unix s) of the log-store rows a fitted version's RLS state holds."""
MERGE_ROWS_UNTIL_TAG = "merge_rows_until"
"""Version tag of a fleet merge: every row it holds finished before this time (`flows.fleet`)."""


def information_until(registry: ReadoutRegistry, name: str, version: str | int) -> float | None:
    """The time up to which a version's RLS state holds log-store rows (its own fit's or, through its anchor,
    an earlier one's; a merge's snapshot), or None for a version that holds none of them (fitted elsewhere,
    e.g. on the corpus snapshot). An anchored fit adds only rows that arrived after it, so no row counts twice."""
    tags = registry.client.get_model_version(name, str(version)).tags
    cuts = []
    for key in (ROWS_UNTIL_TAG, MERGE_ROWS_UNTIL_TAG):
        try:
            cuts.append(float(tags[key]))
        except (KeyError, TypeError, ValueError):
            continue
    return max(cuts) if cuts else None


def _readout_pair(registry: ReadoutRegistry, name: str, version: str):
    readout = registry.load_readout(name, version)
    rls = registry.load_rls_state(name, version, readout=readout)
    return readout, (rls.state_arrays() if rls is not None else None)


@task(name="run-gate", cache_policy=NO_CACHE)
def run_gate(settings: PipelineSettings, name: str, challenger: str, champion: str | None) -> dict[str, Any]:
    """Replay one slice of served prompts with recorded lengths under FCFS, champion and challenger."""
    from harness.engine import EngineSettings

    registry = ReadoutRegistry(settings.mlflow_tracking_uri)
    readouts = {"challenger": _readout_pair(registry, name, challenger),
                "champion": _readout_pair(registry, name, champion) if champion is not None else None}
    fingerprint = str(readouts["challenger"][0].metadata.get("model_fingerprint") or "") or None
    if settings.gate_prompts is not None:
        from harness.datasets import load_prompts

        prompts = load_prompts(settings.gate_prompts)
    else:
        from harness.datasets import available_prompts

        prompts = available_prompts()
    chosen, lengths = gate_slice(open_store(settings), prompts, settings.replay_slice,
                                 settings.replay_seed, fingerprint, held_out_fraction=settings.test_fraction)
    engine = EngineSettings(model=str(settings.resolved_model_path()), max_model_len=settings.max_model_len,
                            seed=settings.replay_seed)
    replayed = replay_gate(engine, chosen, lengths, readouts, settings.replay_rate, settings.replay_seed)
    verdict = gate_verdict(replayed["results"], settings.gate_margin, settings.gate_p95_bound)
    return {**replayed, "verdict": verdict}


@task(name="record-gate", cache_policy=NO_CACHE)
def record_gate(store_location: str, tracking_uri: str, name: str, challenger: str, champion: str | None,
                results: Mapping[str, Any], verdict: Mapping[str, Any]) -> dict[str, Any]:
    """Log the gate to MLflow (run + tags on the challenger version) and to the `gates` table, once."""
    results, verdict = plain(results), plain(verdict)
    gate_key = _key({"name": name, "challenger": challenger, "champion": champion, "results": results,
                     "verdict": verdict})
    store = store_at(store_location)
    found, recorded_run = store.gate_run(gate_key)
    if found:
        return {"gate_key": gate_key, "gate_run_id": recorded_run, "recorded": False}

    registry = ReadoutRegistry(tracking_uri)
    run_id = None
    experiment = registry.client.get_experiment_by_name(GATE_EXPERIMENT)
    if experiment is not None:  # logged before a crash that kept the store's row from being written
        runs = registry.client.search_runs([experiment.experiment_id],
                                           filter_string=f"tags.gate_key = '{gate_key}'", max_results=1)
        run_id = runs[0].info.run_id if runs else None
    if run_id is None:
        run_id = registry.log_gate(name, challenger, champion, results, verdict)
        registry.client.set_tag(run_id, "gate_key", gate_key)
    store.record_gate(gate_key, datetime.now(UTC).replace(tzinfo=None), name, str(challenger),
                      None if champion is None else str(champion), bool(verdict["passed"]),
                      dumps(verdict, nonfinite="keep"), dumps(results, nonfinite="keep"), run_id)
    return {"gate_key": gate_key, "gate_run_id": run_id, "recorded": True}


@task(name="promote-if-passed", cache_policy=NO_CACHE)
def promote_if_passed(tracking_uri: str, name: str, version: str, verdict: Mapping[str, Any],
                      endpoints: Sequence[str] = (), token: str = "", journal_dir: str | None = None,
                      lock_path: str | None = None, push_retries: int = 3, push_timeout: float = 30.0,
                      champion_url: str | None = None) -> dict[str, Any]:
    """On a passing verdict, make `version` the champion on every replica of `endpoints` and in the
    registry, all or nothing (`flows.promotion.promote`, which raises PromotionFailed with the
    earlier state restored), and publish it at `champion_url`; otherwise leave every alias and
    replica alone."""
    registry = registry_at(tracking_uri, lock_path)
    if not verdict.get("passed", False):
        return {"promoted": False, "champion": registry.get_alias(name, CHAMPION),
                "reason": verdict.get("reason", "the gate did not pass")}
    journal = journal_dir or str(Path(lock_path or registry.alias_lock.path).parent / "promotions")
    result = promote_everywhere(registry, name, version, list(endpoints),
                                PushOptions(token, retries=push_retries, timeout=push_timeout), journal,
                                champion_url)
    return {"promoted": True, **result}


@task(name="rollback-champion", cache_policy=NO_CACHE)
def rollback_champion(tracking_uri: str, name: str, endpoints: Sequence[str], token: str, journal_dir: str,
                      lock_path: str | None = None, push_retries: int = 3, push_timeout: float = 30.0,
                      champion_url: str | None = None) -> dict[str, Any]:
    """Make previous-champion the champion again in the registry and on every replica, all or nothing,
    and publish it at `champion_url`."""
    registry = registry_at(tracking_uri, lock_path)
    return rollback_everywhere(registry, name, list(endpoints),
                               PushOptions(token, retries=push_retries, timeout=push_timeout), journal_dir,
                               champion_url)


def _bundle(registry: ReadoutRegistry, name: str, version: str, force: bool = False) -> tuple[bytes, str]:
    return readout_bundle(registry, name, version, force=force)


@task(name="push-champion", cache_policy=NO_CACHE)
def push_champion(tracking_uri: str, name: str, endpoints: Sequence[str], token: str,
                  version: str | None = None, retries: int = 3, timeout: float = 30.0,
                  lock_path: str | None = None) -> dict[str, Any]:
    """Push the champion (or `version`, the one about to become champion) to every replica.

    When a replica refuses it, replicas that already took it are put back on the current champion,
    and PushFailed is raised: no alias has moved, so registry and serving still agree. The push
    holds the alias lock, so no promotion moves the champion while it runs. The champion is pushed
    with `force` (replicas refuse an older version otherwise): what the registry names is what must
    serve; a `version` that is not the champion is pushed without it.
    """
    registry = registry_at(tracking_uri, lock_path)
    with registry.alias_lock.held():
        return _push_champion(registry, name, endpoints, token, version, retries, timeout)


def _push_champion(registry: ReadoutRegistry, name: str, endpoints: Sequence[str], token: str,
                   version: str | None, retries: int, timeout: float) -> dict[str, Any]:
    champion = registry.get_alias(name, CHAMPION)
    version = str(version or champion or "")
    if not version:
        raise LookupError(f"{name} has no champion to push")
    if not endpoints:
        return {"name": name, "version": version, "pushed": [], "note": "no endpoints configured"}
    bundle, expected = _bundle(registry, name, version, force=version == champion)
    old_bundle = old_expected = None
    if champion is not None and champion != version:  # fetched before any push: a revert needs no MLflow
        old_bundle, old_expected = _bundle(registry, name, champion, force=True)
    pushed: list[dict] = []
    for endpoint in endpoints:
        try:
            pushed.append(push_readout(endpoint, token, bundle, expected, retries=retries, timeout=timeout))
        except PushFailed as failure:
            reverted = []
            if old_bundle is not None:
                for done in pushed:
                    try:
                        push_readout(done["endpoint"], token, old_bundle, old_expected, retries=retries,
                                     timeout=timeout)
                        reverted.append(done["endpoint"])
                    except PushFailed:
                        pass
            stranded = [d["endpoint"] for d in pushed if d["endpoint"] not in reverted]
            message = str(failure)
            if reverted:
                message += f"; put back on champion v{champion}: {reverted}"
            if stranded:
                message += f"; still serving v{version} (no champion to return to): {stranded}"
            raise PushFailed(message, failure.endpoint, failure.status) from failure
    return {"name": name, "version": version, "readout_version": expected, "pushed": pushed}
