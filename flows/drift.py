"""The drift watch: live prediction quality of every replica, and what to do when it slips.

The watch scrapes every replica's rolling per-domain figures (`/metrics`), keeps them in a small state
file, and decides per replica and domain: retrain when live error exceeds the champion's validation
error, reset RLS to its anchor when the online correction does worse than the anchor, or roll back when
the champion itself does worse than the previous one (only on every request, and only with the gate's
support). Each action has a cooldown, and a replica's figures restart at every push, so nothing is judged
twice on the same evidence. Findings, thresholds and precedence: docs/serving.md ("Drift watch").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.events import DRIFT_EVENT, announce_drift
from flows.settings import PipelineSettings
from leap_io.admin_client import READOUT_PATH, AdminClient, AdminToken
from leap_io.durable import write_text_durably
from leap_io.jsonable import dumps, to_jsonable

STATE_VERSION = 1
RETRAIN, RESET, ROLLBACK = "retrain", "reset", "rollback"
ALL = "all"  # the figures over every request, whatever domain its client named
GAUGES = {"leap:rolling_spearman": "spearman", "leap:rolling_mae_tokens": "mae",
          "leap:anchor_mae_tokens": "anchor_mae", "leap:rolling_requests": "rows"}
MAX_DECISIONS_KEPT = 200
MAX_DOMAINS_PER_REPLICA = 64


# ---------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class Observation:
    """One replica's figures for one domain at one scrape."""

    replica: str
    domain: str
    spearman: float
    mae: float
    anchor_mae: float
    rows: int
    version: str
    time: float
    generation: int = -1  # the replica's anchor generation (-1: not reported); figures restart at each

    @property
    def anchor_version(self) -> str:
        """The pushed readout the figures are of (a replica reports `<version>+rls<n>` once RLS corrected it)."""
        return base_version(self.version)

    @property
    def corrected(self) -> bool:
        return "+rls" in self.version

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Observation:
        return cls(replica=str(data["replica"]), domain=str(data["domain"]), spearman=_number(data["spearman"]),
                   mae=_number(data["mae"]), anchor_mae=_number(data["anchor_mae"]), rows=int(data["rows"]),
                   version=str(data["version"]), time=float(data["time"]),
                   generation=int(data.get("generation", -1)))


def base_version(version: str) -> str:
    return version.split("+rls", 1)[0]


def _number(value: Any) -> float:
    """A float, NaN for what is not a finite number (a gauge that was never set reads NaN too)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


class MetricsError(ValueError):
    """A replica's /metrics answer that is not Prometheus text with the quality gauges."""


def parse_quality(text: str, replica: str, version: str, now: float) -> list[Observation]:
    """The per-domain observations in a replica's Prometheus text (MetricsError when it does not parse).

    A domain needs all four gauges; one without them (its figures not computed yet) is left out.
    At most MAX_DOMAINS_PER_REPLICA domains are read (the replica caps its own, this guards the state).
    """
    from prometheus_client.parser import text_string_to_metric_families

    figures: dict[str, dict[str, float]] = {}
    generation = -1
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "leap:anchor_generation" and math.isfinite(sample.value):
                    generation = int(sample.value)
                field = GAUGES.get(sample.name)
                domain = sample.labels.get("domain")
                if field is None or not domain:
                    continue
                if domain not in figures and len(figures) >= MAX_DOMAINS_PER_REPLICA:
                    continue
                figures.setdefault(domain, {})[field] = sample.value
    except Exception as exc:
        raise MetricsError(f"{replica} /metrics is not Prometheus text: {type(exc).__name__}: {exc}") from exc
    observations = []
    for domain, values in sorted(figures.items()):
        if set(values) != set(GAUGES.values()) or not math.isfinite(values["rows"]) or values["rows"] < 0:
            continue
        observations.append(Observation(replica, domain, _number(values["spearman"]), _number(values["mae"]),
                                         _number(values["anchor_mae"]), int(values["rows"]), version, now,
                                         generation))
    return observations


# ---------------------------------------------------------------------------- the state file


