"""Registry retention: keep the versions that serve or may serve again, delete the rest with their files.

Each fit registers a version whose run holds the readout, its plots and its RLS state (`registry.rls_file`:
134.5 MB at d = 4096), so an hourly retrain fills the artifact store by gigabytes a day. `prune_versions`
keeps every version an alias names (`champion`, `previous-champion`, `challenger`) and the newest
`keep_last`; every other version loses its run's artifacts, then the version itself, then its run
(MLflow marks the run deleted; `mlflow gc` would drop its record). It holds the alias lock, so no
promotion or rollback moves an alias onto a version while it goes.
"""

from __future__ import annotations

from typing import Any


class RetentionMixin:
    """Pruning old versions (part of `registry.client.ReadoutRegistry`)."""

    client: Any
    alias_lock: Any
    tracking_uri: str

    def prune_versions(self, name: str, keep_last: int, *, dry_run: bool = False) -> dict[str, Any]:
        """Delete the versions of `name` that no alias names and that are not among the newest `keep_last`,
        each with its run's artifacts. {"name", "kept", "pruned", "dry_run"} (version numbers as text)."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        if keep_last < 1:
            raise ValueError(f"keep_last keeps at least the newest version, not {keep_last}")
        with self.alias_lock.held():
            versions = self.list_versions(name)  # newest first, each with its aliases
            kept = [v for index, v in enumerate(versions) if index < keep_last or v.aliases]
            doomed = [v for v in versions if v not in kept]
            for version in [] if dry_run else doomed:
                if version.run_id:
                    artifact_uri = self.client.get_run(version.run_id).info.artifact_uri
                    self.client.retry(lambda uri=artifact_uri: get_artifact_repository(
                                          uri, tracking_uri=self.tracking_uri).delete_artifacts(),
                                      f"deleting the artifacts of version {version.version}")
                self.client.delete_model_version(name, version.version)
                if version.run_id:
                    self.client.delete_run(version.run_id)
        return {"name": name, "kept": [v.version for v in kept], "pruned": [v.version for v in doomed],
                "dry_run": dry_run}
