"""Finding what the registry holds: versions and their tags, and the runs a rerun must find again.

Each step of the loop is safe to run again because it can find what an earlier run of it left: a fit
by its `fit_key` param, a gate by its `gate_key` tag, a fleet merge by its `merge_key` version tag, and
a replica's anchor by the `readout_version` tag of the version it was pushed from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from registry.aliases import CHAMPION
from registry.calls import RegistryError
from registry.runs import GATE_EXPERIMENT, READOUT_EXPERIMENT

ROWS_UNTIL_TAG = "rows_until"
"""Version tag: the newest arrival time (unix s) of the log-store rows a fitted version's RLS state holds."""
MERGE_ROWS_UNTIL_TAG = "merge_rows_until"
"""Version tag of a fleet merge: every row it holds finished before this time (`flows.fleet`)."""


@dataclass(frozen=True)
class ReadoutVersion:
    """One model version as listed, with the aliases that point at it."""

    name: str
    version: str
    run_id: str
    aliases: tuple[str, ...]
    tags: dict[str, str] = field(default_factory=dict)
    created_ms: int = 0


@dataclass(frozen=True)
class LoggedFit:
    """A finished fit found by its key: the version it registered, its run, and the run's figures."""

    version: str
    run_id: str
    params: dict[str, str]
    metrics: dict[str, float]


class LookupMixin:
    """Versions, tags and earlier runs of a registered model (part of `registry.client.ReadoutRegistry`)."""

    client: Any

    def list_versions(self, name: str) -> list[ReadoutVersion]:
        """All versions of a registered model, newest first, with their aliases."""
        aliases: dict[str, list[str]] = {}
        for alias, version in self.client.get_registered_model(name).aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        versions = self.client.search_model_versions(f"name = '{name}'")
        return sorted(
            (ReadoutVersion(name=name, version=str(v.version), run_id=v.run_id or "",
                            aliases=tuple(sorted(aliases.get(str(v.version), []))), tags=dict(v.tags),
                            created_ms=int(v.creation_timestamp or 0))
             for v in versions),
            key=lambda v: int(v.version), reverse=True,
        )

    def version_info(self, name: str, version: str | int) -> ReadoutVersion:
        """One version with its run, aliases and tags (RegistryError, `not_found`, when there is none)."""
        found = self.client.get_model_version(name, str(version))
        return ReadoutVersion(name=name, version=str(found.version), run_id=found.run_id or "",
                              aliases=tuple(sorted(found.aliases or ())), tags=dict(found.tags),
                              created_ms=int(found.creation_timestamp or 0))

    def version_metrics(self, name: str, version: str | int) -> dict[str, float]:
        """The metrics of the run that logged a version ({} for a version registered without a run)."""
        run_id = self.version_info(name, version).run_id
        return dict(self.client.get_run(run_id).data.metrics) if run_id else {}

    def information_until(self, name: str, version: str | int) -> float | None:
        """The time up to which a version's RLS state holds log-store rows (its own fit's or, through its
        anchor, an earlier one's; a merge's snapshot), or None for a version that holds none of them
        (fitted elsewhere, e.g. on the corpus snapshot). An anchored fit adds only rows that arrived
        after it, so no row counts twice."""
        tags = self.version_info(name, version).tags
        cuts = []
        for key in (ROWS_UNTIL_TAG, MERGE_ROWS_UNTIL_TAG):
            try:
                cuts.append(float(tags[key]))
            except (KeyError, TypeError, ValueError):
                continue
        return max(cuts) if cuts else None

    def list_artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        """Every artifact file of a run, as paths relative to its artifact root."""
        found: list[str] = []
        for info in self.client.list_artifacts(run_id, path):
            if info.is_dir:
                found.extend(self.list_artifacts(run_id, info.path))
            else:
                found.append(info.path)
        return sorted(found)

    # ----------------------------------------------------------------- what an earlier run left

    def find_fit(self, name: str, fit_key: str) -> LoggedFit | None:
        """The newest finished fit logged with `fit_key` whose registered version of `name` still exists."""
        experiment = self.client.get_experiment_by_name(READOUT_EXPERIMENT)
        if experiment is None:
            return None
        runs = self.client.search_runs(
            [experiment.experiment_id],
            filter_string=f"params.fit_key = '{fit_key}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"])
        for run in runs:
            version = run.data.tags.get("registered_version")
            if version is None:
                continue
            try:
                self.client.get_model_version(name, version)
            except RegistryError as error:
                if error.not_found:  # the version was deleted since
                    continue
                raise
            return LoggedFit(version=version, run_id=run.info.run_id, params=dict(run.data.params),
                             metrics=dict(run.data.metrics))
        return None

    def find_gate(self, gate_key: str) -> str | None:
        """The run id of a gate logged with the tag `gate_key`, or None."""
        experiment = self.client.get_experiment_by_name(GATE_EXPERIMENT)
        if experiment is None:
            return None
        runs = self.client.search_runs([experiment.experiment_id], filter_string=f"tags.gate_key = '{gate_key}'",
                                       max_results=1)
        return runs[0].info.run_id if runs else None

    def find_merge(self, name: str, merge_key: str) -> tuple[str, str] | None:
        """(version, readout version) of a fleet merge registered with the version tag `merge_key`, or None."""
        for version in self.list_versions(name):
            if version.tags.get("merge_key") == merge_key:
                return version.version, version.tags.get("readout_version", "")
        return None

    def find_readout(self, name: str, readout_version: str) -> str | None:
        """The version of `name` whose readout is `readout_version` (the champion first), or None (also for
        no such registered model)."""
        try:
            versions = self.list_versions(name)
        except RegistryError as error:
            if error.not_found:
                return None
            raise
        ordered = sorted(versions, key=lambda v: CHAMPION not in v.aliases)
        return next((v.version for v in ordered if v.tags.get("readout_version") == readout_version), None)
