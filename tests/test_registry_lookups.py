"""What the flows ask the registry, against a real sqlite store: earlier fits, gates and merges found again,
versions with their tags and metrics, push bundles, and MLflow's refusals as the registry's own error."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlflow")

from leap_core.readout import LinearReadout
from leap_core.readout_format import from_bytes
from leap_core.rls import RLS
from leap_io.push_bundle import open_bundle
from registry.aliases import CHAMPION
from registry.calls import RegistryError, RegistryUnavailable, call_with_retry
from registry.client import ReadoutRegistry
from registry.lookups import MERGE_ROWS_UNTIL_TAG, ROWS_UNTIL_TAG

pytestmark = pytest.mark.pipeline

MODEL_ID = "lookup-model"
LAYER = 4
DIM = 6
MAX_TOKENS = 256


def _readout(version: str, seed: int) -> tuple[LinearReadout, RLS]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(80, DIM)).astype(np.float32)
    lengths = np.clip(np.exp(3.5 + features @ np.linspace(-0.5, 0.5, DIM)), 1, MAX_TOKENS).round()
    readout = LinearReadout(alpha=10.0, target="sqrt", max_tokens=MAX_TOKENS).fit(features, lengths)
    readout.metadata.update(model_id=MODEL_ID, model_fingerprint="sha256:lookup", layer=LAYER, version=version)
    return readout, RLS.from_readout(readout, features)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    """Three versions: a fit with a fit key and a rows cut, a merge with a merge key, a fit without RLS."""
    registry = ReadoutRegistry(f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db")
    fit_readout, fit_rls = _readout("r-fit", seed=1)
    fit = registry.log_readout(fit_readout, rls=fit_rls, params={"fit_key": "k-fit", "recipe": "last@4"},
                               metrics={"mae": 12.5, "mae_domain_code": 9.0},
                               tags={"fit_key": "k-fit", ROWS_UNTIL_TAG: "100.000"},
                               version_tags={ROWS_UNTIL_TAG: "100.000"})
    merge_readout, merge_rls = _readout("r-merge", seed=2)
    merge_tags = {"merged_from": fit.version, "merge_key": "k-merge", MERGE_ROWS_UNTIL_TAG: "250.500"}
    merge = registry.log_readout(merge_readout, rls=merge_rls, params={"merge_key": "k-merge"}, metrics={},
                                 tags=merge_tags, version_tags=merge_tags)
    bare_readout, _ = _readout("r-bare", seed=3)
    bare = registry.log_readout(bare_readout, params={}, metrics={})
    registry.promote(fit.name, fit.version)
    return {"registry": registry, "name": fit.name, "fit": fit, "merge": merge, "bare": bare,
            "readouts": {"fit": fit_readout, "merge": merge_readout}}


def test_version_info_reads_one_version_with_its_run_aliases_and_tags(store):
    registry, fit = store["registry"], store["fit"]
    info = registry.version_info(store["name"], fit.version)
    assert (info.version, info.run_id, info.aliases) == (fit.version, fit.run_id, (CHAMPION,))
    assert info.tags[ROWS_UNTIL_TAG] == "100.000" and info.tags["readout_version"] == "r-fit"
    assert info.tags["metric.mae"] == "12.5"
    assert registry.version_info(store["name"], int(store["merge"].version)).aliases == ()


def test_version_metrics_are_those_of_the_run_that_logged_it(store):
    metrics = store["registry"].version_metrics(store["name"], store["fit"].version)
    assert metrics["mae"] == pytest.approx(12.5) and metrics["mae_domain_code"] == pytest.approx(9.0)


def test_information_until_takes_the_later_of_the_fit_and_merge_cuts(store):
    registry, name = store["registry"], store["name"]
    assert registry.information_until(name, store["fit"].version) == pytest.approx(100.0)
    assert registry.information_until(name, store["merge"].version) == pytest.approx(250.5)
    assert registry.information_until(name, store["bare"].version) is None


def test_find_fit_returns_the_finished_fit_of_a_key_with_its_run_figures(store):
    registry, name, fit = store["registry"], store["name"], store["fit"]
    found = registry.find_fit(name, "k-fit")
    assert (found.version, found.run_id) == (fit.version, fit.run_id)
    assert found.params["recipe"] == "last@4" and found.metrics["mae"] == pytest.approx(12.5)
    assert registry.find_fit(name, "no-such-key") is None


def test_find_fit_skips_a_fit_whose_version_was_deleted(tmp_path):
    registry = ReadoutRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    assert registry.find_fit("leap-readout-none-L1", "k") is None  # no readout experiment yet
    readout, _ = _readout("r-gone", seed=4)
    logged = registry.log_readout(readout, params={"fit_key": "k-gone"}, metrics={})
    assert registry.find_fit(logged.name, "k-gone").version == logged.version
    registry.client.delete_model_version(logged.name, logged.version)
    assert registry.find_fit(logged.name, "k-gone") is None


def test_find_gate_finds_a_gate_run_by_the_tag_it_was_logged_with(store):
    registry, name, fit = store["registry"], store["name"], store["fit"]
    assert registry.find_gate("k-gate") is None
    run_id = registry.log_gate(name, store["merge"].version, fit.version, {"fcfs": {"mean_ptl": 1.0}},
                               {"passed": True, "reason": "test"}, tags={"gate_key": "k-gate"})
    assert registry.find_gate("k-gate") == run_id
    assert registry.client.get_run(run_id).data.tags["gate_key"] == "k-gate"
    assert registry.find_gate("another-gate") is None


def test_find_merge_and_find_readout_read_the_version_tags(store):
    registry, name, merge = store["registry"], store["name"], store["merge"]
    assert registry.find_merge(name, "k-merge") == (merge.version, "r-merge")
    assert registry.find_merge(name, "k-other") is None
    assert registry.find_readout(name, "r-merge") == merge.version
    assert registry.find_readout(name, "r-fit") == store["fit"].version
    assert registry.find_readout(name, "r-unknown") is None
    assert registry.find_readout("leap-readout-no-such-model-L0", "r-fit") is None


def test_push_bundle_carries_the_readout_and_its_rls_state(store):
    registry, name = store["registry"], store["name"]
    bundle, readout_version = registry.push_bundle(name, CHAMPION)
    opened = open_bundle(bundle)
    assert readout_version == "r-fit" and opened.state is not None and not opened.force
    np.testing.assert_allclose(from_bytes(opened.readout_bytes).theta_,
                               store["readouts"]["fit"].theta_)
    forced = open_bundle(registry.push_bundle(name, store["bare"].version, force=True)[0])
    assert forced.state is None and forced.force


def test_a_refusal_of_mlflow_is_a_registry_error_with_its_code(store):
    registry, name = store["registry"], store["name"]
    with pytest.raises(RegistryError) as missing:
        registry.version_info(name, 99)
    assert missing.value.not_found and not missing.value.already_exists
    assert "get_model_version()" in str(missing.value) and registry.tracking_uri in str(missing.value)
    with pytest.raises(RegistryError) as taken:
        registry.client.create_registered_model(name)
    assert taken.value.already_exists


def test_call_with_retry_gives_up_on_transient_failures_only():
    calls = []

    def down() -> None:
        calls.append(1)
        raise ConnectionError("refused")

    with pytest.raises(RegistryUnavailable, match="after 3 attempts"):
        call_with_retry(down, "a read", retries=2, backoff_s=0.0)
    assert len(calls) == 3
    with pytest.raises(KeyError):
        call_with_retry(lambda: {}["missing"], "a lookup", retries=2, backoff_s=0.0)