class DriftState:
    """Observations per replica and domain (the last `keep`), cooldown clocks and recent decisions."""

    def __init__(self, data: Mapping[str, Any] | None = None, keep: int = 64) -> None:
        data = dict(data or {})
        self.keep = keep
        self.observations: dict[str, dict[str, list[Observation]]] = {
            replica: {domain: [Observation.from_dict(o) for o in series][-keep:] for domain, series in domains.items()}
            for replica, domains in (data.get("observations") or {}).items()}
        self.last_retrain_at: float | None = data.get("last_retrain_at")
        self.last_rollback_at: float | None = data.get("last_rollback_at")
        self.last_reset_at: dict[str, float] = dict(data.get("last_reset_at") or {})
        self.decisions: list[dict] = list(data.get("decisions") or [])[-MAX_DECISIONS_KEPT:]

    def add(self, observation: Observation) -> None:
        series = self.observations.setdefault(observation.replica, {}).setdefault(observation.domain, [])
        series.append(observation)
        del series[:-self.keep]

    def keep_replicas(self, replicas: Sequence[str]) -> list[str]:
        """Forget the replicas no longer watched (their figures judge nothing now); the ones dropped."""
        dropped = sorted(set(self.observations) - set(replicas))
        for replica in dropped:
            del self.observations[replica]
            self.last_reset_at.pop(replica, None)
        return dropped

    def series(self) -> Iterator[tuple[str, str, list[Observation]]]:
        for replica, domains in sorted(self.observations.items()):
            for domain, series in sorted(domains.items()):
                yield replica, domain, series

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "last_retrain_at": self.last_retrain_at,
                "last_rollback_at": self.last_rollback_at, "last_reset_at": self.last_reset_at,
                "observations": {r: {d: [asdict(o) for o in s] for d, s in ds.items()}
                                 for r, ds in self.observations.items()},
                "decisions": self.decisions[-MAX_DECISIONS_KEPT:]}


