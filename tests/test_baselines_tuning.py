"""The baselines' tuning budget: validation split, early stopping, the searched settings, head-and-tail
truncation, the encoder choice and the fit cache's key. Small synthetic data, real sklearn and torch."""

import numpy as np
import pytest
import torch

from evaluation.baseline_fits import cache_key, fit_cached, pinned
from evaluation.baselines import (
    EncoderRidgePredictor,
    HiddenStateMLP,
    LengthData,
    PromptLengthPredictor,
    validation_split,
)
from evaluation.finetuned import EncoderRanker, EncoderRegressor
from leap_core.metrics import spearman
from tests.test_baselines import MAX_TOKENS, synthetic

torch.set_num_threads(1)


def noisy_texts(n: int = 40, seed: int = 3) -> LengthData:
    """Short prompts whose lengths are pure noise: nothing to learn, so validation cannot improve for long."""
    data = synthetic(n=n, seed=seed, max_words=8)
    lengths = np.random.default_rng(seed).integers(1, MAX_TOKENS, n)
    return LengthData(ids=data.ids, texts=data.texts, prompt_tokens=data.prompt_tokens, features=data.features,
                      lengths=lengths, max_tokens=MAX_TOKENS)


def monotone_hidden(n: int, seed: int, d: int = 32) -> LengthData:
    """sqrt(length) a monotone, non-linear function of one direction of a noisy hidden state."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((n, d)).astype(np.float32)
    signal = features[:, 0] + 0.5 * features[:, 1]
    root = 4.0 + 24.0 / (1.0 + np.exp(-1.5 * signal)) + 1.0 * rng.standard_normal(n)
    lengths = np.clip(np.round(root ** 2), 1, MAX_TOKENS).astype(int)
    return LengthData(ids=np.array([f"h{seed}-{i:04d}" for i in range(n)]), texts=[""] * n,
                      prompt_tokens=np.full(n, 10), features=features, lengths=lengths, max_tokens=MAX_TOKENS)


def test_validation_split_is_seeded_disjoint_and_covers():
    fit, val = validation_split(100, 0.15, seed=4)
    assert len(val) == 15 and len(fit) == 85
    assert np.intersect1d(fit, val).size == 0 and np.union1d(fit, val).tolist() == list(range(100))
    again = validation_split(100, 0.15, seed=4)
    assert np.array_equal(again[0], fit) and np.array_equal(again[1], val)
    assert not np.array_equal(validation_split(100, 0.15, seed=5)[1], val)
    assert len(validation_split(3, 0.15, 0)[1]) == 0 and len(validation_split(10, 0.01, 0)[1]) == 2


def test_finetuned_encoder_stops_early_on_noise_and_respects_the_budget():
    data = noisy_texts()
    predictor = EncoderRegressor(epochs=5, lr_encoder=(1e-4, 3e-4), batch_size=16, eval_every=1, patience=2,
                                 max_steps=40, num_threads=1).fit(data)
    fit_rows, _ = validation_split(len(data), predictor.val_fraction, predictor.seed)
    cap = 5 * -(-len(fit_rows) // 16)
    run = [t for t in predictor.trials_ if not t.get("skipped")]
    assert run and all(t["stopped_early"] and t["steps"] < cap for t in run)
    # Stopped after `patience` evaluations without improvement, and kept the best checkpoint's step.
    for trial in run:
        assert trial["steps"] - trial["best_step"] == predictor.patience
        assert trial["val_spearman"] == max(h["val_spearman"] for h in trial["history"])
    assert predictor.n_steps_ <= 40
    best = max(run, key=lambda t: (t["val_spearman"], -t["val_loss"]))
    assert predictor.best_params_ == {"lr_encoder": best["lr_encoder"], "epochs": 5, "steps": best["best_step"]}
    assert predictor.val_spearman_ == best["val_spearman"]
    pred = predictor.predict(data)
    assert pred.shape == (len(data),) and np.isfinite(pred).all()


def test_step_budget_skips_the_rest_of_the_grid():
    data = noisy_texts(n=24, seed=5)
    predictor = EncoderRanker(epochs=2, lr_encoder=(5e-5, 1e-4, 2e-4), max_steps=3, refit=True,
                              num_threads=1).fit(data)
    assert [t.get("skipped", False) for t in predictor.trials_] == [False, True, True]
    assert predictor.trials_[0]["steps"] == 3 and predictor.n_steps_ == 3
    # Cut by the budget between two evaluations (2 steps an epoch), the run is still scored where it stopped.
    assert [h["step"] for h in predictor.trials_[0]["history"]] == [2, 3]
    assert np.isfinite(predictor.val_spearman_)
    assert predictor.best_params_["lr_encoder"] == 5e-5
    assert not predictor.refitted_  # no budget left: the validated checkpoint is kept
    order = np.argsort(predictor.scores(data))
    assert (np.diff(predictor.predict(data)[order]) >= 0).all()


def test_refit_retrains_the_chosen_setting_on_all_training_rows():
    data = synthetic(n=24, seed=6, max_words=8)
    predictor = EncoderRegressor(epochs=1, lr_encoder=1e-4, batch_size=8, refit=True, num_threads=1).fit(data)
    fit_rows, _ = validation_split(len(data), predictor.val_fraction, predictor.seed)
    assert predictor.trials_[0]["steps"] == -(-len(fit_rows) // 8)
    assert predictor.refitted_ and predictor.best_params_["refit_steps"] == -(-len(data) // 8)
    assert predictor.n_steps_ == predictor.trials_[0]["steps"] + predictor.best_params_["refit_steps"]
    pred = predictor.predict(data)
    assert pred.shape == (len(data),) and np.isfinite(pred).all()


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_mlp_settings_are_chosen_on_the_validation_split_of_the_training_rows_only():
    train, test = monotone_hidden(240, seed=0), monotone_hidden(120, seed=1)
    predictor = HiddenStateMLP(hidden=(32,), alphas=(0.1, 10.0), learning_rates=(1e-3, 1e-2), num_threads=1)
    predictor.fit(train)
    assert len(predictor.trials_) == 4
    best = max(predictor.trials_, key=lambda t: t["val_spearman"])
    assert (predictor.best_params_["alpha"], predictor.best_params_["learning_rate"]) == \
        (best["alpha"], best["learning_rate"])
    assert predictor.best_params_["hidden"] == [32]
    assert set(predictor.best_params_["on_grid_edge"]) == {"alpha", "learning_rate"}  # two values a grid: edges
    assert predictor.val_spearman_ == best["val_spearman"]
    # Each trial's score is reproduced from the training rows alone: fit part -> validation part.
    fit_rows, val_rows = validation_split(len(train), predictor.val_fraction, predictor.seed)
    target = np.sqrt(train.lengths)
    for trial in predictor.trials_:
        network = predictor._network(tuple(trial["hidden"]), trial["alpha"], trial["learning_rate"], len(fit_rows))
        network.fit(train.features[fit_rows], (target[fit_rows] - target.mean()) / target.std())
        assert spearman(target[val_rows], network.predict(train.features[val_rows])) == \
            pytest.approx(trial["val_spearman"])
    # The test rows never reach fit: whatever their lengths, the same settings and predictions come out.
    scrambled = LengthData(ids=test.ids, texts=test.texts, prompt_tokens=test.prompt_tokens,
                           features=test.features, lengths=test.lengths[::-1].copy(), max_tokens=MAX_TOKENS)
    assert HiddenStateMLP(**predictor.get_params()).fit(train).best_params_ == predictor.best_params_
    np.testing.assert_allclose(predictor.predict(scrambled), predictor.predict(test))


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_mlp_searches_architectures_and_says_which_choices_sit_on_the_grid_edge():
    train = monotone_hidden(160, seed=4)
    predictor = HiddenStateMLP(hidden=((8,), (8, 8)), alphas=(0.1, 1.0, 10.0), learning_rates=(1e-3,), max_iter=30,
                               num_threads=1).fit(train)
    assert predictor.architectures() == ((8,), (8, 8))
    assert [(tuple(t["hidden"]), t["alpha"]) for t in predictor.trials_] == [
        (h, a) for h in ((8,), (8, 8)) for a in (0.1, 1.0, 10.0)]
    best = max(predictor.trials_, key=lambda t: t["val_spearman"])
    assert predictor.best_params_["hidden"] == best["hidden"]
    assert predictor.best_params_["on_grid_edge"] == ([] if best["alpha"] == 1.0 else ["alpha"])
    assert HiddenStateMLP(hidden=(16, 16)).architectures() == ((16, 16),)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_a_pinned_copy_refits_only_what_the_search_chose():
    """Another split's refit: a fresh copy whose grid is the one chosen point, so it trains one network."""
    train = monotone_hidden(160, seed=4)
    searched = HiddenStateMLP(hidden=((8,), (8, 8)), alphas=(0.1, 10.0), learning_rates=(1e-3,), max_iter=30,
                              num_threads=1).fit(train)
    fresh = pinned(searched)
    assert not hasattr(fresh, "model_") and fresh.num_threads == 1 and fresh.max_iter == 30
    assert fresh.architectures() == (tuple(searched.best_params_["hidden"]),)
    assert fresh.alphas == (searched.best_params_["alpha"],) and fresh.learning_rates == (1e-3,)
    refit = fresh.fit(monotone_hidden(150, seed=5))
    assert refit.trials_ == [] and refit.best_params_["hidden"] == searched.best_params_["hidden"]
    plain = PromptLengthPredictor(alpha=3.0).fit(train)
    assert pinned(plain).get_params() == {"alpha": 3.0} and not hasattr(pinned(plain), "model_")


