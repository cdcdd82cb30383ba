"""Promotion and rollback as one operation over the registry's aliases and every serving replica.

`promote(V)` ends either done (every replica serves V and `champion` names V, `previous-champion` the one
it replaced) or failed (`PromotionFailed`, with replicas and aliases restored), never between, so the
registry never names one readout while replicas serve another. `rollback()` is the same operation
towards `previous-champion`. It runs under the alias lock with a journal in the state folder, so a
process killed part-way is repaired by the next operation; nothing here changes serving except by a
verified push (`flows.push`). Once done, the champion is published (`leap_io.champion`) for replicas
that start later. Step by step: docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from flows.push import PushFailed, push_readout, serving_version
from leap_io.admin_client import AdminToken
from leap_io.durable import write_bytes_durably, write_text_durably
from leap_io.model_identity import serves
from leap_io.push_bundle import with_sequence
from registry.aliases import ALIASES, CHAMPION
from registry.client import ReadoutRegistry

PROMOTE = "promote"
ROLLBACK = "rollback"


class PromotionFailed(RuntimeError):
    """A promotion or rollback did not complete. `restored` says whether the earlier state (aliases
    and replicas) is back in full; `state` says what happened to each part."""

    def __init__(self, message: str, *, restored: bool, state: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.restored = restored
        self.state = dict(state)


@dataclass(frozen=True)
class PushOptions:
    """How replicas are pushed to: admin token, retries of each push and its timeout."""

    token: AdminToken
    retries: int = 3
    timeout: float = 30.0
    backoff_s: float = 0.5


def _reported(endpoint: str, options: PushOptions) -> str | None:
    """The version a replica reports, or None when it does not answer (after a few tries)."""
    for attempt in range(3):
        try:
            return serving_version(endpoint, options.token, timeout=min(options.timeout, 10.0))
        except (httpx.HTTPError, ValueError):
            time.sleep(options.backoff_s * 2 ** attempt)
    return None


# ---------------------------------------------------------------------------- the journal


class _Journal:
    """What an operation in flight has done, on disk, so that whoever comes next can undo it."""

    def __init__(self, folder: str | Path, name: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{name}.json"
        self.bundle_path = self.folder / f"{name}.previous.bundle"
        self.state: dict[str, Any] = {}

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict[str, Any]:
        self.state = json.loads(self.path.read_text())
        return self.state

    def previous_bundle(self) -> bytes | None:
        return self.bundle_path.read_bytes() if self.bundle_path.exists() else None

    def start(self, state: Mapping[str, Any], previous_bundle: bytes | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if previous_bundle is not None:
            write_bytes_durably(self.bundle_path, previous_bundle)
        else:
            self.bundle_path.unlink(missing_ok=True)
        self.update(**state)

    def update(self, **changes: Any) -> None:
        self.state.update(changes)
        write_text_durably(self.path, json.dumps(self.state, sort_keys=True, indent=1))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.bundle_path.unlink(missing_ok=True)



# ---------------------------------------------------------------------------- restoring


def _restore(registry: ReadoutRegistry, name: str, state: Mapping[str, Any], previous_bundle: bytes | None,
             options: PushOptions) -> dict[str, Any]:
    """Put back the state a journal recorded before its operation: replicas, then aliases.

    Returns what happened, with `complete` False when a retry could still restore more (an alias
    write or a push back failed, or a replica that may have taken the new readout does not answer).
    """
    expected, previous = state["expected"], state.get("previous_expected")
    outcome: dict[str, Any] = {"replicas_restored": [], "replicas_untouched": [], "replicas_not_restored": {},
                               "replicas_stranded": [], "aliases_restored": None, "alias_error": None}
    for endpoint in state["endpoints"]:
        reported = _reported(endpoint, options)
        if reported is None:
            if endpoint in state.get("attempted", []):
                outcome["replicas_not_restored"][endpoint] = "does not answer; it may serve the new readout"
            else:
                outcome["replicas_untouched"].append(endpoint)
            continue
        if not serves(reported, expected):
            outcome["replicas_untouched"].append(endpoint)
            continue
        if previous_bundle is None or not previous:
            outcome["replicas_stranded"].append(endpoint)  # no earlier champion to return it to
            continue
        try:
            push_readout(endpoint, options.token, previous_bundle, previous, retries=options.retries,
                         timeout=options.timeout, backoff_s=options.backoff_s)
            outcome["replicas_restored"].append(endpoint)
        except PushFailed as failure:
            outcome["replicas_not_restored"][endpoint] = str(failure)
    if state.get("aliases_touched"):
        try:
            registry.apply_aliases(name, {alias: state["before"].get(alias) for alias in ALIASES})
            outcome["aliases_restored"] = True
        except Exception as error:
            outcome["aliases_restored"] = False
            outcome["alias_error"] = f"{type(error).__name__}: {error}"
    outcome["complete"] = outcome["aliases_restored"] is not False and not outcome["replicas_not_restored"]
    return outcome


def _describe(outcome: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    parts = []
    if outcome["replicas_restored"]:
        parts.append(f"put back on v{state.get('previous')}: {outcome['replicas_restored']}")
    if outcome["replicas_stranded"]:
        parts.append(f"still serving v{state['version']} (there was no champion to return to): "
                     f"{outcome['replicas_stranded']}")
    if outcome["replicas_not_restored"]:
        parts.append(f"NOT restored: {outcome['replicas_not_restored']}")
    if outcome["aliases_restored"] is True:
        parts.append(f"aliases restored to {state['before']}")
    elif outcome["aliases_restored"] is False:
        parts.append(f"aliases NOT restored (still to be set back to {state['before']}): {outcome['alias_error']}")
    else:
        parts.append("no alias was moved")
    return "; ".join(parts)


def _recover(registry: ReadoutRegistry, name: str, journal: _Journal, options: PushOptions) -> dict | None:
    """Finish what an interrupted operation left (its journal): complete it if its aliases were all
    written and every replica serves it, else restore the state before it. Raises PromotionFailed
    when that cannot be done yet, so nothing new starts on top of it."""
    if not journal.exists():
        return None
    state = journal.load()
    current = registry.aliases(name)
    if state.get("aliases_touched") and all(current.get(alias) == state["target"].get(alias) for alias in ALIASES):
        reported = {endpoint: _reported(endpoint, options) for endpoint in state["endpoints"]}
        if all(serves(value or "", state["expected"]) for value in reported.values()):
            journal.remove()
            return {"recovered": "completed", "kind": state["kind"], "version": state["version"]}
    outcome = _restore(registry, name, state, journal.previous_bundle(), options)
    if not outcome["complete"]:
        journal.update(phase="restoring", last_restore=outcome)
        raise PromotionFailed(
            f"an earlier {state['kind']} of {name} to v{state['version']} was interrupted and its earlier state "
            f"could not be restored yet ({_describe(outcome, state)}); journal {journal.path}; nothing new was "
            "started, run the command again once MLflow and the replicas answer", restored=False,
            state={**state, **outcome})
    journal.remove()
    return {"recovered": "restored", "kind": state["kind"], "version": state["version"], **outcome}


# ---------------------------------------------------------------------------- the operation


class ChampionMoved(RuntimeError):
    """Another promotion changed the champion after the gate this one rests on."""


def next_publication(champion_url: str | Path | None, name: str) -> int | None:
    """The sequence number the next champion publication of `name` takes (None without a location, or when
    the location cannot be read now: the pushes then carry none and replicas fall back to clocks)."""
    if not champion_url:
        return None
    from leap_io.champion import ChampionPublication

    try:
        return ChampionPublication(champion_url).next_sequence(name)
    except Exception:
        return None


def publish_champion(champion_url: str | Path | None, name: str, bundle: bytes, readout_version: str,
                     version: str | int, registry_uri: str | None = None,
                     sequence: int | None = None) -> dict[str, Any] | None:
    """Publish `bundle` as the champion of `name` in the registry at `registry_uri` (`leap_io.champion`),
    as publication `sequence` (the one its pushes carried); None without a location, and the error
    instead of raising: the champion already serves and is named by the registry."""
    if not champion_url:
        return None
    from leap_io.champion import ChampionPublication
    from leap_io.settings import read_settings

    # replicas with its public key check it
    signing_key = (read_settings().champion_signing_key or "").strip() or None
    try:
        return ChampionPublication(champion_url).publish(name, bundle, readout_version, version, registry_uri,
                                                         signing_key=signing_key, sequence=sequence)
    except Exception as error:
        return {"location": str(champion_url), "error": f"{type(error).__name__}: {error}"}


def _change(registry: ReadoutRegistry, name: str, kind: str,
            target_of: Callable[[dict[str, str]], dict[str, str | None]], endpoints: Sequence[str],
            options: PushOptions, journal_dir: str | Path, champion_url: str | Path | None = None) -> dict[str, Any]:
    journal = _Journal(journal_dir, name)
    with registry.alias_lock.held():
        try:
            recovered = _recover(registry, name, journal, options)
            before = registry.aliases(name)
            target = target_of(before)
            version = str(target[CHAMPION])
            previous = before.get(CHAMPION)
            bundle, expected = registry.push_bundle(name, version, force=kind == ROLLBACK)
            sequence = next_publication(champion_url, name)
            if sequence is not None:  # the replicas keep it, and tell a later publication by it, not by clocks
                bundle = with_sequence(bundle, sequence)
            previous_bundle = previous_expected = None
            if previous is not None and previous != version:  # fetched now: putting it back needs no MLflow
                previous_bundle, previous_expected = registry.push_bundle(name, previous, force=True)
        except PromotionFailed:
            raise
        except Exception as error:
            raise PromotionFailed(f"{kind} of {name} did not start, nothing was changed: "
                                  f"{type(error).__name__}: {error}", restored=True, state={}) from error
        journal.start({"kind": kind, "name": name, "version": version, "expected": expected, "previous": previous,
                       "previous_expected": previous_expected, "before": before, "target": target,
                       "endpoints": list(endpoints), "attempted": [], "phase": "pushing",
                       "aliases_touched": False, "pid": os.getpid(), "started_at": time.time()},
                      previous_bundle)
        pushed: list[dict[str, Any]] = []
        try:
            for endpoint in endpoints:
                journal.update(attempted=[*journal.state["attempted"], endpoint])
                pushed.append(push_readout(endpoint, options.token, bundle, expected, retries=options.retries,
                                           timeout=options.timeout, backoff_s=options.backoff_s))
            journal.update(phase="aliases")
            changed = registry.apply_aliases(name, target,
                                             before_write=lambda: journal.update(aliases_touched=True))
        except Exception as error:
            outcome = _restore(registry, name, journal.state, previous_bundle, options)
            if outcome["complete"]:
                journal.remove()
            else:
                journal.update(phase="restoring", last_restore=outcome)
            where = "pushing to the replicas" if journal.state["phase"] == "pushing" else "moving the aliases"
            restored = outcome["complete"] and not outcome["replicas_stranded"]
            message = (f"{kind} of {name} to v{version} failed while {where}: {type(error).__name__}: {error}. "
                       + ("The earlier state is back: " if restored else "The earlier state is NOT fully back: ")
                       + _describe(outcome, journal.state))
            if not outcome["complete"]:
                message += f". Journal {journal.path}: the next promotion or rollback restores the rest first"
            raise PromotionFailed(message, restored=restored, state={**journal.state, **outcome}) from error
        journal.remove()
        published = publish_champion(champion_url, name, bundle, expected, version, registry.tracking_uri, sequence)
    return {"name": name, "version": version, "readout_version": expected, "champion": version,
            "replaced": previous if previous != version else None, "aliases": target, "aliases_changed": changed,
            "pushed": pushed, "recovered": recovered, "published": published}


UNCHECKED = object()
"""`promote(gated_against=...)` default: promote whatever the champion is now."""


def promote(registry: ReadoutRegistry, name: str, version: str | int, endpoints: Sequence[str],
            options: PushOptions, journal_dir: str | Path, champion_url: str | Path | None = None,
            gated_against: object = UNCHECKED) -> dict[str, Any]:
    """Make `version` the champion on every replica and in the registry, or fail with the earlier state
    restored (see the module docstring), then publish it at `champion_url`. Returns the pushes, the
    aliases written and the publication.

    `gated_against`: the champion (a version, or None for none) the gate judged `version` against. Under
    the alias lock the champion must still be that one, else nothing is changed and PromotionFailed says
    so: another promotion went first, and this gate's verdict is not about the champion it would replace."""
    def target(current: Mapping[str, str]) -> dict[str, str | None]:
        if gated_against is not UNCHECKED and current.get(CHAMPION) != gated_against:
            raise ChampionMoved(f"the champion is v{current.get(CHAMPION)} now; v{version}'s gate was against "
                                f"{'no champion' if gated_against is None else f'v{gated_against}'}: gate it again")
        return registry.promotion_target(current, version)

    result = _change(registry, name, PROMOTE, target, endpoints, options, journal_dir, champion_url)
    return {"status": "promoted", **result}


def rollback(registry: ReadoutRegistry, name: str, endpoints: Sequence[str], options: PushOptions,
             journal_dir: str | Path, champion_url: str | Path | None = None) -> dict[str, Any]:
    """Make `previous-champion` the champion again, in the registry AND on every replica, or fail with
    the earlier state restored, then publish it at `champion_url`. Raises PromotionFailed (from
    LookupError) when there is none."""
    result = _change(registry, name, ROLLBACK, lambda current: registry.rollback_target(name, current),
                     endpoints, options, journal_dir, champion_url)
    return {"status": "rolled-back", **result}


def recover(registry: ReadoutRegistry, name: str, options: PushOptions, journal_dir: str | Path) -> dict | None:
    """Undo (or complete) an operation a killed process left in the journal; None when there is none."""
    with registry.alias_lock.held():
        return _recover(registry, name, _Journal(journal_dir, name), options)
