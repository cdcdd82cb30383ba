"""The aliases that promote readouts: `challenger` waits for the gate, `champion` serves, and
`previous-champion` keeps the last good version one step away for a rollback.

Every alias write holds the registry's alias lock (`registry.locking`), so the writers of one host
queue instead of interleaving.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from registry.calls import RegistryError
from registry.locking import AliasLockHandle

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous-champion"

ALIASES = (CHAMPION, PREVIOUS_CHAMPION, CHALLENGER)
"""Every alias LEAP writes, in the order a change of several writes them: champion first."""


class AliasMixin:
    """Reading and moving the aliases of a registered model (part of `registry.client.ReadoutRegistry`)."""

    client: Any
    alias_lock: AliasLockHandle

    def set_alias(self, name: str, alias: str, version: str | int) -> None:
        with self.alias_lock.held():
            self.client.set_registered_model_alias(name, alias, str(version))

    def get_alias(self, name: str, alias: str) -> str | None:
        """The version an alias points at, or None when the alias or the model does not exist."""
        return self.aliases(name).get(alias)

    def aliases(self, name: str) -> dict[str, str]:
        """Every alias of a registered model and its version, read at once ({} for no such model)."""
        try:
            aliases = self.client.get_registered_model(name).aliases
        except RegistryError as error:
            if error.not_found:
                return {}
            raise
        return {str(alias): str(version) for alias, version in aliases.items()}

    def apply_aliases(self, name: str, target: Mapping[str, str | int | None], *,
                      before_write: Callable[[], None] | None = None) -> list[str]:
        """Point each alias of `target` at its version (None: remove it), champion first; returns the
        aliases that changed. Every version is checked to exist before any alias moves, and all of it
        runs under the alias lock. A failure part-way leaves the aliases written so far: callers that
        need all or nothing restore the aliases they read before (see `flows.promotion`), and
        `before_write` is called once before the first write, so they know whether any was tried."""
        order = [alias for alias in ALIASES if alias in target] + [a for a in target if a not in ALIASES]
        with self.alias_lock.held():
            for alias in order:
                if target[alias] is not None:
                    self.client.get_model_version(name, str(target[alias]))  # fail before touching any alias
            current = self.aliases(name)
            changed: list[str] = []
            for alias in order:
                version = target[alias]
                if (current.get(alias) is None) if version is None else (current.get(alias) == str(version)):
                    continue
                if before_write is not None and not changed:
                    before_write()
                changed.append(alias)
                if version is None:
                    self.client.delete_registered_model_alias(name, alias)
                else:
                    self.client.set_registered_model_alias(name, alias, str(version))
            return changed

    def set_challenger(self, name: str, version: str | int) -> None:
        self.set_alias(name, CHALLENGER, version)

    @staticmethod
    def promotion_target(current: Mapping[str, str], version: str | int) -> dict[str, str | None]:
        """The aliases after promoting `version`: it is champion, the champion it replaces is
        previous-champion, and a challenger alias on it is removed (it no longer waits for a gate)."""
        version = str(version)
        champion = current.get(CHAMPION)
        previous = champion if champion is not None and champion != version else current.get(PREVIOUS_CHAMPION)
        challenger = current.get(CHALLENGER)
        return {CHAMPION: version, PREVIOUS_CHAMPION: previous,
                CHALLENGER: None if challenger == version else challenger}

    @staticmethod
    def rollback_target(name: str, current: Mapping[str, str]) -> dict[str, str | None]:
        """The aliases after a rollback: previous-champion is champion again, and the demoted version
        becomes previous-champion, so that a mistaken rollback is itself one rollback to undo."""
        previous = current.get(PREVIOUS_CHAMPION)
        if previous is None:
            raise LookupError(f"{name} has no {PREVIOUS_CHAMPION!r} version to roll back to")
        champion = current.get(CHAMPION)
        return {CHAMPION: previous,
                PREVIOUS_CHAMPION: champion if champion is not None and champion != previous else None,
                CHALLENGER: current.get(CHALLENGER)}

    def promote(self, name: str, version: str | int) -> str | None:
        """Make `version` the champion; the champion it replaces becomes `previous-champion`.

        Returns the replaced champion version (None when there was none to replace). A challenger
        alias on the promoted version is removed: it no longer waits for a gate. This moves aliases
        only; `flows.promotion.promote` also moves the replicas, all or nothing.
        """
        version = str(version)
        with self.alias_lock.held():
            current = self.aliases(name)
            self.apply_aliases(name, self.promotion_target(current, version))
        champion = current.get(CHAMPION)
        return champion if champion != version else None

    def rollback(self, name: str) -> str:
        """Point `champion` back at `previous-champion`, and the demoted version at
        `previous-champion` so that a mistaken rollback is itself one call to undo. Aliases only;
        `flows.promotion.rollback` also pushes the restored champion to the replicas."""
        with self.alias_lock.held():
            target = self.rollback_target(name, self.aliases(name))
            self.apply_aliases(name, target)
        return str(target[CHAMPION])
