"""Where the readout a replica serves at start comes from (`source` in `describe()`).

In order: the published champion when newer than this replica's saved push ("champion"), the saved push
("state"), the configured file ("config"), the registry ("registry", loaded lazily in the background),
else none until the first push; docs/serving.md ("Restoring the readout at start") gives the rules. The
plugin never imports a registry client: a `RegistrySource` is handed in by an in-process caller, else
found through the `leap.readout_sources` entry point, since vLLM builds the runtime in its own process
from a class name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from leap_io.champion import ChampionPublication, Publication, registry_key
from leap_io.model_identity import registered_model_name
from leap_io.push_bundle import make_bundle
from leap_io.redact import redact_text, redact_url
from serving.readout.saved_state import Saved, StateDamaged, config_bundle
from serving.readout.service import ReadoutService
from serving.supervise import SupervisedThread
from serving.telemetry import Telemetry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "leap.readout_sources"
REGISTRY_ENTRY_POINT = "mlflow"  # `registry_uri` is an MLflow tracking URI



def published_is_newer(saved: Saved, published: Publication) -> bool:
    """Whether a publication came after a replica's saved push: by their publication sequence when both
    have one (no clock involved), else by the publisher's clock against this host's."""
    if saved.version == published.version:
        return False
    if saved.sequence is not None and published.sequence is not None:
        return published.sequence > saved.sequence
    return published.published_at > saved.saved_at

class RegistrySource(Protocol):
    """The registry a replica's champion is loaded from at start."""

    def champion_bundle(self, name: str, expect: Mapping[str, Any]) -> bytes:
        """The push bundle (readout file and RLS anchor) of registered model `name`'s champion, its
        readout checked against `expect` (the served model's fingerprint)."""
        ...


RegistrySourceFactory = Callable[[str], RegistrySource]
"""Opens the registry at a URI (`registry_uri`) as a `RegistrySource`."""


