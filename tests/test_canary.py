"""Canary promotion: a challenger serves on some replicas first; their live figures against the rest's, over
the same window, promote it everywhere or roll the canaries back by themselves.

Real parts: LEAP runtimes driven through their scheduler hooks with real vLLM requests and the real
capture channel (no engine, as in tests/test_runtime_hardening.py), their admin servers over HTTP, their
feedback writers, segments ingested into a real DuckDB store, and a sqlite MLflow registry. Without an
engine, latencies are this test's own pacing, so the mean-PTL guard is widened where it is not the point.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from leap_core.canary_figures import canary_figures

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from serving.capture.hidden_states import FeatureSender
from tests.runtime_fixtures import DIM, build, eventually, scaled_readout  # noqa: F401  (pytest fixtures, used by name)

TOKEN = "canary-token"


def test_the_figures_find_worse_canaries_by_ranking_error_or_latency_and_not_equal_ones():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 800, 300).astype(float)
    good = tokens * rng.lognormal(0.0, 0.3, tokens.size)
    ptl = rng.lognormal(-3.0, 0.2, tokens.size)
    ranking = canary_figures((tokens, rng.uniform(5, 800, tokens.size), ptl), (tokens, good, ptl), n_boot=300)
    assert ranking["canary_worse"] and {"spearman", "mae"} <= set(ranking["worse_on"])
    assert ranking["spearman"]["difference"]["ci_high"] < 0.0 and ranking["n_canary"] == ranking["n_rest"] == 300
    slow = canary_figures((tokens, good, ptl * 1.5), (tokens, good, ptl), n_boot=300)
    assert slow["worse_on"] == ["mean_ptl"] and slow["mean_ptl"]["ratio"]["ci_low"] > 1.05
    other = rng.permutation(tokens.size)  # the rest saw other requests of the same stream
    same = canary_figures((tokens, good, ptl), (tokens[other], good[other] * 1.01, ptl[other]), n_boot=300)
    assert not same["canary_worse"]
    assert same["spearman"]["difference"]["ci_low"] < 0.0 < same["spearman"]["difference"]["ci_high"]
    with pytest.raises(ValueError, match="at least 2"):
        canary_figures(([1.0], [1.0], [1.0]), (tokens, good, ptl))


def _traffic(runtime, prefix: str, n: int) -> None:
    """`n` requests finished on `runtime` whose true length is their vector's first value."""
    sender = FeatureSender(runtime.config.channel)
    for i in range(n):
        length = 10 + 7 * i
        request = Request(f"{prefix}{i:03d}-00000001", [1, 2, 3, 4], SamplingParams(max_tokens=4096), None,
                          arrival_time=time.time())
        runtime.before_schedule([request], 0)
        vector = np.random.default_rng(i).normal(size=DIM).astype(np.float32)
        vector[0] = length
        sender.send([request.request_id], vector[None])
        assert eventually(lambda request=request: request.request_id in runtime.tracker.predictions)
        request.num_computed_tokens = request.num_prompt_tokens + length - 1
        request.append_output_token_ids([7] * length)
        request.status = RequestStatus.FINISHED_STOPPED
        runtime.on_finished(request)
    runtime.flush_feedback()


