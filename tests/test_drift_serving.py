"""The drift watch against a serving replica that meets another domain than its readout was fitted on.

Real parts throughout: the replica is a `LeapRuntime` with its admin server (no engine, see
tests/drift_fixtures.py), its traffic the committed snapshot's features and true output lengths of two
prompt sets (SmolLM2-135M-Instruct, layer 22), the champion a readout fitted on one set and registered
in a sqlite MLflow registry with its validation MAE, and the watch the Prefect flow `leap watch` runs,
scraping the replica's /metrics over HTTP and acting through the registry and the admin API.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("prefect")

from flows.drift import RESET, RETRAIN, ROLLBACK, drift_flow
from leap_core.metrics import mae
from leap_core.rls import fit_readout_with_anchor
from registry.client import CHAMPION, ReadoutRegistry
from tests.drift_fixtures import MAX_TOKENS, TOKEN, Traffic, readout_metadata, replica_config, snapshot_domains
from tests.flow_fixtures import pipeline_home

pytestmark = pytest.mark.pipeline
FITTED_ON, SHIFTED_TO = "alpaca", "alpaca_zh"  # median output 88 tokens against 342


@pytest.fixture(scope="module", autouse=True)
def prefect_server():
    """One temporary Prefect server for the module's watch runs (this machine may be slow to start one)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(scope="module")
def domains():
    found = snapshot_domains(FITTED_ON, SHIFTED_TO)
    assert {name: len(d.ids) for name, d in found.items()} == {FITTED_ON: 300, SHIFTED_TO: 300}
    return found


@pytest.fixture
def replica(tmp_path, domains):
    """A champion fitted on the first 200 rows of FITTED_ON (validated on the next 50), registered and
    serving on a replica whose watch settings are in the environment; yields what the tests need."""
    from leap_core.readout_format import to_bytes
    from leap_io.push_bundle import make_bundle
    from serving.runtime import LeapRuntime

    home = tmp_path / "home"
    fitted = domains[FITTED_ON]
    train, valid = fitted.part(0, 200), fitted.part(200, 250)
    readout, rls = fit_readout_with_anchor(train.features, train.lengths, alpha=30.0, max_tokens=MAX_TOKENS,
                                           metadata=readout_metadata("20260101T000000-drift001"))
    validation_mae = mae(valid.lengths, readout.predict(valid.features))
    registry = ReadoutRegistry(f"sqlite:///{home}/mlflow/mlflow.db")
    logged = registry.log_readout(readout, rls=rls, params={"data_hash": FITTED_ON},
                                  metrics={"mae": validation_mae})
    registry.set_alias(logged.name, CHAMPION, logged.version)
    made = []

    def start(**leap) -> dict:
        runtime = LeapRuntime(replica_config(admin_port=0, admin_token=TOKEN, **leap))
        made.append(runtime)
        runtime.push_readout(make_bundle(to_bytes(readout), rls.state_arrays()))
        return {"runtime": runtime, "traffic": Traffic(runtime), "url": f"http://127.0.0.1:{runtime.admin.port}",
                "version": readout.metadata["version"], "validation_mae": validation_mae,
                "held_out": fitted.part(250, 300), "shifted": domains[SHIFTED_TO], "name": logged.name}

    yield home, start
    for runtime in made:
        runtime.close()


def watch_env(home, url: str, **settings) -> dict:
    token = home / "replica.token"
    token.write_text(TOKEN)
    env = {"LEAP_ENDPOINTS": url, "LEAP_ADMIN_TOKEN_FILE": str(token), "LEAP_DRIFT_WINDOW": "2",
           "LEAP_DRIFT_MIN_ROWS": "32", "LEAP_MIN_ROWS": "100000", "LEAP_PUSH_RETRIES": "0"}
    return {**env, **{f"LEAP_DRIFT_{k.upper()}": str(v) for k, v in settings.items()}}


def watch_command() -> dict:
    """One pass of `leap watch --once --json`, its printed JSON."""
    import json

    from typer.testing import CliRunner

    from leap_cli.main import app

    outcome = CliRunner().invoke(app, ["watch", "--once", "--json"])
    assert outcome.exit_code == 0, outcome.output
    return json.loads(outcome.stdout.strip().splitlines()[-1])


def test_traffic_of_another_domain_raises_live_error_and_starts_one_retrain(replica):
    home, start = replica
    r = start(rls=False)
    traffic = r["traffic"]
    with pipeline_home(home, **watch_env(home, r["url"])):
        # the domain it was fitted on: held-out rows keep live error near the validation error
        traffic.serve(r["held_out"].part(0, 32))
        first = drift_flow()
        traffic.serve(r["held_out"].part(32, 48))
        second = drift_flow()
        assert first["drift_events"] == second["drift_events"] == 0, second["decisions"]
        calm = {o["domain"]: o for o in second["observations"]}
        assert calm[FITTED_ON]["rows"] == 48
        assert calm[FITTED_ON]["mae"] < r["validation_mae"] * 1.25

        # the other domain: two observations over enough of its requests, and the watch retrains
        traffic.serve(r["shifted"].part(0, 48))
        third = drift_flow()
        traffic.serve(r["shifted"].part(48, 96))
        fourth = drift_flow()
        fifth = watch_command()  # the same figures again: the cooldown holds a second retrain back
    assert third["retrains"] == 0  # one observation is not a window
    shifted = {o["domain"]: o for o in fourth["observations"]}[SHIFTED_TO]
    assert shifted["rows"] == 96 and shifted["mae"] > 1.25 * r["validation_mae"]
    retrains = [d for d in fourth["decisions"] if d["action"] == RETRAIN]
    assert [d["acted"] for d in retrains][0] and fourth["retrains"] == 1, fourth["decisions"]
    assert retrains[0]["domain"] in (SHIFTED_TO, "all") and retrains[0]["outcome"]["started"] == "flow"
    assert retrains[0]["outcome"]["status"] in ("no-data", "not-enough-data")  # the retrain ran, found no fit
    assert fifth["retrains"] == 0 and fifth["drift_events"] >= 1
    assert {d["held_back"] for d in fifth["decisions"]} == {"retrain cooldown"}
    assert fourth["baseline"]["validation_mae"] == pytest.approx(r["validation_mae"])