@contextlib.contextmanager
def state_file(path: Path, keep: int) -> Iterator[tuple[DriftState, dict[str, Any]]]:
    """The state under an exclusive lock (one watch at a time), written back atomically on success.

    Yields (state, notes); a file that does not parse is renamed aside and named in `notes`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    notes: dict[str, Any] = {}
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        data = None
        if path.exists():
            try:
                data = json.loads(path.read_text())
                state = DriftState(data, keep)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
                os.replace(path, aside)
                notes["state_set_aside"] = {"path": str(aside), "reason": f"{type(exc).__name__}: {exc}"}
                state = DriftState(None, keep)
        else:
            state = DriftState(None, keep)
        yield state, notes
        write_text_durably(path, dumps(to_jsonable(state.to_dict(), nonfinite="keep"), nonfinite="keep"))


# ---------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class DriftPolicy:
    """When the watch acts (see the module docstring); from `PipelineSettings.drift_*`."""

    margin: float = 0.25
    rls_margin: float = 0.10
    window: int = 3
    min_rows: int = 64
    cooldown_s: float = 3600.0

    @classmethod
    def from_settings(cls, settings: PipelineSettings) -> DriftPolicy:
        return cls(margin=settings.drift_margin, rls_margin=settings.drift_rls_margin, window=settings.drift_window,
                   min_rows=settings.drift_min_rows, cooldown_s=settings.drift_cooldown_s)


@dataclass(frozen=True)
class Baseline:
    """The champion the live figures are judged against."""

    champion: str | None  # registered version
    champion_readout: str | None  # its readout version, as replicas report it
    validation_mae: float | None
    previous_readout: str | None = None  # the previous champion's readout version
    validation_mae_by_domain: Mapping[str, float] | None = None  # where the fit had enough rows of one
    previous_champion: str | None = None  # its registered version

    def bar(self, domain: str) -> float | None:
        """The validation MAE a domain's live MAE is judged against: the domain's own, else the overall."""
        from training.fit import domain_mae_metric

        own = (self.validation_mae_by_domain or {}).get(domain_mae_metric(domain))
        return own if own is not None and math.isfinite(own) else self.validation_mae


def _window(series: Sequence[Observation], policy: DriftPolicy, now: float) -> list[Observation] | None:
    """The last `window` observations when the newest is of this scrape (`now`), all are of one anchor
    generation and each is over enough requests; else None."""
    last = list(series[-policy.window:])
    if (len(last) < policy.window or last[-1].time != now or len({o.generation for o in last}) != 1
            or any(o.rows < policy.min_rows or math.isnan(o.mae) for o in last)):
        return None
    return last


def _cooling(last_at: float | None, now: float, policy: DriftPolicy) -> bool:
    return last_at is not None and now - last_at < policy.cooldown_s


def _round(value: float) -> float:
    return round(value, 3) if math.isfinite(value) else value


def decide(state: DriftState, baseline: Baseline, policy: DriftPolicy, now: float) -> list[dict[str, Any]]:
    """What to do about the observations kept: one decision per finding, each with its reason.

    A decision has `action` (retrain, reset, rollback), `acted` (False when a cooldown or a stronger
    action this run holds it back), `replica`, `domain` and `reason`. Pure: the caller carries them out.
    """
    if baseline.champion is None or not baseline.champion_readout:
        return []
    findings: list[dict[str, Any]] = []
    for replica, domain, series in state.series():
        last = _window(series, policy, now)
        if last is None or any(o.anchor_version != baseline.champion_readout for o in last):
            continue  # not enough requests yet, or the window spans another readout than the champion
        where = {"replica": replica, "domain": domain, "version": last[-1].version,
                 "rows": [o.rows for o in last], "mae": [_round(o.mae) for o in last],
                 "anchor_mae": [_round(o.anchor_mae) for o in last]}
        if all(o.corrected and o.anchor_mae >= 0 and o.mae > o.anchor_mae * (1 + policy.rls_margin) for o in last):
            findings.append({"action": RESET, **where, "reason": (
                f"the online-corrected readout's MAE exceeds its anchor's by more than {policy.rls_margin:.0%} "
                f"in each of the last {policy.window} observations")})
            continue
        previous = [o for o in series if baseline.previous_readout and o.anchor_version == baseline.previous_readout
                    and o.rows >= policy.min_rows and not math.isnan(o.anchor_mae)]
        if previous:
            before = sorted(o.anchor_mae for o in previous)[len(previous) // 2]
            if all(o.anchor_mae > before * (1 + policy.margin) for o in last):
                findings.append({"action": ROLLBACK, **where, "previous_anchor_mae": _round(before), "reason": (
                    f"champion v{baseline.champion}'s anchor MAE exceeds the previous champion's "
                    f"({before:.1f} on this replica and domain) by more than {policy.margin:.0%} in each of the "
                    f"last {policy.window} observations")})
                continue
        bar = baseline.bar(domain)
        if bar is not None and math.isfinite(bar) and all(o.mae > bar * (1 + policy.margin) for o in last):
            findings.append({"action": RETRAIN, **where, "validation_mae": _round(bar), "reason": (
                f"live MAE exceeds champion v{baseline.champion}'s validation MAE"
                f"{' on this domain' if bar != baseline.validation_mae else ''} ({bar:.1f}) by more than "
                f"{policy.margin:.0%} in each of the last {policy.window} observations")})
    rollback_due = (any(f["action"] == ROLLBACK and f["domain"] == ALL for f in findings)
                    and not _cooling(state.last_rollback_at, now, policy))
    taken: set[tuple[str, str]] = set()
    for finding in findings:
        action, replica = finding["action"], finding["replica"]
        key = (action, replica if action == RESET else "")
        if action == ROLLBACK and finding["domain"] != ALL:
            held = ("a fleet-wide rollback needs the champion worse on every request (domain 'all'), "
                    "not on one domain a client names")
        elif action == ROLLBACK:
            held = "rollback cooldown" if not rollback_due else None
        elif rollback_due:
            held = "a rollback this run re-anchors every replica"
        elif action == RESET:
            held = "reset cooldown" if _cooling(state.last_reset_at.get(replica), now, policy) else None
        else:
            held = "retrain cooldown" if _cooling(state.last_retrain_at, now, policy) else None
        if held is None and key in taken:
            held = f"one {action} per run" + (" and replica" if action == RESET else "")
        finding["acted"] = held is None
        if held is None:
            taken.add(key)
        else:
            finding["held_back"] = held
    return findings


# ---------------------------------------------------------------------------- tasks


@task(name="scrape-replica", cache_policy=NO_CACHE)
def scrape_replica(endpoint: str, token: AdminToken, timeout: float, now: float) -> dict[str, Any]:
    """One replica's readout (version, model, layer) and per-domain observations, stamped `now` (the
    watch's pass, so its decisions judge exactly what this pass saw); `error` when it fails."""
    try:
        with AdminClient(endpoint, token, timeout) as admin:
            described = admin.readout()
            described.raise_for_status()
            info = described.json()
            if not isinstance(info, dict):
                raise MetricsError(f"{endpoint} {READOUT_PATH} is not a JSON object")
            version = str(info.get("version") or "")
            metrics = admin.metrics()
            metrics.raise_for_status()
            observations = parse_quality(metrics.text, endpoint, version, now)
    except (httpx.HTTPError, ValueError) as exc:
        return {"endpoint": endpoint, "error": f"{type(exc).__name__}: {exc}"}
    layer = info.get("layer")
    return {"endpoint": endpoint, "version": version, "model_id": info.get("model_id"),
            "layer": layer if isinstance(layer, int) and not isinstance(layer, bool) else None,
            "observations": [asdict(o) for o in observations]}