def installed_registry_source() -> RegistrySourceFactory:
    """The factory the `leap.readout_sources` entry point `mlflow` names; LookupError when none is installed."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP, name=REGISTRY_ENTRY_POINT):
        return entry.load()
    raise LookupError(f"no {REGISTRY_ENTRY_POINT!r} entry point in group {ENTRY_POINT_GROUP!r}: install LEAP "
                      "with its registry (pip install -e '.[pipeline]')")


class ReadoutSources:
    """Serves a replica's readout at start from the first source that has one (see the module docstring).

    Parameters
    ----------
    service : the readout service the readout found is served on.
    telemetry : counts the sources that could not be used.
    model_id, layer : the served model's id and serving layer, which name its registered readout model.
    registry_source : opens the registry at `registry_uri`; None: the installed entry point.
    """

    def __init__(self, service: ReadoutService, telemetry: Telemetry, model_id: str, layer: int,
                 registry_source: RegistrySourceFactory | None = None) -> None:
        self.service = service
        self.config = service.config
        self._telemetry = telemetry
        self._model_id = model_id
        self._layer = layer
        self._registry_source = registry_source
        self.registry_status: dict[str, Any] = {"state": "off"}
        self.champion_status: dict[str, Any] = {"state": "off"}

    def model_name(self) -> str:
        """The registered model whose champion serves here: `registry_model`, else the model's and layer's."""
        return self.config.registry_model or registered_model_name(self._model_id, int(self._layer))

    def start(self) -> ReadoutSources:
        """Serve the readout a restart should serve; the registry's loads in the background."""
        if self._take_published_champion() or self._restore_state():
            return self
        if self.config.readout_path:
            self._serve_config_file()
        elif self.config.registry_uri:
            self._load_registry_in_background()
        return self

    def describe(self) -> dict:
        return {"registry": dict(self.registry_status), "champion": dict(self.champion_status)}

    # -- the sources, in order -------------------------------------------------------------------
    def _take_published_champion(self) -> bool:
        """Serve the published champion when it is newer than the saved push and another version."""
        location = self.config.champion_url
        if not location:
            return False
        state = self.service.state
        try:
            name = self.model_name()
            published = ChampionPublication(location).load(name, public_key=self.config.champion_public_key)
            if published is None:
                self.champion_status = {"state": "none", "location": redact_url(location), "model": name}
                return False
            own = self.config.registry_uri
            if published.registry is not None and own and registry_key(own) != published.registry:
                self.champion_status = {"state": "other-registry", "version": published.version,
                                        "registry": redact_url(published.registry),
                                        "own_registry": redact_url(registry_key(own))}
                logger.info("LEAP leaves the champion published at %s alone: it is %s's, this replica's registry "
                            "is %s", redact_url(location), redact_url(published.registry), redact_url(own))
                return False
            saved = state.saved() if state is not None else None
            if saved is not None and not published_is_newer(saved, published):
                try:
                    state.load()  # the saved push serves, unless it is damaged
                    self.champion_status = {"state": "older-than-state", "version": published.version}
                    return False
                except StateDamaged:
                    pass
            readout, rls = self.service.check(published.bundle)
        except Exception as exc:
            self._telemetry.drop("champion", "unusable")
            self.champion_status = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
            logger.warning("LEAP published champion at %s is not served: %s", redact_url(location), exc)
            return False
        self.service.serve(readout, rls, "champion")
        version = self.service.version
        self.champion_status = {"state": "loaded", "version": version, "model": name,
                                "registry_version": published.registry_version, "sequence": published.sequence}
        self.service.persist(published.bundle, version, published.sequence)
        logger.info("LEAP serves the published champion %s of %s", version, name)
        return True

    def _restore_state(self) -> bool:
        state = self.service.state
        if state is None:
            return False
        try:
            saved = state.load()
            if saved is None:
                return False
            readout_bytes, rls_state, meta = saved
            readout, rls = self.service.check(make_bundle(readout_bytes, rls_state))
        except Exception as exc:
            self._telemetry.drop("state", "unusable")
            logger.warning("LEAP state in %s is not served: %s", state.folder, exc)
            return False
        self.service.serve(readout, rls, "state")
        self.service.persisted_at = meta.get("saved_at")
        logger.info("LEAP serves readout %s restored from %s", self.service.version, state.folder)
        return True

    def _serve_config_file(self) -> None:
        """The readout (and RLS) files of the settings, read as `leap serve` checked them before the engine
        started (`config_bundle`): an explicit file must load, so a failure here is raised."""
        bundle = config_bundle(self.config.readout_path, self.config.rls_state_path,
                               self.config.champion_public_key)
        readout, rls = self.service.check(bundle)
        self.service.serve(readout, rls, "config")

    def _load_registry_in_background(self) -> None:
        generation = self.service.generation
        uri = self.config.registry_uri
        self.registry_status = {"state": "loading", "uri": redact_url(uri)}

        def load() -> None:
            try:
                name = self.model_name()
                opened = (self._registry_source or installed_registry_source())(uri)
                # checked exactly like a push: the registry is one more place a bad readout can come from
                readout, rls = self.service.check(opened.champion_bundle(name, self.service.expect))
            except Exception as exc:
                error = redact_text(f"{type(exc).__name__}: {exc}")  # no traceback: it would show the password
                if getattr(exc, "not_found", False) is True:  # registry.calls.RegistryError: nothing promoted yet
                    logger.info("LEAP finds no champion in the registry at %s yet (%s); it serves what it has until "
                                "one is pushed", redact_url(uri), error)
                    self.registry_status = {"state": "none", "uri": redact_url(uri), "error": error}
                    return
                logger.warning("LEAP could not load the registry champion from %s: %s", redact_url(uri), error)
                self.registry_status = {"state": "failed", "uri": redact_url(uri), "error": error}
                return
            if not self.service.serve_unless_moved_on(readout, rls, "registry", generation):
                self.registry_status = {"state": "superseded"}  # a push arrived first: it wins
                return
            self.registry_status = {"state": "loaded", "model": name}
            logger.info("LEAP serves registry champion %s of %s", self.service.version, name)

        SupervisedThread("leap-registry-load", load).start()
