"""The champion watch against a real champion publication on disk: which version is champion, whether this
replica serves it, and a damaged publication that keeps the last answer."""

from __future__ import annotations

import time

from leap_io.champion import ChampionPublication
from serving.readout.champion_watch import ChampionWatch
from serving.telemetry import Telemetry

NAME = "leap-smollm2-l20"


def _watch(tmp_path, served: list[str]) -> tuple[ChampionWatch, Telemetry]:
    telemetry = Telemetry()
    watch = ChampionWatch(str(tmp_path), lambda: NAME, lambda: served[0], telemetry, every_s=0.05)
    return watch, telemetry


def test_nothing_is_exported_before_a_champion_is_published(tmp_path):
    watch, telemetry = _watch(tmp_path, ["v1"])
    watch.start()
    try:
        time.sleep(0.2)
        assert watch.champion is None
        assert telemetry.registry.get_sample_value("leap:readout_is_champion") is None
    finally:
        watch.close()


def test_the_served_version_is_compared_with_the_published_champion(tmp_path):
    publication = ChampionPublication(tmp_path)
    publication.publish(NAME, b"bundle-1", "v1", 1)
    served = ["v1"]
    watch, telemetry = _watch(tmp_path, served)
    watch.start()
    try:
        deadline = time.monotonic() + 5
        while watch.champion is None and time.monotonic() < deadline:
            time.sleep(0.02)
        sample = telemetry.registry.get_sample_value
        assert sample("leap:champion_info", {"version": "v1"}) == 1.0
        assert sample("leap:readout_is_champion") == 1.0
        served[0] = "v0-forced"  # a forced push, or a replica that missed the promotion
        assert sample("leap:readout_is_champion") == 0.0
        publication.publish(NAME, b"bundle-2", "v2", 2)
        while watch.champion != "v2" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sample("leap:champion_info", {"version": "v2"}) == 1.0 and sample("leap:readout_is_champion") == 0.0
    finally:
        watch.close()


def test_a_damaged_publication_keeps_the_last_answer_and_is_counted(tmp_path):
    ChampionPublication(tmp_path).publish(NAME, b"bundle-1", "v1", 1)
    watch, telemetry = _watch(tmp_path, ["v1"])
    assert watch.check() == "v1"
    (tmp_path / f"{NAME}.bundle").write_bytes(b"not the bundle the JSON records")
    assert watch.check() == "v1"
    (tmp_path / f"{NAME}.json").write_text("{not json")
    assert watch.check() == "v1"
    assert telemetry.dropped("champion_check", "unreadable") == 2
    assert telemetry.registry.get_sample_value("leap:readout_is_champion") is None  # not registered until start
