"""The steps of the retraining loop as small Prefect tasks, each safe to run again.

Rerunning any step converges instead of duplicating: ingest skips segments already in the ledger, a fit
on the same rows with the same settings returns the version registered before, a recorded gate is
found by its content key, promotion only happens on a passing verdict and is all or nothing across
the registry and the replicas (`flows.promotion`), and a push is verified by the version the replica
reports. Registry calls are retried with backoff by the registry client and then fail loudly; every
task that writes an alias or pushes takes the alias lock (`lock_path`). Tasks whose inputs are feature
arrays skip Prefect's input hashing (NO_CACHE), which would otherwise hash megabytes per call.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.promotion import UNCHECKED, PushOptions
from flows.promotion import promote as promote_everywhere
from flows.promotion import rollback as rollback_everywhere
from flows.push import PushFailed, push_readout
from flows.settings import PipelineSettings, resolved_model_path
from flows.shadow import shadow_evidence
from harness.gate_replay import replay_gate
from leap_core.gate_verdict import gate_verdict
from leap_core.readout import LinearReadout
from leap_core.rls import RLS
from leap_io.admin_client import AdminToken
from leap_io.jsonable import dumps, to_jsonable
from leap_io.s3_locations import is_object_url
from registry.aliases import CHAMPION
from registry.client import ReadoutRegistry
from registry.locking import is_postgres_location
from registry.lookups import ROWS_UNTIL_TAG
from store.duckdb import TrainingFrame
from store.ingest import IngestReport, SegmentSource, complete_segments, ingest_folder, ingest_segments, totals
from store.stores import Store, open_store, store_at
from training.fit import NotEnoughRowsError, fit_readout, select_window, time_split
from training.spec import FeatureSpace, FitSpec, content_key, rows_until


def plain(value: Any) -> Any:
    """numpy scalars and arrays as JSON values, recursively (flow results must be JSON-able); NaN stays NaN."""
    return to_jsonable(value, nonfinite="keep")


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


# ---------------------------------------------------------------------------- the registry

def _journal_home(lock_path: str | None, registry: ReadoutRegistry) -> Path:
    """Beside a file lock; a lock in PostgreSQL has no folder, so then the temporary folder."""
    location = lock_path or registry.alias_lock.path
    if is_postgres_location(str(location)):
        return Path(tempfile.gettempdir()) / "leap"
    return Path(location).parent


def registry_at(tracking_uri: str, lock_path: str | None = None) -> ReadoutRegistry:
    """The registry client of a task; `lock_path` is the alias lock every alias writer shares."""
    return ReadoutRegistry(tracking_uri, lock_path=lock_path)


def registry_uri(settings: PipelineSettings) -> str:
    """Where the flows of `settings` find the registry: what every task that reads or writes it is given."""
    return settings.mlflow_tracking_uri


def registry_of(settings: PipelineSettings) -> ReadoutRegistry:
    """The registry of `settings`, its alias writes under the settings' alias lock."""
    return registry_at(registry_uri(settings), settings.alias_lock_location)


# ---------------------------------------------------------------------------- tasks

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


@task(name="prune-registry", cache_policy=NO_CACHE)
def prune_registry(tracking_uri: str, name: str, keep_last: int, lock_path: str | None = None) -> dict[str, Any]:
    """Delete the versions of `name` no alias names beyond the newest `keep_last`, with their artifacts."""
    return registry_at(tracking_uri, lock_path).prune_versions(name, keep_last)


@task(name="compact-feature-files", cache_policy=NO_CACHE)
def compact_feature_files(store_location: str, below_rows: int) -> dict[str, Any]:
    """Rewrite the DuckDB store's small feature files into large ones (`store.compaction`)."""
    from store.compaction import compact_features

    return compact_features(store_at(store_location), small_rows=below_rows, target_rows=max(10 * below_rows, 2))


@task(name="prune-feedback", cache_policy=NO_CACHE)
def prune_feedback(store_location: str, feedback_dir: str, retention_days: float,
                   s3_endpoint_url: str | None = None) -> dict[str, int]:
    """Remove the segments whose rows are all in the store, ingested `retention_days` ago or more
    (`store.retention.prune_ingested`)."""
    from store.retention import prune_ingested

    sources = complete_segments(feedback_dir, endpoint_url=s3_endpoint_url)
    return prune_ingested(store_at(store_location), sources, older_than_s=retention_days * 86_400.0)


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
                           domains: list[str] | None, min_rows: int, max_rows: int | None = None) -> TrainingFrame:
    """The finished requests of one feature space (fingerprint, layer and capture recipe) arriving in
    [since, until), at most about the newest `max_rows` of them."""
    store = store_at(store_location)
    filters = dict(until=until, domains=domains, model_fingerprint=space.model_fingerprint, layer=space.layer,
                   recipe=space.recipe)
    if max_rows is not None:
        cutoff = store.newest_since(max_rows, since=since, **filters)
        since = cutoff if cutoff is not None and (since is None or cutoff > since) else since
    return select_window(store, since=since, min_rows=min_rows, **filters)


