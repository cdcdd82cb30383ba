"""How long one engine step takes (`StepTimeModel`), and its fit from measured steps.

The simulator (`leap_core.simulator`) advances its clock by this model; the live replay's step clock
(`harness.replay`) and the studies calibrate it from the steps a running engine records. It is its own
module because the cost model and its least-squares fit are one idea, apart from the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls

__all__ = ["MIN_STEPS_PER_DECODE_COUNT", "StepTimeModel"]

MIN_STEPS_PER_DECODE_COUNT = 20  # measured steps a decode count needs before it gets its own fixed cost


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one engine step takes: a fixed cost that depends on how many requests it decodes, plus a cost
    per token of context the decoded requests attend to, per prefill token, and per pair of prefill tokens
    attending to each other.

    - A decode reads its sequence's whole KV cache, so a step of 8 decodes over 5,000 tokens of context
      costs measurably more than one over 1,000 (on two CPU cores about 1.7 us a token: 28 against 24 ms
      at 8 decodes). The context of a decoded request is its prompt plus the tokens it has generated.
    - The engine's cost is not linear in the number of decodes on a CPU (3 or 4 decodes cost less than 2,
      by about 2 ms on two cores), so `decode_base_s[d]`, when given, is the fixed cost of a step that
      decodes d requests; past its end, and without it, `base_s + per_decode_s * d`.
    - A prefill chunk of n tokens starting at token c of its prompt makes n (c + (n + 1) / 2) attending
      pairs (P (P + 1) / 2 over a whole prompt of P, however it is chunked): a 2,000-token chunk costs more
      per token than a 100-token prompt.

    Fitted on saturated runs alone without the last two, the model priced a lightly loaded engine's requests
    5-12% slow. The defaults are plausible for SmolLM2-135M on two CPU cores; calibrate with `fit` from
    measured steps (a model saved before a term existed reads it as 0, or no table).
    """

    base_s: float = 0.02
    per_decode_s: float = 0.001
    per_prefill_token_s: float = 0.00005
    per_context_token_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    decode_base_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_base_s", tuple(float(v) for v in self.decode_base_s))  # a JSON list too

    def step_seconds(self, num_decodes, num_prefill_tokens, context_tokens=0, prefill_pairs=0):
        """Duration of a step (scalars or arrays): `context_tokens` sums the decoded requests' contexts,
        `prefill_pairs` the prefill chunks' attending pairs."""
        decodes = np.asarray(num_decodes)
        fixed = self.base_s + self.per_decode_s * decodes
        if self.decode_base_s:
            table = np.asarray(self.decode_base_s)
            inside = decodes < table.size
            fixed = np.where(inside, table[np.minimum(decodes, table.size - 1).astype(np.int64)], fixed)
        seconds = (fixed + self.per_prefill_token_s * np.asarray(num_prefill_tokens)
                   + self.per_context_token_s * np.asarray(context_tokens)
                   + self.per_prefill_pair_s * np.asarray(prefill_pairs))
        return float(seconds) if np.ndim(seconds) == 0 else seconds

    def shape_seconds(self, shapes) -> np.ndarray:
        """Durations of steps given as rows (decodes, prefill tokens[, context tokens[, prefill pairs]]), as
        the runtime records them."""
        shapes = np.asarray(shapes, dtype=np.float64)
        if shapes.size == 0:
            return np.zeros(0)
        return self.step_seconds(*np.atleast_2d(shapes).T)

    @classmethod
    def fit(cls, num_decodes, num_prefill_tokens, step_seconds, context_tokens=None, prefill_pairs=None,
            by_decode_count: bool = False) -> StepTimeModel:
        """Least-squares coefficients from measured steps, constrained non-negative (a cost cannot be < 0);
        a count not given has cost 0. `by_decode_count`: each decode count seen in at least
        MIN_STEPS_PER_DECODE_COUNT steps gets its own fixed cost (`decode_base_s`; counts in between the
        seen ones interpolated), the linear `base_s + per_decode_s * d` fitted beside it for the rest."""
        decodes = np.asarray(num_decodes, dtype=np.float64)
        seconds = np.asarray(step_seconds, dtype=np.float64)

        def column(values) -> np.ndarray:
            return np.zeros_like(decodes) if values is None else np.asarray(values, dtype=np.float64)

        shared = np.column_stack((column(num_prefill_tokens), column(context_tokens), column(prefill_pairs)))
        linear = _nnls(np.column_stack((np.ones_like(decodes), decodes, shared)), seconds)
        model = cls(base_s=linear[0], per_decode_s=linear[1], per_prefill_token_s=linear[2],
                    per_context_token_s=linear[3], per_prefill_pair_s=linear[4])
        counts = np.bincount(decodes.astype(np.int64)) if decodes.size else np.zeros(0, dtype=np.int64)
        seen = np.flatnonzero(counts >= MIN_STEPS_PER_DECODE_COUNT)
        if not by_decode_count or seen.size < 2:
            return model
        rows = np.isin(decodes, seen)  # steps at counts seen too rarely stay out of the table's fit
        indicators = [(decodes[rows] == d).astype(np.float64) for d in seen]
        coef = _nnls(np.column_stack((*indicators, shared[rows])), seconds[rows])
        table = np.interp(np.arange(seen[-1] + 1), seen, coef[:seen.size])
        return replace(model, decode_base_s=tuple(float(v) for v in table), per_prefill_token_s=coef[-3],
                       per_context_token_s=coef[-2], per_prefill_pair_s=coef[-1])

    @classmethod
    def fit_shapes(cls, shapes, step_seconds) -> StepTimeModel:
        """`fit` by decode count on step rows (decodes, prefill tokens[, context tokens[, prefill pairs]]) as
        the runtime records them."""
        shapes = np.asarray(shapes, dtype=np.float64)
        extra = [shapes[:, k] if shapes.shape[1] > k else None for k in (2, 3)]
        return cls.fit(shapes[:, 0], shapes[:, 1], step_seconds, *extra, by_decode_count=True)


def _nnls(design: np.ndarray, target: np.ndarray) -> list[float]:
    """Non-negative least squares with each column scaled to at most 1 (a column never exercised gets 0)."""
    scale = np.abs(design).max(axis=0) if design.size else np.ones(design.shape[1])
    scale[scale == 0] = 1.0
    coef, _ = nnls(design / scale, target)
    return [float(v) for v in coef / scale]
