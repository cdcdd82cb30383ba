"""The registry champion as the serving plugin loads it at start: one push bundle, read from MLflow.

`MlflowChampionSource` is the `leap.readout_sources` entry point `mlflow` (pyproject.toml): a replica
whose settings name a `registry_uri` and that has nothing newer to serve opens it through that entry
point, in whatever process vLLM builds the scheduler in, without the plugin importing MLflow itself
(`serving.readout.sources.RegistrySource`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from registry.client import CHAMPION, ReadoutRegistry


class MlflowChampionSource:
    """The champion of a registered readout model in the MLflow registry at `tracking_uri`."""

    def __init__(self, tracking_uri: str) -> None:
        self.registry = ReadoutRegistry(tracking_uri)

    def champion_bundle(self, name: str, expect: Mapping[str, Any]) -> bytes:
        """The champion's readout file (refused unless it records `expect`) and RLS anchor, as a push bundle."""
        return self.registry.push_bundle(name, CHAMPION, expect=expect)[0]