@pytest.mark.parametrize(("challenger", "expected"), [
    (scaled_readout("inverted", -1.0, 400.0), "rolled-back"),  # predicts long for short: ranks upside down
    (scaled_readout("fresher", 1.0), "promoted"),  # ranks and errs as the champion does
])
def test_the_canary_is_judged_on_live_rows_and_promoted_or_rolled_back_by_itself(build, tmp_path: Path,
                                                                                  challenger, expected):
    from flows.canary import canary_promote
    from flows.promotion import PushOptions
    from flows.push import push_readout, serving_version
    from registry.aliases import CHAMPION
    from registry.client import ReadoutRegistry
    from store.duckdb import LogStore
    from store.ingest import ingest_folder, totals

    feedback = tmp_path / "feedback"
    replicas = [build(policy="leap", admin_port=0, admin_token=TOKEN, feedback_dir=str(feedback / f"r{i}"))
                for i in range(2)]
    endpoints = {f"http://127.0.0.1:{r.admin.port}": r for r in replicas}
    registry = ReadoutRegistry(f"sqlite:///{tmp_path}/mlflow.db", lock_path=tmp_path / "alias.lock")
    champion = registry.log_readout(scaled_readout("champion", 1.0), params={}, metrics={})
    candidate = registry.log_readout(challenger, params={}, metrics={})
    registry.set_alias(champion.name, CHAMPION, champion.version)
    bundle, expected_version = registry.push_bundle(champion.name, champion.version)
    for endpoint in endpoints:
        push_readout(endpoint, TOKEN, bundle, expected_version)
    canary_endpoint, rest_endpoint = sorted(endpoints)
    store = LogStore(tmp_path / "leap.duckdb")
    outcome: dict = {}

    def run() -> None:
        outcome.update(canary_promote(
            registry, store, champion.name, candidate.version, champion.version, list(endpoints), 1,
            PushOptions(TOKEN), str(tmp_path / "journal"), lambda: totals(ingest_folder(store, feedback))["accepted"],
            window_s=120.0, min_rows=24, poll_s=0.2, ptl_bound=100.0))

    flow = threading.Thread(target=run, daemon=True)
    flow.start()
    assert eventually(lambda: serving_version(canary_endpoint, TOKEN) == challenger.metadata["version"], 30)
    assert serving_version(rest_endpoint, TOKEN) == "champion"
    _traffic(endpoints[canary_endpoint], "c", 30)
    _traffic(endpoints[rest_endpoint], "r", 30)
    flow.join(120)
    assert not flow.is_alive()

    assert outcome["status"] == expected, outcome["reason"]
    evidence = outcome["evidence"]
    assert evidence["labelled_rows"] == {"canary": 30, "rest": 30}
    assert evidence["figures"]["spearman"]["rest"] == pytest.approx(1.0)
    actions = [run["action"] for run in registry.operations()]
    if expected == "rolled-back":
        assert "spearman" in outcome["reason"] and evidence["figures"]["spearman"]["canary"] == pytest.approx(-1.0)
        assert {serving_version(e, TOKEN) for e in endpoints} == {"champion"}
        assert registry.get_alias(champion.name, CHAMPION) == str(champion.version)
        assert actions == ["canary-rollback"]
    else:
        assert not evidence["figures"]["canary_worse"]
        assert {serving_version(e, TOKEN) for e in endpoints} == {"fresher"}
        assert registry.get_alias(champion.name, CHAMPION) == str(candidate.version)
        assert actions == ["canary-promote"]


def test_a_canary_without_rows_fails_closed_when_its_window_is_over(build, tmp_path: Path):
    from flows.canary import canary_promote, split_fleet
    from flows.promotion import PushOptions
    from flows.push import push_readout, serving_version
    from registry.aliases import CHAMPION
    from registry.client import ReadoutRegistry
    from store.duckdb import LogStore

    replicas = [build(policy="leap", admin_port=0, admin_token=TOKEN) for _ in range(3)]
    endpoints = [f"http://127.0.0.1:{r.admin.port}" for r in replicas]
    registry = ReadoutRegistry(f"sqlite:///{tmp_path}/mlflow.db", lock_path=tmp_path / "alias.lock")
    champion = registry.log_readout(scaled_readout("champion", 1.0), params={}, metrics={})
    candidate = registry.log_readout(scaled_readout("quiet", 1.0, 2.0), params={}, metrics={})
    registry.set_alias(champion.name, CHAMPION, champion.version)
    bundle, version = registry.push_bundle(champion.name, champion.version)
    for endpoint in endpoints:
        push_readout(endpoint, TOKEN, bundle, version)
    with pytest.raises(ValueError, match="canaries < replicas"):
        split_fleet(endpoints, 3)
    outcome = canary_promote(registry, LogStore(tmp_path / "leap.duckdb"), champion.name, candidate.version,
                             champion.version, endpoints, 2, PushOptions(TOKEN), str(tmp_path / "journal"),
                             lambda: 0, window_s=0.5, min_rows=8, poll_s=0.1, ptl_bound=0.05)
    assert outcome["status"] == "rolled-back" and "too few rows" in outcome["reason"]
    assert outcome["canaries"] == sorted(endpoints)[:2] and len(outcome["restored"]) == 2
    assert {serving_version(e, TOKEN) for e in endpoints} == {"champion"}


def test_leap_push_takes_a_canary_only_with_promote(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from leap_cli.main import app

    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    refused = CliRunner().invoke(app, ["push", "--canary", "1", "--json"])
    assert refused.exit_code == 2 and "--canary goes with --promote" in refused.output
