"""Shadow scoring: a replica holds a challenger beside the serving readout, predicts every finished request
from the same captured vector, never schedules by it, and each feedback row carries both predictions; the
stores keep them, the flows' paired figures find a worse shadow, and the gate's verdict takes them.

Real parts: LEAP runtimes driven through their scheduler hooks with real vLLM requests and the real
capture channel (no engine, as in tests/test_runtime_hardening.py), their admin servers over HTTP, real
Parquet segments ingested into a real DuckDB store, and a sqlite MLflow registry.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import generate_latest

from leap_core.gate_verdict import BETTER, gate_verdict
from leap_core.readout_format import to_bytes
from leap_core.shadow_figures import pairwise_order_accuracy, shadow_figures
from leap_io.push_bundle import make_bundle

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from serving.capture.hidden_states import FeatureSender
from tests.runtime_fixtures import DIM, build, eventually, first_value_readout, scaled_readout  # noqa: F401  (pytest fixtures, used by name)

TOKEN = "shadow-token"


def finished(runtime, sender: FeatureSender, rid: str, first: float, tokens: int) -> None:
    """One request predicted from a vector whose first value is `first`, decoded `tokens` and finished."""
    request = Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4096), None, arrival_time=time.time())
    runtime.before_schedule([request], 0)
    vector = np.random.default_rng(len(rid)).normal(size=DIM).astype(np.float32)
    vector[0] = first
    sender.send([rid], vector[None])
    assert eventually(lambda: rid in runtime.tracker.predictions)
    request.num_computed_tokens = request.num_prompt_tokens + tokens - 1
    request.append_output_token_ids([7] * tokens)
    request.status = RequestStatus.FINISHED_STOPPED
    runtime.on_finished(request)


def test_a_shadow_held_over_http_predicts_each_row_from_the_same_vector_and_never_schedules(build):
    runtime = build(policy="leap", decode_slots=1, admin_port=0, admin_token=TOKEN)
    runtime.reset_readout(first_value_readout("served-1"), None)
    rows: list[dict] = []
    runtime.recorder.listeners.append(rows.append)
    sender = FeatureSender(runtime.config.channel)
    url, auth = f"http://127.0.0.1:{runtime.admin.port}/leap/shadow", {"Authorization": f"Bearer {TOKEN}"}
    body = make_bundle(to_bytes(scaled_readout("shadow-1", 3.0)), None)

    assert httpx.post(url, content=body, timeout=10).status_code == 401
    answer = httpx.post(url, content=body, headers=auth, timeout=10)
    assert answer.status_code == 200 and answer.json() == {"shadow": "shadow-1", "previous": None}

    for i, (first, tokens) in enumerate([(10.0, 12), (40.0, 35), (25.0, 20)]):
        finished(runtime, sender, f"r{i}-00000001", first, tokens)
    assert [(row["predicted_at_admission"], row["shadow_predicted"], row["shadow_version"]) for row in rows] == [
        (10.0, 30.0, "shadow-1"), (40.0, 120.0, "shadow-1"), (25.0, 75.0, "shadow-1")]
    assert all(row["readout_version"] == "served-1" for row in rows)  # the served readout still schedules
    health = httpx.get(f"http://127.0.0.1:{runtime.admin.port}/leap/health", timeout=10).json()
    assert health["shadow"]["version"] == "shadow-1" and health["shadow"]["predicted"] == 3
    assert 0.0 < health["shadow"]["seconds"] < 1.0  # what holding it cost, measured
    assert runtime.metrics_registry.get_sample_value("leap:shadow_rows") == 3.0

    released = httpx.post(url, content=b"", headers=auth, timeout=10)
    assert released.json() == {"shadow": None, "previous": "shadow-1"}
    finished(runtime, sender, "r9-00000001", 5.0, 4)
    assert rows[-1]["shadow_predicted"] is None and rows[-1]["shadow_version"] is None


def test_a_bundle_that_could_not_serve_here_is_refused_and_nothing_is_held(build):
    runtime = build(policy="leap", admin_port=0, admin_token=TOKEN)
    url, auth = f"http://127.0.0.1:{runtime.admin.port}/leap/shadow", {"Authorization": f"Bearer {TOKEN}"}
    wrong_dim = first_value_readout("other", dim=DIM + 3)
    for body in (b"not a bundle", make_bundle(to_bytes(wrong_dim), None)):
        answer = httpx.post(url, content=body, headers=auth, timeout=10)
        assert 400 <= answer.status_code < 500, answer.text
    assert runtime.shadow.version is None


def test_the_live_figures_on_metrics_pair_both_readouts_on_the_same_requests(build):
    runtime = build(policy="leap", admin_port=0, admin_token=TOKEN)
    runtime.reset_readout(first_value_readout("served-1"), None)
    runtime.hold_shadow(make_bundle(to_bytes(scaled_readout("inverted", -1.0, intercept=300.0)), None))
    sender = FeatureSender(runtime.config.channel)
    for i in range(16):  # a multiple of the figures' refresh period
        finished(runtime, sender, f"m{i:02d}-00000001", float(10 + 5 * i), 10 + 5 * i)
    text = generate_latest(runtime.metrics_registry).decode()
    assert 'leap:shadow_figure{figure="spearman",readout="served"} 1.0' in text
    assert 'leap:shadow_figure{figure="spearman",readout="shadow"} -1.0' in text


def test_order_accuracy_counts_the_pairs_a_prediction_puts_in_the_right_order():
    assert pairwise_order_accuracy([1, 2, 3], [1, 3, 2]) == pytest.approx(2 / 3)
    assert pairwise_order_accuracy([1, 2, 3], [5, 5, 5]) == pytest.approx(0.5)  # ties count half
    assert pairwise_order_accuracy([1, 2, 3], [3, 2, 1]) == 0.0
    assert np.isnan(pairwise_order_accuracy([4, 4], [1, 2]))  # no pair of different lengths


def test_the_paired_figures_find_a_worse_shadow_and_not_an_equal_one():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 800, 400).astype(float)
    good = tokens * rng.lognormal(0.0, 0.3, tokens.size)
    noise = rng.uniform(5, 800, tokens.size)
    worse = shadow_figures(tokens, good, noise, n_boot=300)
    assert worse["shadow_worse"] and {"spearman", "order_accuracy", "mae"} <= set(worse["worse_on"])
    difference = worse["spearman"]["difference"]
    assert difference["ci_low"] <= difference["value"] <= difference["ci_high"] < 0.0
    assert worse["spearman"]["served"] > 0.8 and abs(worse["spearman"]["shadow"]) < 0.2
    same = shadow_figures(tokens, good, good.copy(), n_boot=300)
    assert not same["shadow_worse"] and same["spearman"]["difference"]["value"] == 0.0
    better = shadow_figures(tokens, noise, good, n_boot=300)
    assert not better["shadow_worse"] and better["spearman"]["difference"]["ci_low"] > 0.0
    dropped = shadow_figures([5.0, np.nan, 7.0, 9.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, np.inf, 4.0], n_boot=50)
    assert dropped["n"] == 2 and dropped["n_dropped"] == 2


def _arm(ptl, tokens) -> dict:
    return {"mean_ptl": float(np.mean(ptl)), "ptl": list(ptl), "output_tokens": list(tokens), "repeats": 1}


def test_a_challenger_worse_in_shadow_passes_on_no_rule_even_when_the_replay_finds_it_better():
    rng = np.random.default_rng(1)
    tokens = rng.integers(10, 500, 64)
    bar = rng.lognormal(0.0, 0.5, 64)
    results = {"fcfs": _arm(bar * 1.5, tokens), "champion": _arm(bar, tokens), "challenger": _arm(bar * 0.8, tokens)}
    figures = shadow_figures(tokens.astype(float), tokens * 1.1, rng.uniform(10, 500, 64), n_boot=300)
    assert figures["shadow_worse"]
    verdict = gate_verdict(results, shadow=figures)
    assert verdict["outcome"] == BETTER and not verdict["passed"]
    assert "in shadow on 64 live requests: worse on" in verdict["reason"]
    assert verdict["shadow"]["n"] == 64
    fine = shadow_figures(tokens.astype(float), tokens * 1.1, tokens * 1.05, n_boot=300)  # closer: not worse
    assert gate_verdict(results, shadow=fine)["passed"]


def test_shadow_rows_survive_the_segment_and_the_store_and_give_the_flows_their_evidence(tmp_path: Path):
    from flows.shadow import shadow_evidence
    from serving.feedback.writer import FeedbackWriter
    from store.duckdb import LogStore
    from store.ingest import ingest_folder

    folder = tmp_path / "feedback"
    writer = FeedbackWriter(folder, 4, 3, "m", "fp", replica_id="r0", flush_seconds=0.05)
    rng = np.random.default_rng(2)
    n = 80
    for i in range(n):
        tokens = int(rng.integers(5, 400))
        capped = i < 6  # a client-capped length is no label
        writer.write({
            "request_id": f"req-{i:05d}", "model_id": "m", "model_fingerprint": "fp", "layer": 3, "policy": "leap",
            "arrival_time": 1_750_000_000.0 + i, "first_token_time": 1_750_000_000.5 + i,
            "finish_time": 1_750_000_001.0 + i, "prompt_tokens": 10, "output_tokens": tokens,
            "finish_reason": "length" if capped else "stop", "max_tokens": tokens if capped else 512,
            "decoding": "{}", "domain": "chat", "tenant": None,
            "predicted_at_admission": tokens * 1.1, "predicted_latest": tokens * 1.1, "readout_version": "v1",
            "shadow_predicted": float(rng.uniform(5, 400)) if i % 10 else None,
            "shadow_version": "v2" if i % 10 else None,
            "feature": rng.standard_normal(4).astype(np.float32)})
    writer.close()
    store = LogStore(tmp_path / "leap.duckdb")
    reports = ingest_folder(store, folder)
    assert sum(report.accepted for report in reports) == n
    rows = store.shadow_rows("v2")
    assert len(rows["shadow"]) == n - n // 10 and np.all(rows["served"] > 0)
    assert store.shadow_rows("v2", since=1_750_000_000.0 + n).get("shadow").size == 0
    assert store.shadow_rows("v9")["shadow"].size == 0
    challenger = scaled_readout("v2", 1.0)
    evidence = shadow_evidence(store, challenger, min_rows=32)
    assert evidence["rows"] == 72 and evidence["labelled_rows"] == 72 - 5  # i = 1..5 were capped
    assert evidence["figures"]["shadow_worse"] and evidence["reason"] is None
    too_few = shadow_evidence(store, challenger, min_rows=1000)
    assert too_few["figures"] is None and "1000 needed" in too_few["reason"]


def test_leap_shadow_reaches_every_replica_and_is_recorded_in_the_registry(build, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from leap_cli.main import app
    from registry.client import ReadoutRegistry

    replicas = [build(policy="leap", admin_port=0, admin_token=TOKEN) for _ in range(2)]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    registry = ReadoutRegistry(uri)
    logged = registry.log_readout(scaled_readout("candidate", 2.0), params={}, metrics={})
    name, version = logged.name, logged.version
    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    monkeypatch.setenv("LEAP_ENDPOINTS", ",".join(f"http://127.0.0.1:{r.admin.port}" for r in replicas))
    monkeypatch.setenv("LEAP_ADMIN_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("LEAP_MLFLOW_TRACKING_URI", uri)

    missing = CliRunner().invoke(app, ["shadow", "on", "--name", name, "--json"])
    assert missing.exit_code != 0 and "--version" in missing.output
    held = CliRunner().invoke(app, ["shadow", "on", "--version", str(version), "--name", name, "--json"])
    assert held.exit_code == 0, held.output
    report = json.loads(held.stdout.strip().splitlines()[-1])
    assert report["status"] == "held" and report["replicas_holding"] == 2 and not report["failed"]
    assert all(r.shadow.version == report["readout_version"] for r in replicas)
    released = CliRunner().invoke(app, ["shadow", "off", "--name", name, "--json"])
    assert released.exit_code == 0 and all(r.shadow.version is None for r in replicas)
    actions = [run["action"] for run in registry.operations()]
    assert actions == ["shadow-release", "shadow-hold"]


def test_the_gate_report_carries_the_shadow_figures_as_metrics_and_in_its_table():
    from registry.gate_report import shadow_metrics, verdict_report

    rng = np.random.default_rng(3)
    tokens = rng.integers(10, 500, 64).astype(float)
    figures = shadow_figures(tokens, tokens * 1.1, rng.uniform(10, 500, 64), n_boot=200)
    metrics = shadow_metrics(figures)
    assert metrics["shadow.n"] == 64.0 and metrics["shadow.worse"] == 1.0
    assert metrics["shadow.spearman.served"] == pytest.approx(1.0)
    assert metrics["shadow.spearman.difference.ci_low"] <= metrics["shadow.spearman.difference"] < 0.0
    assert {f"shadow.{f}.difference.ci_high" for f in ("spearman", "mae", "order_accuracy")} <= set(metrics)
    assert shadow_metrics(None) == {}
    bar = rng.lognormal(0.0, 0.5, 64)
    results = {"champion": _arm(bar, tokens), "challenger": _arm(bar * 0.8, tokens)}
    report = verdict_report(gate_verdict(results, shadow=figures), "3")
    table = report.markdown()
    assert "| shadow | 64 live requests; worse on spearman" in table and "| shadow Spearman | " in table
    assert "| longest-quartile P95 PTL | x0.800 (interval x" in table and "worse above x1.200)" in table
    assert report.title == "Gate: better against champion v3, not passed"
    assert report.tags()["leap.gate.spearman"] == f"{figures['spearman']['shadow']:.4f}"
    assert report.metrics()["gate.shadow.worse"] == 1.0


def test_the_live_figures_are_recomputed_every_period_once_the_window_is_full_too(monkeypatch):
    import serving.readout.shadow as shadow_module
    import serving.rolling_quality as rolling_quality
    from serving.telemetry import Telemetry

    calls = []  # the shadow's figures are its window's (serving.rolling_quality)
    monkeypatch.setattr(rolling_quality, "spearman", lambda a, b: calls.append(len(a)) or 0.0)
    shadow = shadow_module.ShadowReadout({}, None, Telemetry(), window=32)
    for i in range(8 * shadow_module.FIGURES_EVERY):  # 4x the window: full after the first 32 pairs
        shadow.observe(float(i), float(i), i + 1)
    assert len(calls) == 2 * 8  # both readouts, once per period, not once per pair after the window fills
    assert calls[-1] == 32


def test_the_serving_bench_prices_the_shadow_by_switchback_steps_pooled_over_repeats():
    from experiments.bench.serving import SHADOW, shadow_cost
    from experiments.bench.switchback import block_is_on

    def run(cost_s: float, shadow_seconds: float) -> dict:
        on = [block_is_on(k, 4) for k in range(160)]
        decodes = [8 + k % 5 for k in range(160)]
        seconds = [0.05 + 0.001 * d + (cost_s if o else 0.0) + 1e-4 * (k % 3) for k, (o, d) in enumerate(zip(on, decodes))]
        return {"shadow_predicted": 40, "shadow_seconds": shadow_seconds,
                "switchback": {"block_steps": 4, "on": on, "tokens": decodes, "seconds": seconds,
                               "decodes": decodes, "prefill": [0] * 160}}

    cost = shadow_cost({SHADOW: [run(0.0005, 0.4), run(0.0005, 0.8)]})
    base = 0.05 + 0.001 * 10 + 1e-4  # the mean decode-only step without the shadow
    expected = base / (base + 0.0005)
    assert cost["throughput_ratio"] == pytest.approx(expected, rel=2e-3)
    assert cost["throughput_ratio_ci"][0] <= cost["throughput_ratio"] <= cost["throughput_ratio_ci"][1] < 1.0
    assert cost["pairs"] == 2 * 160 // 8 and cost["repeats"] == 2 and cost["block_steps"] == 4
    assert cost["delta_ms_per_step"] == pytest.approx(0.5, rel=0.05) and cost["shadow_predictions"] == [40, 40]
    on_seconds = sum(s for s, o in zip(run(0.0005, 0.4)["switchback"]["seconds"], run(0.0005, 0.4)["switchback"]["on"]) if o)
    assert cost["shadow_seconds_over_on_seconds"] == pytest.approx([0.4 / on_seconds, 0.8 / on_seconds])
    assert shadow_cost({SHADOW: [{"shadow_predicted": 0}]})["throughput_ratio"] is None
