"""The length predictors LEAP's linear readout is compared against, behind one interface.

Each predictor is a scikit-learn-like estimator: hyper-parameters in `__init__`, `fit(LengthData)`,
`predict(LengthData)` -> predicted output lengths in tokens within [1, M] (bigger = longer), plus
`name` (the JSON key), `input` ("text": needs only the prompt text, so it can run at arrival;
"hidden": needs the serving model's captured hidden state, so it runs after prefill) and `n_params_`.
The baselines stand for the predictor families of related systems: prompt length alone, a frozen
sentence encoder with a ridge head, an end-to-end fine-tuned encoder regressor (SSJF/TIE), a
fine-tuned encoder ranker (LTR) and an MLP classifier over length bins on the hidden state (TRAIL).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from sklearn.base import BaseEstimator
from sklearn.linear_model import Ridge, RidgeCV
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from leap_core.readout import LinearReadout

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
                          sets=None if self.sets is None else self.sets[rows])

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


def _sqrt_lengths(lengths: np.ndarray) -> np.ndarray:
    return np.sqrt(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))


def _from_sqrt(values: np.ndarray, max_tokens: int) -> np.ndarray:
    """Clip sqrt-space predictions to [1, sqrt(M)], then square them back to tokens."""
    return np.square(np.clip(np.asarray(values, dtype=np.float64), 1.0, np.sqrt(max_tokens)))


class PromptLengthPredictor(BaseEstimator):
    """Ridge on the log prompt length: how much of the output length the prompt size alone explains."""

    name = "prompt_length"
    input = "text"

    def __init__(self, alpha: float = 1.0):
        self.alpha = alpha

    def fit(self, data: LengthData) -> PromptLengthPredictor:
        self.model_ = make_pipeline(StandardScaler(), Ridge(alpha=self.alpha))
        self.model_.fit(self._design(data), _sqrt_lengths(data.lengths))
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = 2
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        return _from_sqrt(self.model_.predict(self._design(data)), self.max_tokens_)

    @staticmethod
    def _design(data: LengthData) -> np.ndarray:
        return np.log1p(np.asarray(data.prompt_tokens, dtype=np.float64)).reshape(-1, 1)


class EncoderRidgePredictor(BaseEstimator):
    """Frozen MiniLM embedding (mean-pooled, L2-normalised) + standardized RidgeCV on sqrt length.

    The encoder is the shipped checkpoint and never trained, so it is shared (`frozen_encoder`) and not
    part of the fitted state: only the 384 + 1 ridge weights are learned and pickled.
    """

    name = "minilm_ridge"
    input = "text"

    def __init__(self, alphas: tuple[float, ...] = tuple(np.logspace(-1, 4, 11)), batch_size: int = 64,
                 max_seq_len: int = 256, num_threads: int | None = None):
        self.alphas = alphas
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.num_threads = num_threads

    def fit(self, data: LengthData) -> EncoderRidgePredictor:
        self.model_: Pipeline = make_pipeline(StandardScaler(), RidgeCV(alphas=np.asarray(self.alphas)))
        self.model_.fit(self._embed(data), _sqrt_lengths(data.lengths))
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = int(self.model_[-1].coef_.size) + 1
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        return _from_sqrt(self.model_.predict(self._embed(data)), self.max_tokens_)

    def _embed(self, data: LengthData) -> np.ndarray:
        from evaluation.encoder import frozen_encoder

        with _torch_threads(self.num_threads):
            return frozen_encoder().embed(data.texts, batch_size=self.batch_size, normalize=True,
                                          max_seq_len=self.max_seq_len)


class _FineTunedEncoder(BaseEstimator):
    """MiniLM + a linear head on the mean pool, all weights trained end to end.

    AdamW with separate learning rates for the encoder and the freshly initialised head, linear
    warm-up then linear decay, shuffling from a seeded numpy Generator. Subclasses choose the target
    and the loss (`_targets`, `_loss`) and turn head outputs into lengths (`predict`, with anything it
    needs from the trained model computed in `_finish_fit`).
    """

    input = "text"

    def __init__(self, epochs: int = 3, batch_size: int = 16, max_seq_len: int = 256,
                 lr_encoder: float = 3e-5, lr_head: float = 1e-3, weight_decay: float = 0.01,
                 warmup_ratio: float = 0.1, seed: int = 0, num_threads: int | None = None):
        self.epochs = epochs
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.lr_encoder = lr_encoder
        self.lr_head = lr_head
        self.weight_decay = weight_decay
        self.warmup_ratio = warmup_ratio
        self.seed = seed
        self.num_threads = num_threads

    def fit(self, data: LengthData) -> _FineTunedEncoder:
        from transformers import get_linear_schedule_with_warmup

        from evaluation.encoder import SentenceEncoder

        targets = torch.as_tensor(self._targets(data), dtype=torch.float32)
        rng = np.random.default_rng(self.seed)
        n = len(data)
        total_steps = self.epochs * -(-n // self.batch_size)
        with _torch_threads(self.num_threads):
            torch.manual_seed(self.seed)
            encoder = SentenceEncoder()
            head = nn.Linear(encoder.dim, 1)
            optimizer = torch.optim.AdamW(
                [{"params": encoder.model.parameters(), "lr": self.lr_encoder},
                 {"params": head.parameters(), "lr": self.lr_head}], weight_decay=self.weight_decay)
            schedule = get_linear_schedule_with_warmup(optimizer, int(self.warmup_ratio * total_steps),
                                                       total_steps)
            encoder.model.train()
            for _ in range(self.epochs):
                order = rng.permutation(n)
                for start in range(0, n, self.batch_size):
                    index = order[start:start + self.batch_size]
                    outputs = head(encoder.pooled([data.texts[i] for i in index], self.max_seq_len))
                    loss = self._loss(outputs.squeeze(-1), targets[index])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    schedule.step()
            encoder.model.eval()
        self.encoder_, self.head_ = encoder, head
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = encoder.n_params + sum(p.numel() for p in head.parameters())
        self._finish_fit(data)
        return self

    def _outputs(self, data: LengthData) -> np.ndarray:
        """Head outputs in eval mode, no gradients, batches of 64 (sorted by length)."""
        with _torch_threads(self.num_threads), torch.no_grad():
            pooled = self.encoder_.embed(data.texts, batch_size=64, normalize=False,
                                         max_seq_len=self.max_seq_len)
            return self.head_(torch.from_numpy(pooled)).squeeze(-1).numpy().astype(np.float64)

    def _targets(self, data: LengthData) -> np.ndarray:
        raise NotImplementedError

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _finish_fit(self, data: LengthData) -> None:
        """State a subclass derives from the trained model (nothing by default)."""


class EncoderRegressor(_FineTunedEncoder):
    """SSJF/TIE-style: fine-tuned MiniLM regressing the standardized sqrt length with MSE."""

    name = "minilm_finetuned"

    def _targets(self, data: LengthData) -> np.ndarray:
        """Standardized sqrt lengths; the mean and scale are kept to undo it in predict."""
        root = _sqrt_lengths(data.lengths)
        self.target_mean_ = float(root.mean())
        self.target_scale_ = float(root.std()) or 1.0
        return (root - self.target_mean_) / self.target_scale_

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def predict(self, data: LengthData) -> np.ndarray:
        root = self.target_mean_ + self.target_scale_ * self._outputs(data)
        return _from_sqrt(root, self.max_tokens_)


class EncoderRanker(_FineTunedEncoder):
    """LTR-style: fine-tuned MiniLM scoring prompts with a pairwise RankNet (logistic) loss.

    The loss covers every pair in a batch whose sqrt lengths differ, so the model learns an order, not
    a scale. To hand the scheduler a length, `fit` keeps the sorted training scores and sorted training
    lengths, and `predict` maps a score to the training length at the same quantile (np.interp): the
    ranking is the model's, the scale is the training distribution's, and predicted lengths are a
    non-decreasing function of the score within [min, max] of the training lengths.
    """

    name = "minilm_ltr"

    def _targets(self, data: LengthData) -> np.ndarray:
        return _sqrt_lengths(data.lengths)

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean of log(1 + exp(-(s_i - s_j))) over pairs with t_i > t_j (0 when no pair differs)."""
        longer = (targets[:, None] > targets[None, :]).to(outputs.dtype)
        margins = outputs[:, None] - outputs[None, :]
        return (nn.functional.softplus(-margins) * longer).sum() / longer.sum().clamp(min=1.0)

    def _finish_fit(self, data: LengthData) -> None:
        self.train_scores_ = np.sort(self._outputs(data))
        lengths = np.clip(np.asarray(data.lengths, dtype=np.float64), 1, self.max_tokens_)
        self.train_lengths_ = np.sort(lengths)

    def scores(self, data: LengthData) -> np.ndarray:
        """The raw ranking scores (bigger = longer)."""
        return self._outputs(data)

    def predict(self, data: LengthData) -> np.ndarray:
        return np.interp(self.scores(data), self.train_scores_, self.train_lengths_)


