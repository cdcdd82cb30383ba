"""Ranking under the predictor's uncertainty: the Gittins index of a request's remaining length.

`LengthGivenPrediction` keeps, per bin of predicted length, the true lengths of validation requests
predicted there: the distribution of a request's length L given its prediction. After `a` tokens, with
R = L - a over the samples with L > a and weight w(L) (1/L for per-token latency, 1 for latency),

    G(a) = sup_Delta  E[w(L) 1{R <= Delta} | L > a]  /  E[min(R, Delta) | L > a],

and serving the largest index first minimises mean weighted response time (Gittins; Scully et al.
2020). G is precomputed per bin and generated count (`gittins_indices`) so the policy
(`leap_core.policy.GittinsPolicy`) reads one entry per request per step; the readout file carries it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.base import BaseEstimator

WEIGHTS = ("ptl", "latency")
MAX_TABLE_ENTRIES = 1 << 23
"""Most entries of `LengthGivenPrediction.index_` (bins x M): 64 MiB."""
MAX_TABLE_WORK = 1 << 31
"""Most (generated count, distinct length) terms one table may cost: a few seconds."""


_BLOCK = 1 << 20
"""Entries of one (generated counts x distinct lengths) block of `gittins_indices`."""


def gittins_indices(lengths: ArrayLike, generated: ArrayLike, weights: ArrayLike | None = None) -> NDArray[np.float64]:
    """G at each of the `generated` counts for one distribution given by samples of the total length (see the
    module docstring); NaN where no sample is longer than the count.

    Samples of equal length are taken together: across a run of equal remaining lengths the denominator of
    the sorted formula stays the same while the numerator grows, so the maximum is at a run's end, and one
    term per distinct length suffices. The cost is (counts) x (distinct lengths), computed in blocks.
    """
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    w = np.ones_like(lengths) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != lengths.shape:
        raise ValueError(f"{w.size} weights for {lengths.size} lengths")
    a = np.asarray(generated, dtype=np.float64).reshape(-1)
    result = np.full(a.shape, np.nan)
    if lengths.size == 0:
        return result
    values, inverse = np.unique(lengths, return_inverse=True)
    count = np.bincount(inverse, minlength=values.size).astype(np.float64)
    # prefix sums over the distinct lengths, 0 first: samples, their total length, their weight
    samples = np.concatenate(([0.0], np.cumsum(count)))
    total = np.concatenate(([0.0], np.cumsum(count * values)))
    weight = np.concatenate(([0.0], np.cumsum(np.bincount(inverse, weights=w, minlength=values.size))))
    shorter = np.searchsorted(values, a, side="right")  # distinct lengths the request has outlived
    live = np.flatnonzero(shorter < values.size)
    live = live[np.argsort(shorter[live], kind="stable")]
    step = max(1, _BLOCK // values.size)
    for begin in range(0, live.size, step):
        rows = live[begin:begin + step]
        first = int(shorter[rows].min())  # no row's run of alive lengths starts before it
        p, age = shorter[rows, None], a[rows, None]
        v = values[None, first:]
        done = samples[None, first + 1:] - samples[p]  # alive samples no longer than v
        alive = samples[-1] - samples[p]
        invested = total[None, first + 1:] - total[p] - done * age + (alive - done) * (v - age)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (weight[None, first + 1:] - weight[p]) / invested
        ratio[np.arange(first, values.size)[None, :] < p] = -np.inf  # lengths already outlived
        result[rows] = ratio.max(axis=1)
    return result


def gittins_index(lengths: ArrayLike, generated: int, weights: ArrayLike | None = None) -> float:
    """G(generated) of one distribution given by samples of the total length (see the module docstring);
    NaN when no sample is longer than `generated`."""
    return float(gittins_indices(lengths, [generated], weights)[0])


class LengthGivenPrediction(BaseEstimator):
    """The distribution of true output length given the predicted length, from validation pairs.

    Parameters
    ----------
    n_bins : bins of predicted length, at quantiles of the validation predictions.
    max_tokens : the output budget M (true lengths are clipped to [1, M]).
    weight : "ptl" (w = 1/L: mean per-token latency) or "latency" (w = 1).

    Learned: `edges_` (at most n_bins - 1 inner bin edges: equal quantiles merge), `samples_` (per bin, the
    sorted true lengths), `index_` ((bins, M) Gittins index per bin and generated count), `n_` validation
    pairs. `from_samples` rebuilds a fitted one from `edges_` and `samples_` (the readout file stores them).
    """

    def __init__(self, n_bins: int = 10, max_tokens: int = 1024, weight: str = "ptl") -> None:
        self.n_bins = n_bins
        self.max_tokens = max_tokens
        self.weight = weight

    def fit(self, predicted: ArrayLike, true: ArrayLike) -> LengthGivenPrediction:
        self._check_params()
        predicted = np.asarray(predicted, dtype=np.float64).reshape(-1)
        true = np.clip(np.asarray(true, dtype=np.float64).reshape(-1), 1, self.max_tokens)
        if predicted.shape != true.shape:
            raise ValueError(f"predicted has {predicted.size} rows, true has {true.size}")
        if predicted.size < self.n_bins:
            raise ValueError(f"{predicted.size} validation pairs cannot fill {self.n_bins} bins")
        edges = np.unique(np.quantile(predicted, np.linspace(0, 1, self.n_bins + 1)[1:-1]))
        bins = np.digitize(predicted, edges)
        self._set_samples(edges, [np.sort(true[bins == b]) for b in range(edges.size + 1)])
        return self

    @classmethod
    def from_samples(cls, edges: ArrayLike, samples: list[ArrayLike], *, n_bins: int, max_tokens: int,
                     weight: str = "ptl") -> LengthGivenPrediction:
        """A fitted distribution from stored state (the readout file uses this): the inner bin `edges`
        (strictly increasing, at most n_bins - 1 of them) and per bin the sorted true lengths in [1, M].
        ValueError names what is wrong."""
        distribution = cls(n_bins=n_bins, max_tokens=max_tokens, weight=weight)
        distribution._check_params()
        edges = np.array(edges, dtype=np.float64).reshape(-1)
        if edges.size > n_bins - 1:
            raise ValueError(f"{edges.size} inner bin edges are more than {n_bins} bins have")
        if not np.isfinite(edges).all() or (np.diff(edges) <= 0).any():
            raise ValueError("bin edges must be finite and strictly increasing")
        if len(samples) != edges.size + 1:
            raise ValueError(f"{len(samples)} bins of samples for {edges.size} inner edges (expected "
                             f"{edges.size + 1})")
        samples = [np.array(s, dtype=np.float64).reshape(-1) for s in samples]
        for b, lengths in enumerate(samples):
            if not np.isfinite(lengths).all() or (lengths < 1).any() or (lengths > max_tokens).any():
                raise ValueError(f"bin {b} holds lengths outside [1, {max_tokens}]")
            if (np.diff(lengths) < 0).any():
                raise ValueError(f"bin {b}'s lengths are not sorted")
        if sum(s.size for s in samples) == 0:
            raise ValueError("the distribution holds no samples")
        distribution._set_samples(edges, samples)
        return distribution

    def _check_params(self) -> None:
        if self.weight not in WEIGHTS:
            raise ValueError(f"weight must be one of {WEIGHTS}, got {self.weight!r}")
        if not isinstance(self.n_bins, (int, np.integer)) or isinstance(self.n_bins, bool) or self.n_bins < 1:
            raise ValueError(f"n_bins must be a positive integer, got {self.n_bins!r}")
        if (not isinstance(self.max_tokens, (int, np.integer)) or isinstance(self.max_tokens, bool)
                or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")

    def _set_samples(self, edges: np.ndarray, samples: list[np.ndarray]) -> None:
        pooled = np.sort(np.concatenate(samples))
        budget = int(self.max_tokens)
        entries = len(samples) * budget
        work = sum(np.unique(s).size * min(budget, int(s.max())) for s in (*samples, pooled) if s.size)
        if entries > MAX_TABLE_ENTRIES or work > MAX_TABLE_WORK:
            raise ValueError(f"a table of {len(samples)} bins x {budget} tokens over these samples ({entries} "
                             f"entries, {work} terms) is beyond {MAX_TABLE_ENTRIES} entries or {MAX_TABLE_WORK} terms")
        self.edges_ = edges
        self.samples_ = samples
        self.n_ = int(sum(s.size for s in samples))
        self.index_ = self._table(pooled)

    def _weights(self, lengths: np.ndarray) -> np.ndarray:
        return 1.0 / lengths if self.weight == "ptl" else np.ones_like(lengths)

    def _table(self, pooled: np.ndarray) -> NDArray[np.float64]:
        budget = int(self.max_tokens)
        generated = np.arange(budget)
        fallback = gittins_indices(pooled, generated, self._weights(pooled))
        # outlived every sample: only the budget ends it
        budget_only = self._weights(np.array([float(budget)]))[0] / np.maximum(budget - generated, 1)
        fallback = np.where(np.isnan(fallback), budget_only, fallback)
        table = np.empty((len(self.samples_), budget))
        for b, samples in enumerate(self.samples_):
            own = gittins_indices(samples, generated, self._weights(samples))
            table[b] = np.where(np.isnan(own), fallback, own)
        return table

    def bins(self, predicted: ArrayLike) -> NDArray[np.intp]:
        return np.digitize(np.asarray(predicted, dtype=np.float64), self.edges_)

    def index(self, predicted: ArrayLike, generated: ArrayLike) -> NDArray[np.float64]:
        """G for each request: its prediction's bin, its generated count (clipped to [0, M - 1])."""
        a = np.clip(np.asarray(generated, dtype=np.int64), 0, int(self.max_tokens) - 1)
        return self.index_[self.bins(predicted), a]
