"""A challenger held in shadow: it predicts every finished request from the vector already captured, and never
schedules.

`POST /leap/shadow` holds a push bundle's readout beside the serving one (validated as a push, with no
version order); an empty body lets it go. Each finished request with a captured vector is predicted by
the shadow from that same vector (one dot product, no extra capture or forward pass), and its feedback row
carries `shadow_predicted` and `shadow_version`. Rolling paired figures go to `/metrics`; the figures
with intervals are the flows' (`leap_core.shadow_figures`), over every replica's honest labels. See
docs/serving.md ("Shadow scoring").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from serving.readout.push import CaptureSpace, validate_push
from serving.rolling_quality import QUALITY_WINDOW, RollingQuality
from serving.telemetry import Telemetry

logger = logging.getLogger(__name__)

FIGURES_EVERY = 16


@dataclass(frozen=True)
class _Held:
    readout: object
    columns: np.ndarray | None
    version: str


class ShadowReadout:
    """The readout a replica holds in shadow (none until `hold`), its predictions and live paired figures."""

    def __init__(self, expect: dict, capture: CaptureSpace | None, telemetry: Telemetry,
                 window: int = QUALITY_WINDOW) -> None:
        self.expect = dict(expect)
        self.capture = capture
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self._held: _Held | None = None
        self._pairs = RollingQuality(window, readouts=2)  # (true length, served, shadow)
        self.predicted = 0
        self.errors = 0
        self._paired = 0  # pairs taken since held: the figures are recomputed every FIGURES_EVERY of them
        self.seconds = 0.0  # spent predicting and pairing: what holding the shadow costs this process

    @property
    def version(self) -> str | None:
        held = self._held
        return None if held is None else held.version

    def hold(self, body: bytes) -> dict:
        """Hold the bundle's readout in shadow (PushRefused when it could not serve here); an empty body
        lets the shadow go."""
        if not body:
            with self._lock:
                previous, self._held = self.version, None
                self._pairs.clear()
                self._paired = 0
            self._telemetry.shadow_rows.set(0)
            self._telemetry.shadow_active.set(0)
            logger.info("LEAP shadow %s let go", previous)
            return {"shadow": None, "previous": previous}
        readout, _ = validate_push(body, self.expect, None, self.capture)
        columns = None if self.capture is None else self.capture.check(readout)
        held = _Held(readout, columns, str(readout.metadata.get("version", "")))
        with self._lock:
            previous, self._held = self.version, held
            self._pairs.clear()
            self._paired = 0
        self._telemetry.shadow_rows.set(0)
        self._telemetry.shadow_active.set(1)
        logger.info("LEAP shadow %s held (was %s)", held.version, previous)
        return {"shadow": held.version, "previous": previous}

    def predict(self, feature: np.ndarray | None) -> tuple[float | None, str | None]:
        """(the shadow's predicted length of one captured vector, its version); (None, None) while no
        shadow is held. A shadow that cannot predict costs its figure, never the row."""
        held = self._held
        if held is None or feature is None:
            return None, None
        started = time.perf_counter()
        try:
            vector = np.asarray(feature)
            if held.columns is not None:
                vector = np.take(vector, held.columns, axis=-1)
            value = float(np.asarray(held.readout.predict(vector[None, :])).reshape(-1)[0])
        except Exception:
            self.errors += 1
            self._telemetry.drop("shadow_prediction", "error")
            logger.warning("LEAP: the shadow readout could not predict", exc_info=True)
            return None, held.version
        finally:
            self.seconds += time.perf_counter() - started
        self.predicted += 1
        return value, held.version

    def observe(self, served: float | None, shadow: float | None, output_tokens: int) -> None:
        """Pair one finished request's two predictions with its true length for the live figures."""
        if served is None or shadow is None or output_tokens <= 0:
            return
        started = time.perf_counter()
        try:
            self._pair(served, shadow, output_tokens)
        finally:
            self.seconds += time.perf_counter() - started

    def _pair(self, served: float, shadow: float, output_tokens: int) -> None:
        with self._lock:
            self._pairs.add(output_tokens, served, shadow)
            self._paired += 1
            n = len(self._pairs)
            pairs = self._pairs.snapshot() if self._paired % FIGURES_EVERY == 0 else None
        self._telemetry.shadow_rows.set(n)
        if pairs is None:
            return
        for index, name in ((0, "served"), (1, "shadow")):
            self._telemetry.shadow_figure.labels(readout=name, figure="spearman").set(pairs.spearman(index))
            self._telemetry.shadow_figure.labels(readout=name, figure="mae").set(pairs.mae(index))

    def describe(self) -> dict:
        with self._lock:
            rows = len(self._pairs)
        return {"version": self.version, "predicted": self.predicted, "errors": self.errors, "paired_rows": rows,
                "seconds": self.seconds}