class HiddenStateMLP(BaseEstimator):
    """TRAIL-style: an MLP over the standardized hidden state classifying the length into equal-width bins.

    The prediction is the expected bin centre under the predicted distribution, so it is continuous
    and ordered even though training is a classification.
    """

    name = "trail_mlp"
    input = "hidden"

    def __init__(self, hidden: int = 1024, n_bins: int = 16, dropout: float = 0.1, lr: float = 1e-3,
                 weight_decay: float = 0.01, epochs: int = 30, batch_size: int = 64, seed: int = 0,
                 num_threads: int | None = None):
        self.hidden = hidden
        self.n_bins = n_bins
        self.dropout = dropout
        self.lr = lr
        self.weight_decay = weight_decay
        self.epochs = epochs
        self.batch_size = batch_size
        self.seed = seed
        self.num_threads = num_threads

    def fit(self, data: LengthData) -> HiddenStateMLP:
        self.max_tokens_ = int(data.max_tokens)
        edges = np.linspace(0.0, self.max_tokens_, self.n_bins + 1)
        self.bin_centres_ = (edges[:-1] + edges[1:]) / 2
        labels = np.clip(np.searchsorted(edges, data.lengths, side="right") - 1, 0, self.n_bins - 1)
        self.scaler_ = StandardScaler().fit(data.features)
        inputs = torch.as_tensor(self.scaler_.transform(data.features), dtype=torch.float32)
        labels = torch.as_tensor(labels, dtype=torch.long)
        rng = np.random.default_rng(self.seed)
        with _torch_threads(self.num_threads):
            torch.manual_seed(self.seed)
            network = nn.Sequential(
                nn.Linear(inputs.shape[1], self.hidden), nn.ReLU(), nn.Dropout(self.dropout),
                nn.Linear(self.hidden, self.hidden), nn.ReLU(), nn.Dropout(self.dropout),
                nn.Linear(self.hidden, self.n_bins))
            optimizer = torch.optim.AdamW(network.parameters(), lr=self.lr, weight_decay=self.weight_decay)
            network.train()
            for _ in range(self.epochs):
                order = torch.from_numpy(rng.permutation(len(data)))
                for batch in order.split(self.batch_size):
                    loss = nn.functional.cross_entropy(network(inputs[batch]), labels[batch])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            network.eval()
        self.network_ = network
        self.n_params_ = sum(p.numel() for p in network.parameters())
        return self

    def predict(self, data: LengthData) -> np.ndarray:
        inputs = torch.as_tensor(self.scaler_.transform(data.features), dtype=torch.float32)
        with _torch_threads(self.num_threads), torch.no_grad():
            probabilities = torch.softmax(self.network_(inputs), dim=1).numpy().astype(np.float64)
        return np.clip(probabilities @ self.bin_centres_, 1.0, self.max_tokens_)


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

    The default penalty is the one the live experiments use (`harness.experiment.DEFAULT_ALPHA`).
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


