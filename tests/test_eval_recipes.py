"""The recipe study's parts on synthetic corpus rows: the capture layout, the choice, the figures, RLS."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation import recipes as recipes_study
from evaluation.recipes import RecipeRows, capture_ms, capture_of, capture_rows, run_recipes
from leap_core.recipes import DOMAIN_VALUE, Recipe, request_columns
from study_harness.corpus import Corpus
from study_harness.recipe_corpus import WIDE_RECIPE, joined

H = 6


def _corpus(n: int, seed: int, sets: tuple[str, ...], domains: tuple[str, ...]) -> Corpus:
    """Rows whose length is driven by the mean@17 block (the 4th block of the wide recipe) plus noise."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, len(WIDE_RECIPE.blocks) * H)).astype(np.float32)
    mean17 = WIDE_RECIPE.offsets(H)["mean@17"][0]
    lengths = np.clip((12 + 5 * features[:, mean17] + rng.normal(scale=1.0, size=n)) ** 2, 1, 512).astype(int)
    pick = np.arange(n) % len(sets)
    return Corpus(np.asarray([f"p{seed}-{i}" for i in range(n)], dtype=object), np.asarray(sets, dtype=object)[pick],
                  np.asarray(domains, dtype=object)[pick], np.full(n, "en", dtype=object),
                  rng.integers(5, 400, n), lengths, np.where(lengths >= 512, "length", "stop").astype(object),
                  features, -2, 512)


def test_capture_rows_lay_out_the_corpus_as_serving_captures_it():
    corpus = _corpus(5, 0, ("sharegpt",), ("chat",))
    capture = capture_of(["chat", "math"])
    rows = capture_rows(corpus, capture, {"temperature": 0.7, "top_p": 0.9})
    assert rows.matrix.shape == (5, capture.dim(H))
    k = 2
    extra = request_columns(capture, int(corpus.prompt_tokens[k]), {"temperature": 0.7, "top_p": 0.9}, 512, "chat")
    tail = np.concatenate([extra["prompt"], extra["decoding"], extra["domain=chat/math"]])
    np.testing.assert_allclose(rows.matrix[k, -tail.size:], tail, rtol=1e-6)
    np.testing.assert_array_equal(rows.X("last@17"), corpus.features[:, H:2 * H])
    assert rows.X("domain=chat/math+last@14")[k, 0] == DOMAIN_VALUE


def test_joined_takes_features_by_prompt_id_in_the_labels_order():
    features = _corpus(4, 1, ("sharegpt",), ("chat",))
    labels = features.subset(np.array([3, 1]))
    labels.features = np.zeros((2, 1), np.float32)
    rows = joined(features, labels)
    np.testing.assert_array_equal(rows.features, features.features[[3, 1]])
    assert rows.ids.tolist() == [features.ids[3], features.ids[1]]


