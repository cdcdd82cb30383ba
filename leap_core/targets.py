"""Target transforms: the space in which the readout regresses output lengths.

Output lengths are heavy-tailed; fitting sqrt(length) (the default) keeps long requests from dominating
the squared loss while staying closer to linear than log. Predictions are clipped to the transform of
[1, M] before mapping back, so a readout never predicts an impossible length. Fixed targets (sqrt, log,
raw) are functions of the length alone; fitted targets (rank, softbin) are monotone piecewise-linear maps
of log length learned once from the training lengths (`TargetMap`), so the readout stays one linear layer
and RLS corrects it exactly in the fitted space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtri

TARGETS = ("sqrt", "log", "raw", "rank", "softbin")
FITTED_TARGETS = ("rank", "softbin")
"""Targets whose map is learned from training lengths (`fit_map`) and travels with the readout."""
MAX_KNOTS = 1025
"""Most knots a fitted map keeps (a readout file refuses more)."""
SOFTBIN_BINS = 16
SOFTBIN_WIDTH = 0.5
"""Soft-bin head: bins at the training quantiles of log length, Gaussian labels of this width (log units)."""
_SOFTBIN_GRID = 257
_RISE = 1e-9
"""Added slope per log-length unit so a saturating map stays strictly increasing (invertible)."""


@dataclass(frozen=True, eq=False)
class TargetMap:
    """A fitted target's map: value = interp(log(length), log_lengths, values), both strictly increasing,
    log_lengths from 0 (length 1) to log(max_tokens)."""

    name: str
    log_lengths: NDArray[np.float64]
    values: NDArray[np.float64]

    def __post_init__(self) -> None:
        knots = np.array(self.log_lengths, dtype=np.float64).reshape(-1)
        values = np.array(self.values, dtype=np.float64).reshape(-1)
        if self.name not in FITTED_TARGETS:
            raise ValueError(f"a target map is for one of {FITTED_TARGETS}, not {self.name!r}")
        if knots.size != values.size or not 2 <= knots.size <= MAX_KNOTS:
            raise ValueError(f"a target map needs 2 to {MAX_KNOTS} knots and one value each, got {knots.size} "
                             f"knots and {values.size} values")
        if not (np.isfinite(knots).all() and np.isfinite(values).all()):
            raise ValueError("a target map's knots and values must be finite")
        if not ((np.diff(knots) > 0).all() and (np.diff(values) > 0).all()):
            raise ValueError("a target map's knots and values must both be strictly increasing")
        if knots[0] != 0.0:
            raise ValueError(f"a target map starts at length 1 (log length 0), got {knots[0]}")
        knots.flags.writeable = values.flags.writeable = False
        object.__setattr__(self, "log_lengths", knots)
        object.__setattr__(self, "values", values)

    @property
    def max_tokens(self) -> int:
        """The budget the map was fitted for (its last knot)."""
        return int(round(float(np.exp(self.log_lengths[-1]))))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TargetMap) and self.name == other.name
                and np.array_equal(self.log_lengths, other.log_lengths) and np.array_equal(self.values, other.values))

    __hash__ = None  # type: ignore[assignment]


def check_target(target: str) -> str:
    """Return `target` if it is one of TARGETS, else raise ValueError naming the known ones."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    return target


def soft_labels(log_lengths: ArrayLike, centers: ArrayLike, width: float = SOFTBIN_WIDTH) -> NDArray[np.float64]:
    """Each row's Gaussian soft label over the bins: weights exp(-(u - c)^2 / 2 width^2), summing to 1."""
    u = np.asarray(log_lengths, dtype=np.float64).reshape(-1, 1)
    scaled = (u - np.asarray(centers, dtype=np.float64)[None, :]) / float(width)
    weights = np.exp(-0.5 * (scaled ** 2 - np.min(scaled ** 2, axis=1, keepdims=True)))  # no all-zero row
    return weights / weights.sum(axis=1, keepdims=True)


def softbin_centers(log_lengths: ArrayLike, max_tokens: int, n_bins: int = SOFTBIN_BINS) -> NDArray[np.float64]:
    """Bin centers: midpoints of the distinct quantile edges of the training log lengths; where those give fewer
    than 2 bins (nearly all lengths equal), `n_bins` even bins over the feasible range [0, log max_tokens]."""
    edges = np.unique(np.quantile(np.asarray(log_lengths, dtype=np.float64), np.linspace(0.0, 1.0, n_bins + 1)))
    if edges.size < 3:
        edges = np.linspace(0.0, float(np.log(max(int(max_tokens), 2))), n_bins + 1)
    return 0.5 * (edges[1:] + edges[:-1])


