"""The rolling window of prediction quality every live figure of a serving process is computed over.

A `RollingQuality` keeps the last `window` finished requests: each one's true length beside the
predictions of one or more readouts (served, anchor or shadow) and its tenant. The owner appends from the
engine thread and takes a `snapshot()` under its own lock; `spearman` and `mae` (optionally weighted so no
tenant carries more than its share, `tenant_weights`) are computed off that lock. Its users are the
per-domain and live-ranking figures of `serving.feedback.recorder` and the paired figures of
`serving.readout.shadow`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from leap_core.metrics import mae, spearman
from serving.feedback.tenant_share import capped_weights

QUALITY_WINDOW = 256


@dataclass(frozen=True)
class QualityRows:
    """A copy of a window's rows: `true` (n,), `predicted` (n, readouts), `tenants` (n,)."""

    true: np.ndarray
    predicted: np.ndarray
    tenants: tuple[str | None, ...]

    def __len__(self) -> int:
        return len(self.true)

    def spearman(self, readout: int = 0) -> float:
        return spearman(self.true, self.predicted[:, readout]) if len(self) > 1 else float("nan")

    def mae(self, readout: int = 0, weights: np.ndarray | None = None) -> float:
        """The readout's MAE in tokens, every row weighing the same, or by `weights` (summing to 1)."""
        if weights is None:
            return mae(self.true, self.predicted[:, readout])
        return float(weights @ np.abs(self.true - self.predicted[:, readout]))

    def tenant_weights(self, max_share: float | None) -> np.ndarray:
        """Row weights under which no tenant carries more than `max_share` (None: every row the same)."""
        return capped_weights(self.tenants, max_share)


class RollingQuality:
    """The last `window` (true length, one prediction per readout, tenant) rows; not thread-safe (its
    owner locks)."""

    def __init__(self, window: int = QUALITY_WINDOW, readouts: int = 1) -> None:
        if window < 1 or readouts < 1:
            raise ValueError(f"a window holds at least one row of at least one readout, not {window} x {readouts}")
        self.window, self.readouts = int(window), int(readouts)
        self._rows: deque[tuple[float, tuple[float, ...], str | None]] = deque(maxlen=self.window)

    def add(self, true_length: float, *predicted: float, tenant: str | None = None) -> None:
        if len(predicted) != self.readouts:
            raise ValueError(f"a row of this window holds {self.readouts} predictions, not {len(predicted)}")
        self._rows.append((float(true_length), tuple(float(p) for p in predicted), tenant))

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def snapshot(self) -> QualityRows:
        rows = list(self._rows)
        return QualityRows(np.fromiter((row[0] for row in rows), dtype=np.float64, count=len(rows)),
                           np.array([row[1] for row in rows], dtype=np.float64).reshape(len(rows), self.readouts),
                           tuple(row[2] for row in rows))
