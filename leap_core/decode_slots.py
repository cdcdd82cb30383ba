"""How many resident requests decode each step: as few as keep the engine ahead of its demand.

Where a step's time grows with the number of requests it decodes, decoding every resident request is
processor sharing; decoding only the most urgent lets the order decide who finishes first, at a price in
throughput. `DecodeSlotRule` picks the smallest count whose service rate stays ahead of demand, from a
step-time fit (`StepTimeEstimator`) and an arrival rate (`DemandRate`). Numbers in, numbers out: the
serving runtime and the simulator both feed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DecodeSlotRule", "DemandRate", "StepTimeEstimator"]


@dataclass(frozen=True)
class DecodeSlotRule:
    """The decode slots for the coming step.

    Parameters
    ----------
    max_slots : the most requests decoded per step (the configured K).
    min_slots : the fewest, whenever at least that many are resident.
    margin : how far the service rate must stay ahead of the demand (1.0: twice the demand). The defaults were
        chosen in the simulator on training rows (`leap eval load`): smaller margins cost latency on a CPU.
    drain_s : the resident backlog counts as demand spread over this many seconds.
    flat_tolerance : decode all when that makes a step at most this much slower than decoding k.
    """

    max_slots: int = 64
    min_slots: int = 4
    margin: float = 1.0
    drain_s: float = 15.0
    flat_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not 1 <= self.min_slots <= self.max_slots:
            raise ValueError(f"need 1 <= min_slots <= max_slots, got {self.min_slots} and {self.max_slots}")
        if self.margin < 0 or self.drain_s <= 0 or self.flat_tolerance < 0:
            raise ValueError("margin and flat_tolerance must be >= 0 and drain_s > 0")

    def demand(self, arriving_tok_s: float, backlog_tokens: float) -> float:
        """Tokens a second the engine must serve: what arrives plus the backlog spread over `drain_s`."""
        return max(arriving_tok_s, 0.0) + max(backlog_tokens, 0.0) / self.drain_s

    def slots(self, fixed_s: float, per_request_s: float, demand_tok_s: float, candidates: int) -> int:
        """Decode slots for a step with `candidates` decode candidates, when a step decoding k of them takes
        `fixed_s + per_request_s * k` seconds and `demand_tok_s` tokens a second must be served."""
        every = min(candidates, self.max_slots)
        if candidates <= self.min_slots or fixed_s <= 0 or per_request_s < 0:
            return every
        need = (1.0 + self.margin) * max(demand_tok_s, 0.0)
        # k / (fixed + c k) >= need  <=>  k (1 - need c) >= need fixed
        if need * per_request_s >= 1.0:
            return every  # no k keeps up: serve as fast as the engine can
        k = max(math.ceil(need * fixed_s / (1.0 - need * per_request_s) - 1e-9), self.min_slots)
        if k >= every:
            return every
        if fixed_s + per_request_s * every <= (1.0 + self.flat_tolerance) * (fixed_s + per_request_s * k):
            return every  # holding requests out would barely shorten a step
        return k


class StepTimeEstimator:
    """Step seconds against (requests decoded, prefill tokens, context tokens the decodes attend to), fitted
    by exponentially weighted least squares over the steps seen; coefficients are kept non-negative.

    Parameters
    ----------
    half_life_steps : a step's weight halves after this many more steps.
    min_steps : steps needed before `fitted` is true.
    ridge : a small penalty that keeps the fit defined before every column has varied.
    """

    COLUMNS = ("fixed", "per_decode", "per_prefill_token", "per_context_token")

    def __init__(self, half_life_steps: float = 2000.0, min_steps: int = 64, ridge: float = 1e-9) -> None:
        self.half_life_steps = half_life_steps
        self.min_steps = min_steps
        self.ridge = ridge
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self.steps_ = 0
        self.coef_ = np.zeros(4)
        self._stale = False

    def observe(self, decodes: int, prefill_tokens: int, context_tokens: int, seconds: float) -> None:
        """One measured step; steps that did nothing, or took a non-finite time, are skipped."""
        if decodes + prefill_tokens <= 0 or not (0.0 < seconds < math.inf):
            return
        x = np.array([1.0, decodes, prefill_tokens, context_tokens], dtype=np.float64)
        self._xtx *= self._decay
        self._xty *= self._decay
        self._xtx += np.outer(x, x)
        self._xty += x * seconds
        self.steps_ += 1
        self._stale = True

    @property
    def fitted(self) -> bool:
        return self.steps_ >= self.min_steps

    def coefficients(self) -> np.ndarray:
        """(fixed, per decode, per prefill token, per context token) seconds, refitted when steps came in."""
        if self._stale:
            self._stale = False
            scale = np.sqrt(np.maximum(np.diag(self._xtx), 1e-300))
            a = self._xtx / np.outer(scale, scale) + self.ridge * np.eye(4)
            coef = np.linalg.solve(a, self._xty / scale) / scale
            if np.any(coef < 0):  # a cost cannot be negative: refit without the negative terms
                keep = coef > 0
                coef = np.zeros(4)
                if keep.any():
                    idx = np.flatnonzero(keep)
                    sub = a[np.ix_(idx, idx)]
                    coef[idx] = np.linalg.solve(sub, (self._xty / scale)[idx]) / scale[idx]
                    coef = np.maximum(coef, 0.0)
            self.coef_ = coef
        return self.coef_

    def decode_step(self, mean_context_tokens: float) -> tuple[float, float]:
        """(fixed seconds, seconds per decoded request) of a decode-only step whose requests each attend to
        `mean_context_tokens` tokens."""
        fixed, per_decode, _, per_context = self.coefficients()
        return float(fixed), float(per_decode + per_context * max(mean_context_tokens, 0.0))


class DemandRate:
    """Tokens a second that arriving requests will need: each arrival adds its predicted output length, and
    the rate decays with time constant `tau_s` (an exponential kernel estimate of the arrival intensity)."""

    def __init__(self, tau_s: float = 30.0) -> None:
        if tau_s <= 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = tau_s
        self._rate = 0.0
        self._at: float | None = None

    def add(self, now: float, tokens: float) -> None:
        """A request arrived at `now` (seconds, any clock) that will need `tokens` output tokens."""
        self._rate = self.rate(now) + max(tokens, 0.0) / self.tau_s
        self._at = now if self._at is None else max(self._at, now)

    def rate(self, now: float) -> float:
        """The estimate at `now`, in tokens a second."""
        if self._at is None:
            return 0.0
        return self._rate * math.exp(-max(now - self._at, 0.0) / self.tau_s)
