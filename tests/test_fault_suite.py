"""The fault suite's client scenarios against one real `leap serve` replica (engine: starts the real server).

Bad `vllm_xargs`, malformed admin requests, hostile pushes, a slow-loris flood of the admin API and 10,000
unknown extras each must leave the replica serving, with its readout unchanged. The rest of the suite (aborts, SIGKILL, a full disk, the pipeline's faults) is the
`leap bench faults` benchmark, not a test.
"""

from __future__ import annotations

import pytest

from experiments.faults.clients import BAD_XARGS
from experiments.faults.suite import QUICK_SCENARIOS, SUMMARY_KEYS, run_suite

pytestmark = pytest.mark.engine


def test_hostile_clients_and_pushes_never_take_a_replica_down(tmp_path):
    summary = run_suite(only=list(QUICK_SCENARIOS), quick=True, workdir=tmp_path)
    assert tuple(summary) == SUMMARY_KEYS
    results = {entry["scenario"]: entry for entry in summary["results"]}
    assert sorted(results) == sorted(QUICK_SCENARIOS)
    for name, entry in results.items():
        assert entry["survived"], f"{name}: {entry['detail']}"
    assert summary["survived"] == summary["scenarios"] == len(QUICK_SCENARIOS)
    assert summary["requests_lost"] == 0

    xargs = results["bad_vllm_xargs"]
    assert xargs["refused_by_middleware"] == 2 * len(BAD_XARGS)  # every case on both endpoints
    assert xargs["engine_bad_extras_counted"] == 0  # refused at the front end, never reached engine-core
    pushes = results["hostile_pushes"]
    assert pushes["answers"]["bomb_inflates_to_1GiB"] == 413 and pushes["body_bytes"]["bomb_inflates_to_1GiB"] < 4 << 20
    assert pushes["readout_before"] == pushes["readout_after"]
    admin = results["malformed_admin"]
    assert admin["answers"]["no_content_length"] == 411 and admin["answers"]["declared_body_of_a_tib"] == 413
    slowloris = results["admin_slowloris"]
    assert slowloris["health_statuses"] == [200] and slowloris["flush_from_another_host"] == 200
    assert slowloris["cut_off"] == 12 and slowloris["refusals"].get("head_deadline", 0) >= 1
    extras = results["unknown_extras"]
    assert extras["statuses"] == {"400": 100} and extras["metrics_lines_after"] <= extras["metrics_lines_before"] + 8
