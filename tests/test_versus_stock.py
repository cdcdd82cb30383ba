"""The wall-clock comparison with stock vLLM: its figures, capacity, ratios over runs and goals, on outcomes
built by hand (the servers themselves run in `leap eval versus-stock`, minutes per run)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.versus_stock import (
    GOALS,
    LEAP,
    STOCK,
    VersusStockSettings,
    arm_order,
    figures,
    goals,
    segment_name,
    summarize,
    sustained_capacity,
)
from leap_core.intervals import ratio_over_runs
from study_harness.openai_traffic import Outcome


def _outcome(rid: str, at: float, first: float, finish: float, tokens: int, chunks=()) -> Outcome:
    return Outcome(id=rid, at=at, sent=at, first_token=first, finish=finish, tokens=tokens, finish_reason="stop",
                   chunks=list(chunks))


def test_figures_measure_latency_from_the_planned_arrival_and_the_longest_quartile_by_stocks_lengths():
    outs = [_outcome("a", 0.0, 0.5, 2.0, 10), _outcome("b", 1.0, 1.2, 5.0, 40),
            Outcome(id="c", at=2.0, sent=2.0, error="HTTP 500")]
    f = figures(outs, long_ids={"b"})
    assert f["n"] == 2 and f["failed"] == 1
    assert f["mean_latency"] == pytest.approx((2.0 + 4.0) / 2)
    assert f["mean_ptl"] == pytest.approx((2.0 / 10 + 4.0 / 40) / 2)
    assert f["mean_ttft"] == pytest.approx((0.5 + 0.2) / 2)
    assert f["throughput"] == pytest.approx(50 / 5.0)  # tokens over first arrival to last finish
    assert f["long_p95_latency"] == pytest.approx(4.0)


def test_sustained_capacity_counts_tokens_while_half_the_burst_still_runs():
    # four requests released at once: one token a chunk, every 0.1 s; they finish at 1, 2, 3, 4 s
    outs = [_outcome(str(i), 0.0, 0.1, 1.0 * (i + 1), 10 * (i + 1),
                     chunks=np.arange(1, 10 * (i + 1) + 1) * 0.1) for i in range(4)]
    cap = sustained_capacity(outs)
    # the window ends when the second request finishes (2 s): 4 requests x ... tokens between 0.1 and 2.0
    tokens = sum(int(np.sum((np.arange(1, 10 * (i + 1) + 1) * 0.1 >= 0.1 - 1e-9)
                            & (np.arange(1, 10 * (i + 1) + 1) * 0.1 <= 2.0 + 1e-9))) for i in range(4))
    assert cap["generated_tok_s"] == pytest.approx(tokens / 1.9, rel=0.02)
    assert cap["mean_output_tokens"] == pytest.approx(25.0)
    assert cap["rps"] == pytest.approx(cap["generated_tok_s"] / 25.0)


def test_the_interval_is_over_runs_and_undefined_for_one_run():
    one = ratio_over_runs([0.9], [1.0])
    assert one["value"] == pytest.approx(0.9) and math.isnan(one["ci_high"])
    r = ratio_over_runs([0.9, 1.0, 0.8], [1.0, 1.0, 1.0])
    assert r["value"] == pytest.approx((0.9 * 1.0 * 0.8) ** (1 / 3))
    assert r["ci_low"] < r["value"] < r["ci_high"] and r["runs"] == 3
    tight = ratio_over_runs([0.9, 0.9001, 0.8999], [1.0, 1.0, 1.0])
    assert tight["ci_high"] - tight["ci_low"] < r["ci_high"] - r["ci_low"]


def test_arms_alternate_and_the_oracle_comes_after_stock():
    assert arm_order(0, True) == (STOCK, LEAP, "oracle")
    assert arm_order(1, True) == (LEAP, STOCK, "oracle")
    assert arm_order(2, False) == (STOCK, LEAP)
    assert arm_order(1, False, ("stock-r512",)) == (LEAP, "stock-r512", STOCK)  # with extra arms all rotate


def _run(scale: float, name: str) -> dict:
    """One run of one arm on one segment: latencies scaled by `scale`."""
    outs = [_outcome(f"q{i}", float(i), float(i) + 0.2 * scale, float(i) + scale * (1 + i % 4), 20 + 10 * (i % 4))
            for i in range(8)]
    return {"segments": {name: [o.to_dict() for o in outs]}}


def test_summary_ratios_and_goals_read_the_runs():
    settings = VersusStockSettings(loads=(0.8,), patterns=("poisson",), repeats=3)
    name = segment_name("poisson", 0.8)
    runs = [{STOCK: _run(1.0, name), LEAP: _run(s, name)} for s in (0.85, 0.9, 0.88)]
    result = summarize(runs, settings, {"rps": 1.0})
    ratio = result["segments"][name]["leap_over_stock"]["mean_latency"]
    assert ratio["value"] == pytest.approx((0.85 * 0.9 * 0.88) ** (1 / 3), rel=1e-6)
    assert result["segments"][name]["lengths_matched"] == 24
    goal = result["goals"][f"{name}:mean_latency"]
    assert goal["at_most"] == GOALS[0.8][0][1] and goal["met"] is True
    slower = [{STOCK: _run(1.0, name), LEAP: _run(s, name)} for s in (0.95, 1.05, 1.0)]
    assert summarize(slower, settings, {"rps": 1.0})["goals_met"] is False


def test_goals_at_half_load_need_every_latency_figure_within_two_percent():
    entry = {"load": 0.5, "leap_over_stock": {f: {"value": 1.0, "ci_low": 0.99, "ci_high": 1.01}
                                              for f in ("mean_latency", "p50_latency", "p90_latency", "p99_latency",
                                                        "mean_ptl", "mean_ttft", "p99_ttft", "long_p95_latency",
                                                        "throughput")}}
    assert all(g["met"] for g in goals({"poisson@0.5": entry}).values())
    entry["leap_over_stock"]["p99_ttft"] = {"value": 1.05, "ci_low": 1.0, "ci_high": 1.1}
    assert goals({"poisson@0.5": entry})["poisson@0.5:p99_ttft"]["met"] is False


def test_the_simulated_check_replays_each_segment_and_reads_the_live_interval():
    from evaluation.versus_stock import simulated_check
    from leap_core.simulator import StepTimeModel

    name = segment_name("poisson", 0.8)

    def run(scale: float) -> dict:
        rows = [dict(_outcome(f"r0-poisson-0.8-{i}-p{i}", 0.5 * i, 0.5 * i + 0.1, 0.5 * i + scale, 20 + 30 * i).to_dict(),
                     prompt_tokens=50) for i in range(6)]
        return {"segments": {name: rows}}

    runs = [{STOCK: run(1.0), LEAP: run(0.9)} for _ in range(2)]
    by_segment = {name: {"leap_over_stock": {"mean_latency": {"value": 0.9, "ci_low": 0.5, "ci_high": 1.5},
                                             "mean_ptl": {"value": 0.9, "ci_low": 0.95, "ci_high": 0.97}}}}
    predicted = {f"p{i}": 20.0 + 30 * i for i in range(3)}  # half the prompts have a prediction
    check = simulated_check(runs, by_segment, predicted, StepTimeModel(base_s=0.02, per_decode_s=0.005), 1024)[name]
    # 6 requests never fill K = 64 or R = 128: LEAP and stock simulate alike
    assert check["mean_latency"]["simulated"] == pytest.approx(1.0)
    assert check["mean_latency"]["inside"] is True and check["mean_ptl"]["inside"] is False
    assert check["predicted_share"] == pytest.approx(0.5)


def test_the_results_section_shows_every_figure_and_the_missed_goals(tmp_path):
    from evaluation.versus_stock_report import plot_versus_stock, section_versus_stock

    settings = VersusStockSettings(loads=(0.8,), patterns=("poisson",), repeats=3)
    name = segment_name("poisson", 0.8)
    runs = [{STOCK: _run(1.0, name), LEAP: _run(s, name)} for s in (0.95, 1.05, 1.0)]
    result = summarize(runs, settings, {"rps": 1.0, "generated_tok_s": 100.0, "mean_output_tokens": 100.0,
                                        "requests": 32})
    result.update(settings={"requests": 8, "repeats": 3, "max_tokens": 256, "max_prompt_tokens": 512},
                  decoding={"temperature": 0.7}, cost={STOCK: {"start_s": 50.0, "run_s": 100.0}}, study_s=600.0)
    text = section_versus_stock(result, "versus-stock.png")
    assert "| mean latency | 0.999 [0.882, 1.131] |" in text and "lengths matched stock's | 24/24" in text
    assert "Goals met: 0 of 1; missed: poisson@0.8:mean_latency 0.999 [0.882, 1.131]." in text
    plot_versus_stock(result, tmp_path / "v.png")
    assert (tmp_path / "v.png").stat().st_size > 0


def test_a_study_kept_repeat_by_repeat_resumes_only_with_its_own_settings_and_workload(tmp_path):
    from evaluation import versus_stock_progress as progress

    settings = VersusStockSettings(loads=(0.8,), patterns=("poisson",), repeats=3)
    as_dict = {"loads": [0.8], "patterns": ["poisson"], "repeats": 3}
    name = segment_name("poisson", 0.8)
    runs = [{STOCK: _run(1.0, name), LEAP: _run(s, name)} for s in (0.85, 0.9)]
    path = tmp_path / "versus-stock.progress.json"
    key = progress.workload_key(b"readout", ["a", "b"], ["c"])
    kept = progress.start(as_dict, key, {"rps": 1.0})
    for i, run in enumerate(runs):
        progress.add_repeat(kept, run, 1.8e9 + i, path)
    resumed = progress.load(path, as_dict, key)
    assert len(resumed["runs"]) == 2 and [p["started"][:4] for p in resumed["played_on"]] == ["2027", "2027"]
    # the runs read back summarize exactly as the runs played
    assert summarize(resumed["runs"], settings, resumed["capacity"]) == summarize(runs, settings, {"rps": 1.0})
    assert progress.load(tmp_path / "none.json", as_dict, key) is None
    with pytest.raises(ValueError, match="other settings \\(repeats\\)"):
        progress.load(path, {**as_dict, "repeats": 6}, key)
    with pytest.raises(ValueError, match="another readout or other prompts"):
        progress.load(path, as_dict, progress.workload_key(b"another readout", ["a", "b"], ["c"]))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        progress.load(path, as_dict, key)
