"""Baseline length predictors: interface, signal on planted data, the ranker's length map, the fit cache.

Their tuning (validation split, early stopping, search, truncation, cache keys) is in test_baselines_tuning.py.
"""

import numpy as np
import pytest
import torch

from evaluation.baseline_fits import BASELINES, fit_cached, make_predictor, measure_cost
from evaluation.baselines import (
    EncoderRidgePredictor,
    HiddenStateMLP,
    LeapReadoutPredictor,
    LengthData,
    OraclePredictor,
    PromptLengthPredictor,
)
from evaluation.finetuned import EncoderRanker, EncoderRegressor
from leap_core.metrics import spearman

torch.set_num_threads(1)

MAX_TOKENS = 1024
WORDS = ("alpha beta gamma delta explain summarise list write story poem code review plan compare "
         "why how what detail short long essay table").split()


def synthetic(n: int = 200, d: int = 24, seed: int = 0, max_words: int = 60) -> LengthData:
    """sqrt(length) = text-length term + feature-direction term + noise.

    Like a real hidden state, feature 1 also encodes the prompt length (noisily), so the text-only and
    the hidden-state predictors each see a good part of the signal.
    """
    rng = np.random.default_rng(seed)
    n_words = rng.integers(3, max_words + 1, n)
    texts = [" ".join(rng.choice(WORDS, size=k)) for k in n_words]
    word_term = (n_words - n_words.mean()) / n_words.std()
    features = rng.standard_normal((n, d)) * rng.uniform(0.5, 5.0, d)
    features[:, 1] = 3.0 * (word_term + 0.3 * rng.standard_normal(n))
    features = features.astype(np.float32)
    direction = features[:, 0] / features[:, 0].std()
    root = 16.0 + 5.0 * word_term + 5.0 * direction + 1.5 * rng.standard_normal(n)
    lengths = np.clip(np.round(root ** 2), 1, MAX_TOKENS).astype(int)
    return LengthData(ids=np.array([f"p{i:04d}" for i in range(n)]), texts=texts,
                      prompt_tokens=np.round(1.3 * n_words + 12).astype(int), features=features,
                      lengths=lengths, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def data() -> LengthData:
    return synthetic()


@pytest.fixture(scope="module")
def short_texts() -> LengthData:
    """48 short prompts, small enough to fine-tune MiniLM for one epoch in a few seconds."""
    return synthetic(n=48, seed=1, max_words=12)


def _check_output(pred: np.ndarray, n: int) -> None:
    assert pred.shape == (n,)
    assert np.isfinite(pred).all()
    assert pred.min() >= 1.0 and pred.max() <= MAX_TOKENS


def test_length_data_subset_keeps_rows_aligned(data):
    part = data.subset(np.array([5, 2]))
    assert part.ids.tolist() == ["p0005", "p0002"]
    assert part.texts == [data.texts[5], data.texts[2]]
    assert part.features.shape == (2, data.features.shape[1]) and part.max_tokens == MAX_TOKENS
    assert len(data.subset(data.lengths > 300)) == int((data.lengths > 300).sum())
    with pytest.raises(ValueError, match="differ in length"):
        LengthData(ids=data.ids, texts=data.texts[:3], prompt_tokens=data.prompt_tokens,
                   features=data.features, lengths=data.lengths, max_tokens=MAX_TOKENS)


def test_registry_and_factory():
    assert set(BASELINES) == {"prompt_length", "minilm_ridge", "use_ridge", "minilm_finetuned", "minilm_ltr",
                              "trail_mlp", "oracle"}
    predictor = make_predictor("trail_mlp", max_iter=2)
    assert isinstance(predictor, HiddenStateMLP) and predictor.max_iter == 2
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("nope")


@pytest.mark.parametrize("predictor", [PromptLengthPredictor(),  # the MLP's search: test_baselines_tuning.py
                                       HiddenStateMLP(hidden=((64,), (64, 64)), alphas=(1.0, 100.0), num_threads=1),
                                       LeapReadoutPredictor(alpha=10.0)],
                         ids=lambda p: p.name)
def test_fast_predictors_rank_held_out_rows(data, predictor):
    train, test = data.subset(slice(0, 150)), data.subset(slice(150, None))
    pred = predictor.fit(train).predict(test)
    _check_output(pred, len(test))
    assert spearman(test.lengths, pred) > 0.5
    assert predictor.input in ("text", "hidden")


def test_parameter_counts(data):
    assert PromptLengthPredictor().fit(data).n_params_ == 2
    assert LeapReadoutPredictor().fit(data).n_params_ == data.features.shape[1] + 1
    assert OraclePredictor().fit(data).n_params_ == 0
    mlp = HiddenStateMLP(hidden=(32,), alphas=(1.0,), learning_rates=(1e-3,), max_iter=5,
                         num_threads=1).fit(data)
    d, h = data.features.shape[1], 32
    assert mlp.n_params_ == (d + 1) * h + (h + 1) * 1


def test_oracle_returns_the_truth(data):
    np.testing.assert_array_equal(OraclePredictor().fit(data).predict(data), data.lengths)


def test_minilm_ridge_fits_frozen_embeddings(short_texts):
    predictor = EncoderRidgePredictor(num_threads=1).fit(short_texts)
    _check_output(predictor.predict(short_texts), len(short_texts))
    assert predictor.n_params_ == 384 + 1
    assert predictor.best_params_["alpha"] in predictor.alphas
    # The text term dominates the planted lengths, so even on training rows the fit must follow it.
    assert spearman(short_texts.lengths, predictor.predict(short_texts)) > 0.3


def test_multilingual_use_ridge_reads_chinese_and_thai(short_texts):
    """The multilingual encoder from its wheel: a 512-dim embedding that tells scripts it was trained on apart."""
    from evaluation.baselines import MultilingualUseRidge, multilingual_use

    predictor = MultilingualUseRidge().fit(short_texts)
    _check_output(predictor.predict(short_texts), len(short_texts))
    assert predictor.n_params_ == 512 + 1
    assert spearman(short_texts.lengths, predictor.predict(short_texts)) > 0.3
    vectors = multilingual_use().encode(["猫在花园里跑", "The cat runs in the garden", "แมววิ่งในสวน",
                                         "Quarterly tax filing deadlines"])
    assert vectors.shape == (4, 512)
    similarity = vectors @ vectors.T
    # the same sentence in three languages is closer to itself than to an unrelated English one
    assert min(similarity[0, 1], similarity[2, 1]) > similarity[3, 1]


def test_finetuned_regressor_and_its_cache(short_texts, tmp_path, monkeypatch):
    predictor = EncoderRegressor(epochs=1, lr_encoder=5e-5, num_threads=1)
    fitted = fit_cached(predictor, short_texts, tmp_path)
    pred = fitted.predict(short_texts)
    _check_output(pred, len(short_texts))
    assert fitted.n_params_ > 22_000_000
    assert len(list(tmp_path.glob("minilm_finetuned-*.pkl"))) == 1

    monkeypatch.setattr(EncoderRegressor, "fit", lambda self, data: pytest.fail("refitted despite cache"))
    loaded = fit_cached(EncoderRegressor(epochs=1, lr_encoder=5e-5, num_threads=2), short_texts, tmp_path)
    assert loaded is not predictor
    np.testing.assert_allclose(loaded.predict(short_texts), pred, rtol=1e-5)
    # Another hyper-parameter is another model: it must not be served from the cache.
    with pytest.raises(pytest.fail.Exception, match="refitted"):
        fit_cached(EncoderRegressor(epochs=2, lr_encoder=5e-5, num_threads=1), short_texts, tmp_path)


def test_ranker_lengths_are_monotone_in_its_scores(short_texts):
    predictor = EncoderRanker(epochs=1, lr_encoder=5e-5, num_threads=1).fit(short_texts)
    scores, pred = predictor.scores(short_texts), predictor.predict(short_texts)
    _check_output(pred, len(short_texts))
    order = np.argsort(scores)
    assert (np.diff(pred[order]) >= 0).all()
    assert pred.min() >= short_texts.lengths.min() and pred.max() <= short_texts.lengths.max()


def test_mlp_cache_reuses_fit_and_measure_cost(data, tmp_path, monkeypatch):
    fitted = fit_cached(HiddenStateMLP(max_iter=20, num_threads=1), data, tmp_path)
    monkeypatch.setattr(HiddenStateMLP, "fit", lambda self, data: pytest.fail("refitted despite cache"))
    loaded = fit_cached(HiddenStateMLP(max_iter=20, num_threads=1), data.subset(np.arange(len(data))[::-1]),
                        tmp_path)
    np.testing.assert_allclose(loaded.predict(data), fitted.predict(data))
    cost = measure_cost(loaded, data, batch_size=8, repeats=2)
    assert cost["batch_size"] == 8 and cost["input"] == "hidden" and cost["n_params"] == loaded.n_params_
    assert cost["ms_per_request"] > 0