def fit_map(target: str, lengths: ArrayLike, max_tokens: int) -> TargetMap | None:
    """The map of a fitted target learned from training `lengths` (clipped to [1, max_tokens]); None for a
    fixed target."""
    check_target(target)
    if target not in FITTED_TARGETS:
        return None
    if int(max_tokens) < 2:
        raise ValueError(f"a fitted target needs max_tokens >= 2, got {max_tokens}")
    top = float(np.log(int(max_tokens)))
    u = np.log(np.clip(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0, float(max_tokens)))
    if u.size < 2 or not np.isfinite(u).all():
        raise ValueError(f"a fitted target needs at least 2 finite training lengths, got {u.size}")
    if target == "softbin":
        centers = softbin_centers(u, int(max_tokens))
        grid = np.linspace(0.0, top, _SOFTBIN_GRID)
        return TargetMap("softbin", grid, soft_labels(grid, centers) @ centers + _RISE * grid)
    distinct, counts = np.unique(u, return_counts=True)  # one distinct length still gets the two end knots
    below = np.cumsum(counts) - counts
    share = (below + 0.5 * counts) / u.size  # mid-rank: tied lengths share one score
    if distinct.size > MAX_KNOTS - 2:  # keep evenly spaced ranks, ends included
        keep = np.unique(np.round(np.linspace(0, distinct.size - 1, MAX_KNOTS - 2)).astype(int))
        distinct, share = distinct[keep], share[keep]
    if distinct[0] > 0.0:
        distinct, share = np.r_[0.0, distinct], np.r_[share[0] / 2, share]
    if distinct[-1] < top:
        distinct, share = np.r_[distinct, top], np.r_[share, (1.0 + share[-1]) / 2]
    return TargetMap("rank", distinct, ndtri(share))


def _fitted(target: str, target_map: TargetMap | None) -> TargetMap:
    if target_map is None:
        raise ValueError(f"the {target} target is fitted: pass its TargetMap (targets.fit_map)")
    if target_map.name != target:
        raise ValueError(f"the target map is for {target_map.name!r}, not {target!r}")
    return target_map


def transform(lengths: ArrayLike, target: str, target_map: TargetMap | None = None) -> NDArray[np.float64]:
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
    if target in FITTED_TARGETS:
        fitted = _fitted(target, target_map)
        return np.interp(np.log(values), fitted.log_lengths, fitted.values)
    return values


def inverse(values: ArrayLike, target: str, target_map: TargetMap | None = None) -> NDArray[np.float64]:
    """Map regression-space values back to lengths (no clipping; see `to_lengths`)."""
    check_target(target)
    values = np.asarray(values, dtype=np.float64)
    if target == "sqrt":
        return np.square(values)
    if target == "log":
        return np.exp(values)
    if target in FITTED_TARGETS:
        fitted = _fitted(target, target_map)
        return np.exp(np.interp(values, fitted.values, fitted.log_lengths))
    return values.copy()


def bounds(target: str, max_tokens: int, target_map: TargetMap | None = None) -> tuple[float, float]:
    """The transform of the feasible length range [1, max_tokens]."""
    check_target(target)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    m = float(max_tokens)
    if target == "sqrt":
        return 1.0, float(np.sqrt(m))
    if target == "log":
        return 0.0, float(np.log(m))
    if target in FITTED_TARGETS:
        low, high = transform(np.array([1.0, m]), target, target_map)
        return float(low), float(high)
    return 1.0, m


def to_lengths(values: ArrayLike, target: str, max_tokens: int,
               target_map: TargetMap | None = None) -> NDArray[np.float64]:
    """Clip regression-space predictions to the feasible range, then map them back to lengths."""
    lo, hi = bounds(target, max_tokens, target_map)
    lengths = inverse(np.clip(np.asarray(values, dtype=np.float64), lo, hi), target, target_map)
    return np.clip(lengths, 1.0, float(max_tokens)) if target in FITTED_TARGETS else lengths
