"""The demo's first champion: its recipe chosen by validation on the committed recipe corpus."""

from __future__ import annotations

import pytest

from study_harness import snapshot


def test_the_first_champion_is_the_validated_recipe_registered_under_the_replicas_layer(tmp_path):
    manifest = snapshot.read_manifest() or {}
    if not any(entry.get("kind") == "recipes" for entry in manifest.get("corpora", {}).values()):
        pytest.skip("no recipe corpus in the committed snapshot")
    from experiments.demo import DEMO_RECIPES, bootstrap_champion
    from harness.model_prep import prepare_model
    from leap_core.recipes import union
    from registry.client import ReadoutRegistry

    model = prepare_model()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = bootstrap_champion(uri, model, 1024, [])
    assert result["status"] == "registered"
    assert result["capture_recipe"] == str(union(DEMO_RECIPES))
    table = result["validation"]
    assert {row["recipe"] for row in table} == set(DEMO_RECIPES)
    assert result["recipe"] == max(table, key=lambda row: row["spearman"])["recipe"]
    registry = ReadoutRegistry(uri)
    assert result["name"] == registry.model_name(model.model_id, union(DEMO_RECIPES).layers[0])
    readout = registry.load_readout(result["name"], result["version"])
    assert readout.metadata["recipe"] == result["recipe"]
    assert readout.dim_ == 576 * result["recipe"].count("@")
    again = bootstrap_champion(uri, model, 1024, [])  # idempotent: the champion is kept
    assert again["status"] == "kept" and again["version"] == result["version"]
