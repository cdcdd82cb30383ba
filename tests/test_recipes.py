"""Feature recipes (names, layout, column selection), pooling across chunks, and the recipe choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leap_core.recipe_choice import choose_recipe, validate_recipe, validate_recipes
from leap_core.recipes import (
    DECODING_COLUMNS,
    DOMAIN_VALUE,
    Recipe,
    RecipeError,
    decoding_columns,
    domain_columns,
    readout_recipe,
    request_columns,
    union,
)
from serving.capture.pooling import PromptPool, entropy_of_logits, prompt_rows
from tests.recipe_reference import entropy_weights, pooled

H = 4


def test_a_name_round_trips_and_says_what_the_vector_holds():
    recipe = Recipe.parse("last@17+mean@22+prompt+decoding+domain=chat/math")
    assert str(recipe) == "last@17+mean@22+prompt+decoding+domain=chat/math"
    assert recipe.layers == (17, 22)
    assert recipe.dim(H) == H + H + 1 + len(DECODING_COLUMNS) + 2
    assert recipe.offsets(H)["mean@22"] == (H, 2 * H)
    assert recipe.pools and not Recipe.parse("last@3").pools


@pytest.mark.parametrize("bad", ["", "last", "last@x", "max@3", "prompt", "last@3+last@3",
                                 "last@1+domain=a/a", "last@1+domain=a+domain=b", "last@1+domain=a b"])
def test_bad_names_are_refused_with_a_reason(bad):
    with pytest.raises(RecipeError):
        Recipe.parse(bad)


def test_layers_are_checked_against_the_model_and_negative_ones_count_from_the_end():
    assert str(Recipe.parse("last@-1").check_layers(30)) == "last@29"
    with pytest.raises(RecipeError, match="30 decoder layers"):
        Recipe.parse("mean@30").check_layers(30)


def test_a_readout_recipe_reads_its_columns_out_of_a_wider_capture():
    capture = Recipe.parse("last@1+last@2+mean@2+prompt+domain=a/b/c")
    vector = np.arange(capture.dim(H))
    columns = Recipe.parse("mean@2+last@1+domain=c/a").columns(capture, H)
    # mean@2 is the third block, last@1 the first, then the c and a indicators
    np.testing.assert_array_equal(vector[columns], [8, 9, 10, 11, 0, 1, 2, 3, 15, 13])
    assert not Recipe.parse("entropy@2").covered_by(capture, H)
    with pytest.raises(RecipeError, match="domains"):
        Recipe.parse("last@1+domain=d").columns(capture, H)


def test_union_holds_every_block_once_in_a_fixed_order():
    wide = union(["mean@3+last@5", "last@2+prompt", "last@5+domain=x", "last@2+domain=y/x"])
    assert str(wide) == "last@2+last@5+mean@3+prompt+domain=x/y"
    for name in ("mean@3+last@5", "last@2+prompt", "last@5+domain=x", "last@2+domain=y/x"):
        assert Recipe.parse(name).covered_by(wide, H)


def test_readouts_from_before_recipes_are_the_last_token_of_their_layer():
    assert str(readout_recipe({"layer": 22})) == "last@22"
    assert str(readout_recipe({"layer": 22, "recipe": "last@17+mean@17"})) == "last@17+mean@17"
    with pytest.raises(RecipeError):
        readout_recipe({})


def test_request_columns_follow_the_settings_and_default_to_greedy():
    recipe = Recipe.parse("last@1+prompt+decoding+domain=chat/math")
    cols = request_columns(recipe, 99, {"temperature": 0.7, "top_p": 0.9, "frequency_penalty": None}, 1023, "math")
    np.testing.assert_allclose(cols["prompt"], [np.log(100)], rtol=1e-6)
    np.testing.assert_allclose(cols["decoding"], [0.7, 0.9, np.log(1024), 1.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(cols["domain=chat/math"], [0.0, DOMAIN_VALUE])
    assert decoding_columns({}, 0)[0] == 0.0 and decoding_columns({}, 0)[1] == 1.0
    assert not domain_columns(("chat",), "unknown").any()


def test_entropy_weights_are_the_entropy_of_each_rows_softmax():
    logits = np.array([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(entropy_weights(logits), [np.log(4), 0.0], atol=1e-9)
    np.testing.assert_allclose(entropy_of_logits(torch.tensor(logits)).numpy(), [np.log(4), 0.0], atol=1e-5)
    states = np.array([[1.0, 0.0], [3.0, 2.0]])
    np.testing.assert_allclose(pooled(states), [2.0, 1.0])
    np.testing.assert_allclose(pooled(states, np.array([1.0, 3.0])), [2.5, 1.5])


def test_prompt_rows_take_only_the_prompt_part_of_each_request():
    # r0: prompt chunk of 3 (computed 2 of 5 -> rows 0..2); r1: decode (computed 6 >= prompt 4);
    # r2: prompt of 4 computed from 0, 6 rows scheduled (4 prompt rows, then 2 beyond, as with drafts)
    index, counts, rows = prompt_rows(np.array([2, 6, 0]), np.array([5, 4, 4]), np.array([0, 3, 4, 10]))
    assert index.tolist() == [0, 2] and counts.tolist() == [3, 4]
    assert rows.tolist() == [0, 1, 2, 4, 5, 6, 7]


def _pool_steps(recipe: Recipe, prompt: np.ndarray, logits: np.ndarray, chunk: int) -> np.ndarray:
    """Feed one request's prompt through PromptPool in chunks of `chunk` rows; return its pooled vector."""
    pool = PromptPool(recipe, list(recipe.layers), lambda final: torch.from_numpy(logits)[final[:, 0].long()])
    n = prompt.shape[0]
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        state = torch.from_numpy(prompt[start:stop]).float()
        # the final state's first column carries the row's position, so the fake head finds its logits
        final = torch.arange(start, stop, dtype=torch.float32)[:, None].repeat(1, 2)
        pool.add(["r"], np.array([start]), np.array([n]), np.array([0, stop - start]), [state], final)
    out = pool.pop(["r"])
    assert out is not None and len(pool) == 0
    return out.numpy()[0]