def test_mlp_regression_beats_a_constant_on_a_monotone_signal():
    train, test = monotone_hidden(400, seed=2), monotone_hidden(200, seed=3)
    predictor = HiddenStateMLP(hidden=(64,), learning_rates=(1e-3, 3e-4), num_threads=1).fit(train)
    pred = predictor.predict(test)
    assert pred.min() >= 1.0 and pred.max() <= MAX_TOKENS
    assert spearman(test.lengths, pred) > 0.7
    constant = np.full(len(test), np.median(train.lengths))
    assert np.abs(pred - test.lengths).mean() < 0.7 * np.abs(constant - test.lengths).mean()
    # sklearn's own early stopping ended training before max_iter.
    assert predictor.best_params_["n_iter"] < predictor.max_iter


def test_cache_key_follows_features_layer_corpus_and_params_not_row_order(tmp_path, monkeypatch):
    data = monotone_hidden(60, seed=4)
    mlp = HiddenStateMLP(hidden=(8,), alphas=(1.0,), learning_rates=(1e-3,), max_iter=5, num_threads=1)
    key = cache_key(mlp, data)
    assert cache_key(mlp, data.subset(np.arange(len(data))[::-1])) == key
    assert cache_key(HiddenStateMLP(**{**mlp.get_params(), "num_threads": 2}), data) == key
    other_features = data.subset(np.arange(len(data)))
    other_features.features = other_features.features.copy()
    other_features.features[7, 3] += 0.5
    assert cache_key(mlp, other_features) != key
    layered = data.subset(np.arange(len(data)))
    layered.layer = 12
    assert cache_key(mlp, layered) != key
    assert cache_key(mlp, data, corpus_hash="L12-M1024-abc") != key
    layered.corpus_hash = "L12-M1024-abc"
    assert cache_key(mlp, layered) == cache_key(mlp, layered.subset(slice(None)))  # subset keeps both
    assert cache_key(HiddenStateMLP(**{**mlp.get_params(), "alphas": (2.0,)}), data) != key
    assert cache_key(EncoderRidgePredictor(head_tokens=None), data) != cache_key(EncoderRidgePredictor(), data)

    fit_cached(mlp, data, tmp_path, corpus_hash="c1")
    monkeypatch.setattr(HiddenStateMLP, "fit", lambda self, data: pytest.fail("refitted"))
    fit_cached(mlp, data, tmp_path, corpus_hash="c1")  # served from the cache
    with pytest.raises(pytest.fail.Exception, match="refitted"):
        fit_cached(mlp, data, tmp_path, corpus_hash="c2")
    with pytest.raises(pytest.fail.Exception, match="refitted"):
        fit_cached(mlp, other_features, tmp_path, corpus_hash="c1")


