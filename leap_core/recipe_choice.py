"""Choosing a feature recipe (and so a layer, and a target) by validation on the training window only.

Each candidate's held-out predictions come from one alpha path (`leap_core.alpha.held_out_path`); its
score is the Spearman of those predictions with the true lengths, since ranking is what the scheduler
uses. The one-standard-error rule (paired bootstrap) picks the recipe with the fewest columns whose
score is within noise of the best: it costs less to capture, store and correct. Candidate targets
(`leap_core.targets`) are rows of the same table. The fit flow validates on the newest rows of its
window, the recipe study on K folds grouped by prompt; neither looks at its test rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from leap_core import targets as targets_module  # `targets` is validate_recipes' argument
from leap_core.alpha import ALPHAS, held_out_path, kfold
from leap_core.intervals import bootstrap_replicates, percentile_interval
from leap_core.metrics import censor, censored_spearman, spearman_difference

N_SE = 1.0
"""Standard errors of its gap to the best a smaller recipe may trail by and still be chosen (0: the best wins)."""
N_BOOT = 200
"""Paired bootstrap replicates behind each gap's standard error and interval."""
LEVEL = 0.95
RULE = (f"one standard error: the fewest columns whose validation Spearman trails the best by at most {N_SE:g} "
        f"paired-bootstrap standard error of the gap ({N_BOOT} draws of the validation rows)")


def validate_recipe(X: ArrayLike, lengths: ArrayLike, *, max_tokens: int, target: str = "sqrt",
                    cv: Any = None, groups: ArrayLike | None = None, alphas: ArrayLike = ALPHAS) -> dict[str, Any]:
    """{"alpha", "spearman", "mae", "n", "dim"} of one recipe's matrix X over the splits of `cv`.

    Rows never held out (a `newest_split` keeps the older ones for fitting only) are not scored.
    """
    return _validate(X, lengths, max_tokens=max_tokens, target=target, cv=cv, groups=groups, alphas=alphas)[0]


def _validate(X: ArrayLike, lengths: ArrayLike, *, max_tokens: int, target: str, cv: Any = None,
              groups: ArrayLike | None = None, alphas: ArrayLike = ALPHAS) -> tuple[dict[str, Any], np.ndarray]:
    """validate_recipe's row and the held-out predictions it scored at its penalty (NaN on rows never held out)."""
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
    row = {"alpha": float(alphas[best]), "mae": float(errors[best]), "n": int(scored.sum()), "dim": int(X.shape[1]),
           "spearman": censored_spearman(lengths[scored], held[scored, best], int(max_tokens))}
    return row, held[:, best]


def validate_recipes(matrices: Mapping[str, ArrayLike], lengths: ArrayLike, *, max_tokens: int,
                     targets: Sequence[str] | None = None, target: str = "sqrt", n_boot: int = N_BOOT,
                     seed: int = 0, **options: Any) -> list[dict[str, Any]]:
    """One `validate_recipe` row per recipe and target, {"recipe": name, "target": t, ...}, best validation
    Spearman first. `targets`: the candidate regression targets (default: `target` alone); each pair gets
    its own penalty, and every pair is scored on the same held-out rows in tokens, so the rows compare.
    Each row also carries its gap to the best row's Spearman (`gap`, with `gap_ci_low`/`gap_ci_high` and
    `gap_se` from `n_boot` paired bootstrap draws of the validation rows, the same draws for every row)."""
    candidates = [targets_module.check_target(t) for t in dict.fromkeys(targets or (target,))]
    scored = []  # (row, its held-out predictions)
    for name, X in matrices.items():
        for t in candidates:
            row, held = _validate(X, lengths, max_tokens=max_tokens, target=t, **options)
            scored.append(({"recipe": name, "target": t, **row}, held))
    best_row, best_held = max(scored, key=lambda pair: pair[0]["spearman"])
    rows = ~np.isnan(best_held)
    truth, _ = censor(np.asarray(lengths, dtype=np.float64).reshape(-1)[rows], int(max_tokens))
    table = []
    for row, held in scored:
        if row is best_row:
            gap, replicates = 0.0, np.zeros(1)
        else:
            _, replicates = bootstrap_replicates(spearman_difference, truth, best_held[rows], held[rows],
                                                 n_boot=n_boot, seed=seed, vectorized=True)
            gap = best_row["spearman"] - row["spearman"]
        interval = percentile_interval(gap, replicates, LEVEL)
        finite = replicates[np.isfinite(replicates)]
        table.append({**row, "gap": gap, "gap_ci_low": interval["ci_low"], "gap_ci_high": interval["ci_high"],
                      "gap_se": float(finite.std(ddof=1)) if finite.size > 1 else 0.0})
    return sorted(table, key=lambda row: (-row["spearman"], row["dim"], _target_rank(row), row["recipe"]))


def choose_recipe(table: list[dict[str, Any]], n_se: float = N_SE) -> dict[str, Any]:
    """The row to serve: the one with the fewest columns among those whose validation Spearman trails the best
    by at most `n_se` standard errors of the gap (`gap_se`; a row without one must equal the best); among
    those, the higher score, then the target listed first in `leap_core.targets.TARGETS`."""
    if not table:
        raise ValueError("no recipe was validated")
    if not n_se >= 0:
        raise ValueError(f"n_se must be >= 0, got {n_se}")
    best = max(row["spearman"] for row in table)
    close = [row for row in table if best - row["spearman"] <= n_se * row.get("gap_se", 0.0)]
    return min(close, key=lambda row: (row["dim"], -row["spearman"], _target_rank(row), row["recipe"]))


def _target_rank(row: Mapping[str, Any]) -> int:
    name = row.get("target", targets_module.TARGETS[0])
    return targets_module.TARGETS.index(name) if name in targets_module.TARGETS else len(targets_module.TARGETS)
