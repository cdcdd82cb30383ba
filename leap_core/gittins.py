"""Ranking under the predictor's uncertainty: the Gittins index of a request's remaining length.

A point prediction says "about 200 tokens"; the readout's validation errors say how far off such a
prediction tends to be. `LengthGivenPrediction` keeps, per bin of predicted length, the true lengths of
validation requests predicted in that bin: the distribution of a request's length L given its prediction.
Once a request has generated `a` tokens without finishing, its remaining length R = L - a follows the
bin's samples with L > a (the request has outlived the shorter ones).

The index, for preemptive scheduling of jobs whose sizes are known only in distribution (Gittins;
Aalto, Ayesta and Righter 2009; Scully, Harchol-Balter and Scheller-Wolf 2020 for the weighted form): for
a quantum of Delta tokens of service,

    G(a) = sup_Delta  E[w(L) 1{R <= Delta} | L > a]  /  E[min(R, Delta) | L > a],

the expected weight completed per token of service invested. Serving the largest index first minimises
the mean weighted response time of a single M/G/1 server; the weight w(L) = 1/L makes it the mean
latency per output token (PTL), the figure LEAP is judged by, and w = 1 the mean latency. With the m
samples sorted by remaining length, r_1 <= ... <= r_m, the supremum is over Delta in {r_j}:

    G(a) = max_j  (sum_{i<=j} w_i)  /  (sum_{i<=j} r_i + (m - j) r_j)      (each term over m).

With an exact prediction (one sample L) it is w(L) / (L - a): shortest remaining first, weighted. A
request that has outlived every sample of its bin uses the samples of all bins; one that has outlived
those too can only end by the budget M, so its single remaining is M - a.

`index_table` precomputes G for every bin and generated count 0..M-1 (the policy reads one entry per
request per step); `leap_core.policy.GittinsPolicy` ranks by 1 / G, the expected service per unit weight.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator

WEIGHTS = ("ptl", "latency")


def gittins_index(lengths: ArrayLike, generated: int, weights: ArrayLike | None = None) -> float:
    """G(generated) of one distribution given by samples of the total length (see the module docstring);
    NaN when no sample is longer than `generated`."""
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    alive = lengths > generated
    if not alive.any():
        return float("nan")
    w = np.ones_like(lengths) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    remaining = lengths[alive] - generated
    order = np.argsort(remaining, kind="stable")
    r, wr = remaining[order], w[alive][order]
    m = r.size
    invested = np.cumsum(r) + (m - np.arange(1, m + 1)) * r
    return float(np.max(np.cumsum(wr) / invested))


class LengthGivenPrediction(BaseEstimator):
    """The distribution of true output length given the predicted length, from validation pairs.

    Parameters
    ----------
    n_bins : bins of predicted length, at quantiles of the validation predictions.
    max_tokens : the output budget M (true lengths are clipped to [1, M]).
    weight : "ptl" (w = 1/L: mean per-token latency) or "latency" (w = 1).

    Learned: `edges_` (n_bins - 1 inner bin edges), `samples_` (per bin, the sorted true lengths),
    `index_` ((n_bins, M) Gittins index per bin and generated count), `n_` validation pairs.
    """

    def __init__(self, n_bins: int = 10, max_tokens: int = 1024, weight: str = "ptl") -> None:
        self.n_bins = n_bins
        self.max_tokens = max_tokens
        self.weight = weight

    def fit(self, predicted: ArrayLike, true: ArrayLike) -> LengthGivenPrediction:
        predicted = np.asarray(predicted, dtype=np.float64).reshape(-1)
        true = np.clip(np.asarray(true, dtype=np.float64).reshape(-1), 1, self.max_tokens)
        if predicted.shape != true.shape:
            raise ValueError(f"predicted has {predicted.size} rows, true has {true.size}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"weight must be one of {WEIGHTS}, got {self.weight!r}")
        if self.n_bins < 1 or predicted.size < self.n_bins:
            raise ValueError(f"{predicted.size} validation pairs cannot fill {self.n_bins} bins")
        inner = np.quantile(predicted, np.linspace(0, 1, self.n_bins + 1)[1:-1])
        self.edges_ = np.unique(inner)
        bins = np.digitize(predicted, self.edges_)
        self.samples_ = [np.sort(true[bins == b]) for b in range(self.edges_.size + 1)]
        self.n_ = int(predicted.size)
        self.index_ = self._table(np.sort(true))
        return self

    def _weights(self, lengths: np.ndarray) -> np.ndarray:
        return 1.0 / lengths if self.weight == "ptl" else np.ones_like(lengths)

    def _table(self, pooled: np.ndarray) -> NDArray[np.float64]:
        budget = int(self.max_tokens)
        table = np.empty((len(self.samples_), budget))
        for b, samples in enumerate(self.samples_):
            for a in range(budget):
                value = gittins_index(samples, a, self._weights(samples)) if samples.size else float("nan")
                if np.isnan(value):
                    value = gittins_index(pooled, a, self._weights(pooled))
                if np.isnan(value):  # outlived every sample: only the budget ends it
                    value = self._weights(np.array([float(budget)]))[0] / max(budget - a, 1)
                table[b, a] = value
        return table

    def bins(self, predicted: ArrayLike) -> NDArray[np.intp]:
        return np.digitize(np.asarray(predicted, dtype=np.float64), self.edges_)

    def index(self, predicted: ArrayLike, generated: ArrayLike) -> NDArray[np.float64]:
        """G for each request: its prediction's bin, its generated count (clipped to [0, M - 1])."""
        a = np.clip(np.asarray(generated, dtype=np.int64), 0, int(self.max_tokens) - 1)
        return self.index_[self.bins(predicted), a]
