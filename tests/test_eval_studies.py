"""The study plumbing without the engine: prompt selection, the feedback/evaluation split, the transfer
study's RLS curve, and the report rendered from saved results."""

from __future__ import annotations

import json

import numpy as np
import pytest

from evaluation.baselines import LengthData


def synthetic(n: int, d: int = 12, seed: int = 0, shift: float = 0.0, max_tokens: int = 1024) -> LengthData:
    """Lengths from a direction of the features; `shift` rotates that direction (a new domain)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    w = np.zeros(d)
    w[0], w[1] = np.cos(shift), np.sin(shift)
    lengths = np.clip((12 + 5 * X @ w + rng.normal(scale=0.5, size=n)) ** 2, 1, max_tokens).astype(np.int64)
    return LengthData(ids=np.array([f"s-{i}" for i in range(n)], dtype=object), texts=["x " * (5 + i % 40)
                      for i in range(n)], prompt_tokens=np.full(n, 20), features=X, lengths=lengths,
                      max_tokens=max_tokens)


def test_a_snapshot_extension_records_every_set_once_at_its_larger_count():
    from evaluation.corpora import merged_selection

    assert merged_selection("sharegpt:3050,math:300", "sharegpt:4000") == "sharegpt:4000,math:300"
    assert merged_selection("sharegpt:3050,math:300", "sharegpt_untouched:600") == \
        "sharegpt:3050,math:300,sharegpt_untouched:600"
    assert merged_selection("a:5", "a") == "a" and merged_selection("", "b:2") == "b:2"


def test_selection_is_seeded_disjoint_and_per_file(tmp_path):
    from evaluation.selections import select

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"p-{i}", "set": "p", "domain": "d", "lang": "en",
                                        "prompt": f"prompt {i}"}) + "\n" for i in range(50)))
    first = select(f"{path}:10")
    assert len(first) == 10 and first == select(f"{path}:10")
    assert [p["id"] for p in first] != [f"p-{i}" for i in range(10)]  # spread over the file, not its head
    rest = select(str(path), exclude=[p["id"] for p in first])
    assert len(rest) == 40 and not {p["id"] for p in rest} & {p["id"] for p in first}
    with pytest.raises(FileNotFoundError):
        select("no_such_set")


def test_split_stream_keeps_at_least_15_percent_for_evaluation():
    from evaluation.data import split_stream

    stream, evaluation = split_stream(1300, (100, 500, 1000))
    assert len(stream) == 1000 and len(evaluation) == 300
    assert not set(stream) & set(evaluation) and len(set(stream) | set(evaluation)) == 1300
    stream, evaluation = split_stream(200, (100, 500, 1000))
    assert len(evaluation) == 30 and len(stream) == 170


def test_transfer_rls_recovers_a_rotated_domain():
    from evaluation.baseline_fits import make_predictor
    from evaluation.transfer import run_transfer

    train, target = synthetic(600, seed=1), synthetic(1300, seed=2, shift=1.2)
    baselines = {"prompt_length": make_predictor("prompt_length").fit(train)}
    result = run_transfer(train, target, baselines)
    assert set(result["spearman_rls"]) == {"100", "500", "1000"}
    assert result["n_feedback_pool"] == 1000 and result["n_eval"] == 300
    curve = [result["spearman_rls"][k] for k in ("100", "500", "1000")]
    assert result["spearman_frozen"] < curve[0] <= curve[-1] + 0.02
    assert curve[-1] <= result["spearman_refit"] + 0.02
    assert result["gap_closed"]["fraction"] > 0.6
    assert "prompt_length" in result["spearman_baselines"]
    # Each baseline's hyper-parameters are recorded with the result, as given to it.
    recorded = json.loads(json.dumps(result["baseline_hyperparameters"]))
    assert list(recorded) == ["prompt_length"]
    assert recorded["prompt_length"]["params"] == json.loads(json.dumps(baselines["prompt_length"].get_params()))


def test_report_renders_every_saved_study(tmp_path):
    from evaluation.report import ORDER, render_report
    from evaluation.transfer import run_transfer

    train, target = synthetic(300, seed=1), synthetic(400, seed=2, shift=0.8)
    transfer = run_transfer(train, target, {}, counts=(50, 200))
    transfer.update(study="transfer", command="leap eval transfer --test x.jsonl --save")
    (tmp_path / "transfer-multilingual.json").write_text(json.dumps(transfer))
    corpus = {"study": "corpus", "max_tokens": 1024, "n": 3, "chat_capped_fraction": 0.05, "command": "leap eval corpus",
              "per_set": {"sharegpt": {"n": 3, "mean": 100.0, "p10": 10.0, "p50": 90.0, "p90": 300.0,
                                       "capped_fraction": 0.05}},
              "goals": {"chat_capped_fraction": {"target": "<= 0.1", "measured": 0.05, "met": True}}}
    (tmp_path / "corpus.json").write_text(json.dumps(corpus))
    out = tmp_path / "results.md"
    rendered = render_report(tmp_path, out)
    assert rendered["sections"] == ["corpus", "transfer"]
    assert set(rendered["missing"]) == set(ORDER) - {"corpus", "transfer"}
    text = out.read_text()
    assert "leap eval transfer --test x.jsonl --save" in text and "leap eval corpus" in text
    assert f"{transfer['spearman_frozen']:.3f}" in text
    for png in ("corpus.png", "transfer.png"):
        assert (tmp_path / png).stat().st_size > 5000 and f"]({png})" in text
    # Neither records its corpus or a clean commit: the page names them, and the command fails.
    assert rendered["stale"] == rendered["dirty"] == ["corpus", "transfer-multilingual"]
    assert "commit with uncommitted changes, or none recorded: `corpus`, `transfer-multilingual`" in text


def test_the_report_fails_on_a_result_from_another_corpus_or_a_dirty_commit(tmp_path):
    from typer.testing import CliRunner

    from leap_cli.main import app
    from study_harness.snapshot import read_manifest

    current = read_manifest()["corpus_hash"]
    corpus = {"study": "corpus", "max_tokens": 1024, "n": 3, "chat_capped_fraction": 0.05, "command": "leap eval corpus",
              "per_set": {"sharegpt": {"n": 3, "mean": 100.0, "p10": 10.0, "p50": 90.0, "p90": 300.0,
                                       "capped_fraction": 0.05}}, "corpus_hash": current, "commit": "0" * 40,
              "goals": {"chat_capped_fraction": {"target": "<= 0.1", "measured": 0.05, "met": True}}}

    def report(**recorded) -> tuple[int, dict]:
        (tmp_path / "corpus.json").write_text(json.dumps({**corpus, **recorded}))
        done = CliRunner().invoke(app, ["eval", "report", "--results", str(tmp_path), "--out",
                                        str(tmp_path / "results.md"), "--json"])
        return done.exit_code, json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])

    assert report() == (0, {**report()[1], "stale": [], "dirty": []})
    code, rendered = report(commit="0" * 40 + "-dirty")
    assert code == 1 and rendered["dirty"] == ["corpus"] and rendered["stale"] == []
    code, rendered = report(corpus_hash="0123456789abcdef")
    assert code == 1 and rendered["stale"] == ["corpus"] and rendered["dirty"] == []


def test_an_arm_against_countdown_pairs_requests_within_repeats_and_prices_long_requests():
    """`against_countdown` on runs with known answers: the arm halves every short request's PTL and doubles
    the long requests' latency, in each of three repeats whose levels differ."""
    from evaluation.live import against_countdown, section_live_gittins

    tokens = np.arange(1, 21, dtype=np.int64) * 10  # the top decile: 190 and 200 tokens
    long = tokens >= 190
    runs: dict[str, list[dict]] = {"leap": [], "leap-gittins": []}
    for level in (1.0, 2.0, 3.0):
        latency = level * tokens.astype(np.float64)
        runs["leap"].append({"ptl_per_request": latency / tokens, "latency_per_request": latency,
                             "simulated_latency": latency, "tokens_per_request": tokens})
        arm = np.where(long, 2 * latency, latency / 2)
        runs["leap-gittins"].append({"ptl_per_request": arm / tokens, "latency_per_request": arm,
                                     "simulated_latency": latency, "tokens_per_request": tokens})
    out = against_countdown(runs, "leap-gittins")
    expected = (18 * 0.5 + 2 * 2.0) / 20  # every request's PTL is level: the mean of the per-request factors
    assert out["ratio"]["value"] == pytest.approx(expected)
    assert out["ratio"]["ci_low"] < expected < out["ratio"]["ci_high"]  # which requests are drawn matters
    assert out["per_repeat"] == pytest.approx([expected] * 3)
    assert out["simulated"]["value"] == pytest.approx(1.0)
    assert (out["long_requests"], out["long_min_tokens"]) == (2, 190)
    assert out["long_latency_ratio"]["value"] == pytest.approx(2.0)
    result = {"gittins": {k: v for k, v in out.items() if k != "ratio"},
              "ratios": {"gittins_over_countdown": out["ratio"]}, "n_requests": 20, "n_train": 100, "load": 1.2,
              "repeats": 3, "max_resident": 512, "decode_slots": 8, "waiting_cap": 128,
              "step_model_fit": {"steps": 1000, "median_abs_rel_error": 0.05, "total_modeled_over_measured": 1.0},
              "policies": {name: {"mean_ptl": 1.0, "mean_ptl_ci": [0.9, 1.1], "p95_ptl": 2.0, "mean_ttft": 0.5,
                                  "simulated_mean_ptl": 1.0} for name in runs},
              "command": "leap eval live --gittins --save --json"}
    text = section_live_gittins(result, "live-gittins.png")
    assert f"**{expected:.3f} [" in text and "Its interval lies below 1" in text
    assert "the 2 of 20 with at least 190 tokens" in text and "2.000 [2.000, 2.000] of countdown's" in text
