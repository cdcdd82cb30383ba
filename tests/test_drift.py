"""The drift watch's decisions on recorded observations, its reading of /metrics text and its state file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from flows.drift import (
    RESET,
    RETRAIN,
    ROLLBACK,
    Baseline,
    DriftPolicy,
    DriftState,
    MetricsError,
    Observation,
    decide,
    parse_quality,
    state_file,
)

POLICY = DriftPolicy(margin=0.25, rls_margin=0.10, window=3, min_rows=64, cooldown_s=600.0)
BASE = Baseline(champion="2", champion_readout="r2", validation_mae=100.0, previous_readout="r1")


def recorded(maes, anchor_maes=None, rows=256, version="r2", replica="http://a", domain="all", start=1000.0,
             generation=1) -> list[Observation]:
    anchor_maes = anchor_maes or maes
    return [Observation(replica, domain, 0.5, float(m), float(a), rows, version, start + 60 * i, generation)
            for i, (m, a) in enumerate(zip(maes, anchor_maes))]


def state_of(*series: list[Observation], **clocks) -> DriftState:
    state = DriftState(clocks)
    for observations in series:
        for observation in observations:
            state.add(observation)
    return state


def now_of(state: DriftState) -> float:
    return max(o.time for _, _, series in state.series() for o in series)


def only(decisions: list[dict]) -> dict:
    assert len(decisions) == 1, decisions
    return decisions[0]


def test_live_error_above_the_champions_validation_error_over_the_window_retrains():
    state = state_of(recorded([110, 130, 140, 150]))
    decision = only(decide(state, BASE, POLICY, now_of(state)))
    assert decision["action"] == RETRAIN and decision["acted"]
    assert decision["mae"] == [130, 140, 150] and "validation MAE (100.0)" in decision["reason"]


def test_a_domain_is_judged_against_its_own_validation_error_where_the_fit_logged_one():
    state = state_of(recorded([130, 140, 150], domain="code"), recorded([130, 140, 150], domain="chat"))
    baseline = Baseline("2", "r2", 100.0, None, {"mae_domain_code": 140.0})
    decision = only(decide(state, baseline, POLICY, now_of(state)))
    assert decision["domain"] == "chat" and decision["validation_mae"] == 100.0
    state = state_of(recorded([180, 190, 200], domain="code"))
    decision = only(decide(state, baseline, POLICY, now_of(state)))
    assert decision["validation_mae"] == 140.0 and "on this domain (140.0)" in decision["reason"]


@pytest.mark.parametrize("maes, rows, why", [
    ([130, 120, 140], 256, "one observation within the margin"),
    ([130, 140], 256, "fewer observations than the window"),
    ([130, 140, 150], 63, "too few requests behind each"),
])
def test_no_retrain_unless_every_observation_of_the_window_shows_it(maes, rows, why):
    state = state_of(recorded(maes, rows=rows))
    assert decide(state, BASE, POLICY, now_of(state)) == [], why


def test_a_window_across_an_anchor_change_or_another_readout_or_a_silent_replica_is_not_judged():
    pushed = recorded([130, 140, 150])
    pushed[0] = Observation(**{**pushed[0].__dict__, "generation": 0})  # before a push
    state = state_of(pushed)
    assert decide(state, BASE, POLICY, now_of(state)) == []
    state = state_of(recorded([130, 140, 150], version="r9"))  # serves another readout than the champion
    assert decide(state, BASE, POLICY, now_of(state)) == []
    state = state_of(recorded([130, 140, 150]))
    assert decide(state, BASE, POLICY, now_of(state) + 60) == []  # no figures in this scrape
    assert decide(state, Baseline(None, None, None), POLICY, now_of(state)) == []  # no champion


def test_a_second_retrain_waits_for_the_cooldown_and_says_so():
    state = state_of(recorded([130, 140, 150]), last_retrain_at=1000.0)
    now = now_of(state)
    decision = only(decide(state, BASE, POLICY, now))
    assert not decision["acted"] and decision["held_back"] == "retrain cooldown"
    state.last_retrain_at = now - POLICY.cooldown_s
    assert only(decide(state, BASE, POLICY, now))["acted"]


def test_one_retrain_per_run_however_many_replicas_and_domains_drift():
    state = state_of(recorded([130, 140, 150]), recorded([130, 140, 150], replica="http://b"),
                     recorded([130, 140, 150], domain="math"))
    decisions = decide(state, BASE, POLICY, now_of(state))
    assert [d["action"] for d in decisions] == [RETRAIN] * 3
    assert [d["acted"] for d in decisions] == [True, False, False]
    assert {d.get("held_back") for d in decisions[1:]} == {"one retrain per run"}


def test_an_online_correction_worse_than_its_anchor_resets_that_replica_first():
    corrected = recorded([130, 140, 150], anchor_maes=[90, 95, 100], version="r2+rls7")
    state = state_of(corrected, recorded([90, 95, 100], version="r2+rls3", replica="http://b"))
    decision = only(decide(state, BASE, POLICY, now_of(state)))
    assert decision["action"] == RESET and decision["replica"] == "http://a" and decision["acted"]
    assert "anchor" in decision["reason"]
    # within the margin, or not corrected at all (the anchor serves), nothing to reset
    state = state_of(recorded([105, 105, 105], anchor_maes=[100, 100, 100], version="r2+rls7"))
    assert decide(state, BASE, POLICY, now_of(state)) == []
    state = state_of(recorded([150, 150, 150], anchor_maes=[100, 100, 100], version="r2"))
    assert only(decide(state, BASE, POLICY, now_of(state)))["action"] == RETRAIN


def test_resets_have_a_cooldown_per_replica():
    state = state_of(recorded([130, 140, 150], anchor_maes=[90, 95, 100], version="r2+rls7"),
                     recorded([130, 140, 150], anchor_maes=[90, 95, 100], version="r2+rls7", replica="http://b"),
                     last_reset_at={"http://a": 1100.0})
    decisions = decide(state, BASE, POLICY, now_of(state))
    assert [(d["replica"], d["acted"]) for d in decisions] == [("http://a", False), ("http://b", True)]


def test_a_champion_worse_than_the_previous_one_was_on_the_same_traffic_is_rolled_back():
    before = recorded([80, 82, 84, 81, 80], version="r1", start=0.0, generation=0)
    after = recorded([120, 125, 130], version="r2", start=1000.0, generation=1)
    state = state_of(before + after)
    decisions = decide(state, BASE, POLICY, now_of(state))
    assert decisions[0]["action"] == ROLLBACK and decisions[0]["acted"]
    assert decisions[0]["previous_anchor_mae"] == 81
    # the rollback re-anchors every replica: a retrain found this run waits
    state = state_of(before + after, recorded([130, 140, 150], replica="http://b"))
    decisions = decide(state, BASE, POLICY, now_of(state))
    assert [(d["action"], d["acted"]) for d in decisions] == [(ROLLBACK, True), (RETRAIN, False)]
    # no previous champion observed, or as good as it: no rollback
    state = state_of(recorded([80, 82, 84], version="r1", start=0.0, generation=0) + recorded([90, 95, 99]))
    assert decide(state, BASE, POLICY, now_of(state)) == []


METRICS = """# HELP leap:rolling_mae_tokens MAE
# TYPE leap:rolling_mae_tokens gauge
leap:rolling_mae_tokens{domain="all"} 120.5
leap:rolling_mae_tokens{domain="math"} 80.0
leap:rolling_mae_tokens{domain="half"} 3.0
# TYPE leap:anchor_mae_tokens gauge
leap:anchor_mae_tokens{domain="all"} 100.0
leap:anchor_mae_tokens{domain="math"} NaN
# TYPE leap:rolling_spearman gauge
leap:rolling_spearman{domain="all"} 0.6
leap:rolling_spearman{domain="math"} 0.4
# TYPE leap:rolling_requests gauge
leap:rolling_requests{domain="all"} 256.0
leap:rolling_requests{domain="math"} 40.0
# TYPE leap:anchor_generation gauge
leap:anchor_generation 3.0
"""


def test_the_quality_gauges_are_read_per_domain_and_a_domain_missing_figures_is_left_out():
    observations = {o.domain: o for o in parse_quality(METRICS, "http://a", "r2+rls1", 5.0)}
    assert set(observations) == {"all", "math"}
    assert observations["all"] == Observation("http://a", "all", 0.6, 120.5, 100.0, 256, "r2+rls1", 5.0, 3)
    assert math.isnan(observations["math"].anchor_mae) and observations["math"].rows == 40


def test_metrics_that_are_not_prometheus_text_are_refused_with_the_replica_named():
    with pytest.raises(MetricsError, match="http://a"):
        parse_quality("leap:rolling_mae_tokens{domain=\"all\" 1\n", "http://a", "", 0.0)


def test_the_state_survives_runs_keeps_a_bounded_history_and_sets_a_broken_file_aside(tmp_path):
    path = tmp_path / "drift" / "watch.json"
    with state_file(path, keep=4) as (state, notes):
        for observation in recorded(range(100, 110)):
            state.add(observation)
        state.last_retrain_at = 1234.0
        assert notes == {}
    with state_file(path, keep=4) as (state, notes):
        series = state.observations["http://a"]["all"]
        assert [o.mae for o in series] == [106, 107, 108, 109] and state.last_retrain_at == 1234.0
        state.last_reset_at = {"http://a": 1.0, "http://gone": 2.0}
        state.add(recorded([1], replica="http://gone")[0])
        assert state.keep_replicas(["http://a"]) == ["http://gone"]
        assert list(state.observations) == ["http://a"] and state.last_reset_at == {"http://a": 1.0}
    path.write_text("{not json")
    with state_file(path, keep=4) as (state, notes):
        assert state.observations == {}
    aside = notes["state_set_aside"]["path"]
    assert open(aside).read() == "{not json" and "JSONDecodeError" in notes["state_set_aside"]["reason"]
    assert json.loads(path.read_text())["observations"] == {}


def test_the_replica_keeps_figures_per_domain_since_its_anchor_and_caps_the_domains():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from serving.feedback.recorder import DomainQuality
    from serving.telemetry import Telemetry

    telemetry = Telemetry()
    generation = [1]
    quality = DomainQuality(telemetry, lambda: generation[0], window=4, max_domains=2)
    for predicted, anchored, true in [(10, 20, 12), (30, 20, 33), (50, 60, 40), (70, 70, 90), (90, 80, 100)]:
        quality.add(predicted, anchored, true, "math", 1)
    quality.add(5, 5, 5, "code", 1)
    quality.add(5, 5, 5, "chat", 1)  # a third domain: counted in "all" only
    math_rows = [(30, 20, 33), (50, 60, 40), (70, 70, 90), (90, 80, 100)]  # the window keeps the last 4
    assert quality.figures("math") == {"spearman": 1.0, "rows": 4,
                                       "mae": float(np.mean([abs(t - p) for p, _, t in math_rows])),
                                       "anchor_mae": float(np.mean([abs(t - a) for _, a, t in math_rows]))}
    assert quality.figures("all")["rows"] == 4 and quality.figures("chat") is None
    assert telemetry.dropped("quality_row", "domain_cap") == 1
    scraped = {(s.name, s.labels.get("domain")): s.value
               for f in text_string_to_metric_families(generate_latest(telemetry.registry).decode())
               for s in f.samples}
    assert scraped[("leap:rolling_requests", "math")] == 4 and scraped[("leap:anchor_generation", None)] == 1
    assert scraped[("leap:anchor_mae_tokens", "math")] == quality.figures("math")["anchor_mae"]
    generation[0] = 2  # a push: the next scrape reports nothing of the previous readout
    assert quality.domains() == [] and quality.generation == 2


def test_no_tenant_carries_more_than_its_cap_of_the_quality_weight():
    from serving.feedback.tenant_share import capped_weights

    def tenant_weight(tenants, cap):
        weights = capped_weights(tenants, cap)
        assert weights.sum() == pytest.approx(1.0)
        return {t: pytest.approx(sum(w for u, w in zip(tenants, weights) if u == t)) for t in set(tenants)}

    assert tenant_weight(["a"] * 9 + ["b"], 0.5) == {"a": 0.5, "b": 0.5}
    # the cap's excess goes to the others in proportion to their shares
    assert tenant_weight(["a"] * 6 + ["b"] * 3 + ["c"], 0.5) == {"a": 0.5, "b": 0.375, "c": 0.125}
    assert tenant_weight(["a"] * 2 + ["b"] * 3 + [None] * 5, 0.6) == {"a": 0.2, "b": 0.3, None: 0.5}
    # one tenant, no cap, or a cap that cannot hold with so few tenants
    assert list(capped_weights(["a"] * 4, 0.5)) == [0.25] * 4
    assert list(capped_weights(["a", "a", "a", "b"], None)) == [0.25] * 4
    assert tenant_weight(["a"] * 8 + ["b"] * 2, 0.3) == {"a": 0.5, "b": 0.5}
    assert capped_weights([], 0.5).size == 0


def test_a_flooding_tenant_moves_the_replica_figures_by_at_most_its_cap():
    from serving.feedback.recorder import DomainQuality
    from serving.telemetry import Telemetry

    honest, flood = (100, 100, 110), (100, 100, 400)  # (predicted, anchor-predicted, true length)
    capped = DomainQuality(Telemetry(), window=64, tenant_max_share=0.5)
    uncapped = DomainQuality(Telemetry(), window=64)
    for quality in (capped, uncapped):
        for _ in range(8):
            quality.add(*honest, None, 0, tenant="steady")
        for _ in range(56):
            quality.add(*flood, None, 0, tenant="flooder")
    assert uncapped.figures()["mae"] == pytest.approx((8 * 10 + 56 * 300) / 64)
    assert capped.figures()["mae"] == pytest.approx(0.5 * 10 + 0.5 * 300)
    assert capped.figures()["anchor_mae"] == capped.figures()["mae"] and capped.figures()["rows"] == 64


def test_a_champion_worse_on_one_client_named_domain_alone_is_not_rolled_back_fleet_wide():
    before = recorded([80, 82, 84, 81, 80], version="r1", start=0.0, generation=0, domain="tenant-named")
    after = recorded([120, 125, 130], version="r2", start=1000.0, generation=1, domain="tenant-named")
    state = state_of(before + after)
    [decision] = decide(state, BASE, POLICY, now_of(state))
    assert decision["action"] == ROLLBACK and not decision["acted"]
    assert "domain 'all'" in decision["held_back"]
    # the same evidence over every request rolls back, and the domain's finding rides along unacted
    everyone = recorded([80, 82, 84, 81, 80], version="r1", start=0.0, generation=0) + recorded(
        [120, 125, 130], version="r2", start=1000.0, generation=1)
    state = state_of(before + after + everyone)
    acted = [(d["domain"], d["acted"]) for d in decide(state, BASE, POLICY, now_of(state))]
    assert sorted(acted) == [("all", True), ("tenant-named", False)]