@task(name="champion-baseline", cache_policy=NO_CACHE)
def champion_baseline(settings: PipelineSettings, name: str) -> dict[str, Any]:
    """The champion's registered version, readout version and validation MAE; the previous champion's
    readout version (None values where there is none)."""
    from flows.tasks import registry_of
    from registry.aliases import CHAMPION, PREVIOUS_CHAMPION

    registry = registry_of(settings)
    aliases = registry.aliases(name)
    champion = aliases.get(CHAMPION)
    if champion is None:
        return asdict(Baseline(None, None, None))
    metrics = registry.version_metrics(name, champion)
    readout = str(registry.load_readout(name, champion).metadata.get("version", ""))
    previous = aliases.get(PREVIOUS_CHAMPION)
    previous_readout = (str(registry.load_readout(name, previous).metadata.get("version", ""))
                        if previous is not None else None)
    mae = metrics.get("mae")
    by_domain = {key: float(value) for key, value in metrics.items() if key.startswith("mae_domain_")}
    return asdict(Baseline(str(champion), readout, float(mae) if mae is not None else None, previous_readout,
                           by_domain or None, None if previous is None else str(previous)))


@task(name="start-retrain", cache_policy=NO_CACHE)
def start_retrain(deployment: str | None) -> dict[str, Any]:
    """Run the retrain deployment (queued under its concurrency limit) when named, else the retrain flow here."""
    if deployment:
        from prefect.deployments import run_deployment

        run = run_deployment(deployment, timeout=0)
        return {"started": "deployment", "deployment": deployment, "flow_run_id": str(run.id)}
    from flows.pipeline import retrain_flow

    result = retrain_flow()
    return {"started": "flow", "status": result.get("status"), "result": result}


# ---------------------------------------------------------------------------- the flow


def _model_name(scrapes: Sequence[Mapping[str, Any]], name: str | None) -> str | None:
    if name:
        return name
    from registry.client import ReadoutRegistry

    for scrape in scrapes:
        if scrape.get("model_id") and scrape.get("layer") is not None:
            return ReadoutRegistry.model_name(str(scrape["model_id"]), int(scrape["layer"]))
    return None


def rollback_evidence(settings: PipelineSettings, name: str, baseline: Baseline) -> dict[str, Any]:
    """The gate's verdict on a rollback: the previous champion replayed as the challenger against the
    champion, passed when better or no worse within `gate_noninferiority`, and fair to long requests;
    recorded like any gate."""
    from flows.tasks import record_gate, registry_uri, run_gate
    from leap_core.gate_verdict import gate_verdict
    from store.stores import store_location

    if baseline.previous_champion is None or baseline.champion is None:
        return {"passed": False, "reason": "no previous champion is registered"}
    try:
        gate = run_gate(settings, name, baseline.previous_champion, baseline.champion)
    except Exception as exc:
        return {"passed": False, "reason": f"the gate could not replay: {type(exc).__name__}: {exc}"}
    verdict = gate_verdict(gate["results"], margin=0.0, p95_bound=settings.gate_p95_bound,
                           on_no_difference="noninferior", noninferiority=settings.gate_noninferiority)
    logged = record_gate(store_location(settings), registry_uri(settings), name, baseline.previous_champion,
                         baseline.champion, gate["results"], verdict)
    return {**verdict, "gate_run_id": logged["gate_run_id"]}


