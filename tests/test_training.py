"""Fitting a readout from the log store, on a real DuckDB file ingested from real feedback segments."""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from experiments.bench.ingest import BENCH_FINGERPRINT, BENCH_LAYER, write_synthetic_feedback
from leap_core import targets
from leap_core.readout import LinearReadout
from leap_core.rls import RLS
from store.duckdb import LogStore, TrainingFrame
from store.ingest import ingest_folder
from training.fit import (
    ALPHA_GRID,
    DEFAULT_MAX_TOKENS,
    NotEnoughRowsError,
    fit_readout,
    select_alpha,
    select_window,
    time_split,
)

ROWS, DIM, MAX_TOKENS = 1500, 16, 2048
IDENTITY = {"model_id": "bench-model", "model_fingerprint": BENCH_FINGERPRINT, "layer": BENCH_LAYER,
            "version": "v-test"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LogStore:
    root = tmp_path_factory.mktemp("training")
    write_synthetic_feedback(root / "feedback", ROWS, DIM, segment_rows=400, seed=7, abort_fraction=0.05,
                             max_tokens=MAX_TOKENS)
    store = LogStore(root / "log.duckdb")
    ingest_folder(store, root / "feedback")
    return store


@pytest.fixture(scope="module")
def frame(store: LogStore) -> TrainingFrame:
    return select_window(store, model_fingerprint=BENCH_FINGERPRINT, layer=BENCH_LAYER)


@pytest.fixture(scope="module")
def fitted(frame: TrainingFrame):
    train, test = time_split(frame, 0.2)
    return train, test, fit_readout(train, test, **IDENTITY)


def _usable(frame: TrainingFrame) -> np.ndarray:
    return frame.finish_reason != "abort"


def test_select_window_filters_and_refuses_too_few_rows(store: LogStore, frame: TrainingFrame) -> None:
    assert frame.features.shape == (ROWS, DIM) and frame.features.dtype == np.float32
    since, until = float(np.quantile(frame.arrival_time, 0.25)), float(np.quantile(frame.arrival_time, 0.75))
    window = select_window(store, since=since, until=until, domains=["code"], min_rows=1)
    expected = (frame.arrival_time >= since) & (frame.arrival_time < until) & (frame.domain == "code")
    assert sorted(window.request_ids) == sorted(frame.request_ids[expected])

    usable = int(_usable(frame).sum())
    assert usable < ROWS  # some rows were aborted, and those do not count
    assert len(select_window(store, min_rows=usable).request_ids) == ROWS
    with pytest.raises(NotEnoughRowsError, match=f"{usable} usable"):
        select_window(store, min_rows=usable + 1)


def test_time_split_puts_the_newest_rows_in_the_test_set(frame: TrainingFrame) -> None:
    shuffled = frame.take(np.random.default_rng(0).permutation(ROWS))

    for source in (frame, shuffled):
        train, test = time_split(source, 0.25)
        assert (len(train.request_ids), len(test.request_ids)) == (ROWS - 375, 375)
        assert train.arrival_time.max() <= test.arrival_time.min()
        assert np.all(np.diff(train.arrival_time) >= 0) and np.all(np.diff(test.arrival_time) >= 0)
        assert set(train.request_ids).isdisjoint(test.request_ids)
        rows = {rid: i for i, rid in enumerate(frame.request_ids)}
        back = np.array([rows[rid] for rid in test.request_ids])
        assert np.array_equal(test.features, frame.features[back])
        assert np.array_equal(test.output_tokens, frame.output_tokens[back])
    with pytest.raises(ValueError):
        time_split(frame, 1.0)


def test_fit_matches_leap_core_readout_on_the_rows_left_after_aborts(fitted) -> None:
    train, test, result = fitted
    keep_train, keep_test = _usable(train), _usable(test)
    reference = LinearReadout(alpha=result.params["alpha"], target="sqrt", max_tokens=MAX_TOKENS).fit(
        train.features[keep_train], train.output_tokens[keep_train])

    readout = result.readout
    assert readout.max_tokens == MAX_TOKENS == result.params["max_tokens"]
    np.testing.assert_allclose(readout.coef_, reference.coef_, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(readout.predict(test.features), reference.predict(test.features))
    np.testing.assert_array_equal(result.eval_arrays["true"], test.output_tokens[keep_test])
    np.testing.assert_allclose(result.eval_arrays["pred"], reference.predict(test.features[keep_test]))

    aborted = int((~keep_train).sum() + (~keep_test).sum())
    assert aborted > 0 and result.params["n_aborted_excluded"] == aborted
    assert result.params["n_train"] == keep_train.sum() == result.metrics["n_train"]
    assert result.params["n_test"] == keep_test.sum() == result.metrics["n_test"]
    ids = sorted(str(rid) for rid in train.request_ids[keep_train])
    assert result.params["data_hash"] == hashlib.sha256(b"".join(rid.encode() + b"\0" for rid in ids)).hexdigest()
    assert readout.metadata["n_train"] == keep_train.sum()
    assert {key: readout.metadata[key] for key in IDENTITY} == IDENTITY
    assert readout.metadata["created_at"]


def test_rls_state_resumes_at_the_fitted_weights(fitted) -> None:
    _, test, result = fitted
    resumed = RLS.from_state_arrays(result.readout, result.rls_state)

    np.testing.assert_allclose(resumed.readout().predict(test.features), result.readout.predict(test.features),
                               rtol=1e-9)
    np.testing.assert_allclose(resumed.theta_, result.readout.theta_, rtol=1e-9, atol=1e-12)
    assert float(result.rls_state["alpha"]) == result.params["alpha"]


def test_metrics_are_present_finite_and_show_the_planted_signal(fitted) -> None:
    _, _, result = fitted
    expected = {"spearman", "kendall", "mae", "mae_short", "mae_medium", "mae_long", "n_train", "n_test",
                "spearman_chat", "spearman_code", "spearman_math", "mae_domain_chat", "mae_domain_code",
                "mae_domain_math"}
    assert expected <= set(result.metrics)
    assert all(math.isfinite(value) for value in result.metrics.values())
    assert result.metrics["spearman"] > 0.6  # lengths follow the features; an unfitted readout scores ~0
    json.dumps(result.params)  # params go to MLflow as they are


def test_auto_alpha_is_the_grid_value_that_best_predicts_the_newest_training_rows(fitted) -> None:
    train, _, result = fitted
    assert result.params["alpha_selection"] == "auto" and result.params["alpha"] in ALPHA_GRID

    usable = _usable(train)
    X, lengths = train.features[usable], train.output_tokens[usable]
    n_val = round(len(lengths) * 0.2)
    low, high = targets.bounds("sqrt", MAX_TOKENS)
    errors = []
    for alpha in ALPHA_GRID:
        older = LinearReadout(alpha=alpha, max_tokens=MAX_TOKENS).fit(X[:-n_val], lengths[:-n_val])
        prediction = np.clip(older.predict_transformed(X[-n_val:]), low, high)
        errors.append(np.mean((prediction - np.sqrt(lengths[-n_val:])) ** 2))
    selection = select_alpha(X, lengths, max_tokens=MAX_TOKENS)
    np.testing.assert_allclose(selection.scores, errors, rtol=1e-6)  # the readout predicts float32 in float32
    assert result.params["alpha"] == ALPHA_GRID[int(np.argmin(errors))]
    assert len(set(np.round(errors, 6))) > 1  # the grid really ranks the penalties


def test_given_alpha_and_budget_defaults(frame: TrainingFrame) -> None:
    train, test = time_split(frame)
    given = fit_readout(train, test, alpha=30.0, **IDENTITY)
    assert (given.params["alpha"], given.params["alpha_selection"], given.readout.alpha) == (30.0, "given", 30.0)

    unknown_budget = train._replace(max_tokens=np.zeros_like(train.max_tokens))
    assert fit_readout(unknown_budget, test, alpha=30.0, **IDENTITY).readout.max_tokens == DEFAULT_MAX_TOKENS
    assert fit_readout(train, test, alpha=30.0, max_tokens=512, **IDENTITY).readout.max_tokens == 512
    with pytest.raises(ValueError, match="auto"):
        fit_readout(train, test, alpha="best", **IDENTITY)


def test_bench_pipeline_command_reports_ingest_and_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from leap_cli.main import app  # the console command's app, study commands included

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = CliRunner().invoke(app, ["bench", "pipeline", "--rows", "2000", "--json"])

    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == []  # segments and store were scratch files
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert (figures["rows"], figures["dim"]) == (2000, 576)
    assert figures["ingest_rows_per_s"] > 0 and figures["fit_s"] > 0
    assert figures["n_train"] + figures["n_test"] < 2000  # aborted rows were left out
    assert figures["spearman"] > 0.5


def test_flow_results_and_the_cli_share_one_json_encoder() -> None:
    """flows.tasks.plain (NaN kept) and the CLI's strict output are leap_io.jsonable, on numpy-bearing results."""
    from flows.tasks import plain
    from leap_cli.output import _clean
    from leap_io.jsonable import dumps, to_jsonable

    result = {"alpha": np.float64(31.6), "n": np.int64(3), "ok": np.bool_(True), "grid": np.logspace(0, 1, 3),
              "empty_bucket": float("nan"), "per_set": {"chat": (np.float32(0.5), Path("/tmp/x"))},
              "scalar": np.array(2.0)}
    strict = to_jsonable(result)
    assert _clean(result) == strict
    assert strict["empty_bucket"] is None and strict["per_set"] == {"chat": [0.5, "/tmp/x"]}
    assert type(strict["alpha"]) is float and type(strict["n"]) is int and strict["ok"] is True
    assert strict["grid"] == [1.0, math.sqrt(10), 10.0] and strict["scalar"] == 2.0
    kept = plain(result)
    assert math.isnan(kept["empty_bucket"]) and {k: v for k, v in kept.items() if k != "empty_bucket"} == {
        k: v for k, v in strict.items() if k != "empty_bucket"}
    assert json.loads(dumps(result)) == strict
    assert '"empty_bucket": NaN' in dumps(result, nonfinite="keep")
    assert to_jsonable(result, nonfinite="string")["empty_bucket"] == "nan"


def test_the_fit_carries_the_length_distribution_of_its_cross_fitted_predictions(fitted, frame) -> None:
    """Fitted on each training row's prediction by a readout that never saw it, carried by the readout file."""
    from leap_core.cross_fit import DISTRIBUTION_BINS as LENGTH_DISTRIBUTION_BINS
    from leap_core.readout_format import from_bytes, to_bytes
    from training.fit import fit_length_distribution

    train, test, result = fitted
    keep = _usable(train)
    distribution = result.readout.length_distribution_
    expected = fit_length_distribution(train.features[keep], train.output_tokens[keep],
                                       alpha=result.params["alpha"], target="sqrt", max_tokens=MAX_TOKENS)
    assert distribution.n_ == keep.sum() and len(distribution.samples_) == LENGTH_DISTRIBUTION_BINS
    np.testing.assert_array_equal(distribution.edges_, expected.edges_)
    np.testing.assert_array_equal(np.concatenate(distribution.samples_), np.concatenate(expected.samples_))
    np.testing.assert_array_equal(np.sort(np.concatenate(distribution.samples_)),
                                  np.sort(train.output_tokens[keep].astype(float)))
    assert result.params["length_distribution"].startswith("fitted")
    loaded = from_bytes(to_bytes(result.readout)).length_distribution_
    np.testing.assert_allclose(loaded.index_, distribution.index_)
    # too few rows to cross-fit: the readout still fits, without a distribution, and says why
    few = fit_readout(frame.take(slice(0, 8)), test, alpha=30.0, **IDENTITY)
    assert few.readout.length_distribution_ is None
    assert few.params["length_distribution"].startswith("not fitted: ")


def test_a_fit_anchored_at_the_champion_equals_one_ridge_solve_on_both_windows(frame: TrainingFrame) -> None:
    """The champion's rows and a new window, one exact anchored solve: the RLS identity, through the flow's fit."""
    rest, test = time_split(frame, 0.2)
    old, new = time_split(rest, 0.5)  # the champion's training rows, then the window the fit sees
    champion = fit_readout(old, test, alpha=100.0, max_tokens=MAX_TOKENS, **IDENTITY)
    anchor = RLS.from_state_arrays(champion.readout, champion.rls_state)
    refined = fit_readout(new, test, alpha="auto", max_tokens=None, anchor=anchor, **IDENTITY)

    keep_old, keep_new = _usable(old), _usable(new)
    X = np.vstack([old.features[keep_old], new.features[keep_new]]).astype(np.float64)
    y = targets.transform(np.concatenate([old.output_tokens[keep_old], new.output_tokens[keep_new]]), "sqrt")
    U = np.column_stack([np.ones(X.shape[0]), champion.readout.standardize(X)])
    penalty = 100.0 * np.eye(U.shape[1])
    penalty[0, 0] = 0.0  # the intercept is not penalized
    theta = np.linalg.solve(U.T @ U + penalty, U.T @ y)
    np.testing.assert_allclose(refined.readout.theta_, theta, rtol=1e-8, atol=1e-10)
    assert refined.params["alpha"] == 100.0 and refined.params["alpha_selection"] == "anchor"
    assert refined.readout.max_tokens == MAX_TOKENS
    assert refined.readout.metadata["n_train"] == keep_old.sum() + keep_new.sum()
    # its RLS state resumes at the refined weights, anchored at both windows
    resumed = RLS.from_state_arrays(refined.readout, refined.rls_state)
    np.testing.assert_allclose(resumed.theta_, theta, rtol=1e-8, atol=1e-10)


def test_a_fit_key_is_the_one_earlier_fits_were_registered_under() -> None:
    """Settings enter the key only when set: the keys of fits registered before them stay the same."""
    from training.spec import FeatureSpace, FitSpec

    plain = FitSpec(FeatureSpace("m", "sha256:0123abcd", 9), "0f" * 16, "auto", "sqrt", 512, 0.2)
    assert plain.key == "6a6dfb24481e9a1c"
    chosen = FitSpec(FeatureSpace("m", "sha256:0123abcd", 9, "mean@9"), "0f" * 16, 30.0, "sqrt", 512, 0.2,
                     anchor="3", recipes=("last@9", "mean@9"), recipes_not_covered=("last@5",))
    assert chosen.key == "c83017a72b0da1a7"
    assert chosen.readout_version().endswith("-c83017a7")


def test_a_fit_spec_records_where_the_fit_came_from(frame: TrainingFrame, fitted) -> None:
    from training.spec import FeatureSpace, FitSpec, rows_until, window_hash

    train, _, fit = fitted
    space = FeatureSpace(IDENTITY["model_id"], BENCH_FINGERPRINT, BENCH_LAYER)
    spec = FitSpec.of(frame, space, alpha="auto", target="sqrt", max_tokens=MAX_TOKENS, test_fraction=0.2,
                      recipes=[space.recipe, f"last@{BENCH_LAYER + 40}"])
    assert spec.rows_hash == window_hash(frame) and spec.recipes == (space.recipe,)
    assert spec.recipes_not_covered == (f"last@{BENCH_LAYER + 40}",)
    anchored = FitSpec.of(frame, space, alpha="auto", target="sqrt", max_tokens=MAX_TOKENS, test_fraction=0.2,
                          anchor="2", recipes=[space.recipe])
    assert anchored.recipes == () and anchored.key != spec.key
    record = spec.record(fit, {"since": None, "until": 5.0})
    assert record.params["fit_key"] == spec.key and record.params["requested_until"] == 5.0
    assert record.params["recipe_choice"] == "validation" and record.params["anchor"] == "none"
    assert record.params["recipe_candidates_not_covered"] == f"last@{BENCH_LAYER + 40}"
    assert record.metrics["mae"] == fit.metrics["mae"] and record.validation is None
    assert anchored.record(fit).params["recipe_choice"] == "anchor"
    assert float(rows_until(train)) == pytest.approx(float(np.max(train.arrival_time)), abs=1e-3)
