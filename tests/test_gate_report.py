"""The verdict report (registry.gate_report) and where it goes: the version's description, tags and logged
model in a real MLflow store (registry.gate_publish), and the MLflow page the Prefect artifact links to."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlflow")

from flows.gate_artifacts import version_page
from leap_core.gate_verdict import gate_verdict
from leap_core.shadow_figures import shadow_figures
from registry.gate_report import verdict_report, with_verdict

STEP_MODEL = {"median_abs_rel_error": 0.021, "arm_error_median": 0.034, "steps": 512}


def _results(speed: float, seed: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    tokens = np.tile(rng.integers(10, 400, 48), 2)
    bar = rng.lognormal(-3.0, 0.4, 96)
    return {policy: {"ptl": ptl.tolist(), "output_tokens": tokens.tolist(), "repeats": 2}
            for policy, ptl in (("champion", bar), ("challenger", speed * bar))}


def _shadow(seed: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    truth = rng.integers(10, 500, 80).astype(float)
    return shadow_figures(truth, truth * rng.uniform(0.5, 1.5, 80), truth * rng.uniform(0.8, 1.2, 80), n_boot=200)


def test_the_report_states_outcome_ratio_interval_bar_shadow_and_step_model_error():
    verdict = {**gate_verdict(_results(0.8), shadow=_shadow()), "step_model": STEP_MODEL}
    report = verdict_report(verdict, "4", subject="leap-readout-x-L9 v5")
    rows = {row["figure"]: row["value"] for row in report.rows}
    assert report.title == "Gate: better against champion v4, passed"
    assert rows["challenger"] == "leap-readout-x-L9 v5" and rows["bar"] == "champion v4"
    assert rows["mean PTL ratio"].startswith(f"x{verdict['mean_ptl_ratio']:.3f} of the champion's")
    assert rows["95% interval"].startswith(f"x{verdict['ci_low']:.3f} to x{verdict['ci_high']:.3f}")
    assert rows["shadow Spearman"].startswith(f"{verdict['shadow']['spearman']['shadow']:.3f} against the champion's")
    assert rows["step-model error"] == "2.1% median per calibration step; 3.4% median per arm against the wall clock"
    tags = report.tags()
    assert tags["leap.gate.outcome"] == "better" and tags["leap.gate.passed"] == "true"
    assert tags["leap.gate.ratio"] == f"{verdict['mean_ptl_ratio']:.4f}" and tags["leap.gate.step_model_error"] == "0.0340"
    assert {"leap.gate.ratio_low", "leap.gate.ratio_high", "leap.gate.spearman", "leap.gate.mae"} <= set(tags)
    metrics = report.metrics()
    assert metrics["gate.ratio"] == pytest.approx(verdict["mean_ptl_ratio"]) and metrics["gate.passed"] == 1.0
    assert "gate.shadow.spearman.difference" in metrics and "gate.outcome" not in metrics
    markdown = report.markdown("## ")
    assert markdown.startswith("## Gate: better against champion v4, passed\n\n| figure | value |\n|---|---|\n")
    assert len(markdown.splitlines()) == 4 + len(report.rows)  # one line a row: the table is never broken
    assert report.summary().startswith(f"{report.title}: mean PTL x{verdict['mean_ptl_ratio']:.3f}")


def test_a_verdict_that_never_compared_says_why_and_hostile_text_cannot_break_the_table():
    verdict = {"passed": False, "outcome": None, "bar": "fcfs", "reason": "a replay | broke\n\n| figure | value |",
               "shadow_evidence": {"reason": "no champion served beside a shadow"}}
    report = verdict_report(verdict)
    assert report.title == "Gate: no outcome against fcfs, not passed" and report.summary() == report.title
    markdown = report.markdown()
    assert markdown.count("\n") == 3 + len(report.rows) and "a replay \\| broke \\| figure \\| value \\|" in markdown
    assert "not held in shadow (no champion served beside a shadow)" in markdown
    assert report.tags() == {"leap.gate.outcome": "none", "leap.gate.passed": "false", "leap.gate.bar": "fcfs"}
    assert report.metrics() == {"gate.passed": 0.0}


def test_the_gate_section_replaces_the_last_one_and_keeps_what_came_before():
    first = verdict_report(gate_verdict(_results(0.8))).markdown()
    second = verdict_report(gate_verdict(_results(1.0))).markdown()
    described = with_verdict(with_verdict("Fitted on 240 rows.\n\nWindow: last week.", first), second)
    assert described == f"Fitted on 240 rows.\n\nWindow: last week.\n\n{second}"
    assert with_verdict(None, first) == first


def test_the_prefect_artifact_links_the_version_page_without_the_account():
    assert version_page("https://ops:secret@mlflow.example:5443/", "leap-readout-a b-L9", "7") == \
        "https://mlflow.example:5443/#/models/leap-readout-a%20b-L9/versions/7"
    assert version_page("sqlite:////var/lib/leap/mlflow.db", "m", "1") is None
    assert version_page(None, "m", "1") is None


def test_a_later_verdict_without_shadow_figures_leaves_no_stale_shadow_tags(tmp_path):
    from experiments.faults.pipeline import fitted_readout
    from registry.client import ReadoutRegistry

    registry = ReadoutRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    readout, rls = fitted_readout("20260101T000000-report01", seed=1)
    logged = registry.log_readout(readout, rls=rls, params={"data_hash": "t"}, metrics={"spearman": 0.5})
    results = _results(0.8)
    registry.log_gate(logged.name, logged.version, None, results, gate_verdict(results, shadow=_shadow()))
    tags = registry.client.get_model_version(logged.name, logged.version).tags
    assert "leap.gate.spearman" in tags
    registry.log_gate(logged.name, logged.version, None, results, gate_verdict(results))
    version = registry.client.get_model_version(logged.name, logged.version)
    assert "leap.gate.spearman" not in version.tags and version.tags["leap.gate.outcome"] == "better"
    assert version.description.count("Gate:") == 1 and "not held in shadow" in version.description
