"""Lengths the client capped or steered never teach the readout: the one rule (`leap_io.labels`), the fit
that reads it from the store, and the serving process's RLS."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from leap_io.labels import LABEL_PROBLEMS, label_problem, label_problems
from store.duckdb import LogStore
from store.ingest import ingest_folder
from tests.runtime_fixtures import build, eventually, first_value_readout  # noqa: F401 (build is a fixture)
from tests.segment_fuzz import write_segment
from tests.test_runtime_hardening import sender_for  # noqa: F401 (a fixture)
from training.fit import excluded_by_reason, fit_readout, select_window, time_split

M = 4096


@pytest.mark.parametrize(("row", "problem"), [
    ({"finish_reason": "stop", "max_tokens": 64}, None),  # stopped by itself under a small budget: honest
    ({"finish_reason": "length", "max_tokens": M}, None),  # censored at the readout's own budget
    ({"finish_reason": "length", "max_tokens": 64}, "client_cap"),
    ({"finish_reason": "length", "max_tokens": 0}, None),  # budget unknown (an old row): kept as before
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"ignore_eos": True}}, "ignore_eos"),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"min_tokens": 200}}, "min_tokens"),
    ({"finish_reason": "stop", "max_tokens": M, "policy": "oracle"}, "policy_oracle"),
    ({"finish_reason": "stop", "max_tokens": M, "policy": "client"}, "policy_client"),
    ({"finish_reason": "stop", "max_tokens": M, "policy": "leap", "decoding": {"ignore_eos": "yes"}}, None),
    ({"finish_reason": "abort", "max_tokens": M}, "abort"),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"stopped_on": "eos"}}, None),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"stopped_on": "stop_token"}}, "client_stop"),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"eos_logit_bias": True}}, "eos_logit_bias"),
    ({"finish_reason": "length", "max_tokens": M, "decoding": {"allowed_token_ids": 3}}, "allowed_token_ids"),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"allowed_token_ids": 0}}, None),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"structured_outputs": True}}, "structured_outputs"),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"sample_index": 0}}, None),  # one sample counts
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"sample_index": 1}}, "parallel_sample"),
    ({"finish_reason": "stop", "max_tokens": M, "decoding": {"sample_index": True}}, None),  # not an int
])
def test_the_rule(row, problem):
    row = dict(row)
    assert label_problem(row.pop("finish_reason"), row.pop("max_tokens"), M, **row) == problem


def test_the_columns_of_a_frame_follow_the_same_rule_and_unreadable_settings_count_as_none():
    decoding = np.array(['{"ignore_eos": true}', "not json", None, '{"min_tokens": 3}', "[1]"], dtype=object)
    problems = label_problems(np.array(["stop"] * 5, dtype=object), np.full(5, M), M,
                              np.array(["leap"] * 5, dtype=object), decoding)
    assert problems.tolist() == ["ignore_eos", None, None, "min_tokens", None]


def _steered_segment(path: Path, n: int, seed: int):
    """`n` rows: the first quarter capped by the client, then ignore_eos, then the oracle policy; the last
    quarter honest."""
    quarter = n // 4
    finish = ["length"] * quarter + ["stop"] * (n - quarter)
    max_tokens = [32] * quarter + [M] * (n - quarter)
    decoding = ['{"temperature": 0.0}'] * n
    decoding[quarter:2 * quarter] = ['{"temperature": 0.0, "ignore_eos": true}'] * quarter
    policy = ["leap"] * 2 * quarter + ["oracle"] * quarter + ["leap"] * (n - 3 * quarter)
    return write_segment(path, n, 8, seed=seed, finish_reasons=("stop",),
                         overrides={"finish_reason": finish, "max_tokens": max_tokens, "decoding": decoding,
                                    "policy": policy}), quarter


def test_the_fit_keeps_steered_rows_out_and_counts_them(tmp_path: Path):
    store = LogStore(tmp_path / "leap.duckdb")
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    segment, quarter = _steered_segment(feedback / "seg.parquet", 400, seed=5)
    [report] = ingest_folder(store, feedback)
    assert report.accepted == 400  # every row is stored: they are data, only not labels

    frame = select_window(store, min_rows=10)
    excluded = excluded_by_reason(frame)
    assert {key: excluded[key] for key in LABEL_PROBLEMS} == {
        **{key: 0 for key in LABEL_PROBLEMS}, "client_cap": quarter, "ignore_eos": quarter, "policy_oracle": quarter}
    train, test = time_split(frame)
    fit = fit_readout(train, test, alpha=1.0, model_id="m", model_fingerprint="fp-fuzz", layer=20, version="v")
    assert fit.params["n_train"] + fit.params["n_test"] == 400 - 3 * quarter
    assert fit.params["n_excluded_client_cap"] == quarter and fit.params["n_excluded_policy_oracle"] == quarter


# -- the serving process's RLS ---------------------------------------------------------------------------
def test_rls_learns_only_from_lengths_the_client_left_alone(build, sender_for):
    from vllm.v1.request import RequestStatus

    from leap_core.readout_format import to_bytes
    from leap_io.push_bundle import make_bundle
    from tests.test_runtime_hardening import _anchor, decode, feature, finish, make_request, sample

    runtime = build(policy="leap", rls=True, rls_every=1)
    readout = first_value_readout("v1", max_tokens=M)
    runtime.push_readout(make_bundle(to_bytes(readout), _anchor(readout)))
    rows = []
    runtime.recorder.listeners.append(rows.append)
    cases = [  # (request, how it finished)
        (make_request("capped-00000001", max_tokens=64), RequestStatus.FINISHED_LENGTH_CAPPED),
        (make_request("eos-off-00000001", max_tokens=M, extra=None), RequestStatus.FINISHED_LENGTH_CAPPED),
        (make_request("honest-00000001", max_tokens=64), RequestStatus.FINISHED_STOPPED),
        (make_request("full-00000001", max_tokens=M), RequestStatus.FINISHED_LENGTH_CAPPED),
        (make_request("stopped-00000001", max_tokens=M), RequestStatus.FINISHED_STOPPED),  # on the client's token
        (make_request("biased-00000001", max_tokens=M), RequestStatus.FINISHED_STOPPED),  # EOS biased
        (make_request("0_parent-00000001", max_tokens=M), RequestStatus.FINISHED_STOPPED),  # n = 2: counts once
        (make_request("1_parent-00000001", max_tokens=M), RequestStatus.FINISHED_STOPPED),
    ]
    cases[1][0].sampling_params.ignore_eos = True
    cases[4][0].sampling_params.stop_token_ids = [7]
    cases[4][0].stop_reason = 7
    cases[5][0].sampling_params._eos_token_id = 2
    cases[5][0].sampling_params.logit_bias = {2: 5.0}
    sender = sender_for(runtime)
    for i, (request, _) in enumerate(cases):
        runtime.before_schedule([request], 0)
        sender.send([request.request_id], feature(10.0 + i, seed=i)[None])
    assert eventually(lambda: all(request.request_id in runtime.tracker.predictions for request, _ in cases))
    for request, status in cases:
        runtime.on_finished(finish(decode(request, 5), status))
    runtime.readouts.learner.flush()
    assert len(rows) == len(cases)  # every request keeps its feedback row
    assert runtime.readouts.learner.snapshot()["rows"] == 3  # the honest stop, the one capped at M, sample 0
    for reason in ("client_cap", "ignore_eos", "client_stop", "eos_logit_bias", "parallel_sample"):
        assert sample(runtime, "leap:dropped_total", what="rls_row", reason=reason) == 1, reason
    decoding = {row["client_request_id"]: json.loads(row["decoding"]) for row in rows}  # the suffix stripped
    assert decoding["stopped"]["stopped_on"] == "stop_token" and decoding["honest"]["stopped_on"] == "eos"
    assert decoding["biased"]["eos_logit_bias"] is True and decoding["honest"]["eos_logit_bias"] is False
    assert [decoding[f"{i}_parent"]["sample_index"] for i in (0, 1)] == [0, 1]
    # the quality figures count the labelled rows alone
    assert sample(runtime, "leap:rolling_requests", domain="all") == 3