def test_head_and_tail_truncation_and_the_encoder_choice(tmp_path):
    from evaluation.encoder import SentenceEncoder, encoder_path, frozen_encoder

    encoder = frozen_encoder()
    text = " ".join(["alpha"] * 3 + ["beta"] * 50 + ["omega"] * 3)
    head_only = encoder.tokenizer.decode(encoder.tokenize([text], 10)["input_ids"][0])
    head_tail = encoder.tokenizer.decode(encoder.tokenize([text], 10, head_tokens=3)["input_ids"][0])
    assert head_only.split() == ["[CLS]", "alpha", "alpha", "alpha"] + ["beta"] * 5 + ["[SEP]"]
    assert head_tail.split() == ["[CLS]", "alpha", "alpha", "alpha"] + ["beta"] * 2 + ["omega"] * 3 + ["[SEP]"]
    # Texts within the budget are untouched, and a batch pads with a zero mask.
    batch = encoder.tokenize(["short one", text], 10, head_tokens=3)
    plain = encoder.tokenize(["short one"], 10)
    n = int(plain["attention_mask"].sum())
    assert batch["input_ids"][0, :n].tolist() == plain["input_ids"][0].tolist()
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (10 - n)
    # The English encoder cannot read Thai or Chinese: most of it is [UNK].
    assert encoder.unk_fraction(["สวัสดีครับ ยินดีต้อนรับ", "今天天气很好我们去公园散步"]) > 0.3
    assert encoder.unk_fraction(["an ordinary english prompt"]) == 0.0
    # An encoder is a registered name or a local checkpoint folder, nothing fetched from a hub.
    assert encoder_path("minilm") == encoder_path(None) == encoder.model_path
    assert SentenceEncoder(str(encoder.model_path)).dim == encoder.dim
    with pytest.raises(ValueError, match="unknown encoder"):
        encoder_path("intfloat/multilingual-e5-small")
    with pytest.raises(ValueError, match="unknown encoder"):
        EncoderRidgePredictor(encoder=str(tmp_path)).fit(synthetic(n=8, max_words=5))


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_too_few_validation_rows_to_rank_settings_fit_the_grid_s_first_setting_unsearched():
    from evaluation.baselines import MIN_SEARCH_ROWS

    small = monotone_hidden(30, seed=6)  # 4 validation rows: a Spearman over them cannot rank 4 settings
    assert 0 < len(validation_split(30, 0.15, 0)[1]) < MIN_SEARCH_ROWS
    predictor = HiddenStateMLP(hidden=(8,), alphas=(0.1, 10.0), learning_rates=(1e-3, 1e-2), max_iter=30,
                               num_threads=1).fit(small)
    assert predictor.trials_ == [] and np.isnan(predictor.val_spearman_)
    assert predictor.best_params_["searched"] is False and predictor.best_params_["on_grid_edge"] == []
    assert (predictor.best_params_["alpha"], predictor.best_params_["learning_rate"]) == (0.1, 1e-3)
    searched = HiddenStateMLP(hidden=(8,), alphas=(0.1, 10.0), learning_rates=(1e-3, 1e-2), max_iter=30,
                              num_threads=1).fit(monotone_hidden(100, seed=6))  # 15 validation rows: searched
    assert searched.best_params_["searched"] is True and len(searched.trials_) == 4
