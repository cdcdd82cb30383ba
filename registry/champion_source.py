"""The registry champion as serving takes it at start: one push bundle, read from MLflow; and, for
`leap serve`, which registered model's champion that is and what it reads, before the engine starts.

`MlflowChampionSource` is the `leap.readout_sources` entry point `mlflow` (pyproject.toml): a replica
whose settings name a `registry_uri` and that has nothing newer to serve opens it through that entry
point, in whatever process vLLM builds the scheduler in, without the plugin importing MLflow itself
(`serving.readout.sources.RegistrySource`). `find_champion` answers the question the engine cannot ask
itself: its capture recipe is fixed when it starts, so the champion's recipe must be known first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from leap_io.model_identity import registered_model_name
from registry.client import CHAMPION, ReadoutRegistry


class MlflowChampionSource:
    """The champion of a registered readout model in the MLflow registry at `tracking_uri`."""

    def __init__(self, tracking_uri: str) -> None:
        self.registry = ReadoutRegistry(tracking_uri)

    def champion_bundle(self, name: str, expect: Mapping[str, Any]) -> bytes:
        """The champion's readout file (refused unless it records `expect`) and RLS anchor, as a push bundle."""
        return self.registry.push_bundle(name, CHAMPION, expect=expect)[0]


@dataclass(frozen=True)
class FoundChampion:
    """A registered model's champion: its name, registry version and the readout's metadata."""

    name: str
    registry_version: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return str(self.metadata.get("version", ""))


def champion_names(registry: ReadoutRegistry, model_id: str) -> list[str]:
    """The registered readout models of a serving model (`leap-readout-<model id>-L<layer>`, any layer)."""
    prefix = registered_model_name(model_id, 0)[:-1]
    pattern = re.compile(re.escape(prefix) + r"\d+")
    found = registry.client.search_registered_models(filter_string=f"name LIKE '{prefix}%'", max_results=1000)
    return sorted(model.name for model in found if pattern.fullmatch(model.name))


def find_champion(tracking_uri: str, model_id: str, expect: Mapping[str, Any], layer: int | None = None,
                  name: str | None = None) -> FoundChampion | None:
    """The champion a replica of `model_id` serves from the registry at `tracking_uri`: of `name`, else of
    the model and `layer`, else the newest champion of any of the model's layers (the one promoted from
    the most recently registered version). Its readout must record `expect` (the model's fingerprint):
    ValueError else. None when no such model has a champion."""
    registry = ReadoutRegistry(tracking_uri)
    if name is None and layer is not None:
        name = registered_model_name(model_id, layer)
    names = [name] if name is not None else champion_names(registry, model_id)
    champions = [(candidate, version) for candidate in names
                 if (version := registry.get_alias(candidate, CHAMPION)) is not None]
    if not champions:
        return None
    chosen, version = max(champions, key=lambda item: registry.version_info(*item).created_ms)
    readout = registry.load_readout(chosen, version, expect=expect)
    return FoundChampion(chosen, str(version), dict(readout.metadata))