def _target_candidates(champion: LinearReadout | None, target: str,
                       targets: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
    """(the target, the candidates to validate): with a champion its target, no choice (a candidate list
    without it is refused: serving would refuse the challenger); without one, `targets` as given."""
    if not targets:
        return target, ()
    if champion is None:
        return targets[0], tuple(dict.fromkeys(targets))
    if str(champion.target) not in targets:
        raise ValueError(f"the champion's target is {str(champion.target)!r}, not a candidate of {list(targets)}: "
                         "a challenger in another target would be refused")
    return str(champion.target), ()


def _champion_readout(registry: ReadoutRegistry, name: str) -> LinearReadout | None:
    return registry.load_readout(name, CHAMPION) if registry.get_alias(name, CHAMPION) is not None else None


def _output_budget(champion: LinearReadout | None, target: str, max_tokens: int | None,
                   fallback_max_tokens: int | None) -> int:
    """The budget asked for, else the champion's, else the window's: serving refuses a readout whose
    budget or target differs from the champion's, so a challenger must match them to be pushable."""
    champion_budget = champion_target = None
    if champion is not None:
        champion_budget, champion_target = int(champion.max_tokens), str(champion.target)
    budget = max_tokens or champion_budget or fallback_max_tokens
    if budget is None:
        raise ValueError("no output budget: set LEAP_MAX_TOKENS (no champion and no max_tokens in the window)")
    if champion_target is not None and champion_target != target:
        raise ValueError(f"the champion's target is {champion_target!r}; a {target!r} challenger would be refused")
    return int(budget)


def _rows_after(registry: ReadoutRegistry, name: str, champion: str, frame: TrainingFrame) -> TrainingFrame:
    """The rows of `frame` the champion's RLS state does not hold yet: those after its cut, if it has one."""
    cut = registry.information_until(name, champion)
    if cut is None:
        return frame
    frame = frame.take(np.asarray(frame.arrival_time) > cut)
    if len(frame.request_ids) < 2:
        raise NotEnoughRowsError(f"the champion v{champion} already holds every row of the window that "
                                 f"arrived up to {cut:.3f}; {len(frame.request_ids)} arrived after")
    return frame


@task(name="fit-and-register", cache_policy=NO_CACHE)
def fit_and_register(frame: TrainingFrame, tracking_uri: str, space: FeatureSpace, alpha: str | float = "auto",
                     target: str = "sqrt", max_tokens: int | None = None, test_fraction: float = 0.2,
                     window: Mapping[str, Any] | None = None, fallback_max_tokens: int | None = None,
                     lock_path: str | None = None, anchor: str = "none",
                     recipes: Sequence[str] | None = None, targets: Sequence[str] | None = None) -> dict[str, Any]:
    """Fit a readout on `frame`, register it and point `challenger` at it.

    anchor "champion": correct the champion's RLS state with the window's training rows (one exact
    batch update, equal to a ridge solve on the champion's rows and these), so a window smaller than
    the champion's training set refines it instead of replacing it; with no champion, a plain fit.

    recipes: candidate feature recipes; those the capture recipe of the rows (`space.recipe`) covers
    are validated on the newest rows of the training split and the best is fitted (`fit_readout`).
    The run logs them (`recipe_candidates`, and `recipe_candidates_not_covered`), the validation table
    (`recipe_validation.json`, an MLflow table) and the chosen recipe's `validation_spearman`. None,
    none covered, or an anchored fit (the champion fixes the recipe): the capture recipe, no choice.
    targets: candidate regression targets, validated with the recipes (each pair a row of the table) while
    no champion exists; a champion fixes the target (serving refuses another), so then it is used if it is
    a candidate and the fit is refused if it is not. None: `target`.

    A fit of the same rows with the same settings returns the version registered then (the alias is
    set again unless that version is already the champion). The output budget defaults to the
    champion's, since serving refuses a readout whose budget or target differs from the one it runs.
    """
    alpha = "auto" if str(alpha).strip().lower() == "auto" else float(alpha)
    registry = registry_at(tracking_uri, lock_path)
    name = registry.model_name(space.model_id, space.layer)
    champion_readout = _champion_readout(registry, name)
    target, targets = _target_candidates(champion_readout, target, targets)
    budget = _output_budget(champion_readout, target, max_tokens, fallback_max_tokens)
    if anchor not in ("none", "champion"):
        raise ValueError(f"anchor must be 'none' or 'champion', got {anchor!r}")
    champion = registry.get_alias(name, CHAMPION)
    anchored = champion if anchor == "champion" else None
    if anchored is not None:  # the champion's RLS state already holds the rows up to its cut: add only later ones
        frame = _rows_after(registry, name, anchored, frame)
    spec = FitSpec.of(frame, space, alpha=alpha, target=target, max_tokens=budget, test_fraction=test_fraction,
                      anchor=anchored, recipes=recipes, targets=targets)
    found = registry.find_fit(name, spec.key)
    if found is not None:
        if found.version != champion:
            registry.set_challenger(name, found.version)
        return {"name": name, "version": found.version, "run_id": found.run_id, "reused": True,
                "fit_key": spec.key, "window_hash": spec.rows_hash, "rows": len(frame.request_ids),
                "champion": champion, "recipe": found.params.get("recipe", space.recipe), "metrics": found.metrics}
    return _fit_new(registry, name, frame, spec, window, champion)


def _fit_new(registry: ReadoutRegistry, name: str, frame: TrainingFrame, spec: FitSpec,
             window: Mapping[str, Any] | None, champion: str | None) -> dict[str, Any]:
    """Fit `spec` on `frame`, register the readout with its RLS state and make it the challenger."""
    space = spec.space
    train, test = time_split(frame, spec.test_fraction)
    readout_version = spec.readout_version()
    anchor_rls = None
    if spec.anchor is not None:
        anchor_rls = registry.load_rls_state(name, spec.anchor)
        if anchor_rls is None:
            raise ValueError(f"champion {spec.anchor} of {name} has no RLS state to anchor at")
    fit = fit_readout(train, test, alpha=spec.alpha, target=spec.target, max_tokens=spec.max_tokens,
                      model_id=space.model_id, model_fingerprint=space.model_fingerprint, layer=space.layer,
                      version=readout_version, anchor=anchor_rls, capture_recipe=space.recipe,
                      recipes=list(spec.recipes) or None, targets=list(spec.targets) or None)
    record = spec.record(fit, window)
    until = {ROWS_UNTIL_TAG: cut} if (cut := rows_until(train)) else {}
    logged = registry.log_readout(fit.readout, rls=RLS.from_state_arrays(fit.readout, dict(fit.rls_state)),
                                  params=record.params, metrics=record.metrics, eval_arrays=fit.eval_arrays,
                                  run_name=f"fit-{readout_version}", tags={"fit_key": spec.key, **until},
                                  validation=record.validation, version_tags=until)
    registry.set_challenger(name, logged.version)
    return {"name": name, "version": logged.version, "run_id": logged.run_id, "reused": False,
            "fit_key": spec.key, "window_hash": spec.rows_hash, "rows": len(frame.request_ids),
            "readout_version": readout_version, "champion": champion, "recipe": record.params["recipe"],
            "validation": plain(record.validation),
            "metrics": plain({k: v for k, v in record.metrics.items() if isinstance(v, (int, float, np.number))})}


def _readout_pair(registry: ReadoutRegistry, name: str, version: str):
    readout = registry.load_readout(name, version)
    rls = registry.load_rls_state(name, version, readout=readout)
    return readout, (rls.state_arrays() if rls is not None else None)


@task(name="run-gate", cache_policy=NO_CACHE)
def run_gate(settings: PipelineSettings, name: str, challenger: str, champion: str | None) -> dict[str, Any]:
    """Replay one slice of served prompts with recorded lengths under FCFS, champion and challenger, on the
    step clock with counterbalanced repeats, and decide (`harness.gate_replay`, `leap_core.gate_verdict`),
    with the challenger's live figures where replicas held it in shadow (`flows.shadow`)."""
    from harness.engine import EngineSettings

    registry = registry_of(settings)
    readouts = {"challenger": _readout_pair(registry, name, challenger),
                "champion": _readout_pair(registry, name, champion) if champion is not None else None}
    fingerprint = str(readouts["challenger"][0].metadata.get("model_fingerprint") or "") or None
    if settings.gate_prompts is not None:
        from harness.datasets import load_prompts

        prompts = load_prompts(settings.gate_prompts)
    else:
        from harness.datasets import available_prompts

        prompts = available_prompts()
    chosen, lengths = gate_slice(open_store(settings), prompts, settings.replay_slice * settings.gate_blocks,
                                 settings.replay_seed, fingerprint, held_out_fraction=settings.test_fraction)
    engine = EngineSettings(model=str(resolved_model_path(settings)), max_model_len=settings.max_model_len,
                            seed=settings.replay_seed)
    replayed = replay_gate(engine, chosen, lengths, readouts, settings.replay_rate, settings.replay_seed,
                           repeats=settings.gate_repeats, load=settings.gate_load,
                           decode_slots=settings.gate_decode_slots, blocks=settings.gate_blocks)
    shadow = {"figures": None, "reason": "no champion served beside a shadow"}
    if champion is not None:
        shadow = shadow_evidence(open_store(settings), readouts["challenger"][0], settings.gate_shadow_min_rows,
                                 seed=settings.replay_seed)
    verdict = gate_verdict(replayed["results"], settings.gate_margin, settings.gate_p95_bound,
                           settings.gate_on_no_difference, settings.gate_noninferiority, shadow=shadow["figures"])
    return {**replayed, "verdict": {**verdict, "step_model": replayed["step_model"],
                                    "shadow_evidence": {k: v for k, v in shadow.items() if k != "figures"}}}


@task(name="record-gate", cache_policy=NO_CACHE)
def record_gate(store_location: str, tracking_uri: str, name: str, challenger: str, champion: str | None,
                results: Mapping[str, Any], verdict: Mapping[str, Any]) -> dict[str, Any]:
    """Log the gate to MLflow (run + tags on the challenger version) and to the `gates` table, once."""
    results, verdict = plain(results), plain(verdict)
    gate_key = content_key({"name": name, "challenger": challenger, "champion": champion, "results": results,
                            "verdict": verdict})
    store = store_at(store_location)
    found, recorded_run = store.gate_run(gate_key)
    if found:
        return {"gate_key": gate_key, "gate_run_id": recorded_run, "recorded": False}

    registry = registry_at(tracking_uri)
    run_id = registry.find_gate(gate_key)  # logged before a crash that kept the store's row from being written
    if run_id is None:
        run_id = registry.log_gate(name, challenger, champion, results, verdict, tags={"gate_key": gate_key})
    store.record_gate(gate_key, datetime.now(UTC).replace(tzinfo=None), name, str(challenger),
                      None if champion is None else str(champion), bool(verdict["passed"]),
                      dumps(verdict, nonfinite="keep"), dumps(results, nonfinite="keep"), run_id)
    return {"gate_key": gate_key, "gate_run_id": run_id, "recorded": True}


@task(name="promote-if-passed", cache_policy=NO_CACHE)
def promote_if_passed(tracking_uri: str, name: str, version: str, verdict: Mapping[str, Any],
                      endpoints: Sequence[str] = (), token: AdminToken = None, journal_dir: str | None = None,
                      lock_path: str | None = None, push_retries: int = 3, push_timeout: float = 30.0,
                      champion_url: str | None = None, gated_against: object = UNCHECKED) -> dict[str, Any]:
    """On a passing verdict, make `version` the champion on every replica of `endpoints` and in the
    registry, all or nothing (`flows.promotion.promote`, which raises PromotionFailed with the
    earlier state restored), and publish it at `champion_url`; otherwise leave every alias and
    replica alone. `gated_against`: the champion the verdict judged against, which must still be the
    champion when the alias lock is held."""
    registry = registry_at(tracking_uri, lock_path)
    if not verdict.get("passed", False):
        return {"promoted": False, "champion": registry.get_alias(name, CHAMPION),
                "reason": verdict.get("reason", "the gate did not pass")}
    journal = journal_dir or str(_journal_home(lock_path, registry) / "promotions")
    result = promote_everywhere(registry, name, version, list(endpoints),
                                PushOptions(token, retries=push_retries, timeout=push_timeout), journal,
                                champion_url, gated_against)
    return {"promoted": True, **result}


@task(name="rollback-champion", cache_policy=NO_CACHE)
def rollback_champion(tracking_uri: str, name: str, endpoints: Sequence[str], token: AdminToken, journal_dir: str,
                      lock_path: str | None = None, push_retries: int = 3, push_timeout: float = 30.0,
                      champion_url: str | None = None) -> dict[str, Any]:
    """Make previous-champion the champion again in the registry and on every replica, all or nothing,
    and publish it at `champion_url`."""
    registry = registry_at(tracking_uri, lock_path)
    return rollback_everywhere(registry, name, list(endpoints),
                               PushOptions(token, retries=push_retries, timeout=push_timeout), journal_dir,
                               champion_url)


@task(name="push-champion", cache_policy=NO_CACHE)
def push_champion(tracking_uri: str, name: str, endpoints: Sequence[str], token: AdminToken,
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


def _push_champion(registry: ReadoutRegistry, name: str, endpoints: Sequence[str], token: AdminToken,
                   version: str | None, retries: int, timeout: float) -> dict[str, Any]:
    champion = registry.get_alias(name, CHAMPION)
    version = str(version or champion or "")
    if not version:
        raise LookupError(f"{name} has no champion to push")
    if not endpoints:
        return {"name": name, "version": version, "pushed": [], "note": "no endpoints configured"}
    bundle, expected = registry.push_bundle(name, version, force=version == champion)
    old_bundle = old_expected = None
    if champion is not None and champion != version:  # fetched before any push: a revert needs no MLflow
        old_bundle, old_expected = registry.push_bundle(name, champion, force=True)
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
