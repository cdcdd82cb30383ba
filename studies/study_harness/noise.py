"""Synthetic predictions of a chosen ranking quality, to ask how good a predictor must be.

Scheduling only needs the order of lengths, so predictor quality is quoted as the Spearman rank
correlation with the truth. Multiplicative log-normal noise keeps predictions positive and hurts
long and short requests alike, like a real predictor's relative error.
"""

from __future__ import annotations

import numpy as np

from leap_core.metrics import spearman

__all__ = ["noisy_predictions"]


def noisy_predictions(true_lengths, target_spearman: float, seed: int = 0, tolerance: float = 0.002,
                      max_iter: int = 60) -> np.ndarray:
    """Predictions `true * exp(sigma * z)`, z ~ N(0, 1), with sigma chosen so Spearman(pred, true) ~= target.

    One noise draw per seed is scaled by bisection on sigma, so the result is deterministic and the
    correlation is met on this very sample (to within `tolerance` when the sample is large enough for
    ranks to move in small steps). The target must lie in (0, 1]; 1 returns the truth.
    """
    true_lengths = np.asarray(true_lengths, dtype=np.float64)
    if true_lengths.ndim != 1 or true_lengths.size < 2:
        raise ValueError("true_lengths must be a 1-D array of at least two lengths")
    if np.any(true_lengths <= 0):
        raise ValueError("true_lengths must be positive")
    if not 0.0 < target_spearman <= 1.0:
        raise ValueError("target_spearman must be in (0, 1]: multiplicative noise cannot reverse the order")
    if target_spearman == 1.0:
        return true_lengths.copy()

    z = np.random.default_rng(seed).standard_normal(true_lengths.size)

    def predict(sigma: float) -> np.ndarray:
        return true_lengths * np.exp(sigma * z)

    low, high = 0.0, 1.0
    while spearman(true_lengths, predict(high)) > target_spearman:  # widen until the target is bracketed
        low, high = high, high * 2.0
        if high > 1e3:
            raise ValueError(f"target_spearman {target_spearman} is below what noise reaches on this sample")
    sigma = high
    for _ in range(max_iter):
        sigma = 0.5 * (low + high)
        rho = spearman(true_lengths, predict(sigma))
        if abs(rho - target_spearman) <= tolerance:
            break
        if rho > target_spearman:
            low = sigma
        else:
            high = sigma
    return predict(sigma)