def test_the_study_chooses_on_training_rows_and_scores_every_recipe_per_set():
    capture = capture_of(["chat", "math"])
    train = capture_rows(_corpus(300, 2, ("sharegpt",), ("chat",)), capture, {})
    held = capture_rows(_corpus(120, 3, ("sharegpt", "gsm8k"), ("chat", "math")), capture, {})
    candidates = ["last@22", "mean@17", "last@17+mean@17"]
    result = run_recipes(train, held, candidates, n_boot=50, costs={})
    assert result["chosen"] in ("mean@17", "last@17+mean@17")
    assert set(result["recipes"]) == set(candidates)  # last@22, the default, is among them
    for name, figures in result["recipes"].items():
        assert set(figures["spearman"]) == {"sharegpt", "gsm8k", "pooled"}
        for value in figures["spearman"].values():
            assert set(value) >= {"value", "ci_low", "ci_high"}
        assert figures["bytes_per_row"] == 4 * Recipe.parse(name).dim(H)
        assert figures["cost_ms"] is None and figures["predict_ms"] > 0
    assert result["recipes"]["mean@17"]["spearman"]["pooled"]["value"] > \
        result["recipes"]["last@22"]["spearman"]["pooled"]["value"] + 0.3
    gain = result["recipes"]["mean@17"]["spearman_vs_default"]
    assert gain["gsm8k"]["ci_low"] > 0.3 and result["recipes"]["last@22"]["spearman_vs_default"]["pooled"]["value"] == 0
    # RLS: the default and the chosen recipe, each with and without per-domain intercepts, on the math rows
    assert set(result["rls"]) == {"last@22", result["chosen"], "last@22+domain=chat/math",
                                  f"{result['chosen']}+domain=chat/math"}
    assert result["rls"]["last@22"]["math"]["feedback"] == 30
    # every recipe in every target: validated, and scored on ShareGPT with an interval and the paired
    # difference from its sqrt target; the served pair is the best validated one
    assert result["chosen_target"] in recipes_study.TARGETS == ("sqrt", "log", "rank", "softbin")
    assert set(result["targets"]) == set(candidates)
    for name, per in result["targets"].items():
        assert set(per) == set(recipes_study.TARGETS)
        assert set(per["log"]["spearman"]) == {"sharegpt"} and per["log"]["n"]["sharegpt"] == 60
        assert per["sqrt"]["spearman_vs_sqrt"]["sharegpt"]["value"] == 0
        assert per["sqrt"]["spearman"]["sharegpt"] == pytest.approx(result["recipes"][name]["spearman"]["sharegpt"])
    # the served pair: the smallest recipe within one standard error of the best validated pair
    best = max(row["spearman"] for row in result["validation"])
    chosen = result["targets"][result["chosen"]][result["chosen_target"]]
    choice = result["choice"]
    assert choice["rule"].startswith("one standard error") and choice["best_spearman"] == best
    assert best - chosen["validation_spearman"] == pytest.approx(choice["gap"]) and choice["gap"] <= choice["gap_se"]
    assert choice["gap_ci_low"] <= choice["gap"] <= choice["gap_ci_high"]
    smaller = [row for row in result["validation"] if row["dim"] < Recipe.parse(result["chosen"]).dim(H)]
    assert all(best - row["spearman"] > row["gap_se"] for row in smaller)


def test_domain_intercepts_correct_two_domains_shifted_apart_where_one_intercept_cannot():
    capture = capture_of(["chat", "instruction", "math"])
    train = capture_rows(_corpus(300, 4, ("sharegpt",), ("chat",)), capture, {})
    longer, shorter = _corpus(200, 5, ("gsm8k",), ("math",)), _corpus(200, 7, ("alpaca",), ("instruction",))
    longer.output_tokens = np.clip(longer.output_tokens * 3, 1, 512)  # math runs 3x longer
    shorter.output_tokens = np.clip(shorter.output_tokens // 3, 1, 512)  # instruction 3x shorter
    held = RecipeRows.concat([capture_rows(_corpus(40, 6, ("sharegpt",), ("chat",)), capture, {}),
                              capture_rows(longer, capture, {}), capture_rows(shorter, capture, {})])
    result = run_recipes(train, held, ["mean@17"], n_boot=20, costs={})
    plain, per_domain = result["rls"]["mean@17"], result["rls"]["mean@17+domain=chat/instruction/math"]
    for domain in ("math", "instruction"):
        assert plain[domain]["feedback"] == 100 and per_domain[domain]["feedback"] == 100  # one mixed stream
        assert per_domain[domain]["rls"]["mae"] < per_domain[domain]["frozen"]["mae"]
        assert per_domain[domain]["rls"]["mae"] < plain[domain]["rls"]["mae"]


def test_capture_cost_is_the_measured_one_or_the_sum_of_block_costs():
    costs = {"recipes": {"last@22": {"capture_ms_per_request": 0.5}}, "capture_ms_base": 0.1,
             "capture_ms_per_block": {"last": 0.01, "mean@17": 0.2, "entropy@17": 2.0, "prompt": 0.001}}
    assert capture_ms(Recipe.parse("last@22"), costs) == 0.5
    assert abs(capture_ms(Recipe.parse("last@17+mean@17+prompt"), costs) - 0.311) < 1e-9
    assert capture_ms(Recipe.parse("mean@22"), costs) is None
