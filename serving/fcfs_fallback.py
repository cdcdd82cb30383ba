"""The kill switch: a replica serves first-come-first-served, by command or by itself, and says so.

Length-aware scheduling helps only while the readout ranks lengths. `FcfsFallback` puts the decode order
back to FCFS at once without touching the readout, RLS or the engine, so predictions are still recorded
and the live figures go on measuring the readout. It engages by command (`POST /leap/fcfs`,
`leap fcfs on|off`) or by itself when the rolling Spearman falls below `fcfs_below_spearman`; the rules
for ending it and where its state shows are in docs/serving.md ("Kill switch"). The engine thread reads
one attribute per step; switching is one assignment under a lock.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import asdict, dataclass

from serving.telemetry import Telemetry

logger = logging.getLogger(__name__)

COMMAND, LIVE_RANKING = "command", "live-ranking"
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Engaged:
    source: str  # COMMAND or LIVE_RANKING
    reason: str
    since: float


class FcfsFallback:
    """Whether this replica orders decodes FCFS regardless of its policy, and why."""

    def __init__(self, telemetry: Telemetry, spearman_below: float | None = None, min_rows: int = 128) -> None:
        if spearman_below is not None and not -1.0 <= spearman_below <= 1.0:
            raise ValueError(f"spearman_below is a Spearman in [-1, 1], not {spearman_below}")
        self.spearman_below, self.min_rows = spearman_below, int(min_rows)
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self.engaged: Engaged | None = None
        self.switches = 0

    @property
    def on(self) -> bool:
        return self.engaged is not None

    def engage(self, reason: str, source: str = COMMAND) -> dict:
        """Order FCFS from the next step; a command overrides (and outlasts) a fallback found by itself."""
        reason = " ".join(str(reason or "no reason given").split())[:MAX_REASON_CHARS]
        with self._lock:
            current = self.engaged
            if current is None or (source == COMMAND and current.source != COMMAND):
                self.engaged = Engaged(source, reason, time.time())
                self.switches += 1
                self._telemetry.fcfs_fallback.set(1)
                logger.warning("LEAP: decoding FCFS (%s): %s", source, reason)
        return self.state()

    def release(self, source: str = COMMAND) -> dict:
        """Back to the policy; a fallback found by itself is released by a command or a new anchor, one
        engaged by command only by a command."""
        with self._lock:
            current = self.engaged
            if current is not None and (source == COMMAND or current.source == source):
                self.engaged = None
                self.switches += 1
                self._telemetry.fcfs_fallback.set(0)
                logger.warning("LEAP: decoding by policy again (%s)", source)
        return self.state()

    def observe(self, spearman: float, rows: int) -> None:
        """The live ranking over the last `rows` finished requests: engage below the bound."""
        if (self.spearman_below is None or self.on or rows < self.min_rows or not math.isfinite(spearman)
                or spearman >= self.spearman_below):
            return
        self.engage(f"live Spearman {spearman:.3f} over the last {rows} finished requests is below "
                    f"{self.spearman_below:.3f}", LIVE_RANKING)

    def new_anchor(self) -> None:
        """A new readout serves: a fallback the old one's ranking caused ends."""
        self.release(LIVE_RANKING)

    def state(self) -> dict:
        engaged = self.engaged
        return {"on": engaged is not None, **(asdict(engaged) if engaged is not None else {}),
                "switches": self.switches, "spearman_below": self.spearman_below, "min_rows": self.min_rows}
