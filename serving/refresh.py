"""Refresh: re-estimating a decoding request's remaining length from its decode state, at set checkpoints.

Countdown orders decodes by the prefill prediction minus what a request has generated. With refresh on
(`LeapConfig.refresh_at` and `refresh_readout_path` both set), the capture also sends the layer-L state
of a request's decode step after g generated tokens, for each g in `refresh_at`, and a second readout,
fitted on such decode states to the length that remained (`harness/decode_states.py` records them), turns
it into a new predicted total, g + remaining. That total replaces the countdown's prediction for the
request's ordering from then on; the prefill prediction and feature stay what feedback and RLS see.

A refresh readout file must fit exactly like a push (same layer and dim as the served model, finite
weights within float32); one that does not is logged as an error and refresh stays off, the engine
serving on with countdown.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from leap_core.readout import LinearReadout
from leap_io.push_bundle import make_bundle
from serving.admin import PushRefused
from serving.push import validate_push


class RefreshReadoutError(ValueError):
    """The refresh readout file cannot serve here: unreadable, malformed, or for other features."""


def load_refresh_readout(path: str, expect: dict) -> LinearReadout:
    """The readout in `path`, checked against `expect` (layer, dim, fingerprint) like a push."""
    try:
        body = Path(path).read_bytes()
    except OSError as exc:
        raise RefreshReadoutError(f"cannot read the refresh readout {path}: {exc}") from exc
    try:
        readout, _ = validate_push(make_bundle(body, None), expect, None)
    except PushRefused as exc:
        raise RefreshReadoutError(f"the refresh readout {path} cannot serve here: {exc}") from exc
    return readout


class Refresher:
    """The refresh readout of one runtime and the checkpoints it is applied at."""

    def __init__(self, readout: LinearReadout, checkpoints: tuple[int, ...]) -> None:
        self.readout = readout
        self.checkpoints = tuple(checkpoints)

    @property
    def version(self) -> str:
        return str(self.readout.metadata.get("version", ""))

    def predicted_totals(self, generated: np.ndarray, states: np.ndarray) -> np.ndarray:
        """g + the predicted remaining length, for decode states [n, dim] captured after g tokens each.

        One [n, d] x [d] product: cheap enough for the engine's step, where in-process rows arrive.
        """
        remaining = np.asarray(self.readout.predict(states), dtype=np.float64).reshape(-1)
        return np.asarray(generated, dtype=np.float64) + remaining
