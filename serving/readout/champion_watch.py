"""Whether a replica serves the published champion, for `/metrics` (the non-champion alert reads it).

A replica that missed a promotion's push, or kept a forced push, serves another version than the
champion its registry published, and nothing else says so. `ChampionWatch` reads the champion
publication (`leap_io.champion`, the one replicas start from) on its own thread every `every_s`, never
at scrape time, so a slow bucket cannot stall `/metrics`. It exports `leap:champion_info{version}` and
`leap:readout_is_champion` (1 or 0) once a champion is known, and nothing before; a publication it cannot
read keeps the last answer and is counted (`leap:dropped_total{what="champion_check"}`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from leap_io.champion import ChampionPublication
from serving.supervise import RateLimitedLog, SupervisedThread
from serving.telemetry import Telemetry

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 60.0


class ChampionWatch:
    """A Prometheus collector of the published champion's version beside the served one."""

    def __init__(self, location: str, name: Callable[[], str], served: Callable[[], str | None],
                 telemetry: Telemetry, public_key: str | None = None, every_s: float = CHECK_EVERY_S) -> None:
        self.location, self._name, self._served = location, name, served
        self._telemetry, self._public_key, self.every_s = telemetry, public_key, every_s
        self.champion: str | None = None
        self._warn = RateLimitedLog(logger)
        self._thread = SupervisedThread("leap-champion-watch", self._loop,
                                        on_error=lambda _exc: telemetry.thread_error("champion_watch"))

    def start(self) -> ChampionWatch:
        self._telemetry.registry.register(self)
        self._thread.start()
        return self

    def check(self) -> str | None:
        """Read the publication now: the champion's version (None while none is published)."""
        try:
            published = ChampionPublication(self.location).load(self._name(), public_key=self._public_key)
        except Exception as exc:  # unreadable or refused: the last answer stands
            self._telemetry.drop("champion_check", "unreadable")
            self._warn.warning("check", "LEAP cannot read the champion publication: %s", exc)
            return self.champion
        self.champion = None if published is None else published.version
        return self.champion

    def _loop(self) -> None:
        while not self._thread.stopping.is_set():
            self.check()
            self._thread.stopping.wait(self.every_s)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        champion = self.champion
        if champion is None:
            return
        info = GaugeMetricFamily("leap:champion_info", "The champion version published for this replica's model",
                                 labels=["version"])
        info.add_metric([champion], 1.0)
        yield info
        yield GaugeMetricFamily("leap:readout_is_champion", "1 while this replica serves the published champion",
                                value=float(self._served() == champion))

    def close(self) -> None:
        self._thread.stop()
