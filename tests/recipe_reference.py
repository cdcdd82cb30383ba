"""Reference definitions of the pooled recipe blocks, in plain numpy, that the serving pool
(`serving.capture.pooling`, torch, accumulated across prefill chunks) is tested against."""

from __future__ import annotations

import numpy as np


def entropy_weights(logits: np.ndarray) -> np.ndarray:
    """The entropy (nats) of each row's softmax: the pooling weight of each prompt token."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return -(p * np.log(np.clip(p, 1e-300, None))).sum(axis=1)


def pooled(states: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """The (weighted) mean over rows of a [tokens, hidden] state: what `mean@L` and `entropy@L` record."""
    states = np.asarray(states, dtype=np.float64)
    if weights is None:
        return states.mean(axis=0)
    weights = np.asarray(weights, dtype=np.float64)
    total = weights.sum()
    if not total > 0:
        return states.mean(axis=0)
    return (weights[:, None] * states).sum(axis=0) / total
