"""The fine-tuned text encoder baselines: a sentence encoder and a linear head trained end to end, as a
regressor of the sqrt length (SSJF/TIE, `EncoderRegressor`) or a pairwise ranker (LTR, `EncoderRanker`).

They follow the interface of `evaluation.baselines` (`fit(LengthData)`, `predict(LengthData)`, `name`,
`input`, `n_params_`) and tune on a seeded validation split of the training rows: a small grid of learning
rates and epoch caps with early stopping, picked by validation Spearman (`best_params_`, `val_spearman_`,
`trials_`). Long prompts are truncated head-and-tail (`head_tokens`); the encoder is a hyper-parameter
(`encoder`), so a multilingual checkpoint can be used for the multilingual sets.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from torch import nn

from evaluation.baselines import LengthData, _as_grid, _score, _torch_threads, validation_split
from leap_core.targets import to_lengths, transform

# evaluation.encoder and transformers are imported inside the fits: they take seconds to import.


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