def _carry_out(decision: dict[str, Any], settings: PipelineSettings, name: str, state: DriftState,
               now: float, baseline: Baseline) -> None:
    """Act on one decision; its outcome (or the error) is written into it. Never raises."""
    action = decision["action"]
    try:
        from flows.tasks import push_champion, registry_uri, rollback_champion

        if action == RETRAIN:
            state.last_retrain_at = now  # a retrain that fails is not retried before the cooldown either
            decision["outcome"] = start_retrain(settings.drift_retrain_deployment)
        elif action == RESET:
            state.last_reset_at[decision["replica"]] = now
            decision["outcome"] = push_champion(registry_uri(settings), name, [decision["replica"]],
                                                settings.admin_tokens(), retries=settings.push_retries,
                                                timeout=settings.push_timeout_s,
                                                lock_path=settings.alias_lock_location)
        elif action == ROLLBACK:
            state.last_rollback_at = now  # a replay that holds it back is not repeated before the cooldown
            if settings.drift_rollback_gate:
                decision["gate"] = rollback_evidence(settings, name, baseline)
                if not decision["gate"]["passed"]:
                    decision["acted"] = False
                    decision["held_back"] = f"the gate's evidence does not support it: {decision['gate']['reason']}"
                    return
            decision["outcome"] = rollback_champion(registry_uri(settings), name, settings.endpoints,
                                                    settings.admin_tokens(), str(settings.promotion_journal_dir),
                                                    settings.alias_lock_location, settings.push_retries,
                                                    settings.push_timeout_s)
        decision["done"] = True
    except Exception as exc:
        decision["done"] = False
        decision["error"] = f"{type(exc).__name__}: {exc}"


@flow(name="leap-drift-watch")
def drift_flow(name: str | None = None, act: bool = True, retrain_by_event: bool = False) -> dict[str, Any]:
    """Scrape every replica's quality figures, record them, and retrain, reset or roll back as they call for.

    `name`: the registered model (default: the one the replicas report serving). `act` False only
    reports the decisions. A retrain it acts on is announced as a Prefect event (`flows.events`);
    `retrain_by_event` leaves that retrain to the deployment trigger on the event. Returns the
    observations, every decision with its reason and outcome, and the counts `drift_events` (findings,
    acted on or held back), `retrains`, `resets` and `rollbacks` (readouts put back: resets and alias
    rollbacks carried out).
    """
    settings = PipelineSettings()
    policy = DriftPolicy.from_settings(settings)
    now = time.time()
    token = settings.admin_tokens()
    scrapes = [scrape_replica(endpoint, token, settings.drift_scrape_timeout_s, now) for endpoint in settings.endpoints]
    unreachable = {s["endpoint"]: s["error"] for s in scrapes if "error" in s}
    name = _model_name(scrapes, name)
    result: dict[str, Any] = {"status": "watched", "name": name, "replicas": len(settings.endpoints),
                              "unreachable": unreachable, "policy": asdict(policy)}
    baseline, registry_error = Baseline(None, None, None), None
    if name is not None:
        try:
            baseline = Baseline(**champion_baseline(settings, name))
        except Exception as exc:
            registry_error = f"{type(exc).__name__}: {exc}"
    with state_file(settings.drift_state_path, settings.drift_history) as (state, notes):
        forgotten = state.keep_replicas(settings.endpoints)
        if forgotten:
            notes["replicas_forgotten"] = forgotten
        observed = []
        for scrape in scrapes:
            for data in scrape.get("observations", []):
                observation = Observation.from_dict(data)
                state.add(observation)
                observed.append(asdict(observation))
        decisions = decide(state, baseline, policy, now) if registry_error is None else []
        for decision in decisions:
            decision["time"] = now
            if act and decision["acted"] and decision["action"] == RETRAIN:
                decision["event_id"] = announce_drift(name, decision, retrain_by_event)
                if retrain_by_event:
                    state.last_retrain_at = now
                    decision.update(outcome={"started": "event", "event": DRIFT_EVENT}, done=True)
                    continue
            if act and decision["acted"]:
                _carry_out(decision, settings, name, state, now, baseline)
        state.decisions.extend(decisions)
        result.update(notes)
    done = [d for d in decisions if d.get("done")]
    result.update({
        "baseline": asdict(baseline), "registry_error": registry_error, "observations": observed,
        "decisions": decisions, "drift_events": len(decisions),
        "retrains": sum(d["action"] == RETRAIN for d in done), "resets": sum(d["action"] == RESET for d in done),
        "rollbacks": sum(d["action"] in (RESET, ROLLBACK) for d in done),
        "failed": sum(d.get("done") is False for d in decisions), "state_path": str(settings.drift_state_path)})
    if name is None:
        result["status"] = "no-replica-answered" if unreachable else "no-model"
    get_run_logger().info("drift watch: %d observations, %d findings, %d acted on", len(observed), len(decisions),
                          len(done))
    return to_jsonable(result, nonfinite="keep")
