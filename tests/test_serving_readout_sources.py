"""The registry a replica's champion comes from at start is handed in, never imported by the plugin: real
runtimes (no engine) with a registry source of the test's own, the installed `leap.readout_sources`
entry point, and the scheduler class that binds a source for an in-process engine."""

from __future__ import annotations

import logging
import threading

import pytest

pytest.importorskip("vllm")

from leap_core.readout_format import to_bytes
from leap_io.model_identity import registered_model_name
from tests.runtime_fixtures import DIM, LAYER, MODEL, build, eventually, first_value_readout  # noqa: F401  (pytest fixtures, used by name)

NAME = registered_model_name(MODEL, LAYER)
URI = "test://registry"


class _Registry:
    """A registry source that answers with one bundle (or raises), once `release` is set."""

    def __init__(self, bundle: bytes = b"", error: Exception | None = None) -> None:
        self.bundle, self.error = bundle, error
        self.asked: list[tuple[str, dict]] = []
        self.release = threading.Event()
        self.release.set()

    def champion_bundle(self, name: str, expect) -> bytes:
        self.asked.append((name, dict(expect)))
        self.release.wait(10)
        if self.error is not None:
            raise self.error
        return self.bundle


def _opener(registry: _Registry, opened: list[str]):
    def open_registry(uri: str) -> _Registry:
        opened.append(uri)
        return registry

    return open_registry


def _settled(runtime) -> dict:
    assert eventually(lambda: runtime.describe()["registry"]["state"] != "loading", 30)
    return runtime.describe()


def test_a_registry_handed_in_serves_its_champion_of_this_model_and_layer(build):
    registry, opened = _Registry(to_bytes(first_value_readout("registry-3"))), []
    runtime = build(policy="leap", registry_uri=URI, registry_source=_opener(registry, opened))
    described = _settled(runtime)
    assert described["registry"] == {"state": "loaded", "model": NAME}
    assert (described["source"], described["version"]) == ("registry", "registry-3")
    assert opened == [URI] and registry.asked == [(NAME, {})]


def test_without_a_registry_uri_no_registry_is_opened(build):
    opened = []
    runtime = build(policy="leap", registry_source=_opener(_Registry(), opened))
    assert runtime.describe()["registry"] == {"state": "off"} and runtime.describe()["source"] == "none"
    assert opened == []


@pytest.mark.parametrize("answer", ["raises", "foreign readout"])
def test_a_registry_that_fails_or_answers_a_foreign_readout_is_logged_and_never_fatal(build, caplog, answer):
    registry = (_Registry(error=ConnectionError("registry down")) if answer == "raises"
                else _Registry(to_bytes(first_value_readout("wide", dim=DIM + 1))))
    with caplog.at_level(logging.WARNING, logger="serving"):
        runtime = build(policy="leap", registry_uri=URI, registry_source=_opener(registry, []))
        described = _settled(runtime)
    assert described["registry"]["state"] == "failed" and described["source"] == "none"
    assert ("ConnectionError" if answer == "raises" else "PushRefused") in described["registry"]["error"]
    assert runtime.health()["healthy"]
    assert any("registry champion" in record.getMessage() for record in caplog.records)


def test_a_push_that_lands_while_the_registry_answers_wins(build):
    registry = _Registry(to_bytes(first_value_readout("registry-3")))
    registry.release.clear()
    runtime = build(policy="leap", registry_uri=URI, registry_source=_opener(registry, []))
    runtime.push_readout(to_bytes(first_value_readout("pushed-1")))
    registry.release.set()
    described = _settled(runtime)
    assert described["registry"] == {"state": "superseded"}
    assert (described["source"], described["version"]) == ("push", "pushed-1")


def test_without_an_installed_source_the_registry_fails_with_the_reason(build, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **selection: [])
    described = _settled(build(policy="leap", registry_uri=URI))
    assert described["registry"]["state"] == "failed" and described["source"] == "none"
    assert "leap.readout_sources" in described["registry"]["error"]


def test_the_installed_entry_point_is_the_mlflow_registry():
    pytest.importorskip("mlflow")
    from registry.champion_source import MlflowChampionSource
    from serving.readout.sources import installed_registry_source

    assert installed_registry_source() is MlflowChampionSource


def test_an_in_process_scheduler_class_carries_the_source_it_was_given():
    from serving.scheduler import LeapScheduler, scheduler_class

    def open_registry(uri: str) -> _Registry:
        return _Registry()

    assert scheduler_class(False) is LeapScheduler and LeapScheduler.registry_source is None
    bound = scheduler_class(False, open_registry)
    assert issubclass(bound, LeapScheduler) and bound is not LeapScheduler
    assert bound.registry_source is open_registry  # a function, not bound to the scheduler as a method
