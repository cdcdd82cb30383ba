"""The label ceiling's figures (evaluation.ceiling.ceiling_figures) on rows whose noise is known."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.ceiling import ceiling_figures
from evaluation.selections import rerun_order
from leap_core.metrics import spearman


def _runs(n: int, noise: float, runs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the prompt's signal f, `runs` lengths per prompt = f + independent noise of sd `noise`)."""
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=n)
    return signal, signal[:, None] + noise * rng.normal(size=(n, runs))


def test_reproducible_runs_have_a_ceiling_of_one():
    signal, lengths = _runs(300, 0.0, 4)
    result = ceiling_figures(lengths[:, 0], lengths[:, 1], lengths, predictions=signal, n_boot=200)
    assert result["greedy_rerun_spearman"]["value"] == pytest.approx(1.0)
    assert result["sampled_pair_spearman"]["value"] == pytest.approx(1.0)
    assert result["ceiling"]["greedy"]["value"] == pytest.approx(1.0)
    assert result["greedy_rerun"]["exact_share"] == 1.0
    assert result["n"] == 300 and result["samples"] == 4 and result["pairs"] == 6


def test_the_best_predictor_reaches_the_square_root_of_the_agreement_between_runs():
    """With noise of the prompt's own variance two runs correlate at about 0.5, the true signal at about
    sqrt(0.5) = 0.71 with one run: the ceiling row says so, and the signal's own figure sits inside the
    ceiling's interval."""
    signal, lengths = _runs(3000, 1.0, 4, seed=1)
    result = ceiling_figures(lengths[:, 0], lengths[:, 1], lengths, predictions=signal, n_boot=300)
    pair = result["sampled_pair_spearman"]
    assert pair["ci_low"] < pair["value"] < pair["ci_high"]
    assert 0.43 < pair["value"] < 0.55
    ceiling = result["ceiling"]["sampled"]
    assert ceiling["value"] == pytest.approx(np.sqrt(pair["value"]))
    reached = result["readout"]["against_one_sample"]["value"]
    assert ceiling["ci_low"] - 0.02 < reached < ceiling["ci_high"] + 0.02
    # the mean over pairs agrees with one pair, with less spread
    assert pair["value"] == pytest.approx(spearman(lengths[:, 2], lengths[:, 3]), abs=0.05)
    assert result["readout"]["against_sample_median"]["value"] > reached  # the median is less noisy


def test_a_predictor_without_signal_sits_at_zero_and_bad_shapes_are_refused():
    signal, lengths = _runs(500, 0.5, 2, seed=2)
    noise = np.random.default_rng(9).normal(size=500)
    result = ceiling_figures(lengths[:, 0], lengths[:, 1], lengths, predictions=noise, n_boot=200)
    low, high = result["readout"]["against_greedy"]["ci_low"], result["readout"]["against_greedy"]["ci_high"]
    assert low < 0 < high
    assert result["greedy_rerun_spearman"]["ci_low"] > 0.7
    with pytest.raises(ValueError, match="at least 2 samples"):
        ceiling_figures(lengths[:, 0], lengths[:, 1], lengths[:, :1])
    with pytest.raises(ValueError, match="rows differ"):
        ceiling_figures(lengths[:10, 0], lengths[:, 1], lengths)
    with pytest.raises(ValueError, match="predictions"):
        ceiling_figures(lengths[:, 0], lengths[:, 1], lengths, predictions=noise[:3])


def test_the_rerun_queues_the_pool_in_another_fixed_order():
    pool = [{"id": str(i)} for i in range(50)]
    order = rerun_order(pool)
    assert sorted(p["id"] for p in order) == sorted(p["id"] for p in pool)
    assert [p["id"] for p in order] != [p["id"] for p in pool]
    assert order == rerun_order(pool)


@pytest.mark.parametrize("command, module, function", [
    (["eval", "ceiling", "--save", "--json"], "evaluation.ceiling", "ceiling_study"),
    (["bench", "recipes", "--save", "--json"], "study_harness.recipe_bench", "bench_recipes"),
    (["eval", "curve", "--save", "--json"], "evaluation.learning_curve", "learning_curve_study"),
])
def test_saving_a_result_from_a_dirty_checkout_is_refused_before_the_work_runs(monkeypatch, command, module,
                                                                               function):
    import importlib

    from typer.testing import CliRunner

    from leap_cli.main import app
    from study_harness import snapshot

    def must_not_run(*args, **kwargs):
        raise AssertionError("the work ran before the checkout was checked")

    monkeypatch.setattr(importlib.import_module(module), function, must_not_run)
    monkeypatch.setattr(snapshot, "git_commit", lambda: "0123456789abcdef-dirty")
    refused = CliRunner().invoke(app, command)
    assert refused.exit_code == 2
    said = " ".join(refused.output.replace("│", " ").split())  # rich boxes and wraps the message
    assert "tracked files differ from 0123456789ab: commit them" in said


def test_a_result_names_the_commit_its_study_started_from(monkeypatch):
    """A long study outlives the checkout it started on: the result names the start commit and says where
    the checkout was when it ended."""
    import json

    from typer.testing import CliRunner

    from evaluation import ceiling
    from leap_cli.main import app
    from study_harness import snapshot

    heads = iter(["a" * 40, "b" * 40, "b" * 40])
    monkeypatch.setattr(snapshot, "git_commit", lambda: next(heads))
    monkeypatch.setattr(ceiling, "ceiling_study", lambda *args, **kwargs: {"n": 1})
    done = CliRunner().invoke(app, ["eval", "ceiling", "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["commit"] == "a" * 40 and result["commit_at_end"] == "b" * 40
