"""What a registered fit is: the feature space it reads, the spec that decides its result, and its record.

A fit's key is a hash of its spec (the rows, by `window_hash`, and every setting that changes the
readout), so that fitting the same rows with the same settings again finds the version registered
then instead of registering a second one. The record is what the registry keeps of a fit: params that
say where it came from and how it was chosen, metrics, and the recipe validation table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from leap_core.recipes import Recipe
from leap_io.jsonable import dumps
from store.frame import TrainingFrame
from store.sql import canonical_recipe
from training.fit import FitResult


@dataclass(frozen=True)
class FeatureSpace:
    """Whose hidden states a readout reads: the serving model, the captured layer and the capture recipe
    of the rows (`leap_core.recipes`; rows that record none, and an empty `recipe`, are `last@<layer>`)."""

    model_id: str
    model_fingerprint: str
    layer: int
    recipe: str = ""

    def __post_init__(self) -> None:
        recipe = canonical_recipe(self.recipe) if self.recipe else str(Recipe.last(self.layer))
        object.__setattr__(self, "recipe", recipe)


def content_key(payload: Any) -> str:
    """16 hex digits of the SHA-256 of `payload` as canonical JSON: the same content, the same key."""
    return hashlib.sha256(dumps(payload, nonfinite="keep", sort_keys=True, default=str).encode()).hexdigest()[:16]


def window_hash(frame: TrainingFrame) -> str:
    """Identifies the rows of a window: a request id's features and length never change once stored."""
    digest = hashlib.sha256()
    for rid in frame.request_ids:
        digest.update(str(rid).encode())
        digest.update(b"\0")
    digest.update(np.ascontiguousarray(frame.output_tokens, dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


def covered_recipes(candidates: Sequence[str] | None, capture: str, dim: int) -> tuple[list[str], list[str]]:
    """(covered, not covered): the candidate recipes a capture of `dim` floats holds every block of
    (`Recipe.columns`), canonical names in the given order without repeats, and the others."""
    covered: list[str] = []
    missing: list[str] = []
    if not candidates:
        return covered, missing
    hidden = Recipe.parse(capture).hidden_for(int(dim))
    for name in dict.fromkeys(canonical_recipe(c) for c in candidates):
        (covered if Recipe.parse(name).covered_by(capture, hidden) else missing).append(name)
    return covered, missing


def rows_until(train: TrainingFrame) -> str | None:
    """The newest arrival (unix s, as the registry's tag writes it) of the rows a fit's RLS state holds:
    its training split's; None for no rows."""
    return f"{float(np.max(train.arrival_time)):.3f}" if len(train.arrival_time) else None


@dataclass(frozen=True)
class FitRecord:
    """What the registry keeps of one fit besides the readout: params, metrics, the validation table."""

    params: dict[str, Any]
    metrics: dict[str, Any]
    validation: list[dict[str, Any]] | None


@dataclass(frozen=True)
class FitSpec:
    """Everything that decides a fit's readout: its rows (`rows_hash`), feature space and settings.

    `anchor` is the champion version whose RLS state the rows correct (None: a plain fit); `recipes`
    are the candidate recipes the capture covers, chosen among by validation (none with an anchor,
    which keeps its own). `recipes_not_covered` are only recorded: they decide nothing.
    """

    space: FeatureSpace
    rows_hash: str
    alpha: str | float
    target: str
    max_tokens: int
    test_fraction: float
    anchor: str | None = None
    recipes: tuple[str, ...] = ()
    recipes_not_covered: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()

    @classmethod
    def of(cls, frame: TrainingFrame, space: FeatureSpace, *, alpha: str | float, target: str, max_tokens: int,
           test_fraction: float, anchor: str | None = None, recipes: Sequence[str] | None = None,
           targets: Sequence[str] | None = None) -> FitSpec:
        """The spec of fitting `frame` (its candidate `recipes` narrowed to those the capture covers; candidate
        `targets` only without an anchor, whose target is fixed)."""
        covered, not_covered = covered_recipes(recipes, space.recipe, np.asarray(frame.features).shape[1])
        return cls(space=space, rows_hash=window_hash(frame), alpha=alpha, target=target, max_tokens=int(max_tokens),
                   test_fraction=float(test_fraction), anchor=anchor,
                   recipes=() if anchor is not None else tuple(covered), recipes_not_covered=tuple(not_covered),
                   targets=() if anchor is not None else tuple(dict.fromkeys(targets or ())))

    @property
    def key(self) -> str:
        """The fit key: settings added over time enter it only when set, so earlier fits keep their keys."""
        space = self.space
        return content_key({
            "window_hash": self.rows_hash, "alpha": str(self.alpha), "target": self.target,
            "max_tokens": int(self.max_tokens), "test_fraction": float(self.test_fraction),
            "model_fingerprint": space.model_fingerprint, "layer": space.layer,
            **({"anchor": f"champion-{self.anchor}"} if self.anchor is not None else {}),
            **({"capture_recipe": space.recipe} if space.recipe != str(Recipe.last(space.layer)) else {}),
            **({"recipes": list(self.recipes)} if self.recipes else {}),
            **({"targets": list(self.targets)} if self.targets else {})})

    def readout_version(self) -> str:
        """A new readout's version: when it was fitted, and which fit it is."""
        return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}-{self.key[:8]}"

    def record(self, fit: FitResult, window: Mapping[str, Any] | None = None) -> FitRecord:
        """The fit's params (its own, the `window` asked for as `requested_*`, the key and the recipe
        choice), its metrics (with the chosen recipe's `validation_spearman`) and validation table."""
        recipe = fit.params.get("recipe", self.space.recipe)
        params = {**dict(fit.params), **{f"requested_{k}": v for k, v in (window or {}).items()},
                  "fit_key": self.key, "window_hash": self.rows_hash, "alpha_requested": str(self.alpha),
                  "anchor": f"champion v{self.anchor}" if self.anchor is not None else "none",
                  "test_fraction": float(self.test_fraction), "capture_recipe": self.space.recipe,
                  "recipe": recipe, "recipe_candidates": ",".join(self.recipes),
                  "recipe_choice": "anchor" if self.anchor is not None else "validation" if self.recipes else "capture",
                  "target": fit.params.get("target", self.target), "target_candidates": ",".join(self.targets),
                  "target_choice": ("anchor" if self.anchor is not None else "validation" if self.targets
                                    else "given"),
                  **({"recipe_candidates_not_covered": ",".join(self.recipes_not_covered)}
                     if self.recipes_not_covered else {})}
        metrics = dict(fit.metrics)
        validation = [dict(row) for row in fit.validation] if fit.validation else None
        target = params["target"]
        chosen = next((row for row in validation or ()
                       if row["recipe"] == recipe and row.get("target", target) == target), None)
        if chosen is not None:
            metrics["validation_spearman"] = float(chosen["spearman"])
        return FitRecord(params=params, metrics=metrics, validation=validation)
