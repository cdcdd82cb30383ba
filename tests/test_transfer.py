"""The transfer study's figures: intervals over the evaluation rows, per set, within set, and the gap closed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from evaluation.baselines import LengthData
from evaluation.transfer import fit_leap, fit_leap_anchored, run_transfer, section_transfer
from leap_core.rls import RLS
from leap_io.jsonable import dumps

MAX_TOKENS = 1024


def two_sets(n: int, seed: int, shift: float = 0.0) -> LengthData:
    """Two prompt sets: "short" and "long" outputs, told apart by prompt length; within a set, the length
    follows a direction of the features that `shift` rotates (a new domain)."""
    rng = np.random.default_rng(seed)
    d = 12
    X = rng.normal(size=(n, d)).astype(np.float32)
    sets = np.where(np.arange(n) % 2 == 0, "short", "long").astype(object)
    w = np.zeros(d)
    w[0], w[1] = np.cos(shift), np.sin(shift)
    base = np.where(sets == "short", 8.0, 22.0)
    X[:, 2] = np.where(sets == "short", -2.0, 2.0) + 0.1 * rng.normal(size=n)  # the set shows in the state
    lengths = np.clip((base + 3 * X @ w + rng.normal(scale=0.5, size=n)) ** 2, 1, MAX_TOKENS).astype(np.int64)
    prompt_tokens = np.where(sets == "short", 20, 200)
    return LengthData(ids=np.array([f"s{seed}-{i}" for i in range(n)], dtype=object), texts=["x"] * n,
                      prompt_tokens=prompt_tokens, features=X, lengths=lengths, max_tokens=MAX_TOKENS, sets=sets)


class PromptLength:
    """Predicts from the prompt length alone: it knows the set, nothing within it."""

    def predict(self, data: LengthData) -> np.ndarray:
        return np.asarray(data.prompt_tokens, dtype=np.float64) * 3.0


@pytest.fixture(scope="module")
def result():
    train, target = two_sets(600, seed=1), two_sets(700, seed=2, shift=1.2)
    return run_transfer(train, target, {"prompt_length": PromptLength()}, counts=(50, 200, 500), n_boot=400)


def test_anchored_fit_is_fit_leap_and_its_anchor():
    data = two_sets(200, seed=3)
    readout, rls = fit_leap_anchored(data, alpha=10.0)
    reference = fit_leap(data, alpha=10.0)
    np.testing.assert_array_equal(readout.theta_, reference.theta_)
    expected = RLS.from_readout(reference, data.features).state_arrays()
    for key, value in rls.state_arrays().items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)


def test_every_spearman_carries_an_interval_per_set_and_pooled(result):
    assert result["n_eval"] == 200 and result["n_feedback_pool"] == 500
    assert result["baseline_hyperparameters"] == {"prompt_length": {"params": {}}}  # only `predict`: none
    figures = result["metrics"]
    for entry in [figures["frozen"], figures["refit"], *figures["rls"].values()]:
        assert set(entry["per_set"]) == {"short", "long"}
        assert sum(e["n"] for e in entry["per_set"].values()) == entry["pooled"]["n"] == 200
        for figure in [entry["pooled"], *entry["per_set"].values()]:
            for key in ("spearman", "mae"):
                assert figure[key]["ci_low"] <= figure[key]["value"] <= figure[key]["ci_high"]
        within = entry["within_set_spearman"]
        assert within["sets"] == ["long", "short"] and within["ci_low"] <= within["value"] <= within["ci_high"]
    # the flat figures (the former layout) are the pooled point values
    assert result["spearman_frozen"] == figures["frozen"]["pooled"]["spearman"]["value"]
    assert result["spearman_rls"] == {k: v["pooled"]["spearman"]["value"] for k, v in figures["rls"].items()}
    assert set(result["per_set_frozen"]) == {"short", "long"}
    assert result["censored_share"] == pytest.approx(figures["frozen"]["pooled"]["censored_share"])
    baseline = figures["baselines"]["prompt_length"]
    assert baseline["pooled"]["spearman"]["ci_low"] <= baseline["pooled"]["spearman"]["value"]


def test_prompt_length_wins_pooled_but_not_within_a_set(result):
    """The issue's trap: pooled Spearman credits a predictor that only tells the sets apart."""
    baseline = result["metrics"]["baselines"]["prompt_length"]
    assert baseline["pooled"]["spearman"]["value"] > 0.6
    assert np.isnan(baseline["within_set_spearman"]["value"])  # constant within each set: no ranking at all
    refit = result["metrics"]["refit"]["within_set_spearman"]
    assert refit["ci_low"] > 0.5


def test_gap_closed_has_an_interval_at_every_feedback_count(result):
    gap = result["gap_closed"]
    assert gap["feedback"] == 500 and set(gap["by_count"]) == {"50", "200", "500"}
    assert gap["ci_low"] <= gap["fraction"] <= gap["ci_high"]
    assert gap["fraction"] == gap["by_count"]["500"]["value"]
    frozen, refit, rls = result["spearman_frozen"], result["spearman_refit"], result["spearman_rls"]["500"]
    assert gap["fraction"] == pytest.approx((rls - frozen) / (refit - frozen))
    for figure in gap["within_set"].values():
        assert figure["spearman"] == "within_set" and figure["ci_low"] <= figure["value"] <= figure["ci_high"]
    assert gap["by_count"]["50"]["ci_high"] - gap["by_count"]["50"]["ci_low"] > 0


def test_section_shows_intervals_and_the_within_set_table(result):
    saved = json.loads(dumps({**result, "_name": "transfer-two-sets", "command": "leap eval transfer"}))
    text = section_transfer([saved], "transfer.png")
    frozen = saved["metrics"]["frozen"]["pooled"]["spearman"]
    assert f"{frozen['value']:.3f} [{frozen['ci_low']:.2f}, {frozen['ci_high']:.2f}]" in text
    assert "Within-set Spearman" in text and "| two-sets | long, short |" in text
    assert "% [" in text  # the gap closed with its interval
    # a result saved before intervals existed still renders
    legacy = {key: saved[key] for key in ("n_eval", "spearman_frozen", "spearman_rls", "spearman_refit",
                                          "spearman_baselines")}
    assert f"{saved['spearman_frozen']:.3f}" in section_transfer([legacy], "transfer.png")
