"""`leap serve` before its engine starts: the registry the pipeline writes is the default, the champion's
recipe is what the engine captures, a replica's saved files serve again, and files that cannot serve are
refused in one line with exit code 2 while no engine starts.

The command runs through typer's runner on the prepared model, with real files and a real MLflow registry
(sqlite); `os.execv`, where `leap serve` hands over to vLLM's server, is replaced by a recorder, so a test
sees the exact engine command or that none was started. tests/test_serve_start_engine.py starts it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from leap_core.readout_format import to_bytes
from leap_core.rls import fit_readout_with_anchor
from leap_io.push_bundle import make_bundle

LAYER = 17  # not the default layer (22 of SmolLM2's 30): the champion's must be what is captured


class Execd(Exception):
    """Raised where `leap serve` would have become vLLM's server: the engine would start here."""


@pytest.fixture(scope="module")
def model():
    from harness.model_prep import prepare_model

    return prepare_model()


def champion(model, layer: int = LAYER, version: str = "20260301T000000-serve17", seed: int = 0, dim: int | None = None):
    """A readout of the prepared model at `layer` with its RLS anchor (fitted on random rows)."""
    rng = np.random.default_rng(seed)
    dim = dim or model.hidden_size
    X = rng.normal(size=(120, dim)).astype(np.float32)
    lengths = np.clip(np.round(40 + 10 * X[:, 0] + rng.normal(size=120)), 1, 512)
    return fit_readout_with_anchor(X, lengths, alpha=10.0, max_tokens=512, metadata={
        "model_id": model.model_id, "model_fingerprint": model.fingerprint, "layer": layer,
        "recipe": f"last@{layer}", "version": version})


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $LEAP_HOME and no registry, champion or recipe setting from the surrounding environment."""
    for key in ("LEAP_REGISTRY_URI", "LEAP_MLFLOW_TRACKING_URI", "LEAP_RECIPES", "LEAP_RECIPE", "LEAP_LAYER",
                "LEAP_CHAMPION_URL", "LEAP_STATE_DIR", "LEAP_REGISTRY_MODEL", "LEAP_CHAMPION_PUBLIC_KEY",
                "LEAP_READOUT_PATH", "LEAP_RLS_STATE_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LEAP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def serve(monkeypatch, model, *args: str):
    """(exit code, output, the leap settings of the engine command or None when none was started)."""
    from leap_cli.main import app

    started: list[list[str]] = []

    def execv(path, argv):
        started.append(list(argv))
        raise Execd

    monkeypatch.setattr("os.execv", execv)
    result = CliRunner().invoke(app, ["serve", "--model", model.path, "--port", "18000", *args])
    if started:
        assert isinstance(result.exception, Execd), result.output
        argv = started[0]
        return 0, result.output, json.loads(argv[argv.index("--additional-config") + 1])["leap"]
    return result.exit_code, result.output, None


def register(uri: str, readout, rls) -> str:
    from registry.client import ReadoutRegistry

    registry = ReadoutRegistry(uri)
    logged = registry.log_readout(readout, rls=rls, params={"data_hash": "serve-start"}, metrics={"mae": 1.0})
    registry.promote(logged.name, logged.version)
    return logged.name


# ---------------------------------------------------------------------------------------------- the default


def test_with_no_variable_the_registry_under_leap_home_serves_its_champion_and_its_layer_is_captured(
        home, monkeypatch, model):
    readout, rls = champion(model)
    name = register(f"sqlite:///{home}/mlflow/mlflow.db", readout, rls)
    code, output, leap = serve(monkeypatch, model)
    assert code == 0, output
    assert leap["registry_uri"] == f"sqlite:///{home.resolve()}/mlflow/mlflow.db"
    assert leap["registry_model"] == name and name.endswith(f"-L{LAYER}")
    assert leap["recipe"] == f"last@{LAYER}"
    assert leap["champion_url"] == str(home.resolve() / "champion")
    assert "registry champion 20260301T000000-serve17" in output


def test_the_capture_holds_the_candidates_and_the_champion(home, monkeypatch, model):
    readout, rls = champion(model)
    register(f"sqlite:///{home}/mlflow/mlflow.db", readout, rls)
    monkeypatch.setenv("LEAP_RECIPES", "last@22")
    code, output, leap = serve(monkeypatch, model)
    assert code == 0, output
    assert leap["recipe"] == "last@17+last@22"  # the feedback rows' layer is the first: the champion's


def test_a_registry_variable_points_elsewhere(home, tmp_path, monkeypatch, model):
    register(f"sqlite:///{home}/mlflow/mlflow.db", *champion(model))
    other = f"sqlite:///{tmp_path}/other/mlflow.db"
    name = register(other, *champion(model, layer=9, version="20260302T000000-other9"))
    monkeypatch.setenv("LEAP_REGISTRY_URI", other)
    code, output, leap = serve(monkeypatch, model)
    assert code == 0, output
    assert (leap["registry_uri"], leap["registry_model"], leap["recipe"]) == (other, name, "last@9")


def test_of_several_layers_the_newest_champion_serves(home, monkeypatch, model):
    uri = f"sqlite:///{home}/mlflow/mlflow.db"
    register(uri, *champion(model, layer=22, version="20260301T000000-older22"))
    name = register(uri, *champion(model, layer=LAYER, version="20260302T000000-newer17"))
    code, output, leap = serve(monkeypatch, model)
    assert (code, leap["registry_model"], leap["recipe"]) == (0, name, f"last@{LAYER}"), output


def test_with_no_registry_at_all_the_replica_starts_without_one(home, monkeypatch, model):
    code, output, leap = serve(monkeypatch, model)
    assert code == 0, output
    assert "registry_uri" not in leap and "recipe" not in leap  # FCFS until a push, the default capture
    assert not (home / "mlflow" / "mlflow.db").exists()  # nothing was created to find out
    assert "no registry" in output


def test_the_demo_first_champion_is_found_under_the_demos_layer(home, monkeypatch, model):
    from study_harness import snapshot

    manifest = snapshot.read_manifest() or {}
    if not any(entry.get("kind") == "recipes" for entry in manifest.get("corpora", {}).values()):
        pytest.skip("no recipe corpus in the committed snapshot")
    from experiments.demo import bootstrap_champion
    from leap_io.settings import read_settings

    result = bootstrap_champion(read_settings().mlflow_tracking_uri, model, 1024, [])  # as `leap demo` does
    assert result["status"] == "registered"
    code, output, leap = serve(monkeypatch, model)
    assert code == 0, output
    assert leap["registry_model"] == result["name"]
    assert leap["recipe"] == result["recipe"]  # no candidates given: the champion's recipe alone


# ---------------------------------------------------------------------------------------------- saved files


@pytest.fixture
def saved(tmp_path, model):
    """The files a replica keeps in its state folder after a push: readout.bin, rls.npz, readout.json."""
    from serving.readout.saved_state import ReadoutState

    readout, rls = champion(model)
    folder = tmp_path / "serving-8000"
    ReadoutState(folder).save(to_bytes(readout), rls.state_arrays(), readout.metadata["version"])
    return folder


def test_a_replicas_saved_files_serve(home, monkeypatch, model, saved):
    code, output, leap = serve(monkeypatch, model, "--readout", str(saved / "readout.bin"),
                               "--rls-state", str(saved / "rls.npz"))
    assert code == 0, output
    assert leap["readout_path"] == str(saved / "readout.bin") and leap["rls_state_path"] == str(saved / "rls.npz")
    assert leap["recipe"] == f"last@{LAYER}"


def test_the_saved_files_serve_on_a_runtime_with_their_rls_anchor(saved, model):
    """The runtime reads them as the command checked them (source "config"), RLS anchored on rls.npz."""
    from serving.readout.push import validate_push
    from serving.readout.saved_state import config_bundle

    readout, rls = validate_push(config_bundle(saved / "readout.bin", saved / "rls.npz"),
                                 {"model_fingerprint": model.fingerprint}, None)
    expected = champion(model)[1]
    assert rls is not None and np.allclose(rls.theta_, expected.theta_)
    assert readout.metadata["version"] == "20260301T000000-serve17"


def refused(monkeypatch, model, *args: str) -> str:
    """The one line `leap serve` refuses with; asserts exit code 2 and that no engine started."""
    code, output, leap = serve(monkeypatch, model, *args)
    assert leap is None, "an engine was started"
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("leap serve: "), output
    assert "Traceback" not in output
    return lines[0]


def test_a_truncated_readout_is_refused(home, monkeypatch, model, saved, tmp_path):
    cut = tmp_path / "cut.bin"
    cut.write_bytes((saved / "readout.bin").read_bytes()[:200])
    assert "the readout file is not a readable npz archive" in refused(monkeypatch, model, "--readout", str(cut))


def test_an_edited_saved_readout_is_refused(home, monkeypatch, model, saved):
    data = bytearray((saved / "readout.bin").read_bytes())
    (saved / "readout.bin").write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    assert "is not the readout" in refused(monkeypatch, model, "--readout", str(saved / "readout.bin"))


def test_an_rls_file_lacking_arrays_is_refused(home, monkeypatch, model, saved, tmp_path):
    arrays = champion(model)[1].state_arrays()
    del arrays["P"], arrays["theta"]
    lacking = tmp_path / "lacking.npz"
    np.savez(lacking, **arrays)
    line = refused(monkeypatch, model, "--readout", str(saved / "readout.bin"), "--rls-state", str(lacking))
    assert "RLS state does not fit the readout" in line and "lacks arrays" in line


def test_an_rls_file_of_another_dim_is_refused(home, monkeypatch, model, saved, tmp_path):
    other = tmp_path / "other.npz"
    np.savez(other, **champion(model, dim=64)[1].state_arrays())
    line = refused(monkeypatch, model, "--readout", str(saved / "readout.bin"), "--rls-state", str(other))
    assert "has shape (65,)" in line


def test_an_rls_file_of_another_readout_is_refused(home, monkeypatch, model, saved, tmp_path):
    other = tmp_path / "another.npz"
    np.savez(other, **champion(model, seed=5)[1].state_arrays())
    line = refused(monkeypatch, model, "--readout", str(saved / "readout.bin"), "--rls-state", str(other))
    assert "another standardization" in line


def test_files_that_are_not_npz_or_absent_are_refused(home, monkeypatch, model, saved, tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not an archive")
    assert "not an npz archive" in refused(monkeypatch, model, "--readout", str(saved / "readout.bin"),
                                           "--rls-state", str(junk))
    assert "cannot be read" in refused(monkeypatch, model, "--readout", str(tmp_path / "absent.bin"))
    assert "needs --readout" in refused(monkeypatch, model, "--rls-state", str(saved / "rls.npz"))


def test_a_readout_of_another_model_or_a_layer_not_captured_is_refused(home, monkeypatch, model, saved, tmp_path):
    readout, _ = champion(model)
    readout.metadata["model_fingerprint"] = "sha256:" + "0" * 32
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(to_bytes(readout))
    assert "model_fingerprint" in refused(monkeypatch, model, "--readout", str(foreign))
    line = refused(monkeypatch, model, "--readout", str(saved / "readout.bin"), "--layer", "22")
    assert "capture recipe last@22" in line


def test_a_published_bundle_is_checked_against_its_signature(home, monkeypatch, model, tmp_path):
    from leap_io.champion import ChampionPublication
    from leap_io.signing import generate_key_pair

    keys = generate_key_pair(tmp_path / "keys")
    readout, rls = champion(model)
    bundle = make_bundle(to_bytes(readout), rls.state_arrays())
    name = "leap-readout-test-L17"
    ChampionPublication(tmp_path / "published").publish(name, bundle, "v1", 1, signing_key=keys["private_key"])
    path = str(tmp_path / "published" / f"{name}.bundle")
    code, output, leap = serve(monkeypatch, model, "--readout", path)
    assert code == 0 and leap["readout_path"] == path, output
    other = generate_key_pair(tmp_path / "other-keys")
    monkeypatch.setenv("LEAP_CHAMPION_PUBLIC_KEY", other["public_key"])
    assert "signature" in refused(monkeypatch, model, "--readout", path)


def test_the_command_refuses_in_one_line_on_stderr_without_a_traceback(home, model, saved, tmp_path):
    """The real command in its own process: exit code 2, one line on stderr, nothing else."""
    cut = tmp_path / "cut.bin"
    cut.write_bytes((saved / "readout.bin").read_bytes()[:100])
    done = subprocess.run([sys.executable, "-m", "leap_cli.main", "serve", "--model", model.path, "--readout",
                           str(cut)], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("leap serve: refused: the readout file is not a readable npz"), done.stderr
