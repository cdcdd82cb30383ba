"""Validation of a pushed readout: what a replica accepts to serve, and why it refuses the rest.

Refusals, each a PushRefused with its HTTP status:
  413  the body, or an array in it, is larger than any readout this replica could serve
  422  not a readout or bundle; weights that are not finite or do not fit float32; RLS state that
       does not fit the readout
  409  the readout is for another model, target or budget; its recipe reads blocks the replica does
       not capture, or its dim is not its recipe's; or its version is older than the serving one (a
       rollback must say `force`)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from leap_core.readout import LinearReadout
from leap_core.readout_format import (
    ReadoutFormatError,
    ReadoutMismatchError,
    from_bytes,
)
from leap_core.recipes import Recipe, RecipeError, readout_recipe
from leap_core.rls import RLS
from leap_io.push_bundle import BundleError, open_bundle

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


class PushRefused(ValueError):
    """A pushed readout that must not serve; the message says why."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


_RLS_SUFFIX = re.compile(r"\+rls\d+$")
# Version schemes that have an order; a version is compared only with one of the same scheme.
_SCHEMES = (
    ("v", re.compile(r"^v(\d+)$")),  # v12
    ("named", re.compile(r"^([A-Za-z][\w.-]*)/(\d+)$")),  # leap-readout/3 (the name must match too)
    ("time", re.compile(r"^(\d{8}T\d{6})(?:-[0-9A-Za-z]+)?$")),  # 20250101T120000-ab12cd34 (the fit flow)
    ("number", re.compile(r"^(\d+)$")),  # 7 (a registry version number)
)


@dataclass(frozen=True)
class CaptureSpace:
    """What a replica's captured vectors hold (its capture recipe over a model's hidden size and layer
    count), so that every readout is checked against it and reads its own columns of it.

    `default` is the recipe of a predictor that records neither a recipe nor a layer (an evaluation
    head served on the features as they come): the recipe readouts are served on at start.
    """

    recipe: Recipe
    hidden: int
    num_layers: int
    default: Recipe | None = None

    @property
    def dim(self) -> int:
        return self.recipe.dim(self.hidden)

    def recipe_of(self, metadata: Mapping, strict: bool = True) -> Recipe:
        """The recipe a readout reads (files from before recipes: `last@<layer>`), layers counted from 0;
        unless `strict`, `default` for metadata that names neither."""
        if not strict and not metadata.get("recipe") and metadata.get("layer") is None and self.default is not None:
            return self.default
        return readout_recipe(metadata).check_layers(self.num_layers)

    def columns(self, metadata: Mapping) -> np.ndarray:
        """The indices of a captured vector a served readout or predictor reads; RecipeError if the capture
        does not hold them."""
        return self.recipe_of(metadata, strict=False).columns(self.recipe, self.hidden)

    def check(self, readout: LinearReadout) -> np.ndarray:
        """`columns` of a readout about to serve, or PushRefused (409) naming both recipes."""
        try:
            recipe = self.recipe_of(readout.metadata)
            columns = recipe.columns(self.recipe, self.hidden)
        except RecipeError as exc:
            raise PushRefused(f"refused: the readout's recipe does not fit this replica's capture recipe "
                              f"{self.recipe}: {exc}", 409) from exc
        if readout.dim_ != columns.size:
            raise PushRefused(f"refused: the readout has dim {readout.dim_}, but its recipe {recipe} has dim "
                              f"{columns.size} at hidden size {self.hidden}", 409)
        return columns


def version_key(version: str) -> tuple[str, object] | None:
    """(scheme, sortable value) of a readout version, or None when it follows no known scheme.

    The `+rlsN` suffix of an online update is ignored: it is the same readout, corrected.
    """
    base = _RLS_SUFFIX.sub("", str(version).strip())
    for scheme, pattern in _SCHEMES:
        match = pattern.match(base)
        if match is None:
            continue
        if scheme == "named":
            return f"named:{match.group(1)}", int(match.group(2))
        if scheme == "time":
            return scheme, match.group(1)
        return scheme, int(match.group(1))
    return None


def is_older(version: str, serving: str) -> bool:
    """True only when both versions follow the same scheme and `version` comes before `serving`."""
    new, old = version_key(version), version_key(serving)
    return new is not None and old is not None and new[0] == old[0] and new[1] < old[1]


def _check_weights(name: str, values: np.ndarray, *, positive: bool = False) -> None:
    values = np.asarray(values)
    if values.dtype.kind not in "biuf":
        raise PushRefused(f"refused: {name} has dtype {values.dtype}, expected numbers", 422)
    if values.size == 0:
        return
    as_float = values.astype(np.float64, copy=False)
    if not np.isfinite(as_float).all():
        raise PushRefused(f"refused: {name} holds non-finite values", 422)
    biggest = float(np.abs(as_float).max())
    if biggest > _F32_MAX:
        raise PushRefused(f"refused: {name} holds {biggest:.3g}, beyond float32 (max {_F32_MAX:.3g})", 422)
    if positive and float(as_float.min()) < _F32_TINY:
        raise PushRefused(f"refused: {name} holds {float(as_float.min()):.3g}; it divides the features and must "
                          f"be at least {_F32_TINY:.3g}", 422)


def validate_push(body: bytes, expect: dict, current: LinearReadout | None,
                  capture: CaptureSpace | None = None) -> tuple[LinearReadout, RLS | None]:
    """The readout (and RLS anchor) a push carries, or PushRefused saying why it must not serve.

    `expect` names metadata the readout must record as given (a replica: its model fingerprint);
    `capture`, when given, must hold the readout's recipe, and the readout's dim must be that recipe's
    (`CaptureSpace.check`). A readout already serving also fixes the target and the output budget M,
    since RLS and the scheduler work in that target's space, and its version, which a push may not go
    back from unless the bundle says `force`.
    """
    try:
        bundle = open_bundle(body)
    except BundleError as exc:
        raise PushRefused(f"refused: {exc}", exc.status) from exc
    expect = dict(expect)
    if current is not None:
        expect.update(target=current.target, max_tokens=int(current.max_tokens))
    try:
        readout = from_bytes(bundle.readout_bytes, expect=expect)
    except ReadoutMismatchError as exc:
        raise PushRefused(f"refused: {exc}", 409) from exc
    except (ReadoutFormatError, ValueError) as exc:
        raise PushRefused(f"refused: not a valid readout: {exc}", 422) from exc
    if capture is not None:
        capture.check(readout)
    _check_weights("readout coef", readout.coef_)
    _check_weights("readout mean", readout.mean_)
    _check_weights("readout scale", readout.scale_, positive=True)
    _check_weights("readout intercept", np.asarray([readout.intercept_]))
    _check_weights("readout coef / scale", readout.coef_ / readout.scale_)  # the slope float32 features meet
    if current is not None and not bundle.force:
        version = str(readout.metadata.get("version", ""))
        serving = str(current.metadata.get("version", ""))
        if is_older(version, serving):
            raise PushRefused(f"refused: version {version!r} is older than the serving {serving!r}; to roll "
                              f"back, push with force (POST ?force=1, or a `force` member in the bundle)", 409)
    if bundle.state is None:
        return readout, None
    for key, values in bundle.state.items():
        _check_weights(f"RLS array {key}", values)
    try:
        return readout, RLS.from_state_arrays(readout, bundle.state)
    except Exception as exc:  # whatever the state does wrong, it must not serve
        raise PushRefused(f"refused: RLS state does not fit the readout: {exc}", 422) from exc
