"""`leap bench gate` on the real engine: one small trial of each case, paired replays, the figures' shapes.

The error rates themselves come from `leap bench gate --quick --json` (20 trials; README and docs).
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.engine


def test_one_trial_replays_every_arm_and_reads_each_case_from_its_pair():
    from experiments.bench.gate import CASES, bench_gate, case_pairs

    # the step clock calibrated on 16 requests (two rounds of the gate's 8 slots) rather than 64: its fit
    # is checked for shape here; the quick bench's error rates use the full calibration
    result = bench_gate(trials=1, quick=True, slice_size=6, repeats=1, calibration_requests=16)
    assert set(result["cases"]) == set(CASES)
    assert result["pairs"] == {case: {"bar": bar, "challenger": challenger}
                               for case, (bar, challenger) in case_pairs().items()}
    for record in result["cases"].values():
        assert record["trials"] == 1 and record["promoted_rate"] in (0.0, 1.0)
        (run,) = record["runs"]
        assert run["outcome"] in ("better", "no-difference", "worse")
        assert run["ci_low"] <= run["ratio"] <= run["ci_high"]
    assert 0.0 <= result["cases"]["equal"]["no_difference_rate"] <= 1.0
    assert result["gate_seconds_median"] >= result["gate_setup_seconds"] > 0
    assert math.isfinite(result["step_model_error_median"])
    assert result["readout_test_spearman"]["a"] > result["readout_test_spearman"]["shuffled"]


def test_an_unknown_better_bar_is_refused():
    from experiments.bench.gate import case_pairs

    with pytest.raises(ValueError, match="better_bar"):
        case_pairs("champion")
