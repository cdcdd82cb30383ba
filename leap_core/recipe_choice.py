"""Choosing a feature recipe (and so a layer) by validation on the training window only.

For each candidate recipe, every split's held-out predictions come from the one alpha path
(`leap_core.alpha.held_out_path`: the whole penalty grid for the cost of one fit). The penalty is the one
with the lowest held-out mean absolute error; the recipe's score is the Spearman rank correlation of
its held-out predictions at that penalty against the true lengths (outputs that reached M tie at M),
since ranking is what the scheduler uses. The chosen recipe has the highest score; a recipe within
`tolerance` of it with fewer columns wins instead (it costs less to capture, store and correct).

Candidate regression targets (`leap_core.targets`) are chosen the same way: a (recipe, target) pair is
one row of the table, scored in tokens like every other.

The fit flow splits by arrival (the newest rows of its training window); the recipe study by
shuffled K-fold grouped by prompt. Neither looks at its test rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from leap_core import targets as targets_module  # `targets` is validate_recipes' argument
from leap_core.alpha import ALPHAS, held_out_path, kfold
from leap_core.metrics import censored_spearman

TOLERANCE = 0.0
"""Validation Spearman a smaller recipe may give up and still be chosen (0: the best score wins)."""


def validate_recipe(X: ArrayLike, lengths: ArrayLike, *, max_tokens: int, target: str = "sqrt",
                    cv: Any = None, groups: ArrayLike | None = None, alphas: ArrayLike = ALPHAS) -> dict[str, Any]:
    """{"alpha", "spearman", "mae", "n", "dim"} of one recipe's matrix X over the splits of `cv`.

    Rows never held out (a `newest_split` keeps the older ones for fitting only) are not scored.
    """
    X = np.asarray(X)
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    splitter = kfold() if cv is None else cv
    held = np.full((lengths.size, alphas.size), np.nan)
    for fit_rows, held_rows in splitter.split(X, lengths, groups):
        target_map = targets_module.fit_map(target, lengths[fit_rows], int(max_tokens))  # fitted on the fold alone
        pred = held_out_path(X[fit_rows], targets_module.transform(lengths[fit_rows], target, target_map),
                             X[held_rows], alphas)
        held[held_rows] = targets_module.to_lengths(pred, target, int(max_tokens), target_map)
    scored = ~np.isnan(held[:, 0])
    if scored.sum() < 3:
        raise ValueError(f"validation scored {int(scored.sum())} rows; it needs at least 3")
    errors = np.abs(held[scored] - lengths[scored, None]).mean(axis=0)
    best = int(np.argmin(errors))
    return {"alpha": float(alphas[best]), "mae": float(errors[best]), "n": int(scored.sum()), "dim": int(X.shape[1]),
            "spearman": censored_spearman(lengths[scored], held[scored, best], int(max_tokens))}


def validate_recipes(matrices: Mapping[str, ArrayLike], lengths: ArrayLike, *, targets: Sequence[str] | None = None,
                     target: str = "sqrt", **options: Any) -> list[dict[str, Any]]:
    """One `validate_recipe` row per recipe and target, {"recipe": name, "target": t, ...}, best validation
    Spearman first. `targets`: the candidate regression targets (default: `target` alone); each pair gets
    its own penalty, and every pair is scored on the same held-out rows in tokens, so the rows compare."""
    candidates = [targets_module.check_target(t) for t in dict.fromkeys(targets or (target,))]
    table = [{"recipe": name, "target": t, **validate_recipe(X, lengths, target=t, **options)}
             for name, X in matrices.items() for t in candidates]
    return sorted(table, key=lambda row: (-row["spearman"], row["dim"], _target_rank(row), row["recipe"]))


def choose_recipe(table: list[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The row to serve: the best validation Spearman, or the smallest recipe within `tolerance` of it (on
    a tie, the target listed first in `leap_core.targets.TARGETS`)."""
    if not table:
        raise ValueError("no recipe was validated")
    best = max(row["spearman"] for row in table)
    close = [row for row in table if row["spearman"] >= best - tolerance]
    return min(close, key=lambda row: (row["dim"], -row["spearman"], _target_rank(row), row["recipe"]))


def _target_rank(row: Mapping[str, Any]) -> int:
    name = row.get("target", targets_module.TARGETS[0])
    return targets_module.TARGETS.index(name) if name in targets_module.TARGETS else len(targets_module.TARGETS)
