"""Refresh: re-estimating a decoding request's remaining length from its decode state, at set checkpoints.

Countdown orders decodes by the prefill prediction minus what a request has generated. With refresh on
(`LeapConfig.refresh_at` and `refresh_readout_path` both set), the capture also sends the layer-L state
of a request's decode step after g generated tokens, for each g in `refresh_at`, and a second readout,
fitted on such decode states to the length that remained (`studies/study_harness/decode_states.py` records them), turns
it into a new predicted total, g + remaining. That total replaces the countdown's prediction for the
request's ordering from then on; the prefill prediction and feature stay what feedback and RLS see.

A refresh readout file must fit exactly like a push (the served model's fingerprint, finite weights
within float32) and read one layer's state at the decode row, `last@L`, of a layer the capture records
(a refresh row holds the last-token state of every captured layer, in layer order, `refresh_columns`);
one that does not is logged as an error and refresh stays off, the engine serving on with countdown.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from leap_core.readout import LinearReadout
from leap_core.recipes import RecipeError
from leap_io.push_bundle import make_bundle
from serving.readout.push import PushRefused
from serving.config import LeapConfig
from serving.readout.push import CaptureSpace, validate_push

logger = logging.getLogger(__name__)


class RefreshReadoutError(ValueError):
    """The refresh readout file cannot serve here: unreadable, malformed, or for other features."""


def refresh_columns(readout: LinearReadout, capture: CaptureSpace) -> slice:
    """The columns of a refresh row (the last-token states of the capture's layers, sorted, each
    `hidden` wide) that a refresh readout reads; RecipeError when it is not `last@L` of a captured layer."""
    recipe = capture.recipe_of(readout.metadata)
    (block, *others) = recipe.blocks
    if others or block.kind != "last":
        raise RecipeError(f"a refresh readout reads one layer's state at the decode row (last@L), not recipe {recipe}")
    layers = capture.recipe.layers
    if block.layer not in layers:
        raise RecipeError(f"the refresh readout reads layer {block.layer} ({recipe}), which capture recipe "
                          f"{capture.recipe} does not record (layers {list(layers)})")
    if readout.dim_ != capture.hidden:
        raise RecipeError(f"the refresh readout has dim {readout.dim_}, but {recipe} has dim {capture.hidden}")
    position = layers.index(block.layer)
    return slice(position * capture.hidden, (position + 1) * capture.hidden)


def load_refresh_readout(path: str, expect: dict, capture: CaptureSpace | None = None) -> LinearReadout:
    """The readout in `path`, checked against `expect` (fingerprint; layer and dim where given) like a
    push, and when `capture` is given, that it reads a captured layer (`refresh_columns`)."""
    try:
        body = Path(path).read_bytes()
    except OSError as exc:
        raise RefreshReadoutError(f"cannot read the refresh readout {path}: {exc}") from exc
    try:
        readout, _ = validate_push(make_bundle(body, None), expect, None)
        if capture is not None:
            refresh_columns(readout, capture)
    except (PushRefused, RecipeError) as exc:
        raise RefreshReadoutError(f"the refresh readout {path} cannot serve here: {exc}") from exc
    return readout


class Refresher:
    """The refresh readout of one runtime, the checkpoints it is applied at and its columns of a refresh row."""

    def __init__(self, readout: LinearReadout, checkpoints: tuple[int, ...], columns: slice = slice(None)) -> None:
        self.readout = readout
        self.checkpoints = tuple(checkpoints)
        self.columns = columns

    @property
    def version(self) -> str:
        return str(self.readout.metadata.get("version", ""))

    def predicted_totals(self, generated: np.ndarray, states: np.ndarray) -> np.ndarray:
        """g + the predicted remaining length, for refresh rows [n, layers * hidden] captured after g tokens each.

        One [n, d] x [d] product: cheap enough for the engine's step, where in-process rows arrive.
        """
        remaining = np.asarray(self.readout.predict(np.asarray(states)[:, self.columns]), dtype=np.float64).reshape(-1)
        return np.asarray(generated, dtype=np.float64) + remaining


def configured_refresher(config: LeapConfig, expect: dict, capture: CaptureSpace) -> tuple[Refresher | None, str | None]:
    """(the refresher, None) when both refresh settings are given and the readout fits; else (None, why
    refresh is off, None when it was not asked for), logged."""
    if not config.refresh_configured:
        if config.refresh_at or config.refresh_readout_path:
            error = "refresh needs both refresh_at and refresh_readout_path"
            logger.warning("LEAP refresh is off: %s", error)
            return None, error
        return None, None
    try:
        readout = load_refresh_readout(config.refresh_readout_path, expect, capture)
    except RefreshReadoutError as exc:
        logger.error("LEAP refresh is off, decodes keep the countdown: %s", exc)
        return None, str(exc)
    refresher = Refresher(readout, config.refresh_at, refresh_columns(readout, capture))
    logger.info("LEAP refreshes remaining lengths at %s generated tokens with readout %s",
                list(refresher.checkpoints), refresher.version)
    return refresher, None