def test_pooling_across_prefill_chunks_equals_pooling_the_whole_prompt():
    rng = np.random.default_rng(0)
    prompt = rng.normal(size=(11, H))
    logits = rng.normal(size=(11, 7)) * 3
    recipe = Recipe.parse("mean@0+entropy@0")
    whole = np.concatenate([pooled(prompt), pooled(prompt, entropy_weights(logits))])
    for chunk in (11, 4, 1):
        np.testing.assert_allclose(_pool_steps(recipe, prompt, logits, chunk), whole, rtol=1e-5, atol=1e-6)


def test_a_restarted_prefill_starts_a_fresh_sum_and_an_evicted_one_is_reported_lost():
    recipe = Recipe.parse("mean@0")
    pool = PromptPool(recipe, [0], lambda final: final, max_requests=1)
    ones, twos = torch.ones((2, H)), 2 * torch.ones((2, H))
    pool.add(["a"], np.array([0]), np.array([4]), np.array([0, 2]), [ones], None)
    pool.add(["a"], np.array([0]), np.array([4]), np.array([0, 2]), [twos], None)  # recomputed from token 0
    pool.add(["a"], np.array([2]), np.array([4]), np.array([0, 2]), [twos], None)
    np.testing.assert_allclose(pool.pop(["a"]).numpy()[0], 2.0)
    pool.add(["a"], np.array([0]), np.array([4]), np.array([0, 2]), [ones], None)
    pool.add(["b"], np.array([0]), np.array([4]), np.array([0, 2]), [ones], None)  # evicts a
    assert pool.evicted == 1
    pool.add(["a"], np.array([2]), np.array([4]), np.array([0, 2]), [ones], None)  # a partial sum: not kept
    assert pool.pop(["a"]) is None


def test_the_choice_prefers_the_recipe_whose_columns_carry_the_signal():
    rng = np.random.default_rng(1)
    n = 400
    signal, noise = rng.normal(size=(n, 3)), rng.normal(size=(n, 3))
    lengths = np.clip((8 + 3 * signal[:, 0] + rng.normal(scale=0.5, size=n)) ** 2, 1, 512)
    table = validate_recipes({"noise": noise, "signal": signal, "both": np.hstack([noise, signal])}, lengths,
                             max_tokens=512)
    assert table[0]["spearman"] >= table[1]["spearman"] >= table[2]["spearman"]
    assert table[-1]["recipe"] == "noise" and table[-1]["spearman"] < 0.2
    # signal and both differ by noise: one standard error of their gap lets the smaller one win
    assert choose_recipe(table)["recipe"] == "signal"
    assert choose_recipe(table, n_se=0.0) is table[0]  # no allowance: the best score wins
    assert choose_recipe(table, n_se=1e6)["dim"] == 3  # any allowance: the smallest recipe
    with pytest.raises(ValueError, match="n_se"):
        choose_recipe(table, n_se=-1.0)
    best, noise = table[0], table[-1]
    assert (best["gap"], best["gap_se"]) == (0.0, 0.0)
    assert noise["gap"] == pytest.approx(best["spearman"] - noise["spearman"])
    assert 0 < noise["gap_ci_low"] <= noise["gap"] <= noise["gap_ci_high"] and noise["gap_se"] > 0