def test_an_online_correction_worse_than_its_anchor_is_reset_to_the_champion(replica):
    home, start = replica
    r = start(rls=True, rls_every=8, rls_forgetting=0.98)
    runtime, traffic = r["runtime"], r["traffic"]
    # RLS, forgetting fast, follows a burst of the long domain; then the traffic goes back to the one
    # the anchor was fitted on, where the correction overshoots
    traffic.serve(r["shifted"])
    assert runtime.readouts.learner.wait_idle()
    before = runtime.readouts.anchor_prediction(r["held_out"].features[0])[1]
    with pipeline_home(home, **watch_env(home, r["url"], margin=100)):
        traffic.serve(r["held_out"].part(0, 32))
        drift_flow()
        traffic.serve(r["held_out"].part(32, 48))
        result = drift_flow()
    figures = {o["domain"]: o for o in result["observations"]}[FITTED_ON]
    assert figures["mae"] > 1.1 * figures["anchor_mae"], figures  # the correction hurts on this domain
    resets = [d for d in result["decisions"] if d["action"] == RESET]
    assert resets and resets[0]["acted"] and resets[0]["done"], result["decisions"]
    assert result["rollbacks"] == 1 and result["retrains"] == 0
    # the replica serves the champion's anchor again: RLS starts over, the figures afresh
    assert runtime.readouts.version == r["version"] and runtime.readouts.learner.stats()["updates"] == 0
    assert runtime.readouts.anchor_prediction(r["held_out"].features[0])[1] == before + 1
    assert runtime.recorder.quality.figures(FITTED_ON) is None


def _worse_champion_on_the_first_domain(replica, domains, **settings) -> tuple[dict, dict, ReadoutRegistry]:
    """The first champion observed on its own domain, then one fitted on the other domain promoted while
    the traffic stays; returns the replica, the fourth watch pass's result and the registry."""
    from flows.promotion import PushOptions, promote

    home, start = replica
    r = start(rls=False)
    registry = ReadoutRegistry(f"sqlite:///{home}/mlflow/mlflow.db")
    shifted = domains[SHIFTED_TO]
    readout, rls = fit_readout_with_anchor(shifted.features[:200], shifted.lengths[:200], alpha=30.0,
                                           max_tokens=MAX_TOKENS, metadata=readout_metadata("20260102T000000-drift002"))
    logged = registry.log_readout(readout, rls=rls, params={"data_hash": SHIFTED_TO},
                                  metrics={"mae": mae(shifted.lengths[200:250], readout.predict(shifted.features[200:250]))})
    traffic, held_out = r["traffic"], r["held_out"]
    with pipeline_home(home, **watch_env(home, r["url"], **settings)):
        for part in (held_out.part(0, 32), held_out.part(32, 48)):  # the first champion on its own domain
            traffic.serve(part)
            assert drift_flow()["drift_events"] == 0
        # a champion fitted on the other domain is promoted; the traffic stays on the first one
        promote(registry, r["name"], logged.version, [r["url"]], PushOptions(TOKEN, retries=0),
                home / "promotions")
        traffic.serve(held_out.part(0, 32))
        third = drift_flow()
        traffic.serve(held_out.part(32, 48))
        fourth = drift_flow()
    assert third["drift_events"] == 0  # one observation of the new champion is not a window
    return r, fourth, registry


def test_a_champion_worse_than_its_predecessor_on_the_same_traffic_is_rolled_back(replica, domains):
    from registry.client import PREVIOUS_CHAMPION

    r, fourth, registry = _worse_champion_on_the_first_domain(replica, domains, rollback_gate="false")
    rollbacks = [d for d in fourth["decisions"] if d["action"] == ROLLBACK and d["domain"] == "all"]
    assert rollbacks and rollbacks[0]["acted"] and rollbacks[0]["done"], fourth["decisions"]
    assert rollbacks[0]["previous_anchor_mae"] < min(rollbacks[0]["anchor_mae"]) / 1.25
    assert fourth["rollbacks"] == 1 and fourth["retrains"] == 0
    assert registry.get_alias(r["name"], CHAMPION) == "1" and registry.get_alias(r["name"], PREVIOUS_CHAMPION) == "2"
    assert r["runtime"].readouts.version == r["version"]


def test_a_fleet_wide_rollback_waits_for_the_gates_evidence(replica, domains):
    """With the gate on (the default) the rollback replays first; with no served prompt to replay here,
    the gate has no evidence and the rollback is held back: the champion stays, on the replica too."""
    r, fourth, registry = _worse_champion_on_the_first_domain(replica, domains)
    rollbacks = [d for d in fourth["decisions"] if d["action"] == ROLLBACK and d["domain"] == "all"]
    assert rollbacks and not rollbacks[0]["acted"] and "done" not in rollbacks[0], fourth["decisions"]
    assert rollbacks[0]["gate"]["passed"] is False and "LookupError" in rollbacks[0]["gate"]["reason"]
    assert rollbacks[0]["held_back"].startswith("the gate's evidence does not support it")
    assert fourth["rollbacks"] == 0 and fourth["baseline"]["previous_champion"] == "1"
    assert registry.get_alias(r["name"], CHAMPION) == "2"
    assert r["runtime"].readouts.version != r["version"]  # still the promoted champion
