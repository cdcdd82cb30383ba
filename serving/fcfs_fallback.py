"""The kill switch: a replica serves first-come-first-served, by command or by itself, and says so.

Length-aware scheduling helps only while the readout ranks lengths. `FcfsFallback` puts the decode order
back to FCFS at once, without touching the readout, RLS or the engine: predictions are still made and
recorded (so the live figures go on measuring the readout), only the order stops using them.

- By command: `POST /leap/fcfs` (admin token) with `{"on": true, "reason": "..."}`, and `{"on": false}` to
  go back; `leap fcfs on|off` sends it to every replica.
- By itself: with `fcfs_below_spearman` set, when the rolling Spearman of prediction against true length
  over the last finished requests (at least `fcfs_min_rows` of them) falls below that bound. A fallback
  engaged this way ends when a new readout is pushed (it gets its own chance) or by command; one
  engaged by command ends only by command.

The state is on `/leap/health` (`fcfs_fallback`) and `/metrics` (`leap_fcfs_fallback`, 1 while on). The
engine thread reads one attribute per step; switching is a single assignment under a lock.
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