BASELINES: dict[str, type] = {cls.name: cls for cls in (
    PromptLengthPredictor, EncoderRidgePredictor, EncoderRegressor, EncoderRanker, HiddenStateMLP,
    OraclePredictor)}


def make_predictor(name: str, **params: Any) -> BaseEstimator:
    """A fresh baseline by its registry name."""
    if name not in BASELINES:
        raise ValueError(f"unknown predictor {name!r}; expected one of {sorted(BASELINES)}")
    return BASELINES[name](**params)


def measure_cost(predictor: BaseEstimator, data: LengthData, batch_size: int = 1,
                 repeats: int = 3) -> dict[str, Any]:
    """Prediction wall time per request on at most 64 rows, in batches of `batch_size`.

    One untimed call first loads anything lazy (the shared encoder); the median over `repeats`
    passes is reported.
    """
    sample = data.subset(slice(0, min(64, len(data))))
    batches = [sample.subset(slice(start, start + batch_size)) for start in range(0, len(sample), batch_size)]
    predictor.predict(batches[0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            predictor.predict(batch)
        times.append(time.perf_counter() - start)
    return {"ms_per_request": float(np.median(times)) * 1000.0 / len(sample), "batch_size": batch_size,
            "n_params": int(predictor.n_params_), "input": predictor.input}


def cache_key(predictor: BaseEstimator, data: LengthData) -> str:
    """sha256 over the predictor's name and hyper-parameters and the training rows (ids, lengths, M).

    `num_threads` is left out: it changes how fast a model trains, not which model it is.
    """
    params = {key: value for key, value in predictor.get_params(deep=False).items() if key != "num_threads"}
    order = np.argsort(np.asarray(data.ids, dtype=str), kind="stable")
    payload = {"name": predictor.name, "params": params,
               "ids": np.asarray(data.ids, dtype=str)[order].tolist(),
               "lengths": np.asarray(data.lengths, dtype=np.int64)[order].tolist(),
               "max_tokens": int(data.max_tokens)}
    text = json.dumps(payload, sort_keys=True, default=lambda value: np.asarray(value).tolist())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fit_cached(predictor: BaseEstimator, data: LengthData, cache_dir: Path | None) -> BaseEstimator:
    """`predictor.fit(data)`, or the fitted predictor pickled by an earlier identical call.

    The fine-tuned encoders take minutes per epoch on CPU; the cache makes reruns of a study cheap.
    The file is written under a temporary name and renamed, so a crash never leaves a half file.
    """
    if cache_dir is None:
        return predictor.fit(data)
    path = Path(cache_dir) / f"{predictor.name}-{cache_key(predictor, data)}.pkl"
    if path.exists():
        with path.open("rb") as handle:
            return pickle.load(handle)
    predictor.fit(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with partial.open("wb") as handle:
        pickle.dump(predictor, handle, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)
    return predictor