def test_each_gap_s_standard_error_matches_scipy_s_paired_bootstrap():
    from scipy import stats

    from leap_core.metrics import spearman_difference

    rng = np.random.default_rng(5)
    n = 300
    X = rng.normal(size=(n, 4))
    lengths = np.clip((10 + 3 * X[:, 0] + 2 * X[:, 1] + rng.normal(scale=2.0, size=n)) ** 2, 1, 1024)
    table = validate_recipes({"two": X[:, :2], "one": X[:, :1]}, lengths, max_tokens=1024, n_boot=2000)
    best, other = table
    assert best["recipe"] == "two" and other["gap_ci_low"] > 0  # the second signal column is real
    # the same gap from scipy: the held-out predictions again, resampled as pairs
    from leap_core.recipe_choice import _validate

    _, held_best = _validate(X[:, :2], lengths, max_tokens=1024, target="sqrt")
    _, held_other = _validate(X[:, :1], lengths, max_tokens=1024, target="sqrt")
    def difference(true, a, b):
        return stats.spearmanr(true, a)[0] - stats.spearmanr(true, b)[0]

    reference = stats.bootstrap((lengths, held_best, held_other), difference, paired=True, vectorized=False,
                                n_resamples=2000, random_state=1)
    assert other["gap_se"] == pytest.approx(reference.standard_error, rel=0.15)
    assert other["gap"] == pytest.approx(float(spearman_difference(lengths, held_best, held_other)), abs=1e-9)


def test_each_recipe_and_target_is_one_validation_row_and_a_tie_goes_to_the_first_target():
    rng = np.random.default_rng(3)
    n = 400
    X = rng.normal(size=(n, 3)) * np.array([1.0, 0.3, 0.1])
    lengths = np.clip(np.exp(4.0 + X @ np.array([1.0, 0.5, 0.2]) + rng.normal(scale=0.2, size=n)), 1, 1024)
    table = validate_recipes({"x": X, "first": X[:, :1]}, lengths, max_tokens=1024, targets=["sqrt", "log", "sqrt"])
    assert sorted((row["recipe"], row["target"]) for row in table) == [
        ("first", "log"), ("first", "sqrt"), ("x", "log"), ("x", "sqrt")]
    assert [row["spearman"] for row in table] == sorted((row["spearman"] for row in table), reverse=True)
    assert choose_recipe(table) is table[0]
    # the same score: the smaller recipe, then the target listed first in leap_core.targets.TARGETS
    tied = [{"recipe": "a", "target": "log", "spearman": 0.5, "dim": 3},
            {"recipe": "a", "target": "sqrt", "spearman": 0.5, "dim": 3},
            {"recipe": "b", "target": "log", "spearman": 0.5, "dim": 2}]
    assert choose_recipe(tied[:2])["target"] == "sqrt"
    assert choose_recipe(tied)["recipe"] == "b"
    with pytest.raises(ValueError, match="unknown target"):
        validate_recipes({"x": X}, lengths, max_tokens=1024, targets=["cube"])
    # without candidates every row is in `target`
    assert {row["target"] for row in validate_recipes({"x": X}, lengths, max_tokens=1024, target="log")} == {"log"}


def test_a_newest_rows_split_scores_only_the_newest_rows():
    from leap_core.alpha import newest_split

    rng = np.random.default_rng(2)
    X = rng.normal(size=(50, 2))
    row = validate_recipe(X, rng.integers(1, 100, 50), max_tokens=128, cv=newest_split(50, 0.2))
    assert row["n"] == 10 and row["dim"] == 2


def _every_study_recipe():
    from evaluation.recipes import CANDIDATES

    return [*CANDIDATES, "last@17+mean@17+prompt+decoding+domain=chat/math"]


@pytest.mark.parametrize("name", _every_study_recipe())
def test_anchored_rls_equals_one_ridge_solve_on_training_and_feedback_rows_for_every_recipe(name):
    """The RLS equivalence (leap_core.rls) on each study recipe's columns of one wide capture."""
    from leap_core import targets
    from leap_core.rls import fit_readout_with_anchor

    hidden = 5
    capture = union([*_every_study_recipe()])
    rng = np.random.default_rng(3)

    def rows(n: int, domain: str, temperature: float) -> np.ndarray:
        out = rng.normal(size=(n, capture.dim(hidden)))
        for i in range(n):  # the request columns as serving fills them
            cols = request_columns(capture, int(rng.integers(5, 500)), {"temperature": temperature}, 1024, domain)
            for block, values in cols.items():
                start, stop = capture.offsets(hidden)[block]
                out[i, start:stop] = values
        return out

    X_train = np.vstack([rows(150, "chat", 0.0), rows(50, "chat", 0.7)])
    X_feedback = rows(60, "math", 0.7)
    y_train, y_feedback = rng.integers(1, 1024, 200), rng.integers(1, 1024, 60)
    columns = Recipe.parse(name).columns(capture, hidden)
    readout, rls = fit_readout_with_anchor(X_train[:, columns], y_train, alpha=3.0, max_tokens=1024)
    learned = rls.partial_fit(X_feedback[:, columns], y_feedback).readout()
    U = np.column_stack([np.ones(260), readout.standardize(np.vstack([X_train, X_feedback])[:, columns])])
    penalty = 3.0 * np.eye(U.shape[1])
    penalty[0, 0] = 0.0
    expected = np.linalg.solve(U.T @ U + penalty, U.T @ targets.transform(np.r_[y_train, y_feedback], "sqrt"))
    np.testing.assert_allclose(learned.theta_, expected, rtol=1e-8, atol=1e-8 * np.abs(expected).max())
