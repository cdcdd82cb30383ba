"""Target transforms: the space in which the readout regresses output lengths.

Output lengths are heavy-tailed; fitting sqrt(length) (the default) keeps long requests from
dominating the squared loss while staying closer to linear than log. A prediction is clipped to the
transform of the feasible range [1, M] (M = the request's output token budget) before it is mapped
back, so a readout can never predict a length no request can have.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

TARGETS = ("sqrt", "log", "raw")


def check_target(target: str) -> str:
    """Return `target` if it is one of TARGETS, else raise ValueError naming the known ones."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    return target


def transform(lengths: ArrayLike, target: str) -> NDArray[np.float64]:
    """Map output lengths (tokens) into the regression space.

    Lengths below 1 are raised to 1: every finished request emitted at least one token, and log
    must stay finite for a request aborted before its first token.
    """
    check_target(target)
    values = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)
    if target == "sqrt":
        return np.sqrt(values)
    if target == "log":
        return np.log(values)
    return values


def inverse(values: ArrayLike, target: str) -> NDArray[np.float64]:
    """Map regression-space values back to lengths (no clipping; see `to_lengths`)."""
    check_target(target)
    values = np.asarray(values, dtype=np.float64)
    if target == "sqrt":
        return np.square(values)
    if target == "log":
        return np.exp(values)
    return values.copy()


def bounds(target: str, max_tokens: int) -> tuple[float, float]:
    """The transform of the feasible length range [1, max_tokens]."""
    check_target(target)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    m = float(max_tokens)
    if target == "sqrt":
        return 1.0, float(np.sqrt(m))
    if target == "log":
        return 0.0, float(np.log(m))
    return 1.0, m


def to_lengths(values: ArrayLike, target: str, max_tokens: int) -> NDArray[np.float64]:
    """Clip regression-space predictions to the feasible range, then map them back to lengths."""
    lo, hi = bounds(target, max_tokens)
    return inverse(np.clip(np.asarray(values, dtype=np.float64), lo, hi), target)
