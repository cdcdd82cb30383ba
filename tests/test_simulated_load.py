"""The simulated load study (`evaluation.simulated_load`): its shape, its ratios and tail at every load, the
best baseline chosen on the stream rows, the study over several splits, and the engine capacity and step model
it reads from the saved fidelity study. The refresh and tail studies and the three studies' plots are in
test_simulated_refresh_tail.py."""

import json
from dataclasses import asdict

import numpy as np
import pytest

from evaluation.simulated_load import Split, run_load, run_load_over_splits
from evaluation.simulated_load_report import section_load
from evaluation.simulated_refresh import run_refresh
from evaluation.simulation import TAIL_FIGURES, _workloads
from leap_core.simulator import SimConfig, StepTimeModel, fcfs_capacity, poisson_arrivals, simulate
from study_harness.noise import noisy_predictions

STEP_MODEL = StepTimeModel()


def _pool(n: int = 400, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 800, n)
    out = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 1, 2000).astype(int)
    return prompt, out, noisy_predictions(out, 0.6, seed=seed + 1)



@pytest.fixture(scope="module")
def load_result():
    prompt, out, predicted = _pool()
    return run_load(prompt, out, {"noisy": predicted, "leap": np.sqrt(predicted * out)}, STEP_MODEL,
                    loads=(0.7, 0.9), headline=0.9, overloads=(1.5,), n_requests=400, seeds=6)


def test_run_load_returns_the_documented_shape_and_oracle_beats_fcfs(load_result):
    result = load_result
    json.dumps(result, allow_nan=False)
    capacity = result["capacity_rps"]
    assert capacity["value"] > 0 and result["n_requests"] == 400 and result["seeds"] == 6
    assert capacity["scale"] == 1.0 and capacity["ci_low"] is None and capacity["source"].startswith("simulator")
    assert list(result["table"]) == ["0.7", "0.9", "1.5"]
    assert result["overloads"] == [{"load": 1.5, "horizon_requests": 400,
                                    "horizon_s": pytest.approx(400 / (1.5 * capacity["value"]))}]
    for row in result["table"].values():
        assert set(row) == {"noisy", "leap", "leap-adaptive", "fcfs", "oracle", "stock"}
        for figures in row.values():
            assert set(figures) == {"mean_latency_s", "p95_latency_s", "mean_ptl", "p95_ptl", "mean_ptl_ci_low",
                                    "mean_ptl_ci_high", "long_p95_latency_s"}
            assert figures["mean_ptl_ci_low"] <= figures["mean_ptl"] <= figures["mean_ptl_ci_high"]
    assert result["table"]["1.5"]["oracle"]["mean_ptl"] <= result["table"]["1.5"]["fcfs"]["mean_ptl"]
    # the longest tenth of the pool pays the tail: its P95 is above everyone's
    assert result["long_requests"]["quantile"] == 0.9
    for policy in ("fcfs", "oracle"):
        head = result["table"]["0.9"][policy]
        assert head["long_p95_latency_s"] > head["p95_latency_s"]
    sweep = result["sweep"]
    assert sweep["multipliers"] == [0.7, 0.9, 1.5]
    for key in ("mean_ptl", "mean_latency_s"):
        assert all(len(values) == 3 for values in sweep[key].values())
        assert sweep[key]["fcfs"][0] < sweep[key]["fcfs"][-1]  # more load, more latency
    # the ratios are paired by seed: the value is the ratio of the seed means, inside its interval
    assert result["best_baseline"] == "noisy"
    for key in ("leap_over_fcfs", "leap_over_best_baseline", "leap_over_oracle"):
        r = result["ratios"][key]
        assert r["ci_low"] <= r["value"] <= r["ci_high"]
    head = result["table"]["0.9"]
    assert result["ratios"]["leap_over_fcfs"]["value"] == pytest.approx(head["leap"]["mean_ptl"]
                                                                        / head["fcfs"]["mean_ptl"])
    assert result["ratios"]["leap_over_oracle"]["value"] >= 1.0 - 1e-9  # nothing orders better than the truth
    assert set(result["goals"]) == {"leap_over_fcfs", "leap_over_best_baseline", "leap_over_oracle"}
    assert result["best_baseline_chosen_on"] == "test"  # no validation choice given: it says so


def test_run_load_reports_the_ratios_at_every_load(load_result):
    result = load_result
    by_load = result["ratios_by_load"]
    assert list(by_load) == ["0.7", "0.9", "1.5"]
    assert by_load["0.9"] == result["ratios"]  # the headline ratios are the 0.9 entry
    for load, ratios in by_load.items():
        assert list(ratios)[:2] == ["leap_over_stock", "leap_adaptive_over_stock"]  # stock vLLM's first
        assert set(ratios) == {"leap_over_stock", "leap_adaptive_over_stock", "leap_over_stock_latency",
                               "leap_adaptive_over_stock_latency", "leap_over_fcfs", "leap_over_best_baseline",
                               "leap_over_oracle", "leap_adaptive_over_leap"}
        row = result["table"][load]
        for key, arm, other, figure in (("leap_over_fcfs", "leap", "fcfs", "mean_ptl"),
                                        ("leap_over_best_baseline", "leap", "noisy", "mean_ptl"),
                                        ("leap_over_oracle", "leap", "oracle", "mean_ptl"),
                                        ("leap_over_stock", "leap", "stock", "mean_ptl"),
                                        ("leap_adaptive_over_stock", "leap-adaptive", "stock", "mean_ptl"),
                                        ("leap_over_stock_latency", "leap", "stock", "mean_latency_s"),
                                        ("leap_adaptive_over_stock_latency", "leap-adaptive", "stock",
                                         "mean_latency_s"),
                                        ("leap_adaptive_over_leap", "leap-adaptive", "leap", "mean_ptl")):
            r = ratios[key]
            assert r["value"] == pytest.approx(row[arm][figure] / row[other][figure]), key
            assert r["ci_low"] <= r["value"] <= r["ci_high"]
    assert by_load["0.7"]["leap_over_fcfs"]["value"] != by_load["1.5"]["leap_over_fcfs"]["value"]


def test_run_load_reports_each_policys_tail_at_every_load(load_result):
    result = load_result
    tail = result["tail"]
    assert set(tail) == {"noisy", "leap", "leap-adaptive", "fcfs", "oracle", "stock"}
    figures = set(TAIL_FIGURES)
    for by_load in tail.values():
        assert list(by_load) == ["0.7", "0.9", "1.5"]
        for row in by_load.values():
            assert set(row) == figures | {f"{f}_ci" for f in figures}
            for name in figures:
                low, high = row[f"{name}_ci"]
                assert low <= row[name] <= high
            assert row["p50_latency_s"] <= row["p95_latency_s"] <= row["p99_latency_s"]
            assert row["p50_ptl"] <= row["p95_ptl"] <= row["p99_ptl"]
            assert row["long_p95_latency_s"] <= row["long_p99_latency_s"]
            assert row["max_wait_s"] >= 0
    # the same seeds as the table: its P95 figures are the tail block's
    for policy in tail:
        for load in ("0.7", "0.9", "1.5"):
            for name in ("p95_latency_s", "p95_ptl", "long_p95_latency_s"):
                assert tail[policy][load][name] == pytest.approx(result["table"][load][policy][name])
    # over capacity requests queue for admission: the longest wait grows with the load
    assert tail["fcfs"]["1.5"]["max_wait_s"] > tail["fcfs"]["0.7"]["max_wait_s"]


def test_the_tail_figures_are_those_of_the_replays_averaged_over_seeds():
    """Recomputed from the simulator itself for each seed's workload: P99 latency and PTL, the longest wait
    for admission and the long requests' P99."""
    prompt, out, predicted = _pool(n=200)
    result = run_load(prompt, out, {"noisy": predicted}, STEP_MODEL, loads=(0.9,), overloads=(), n_requests=150,
                      seeds=2, decode_slots=4)
    capacity, threshold = result["capacity_rps"]["value"], result["long_requests"]["min_tokens"]
    expected = {"p99_latency_s": [], "p99_ptl": [], "max_wait_s": [], "long_p99_latency_s": []}
    for idx, arrival_seed in _workloads(out.size, 150, 2, 0):
        arrival = poisson_arrivals(150, 0.9 * capacity, seed=arrival_seed)
        run = simulate(arrival, prompt[idx], out[idx], predicted[idx], SimConfig(step_model=STEP_MODEL,
                                                                                   decode_slots=4))
        expected["p99_latency_s"].append(np.percentile(run.finish - arrival, 99))
        expected["p99_ptl"].append(np.percentile((run.finish - arrival) / out[idx], 99))
        expected["max_wait_s"].append(np.max(run.first_token - arrival))
        expected["long_p99_latency_s"].append(np.percentile((run.finish - arrival)[out[idx] >= threshold], 99))
    row = result["tail"]["noisy"]["0.9"]
    for name, values in expected.items():
        assert row[name] == pytest.approx(np.mean(values)), name


def test_run_load_compares_leap_with_the_baseline_it_is_given():
    """A baseline chosen beforehand stays LEAP's opponent even when another one is better on the test seeds."""
    prompt, out, predicted = _pool(n=200)
    worse = noisy_predictions(out, 0.1, seed=9)
    result = run_load(prompt, out, {"good": predicted, "worse": worse, "leap": np.sqrt(predicted * out)}, STEP_MODEL,
                      loads=(0.9,), overloads=(), n_requests=200, seeds=3, decode_slots=4, best_baseline="worse")
    head = result["table"]["0.9"]
    assert head["good"]["mean_ptl"] < head["worse"]["mean_ptl"]  # on test the other one wins
    assert result["best_baseline"] == "worse" and result["best_baseline_chosen_on"] == "validation"
    assert result["ratios"]["leap_over_best_baseline"]["value"] == pytest.approx(head["leap"]["mean_ptl"]
                                                                                 / head["worse"]["mean_ptl"])
    with pytest.raises(ValueError, match="best_baseline 'leap'"):
        run_load(prompt, out, {"good": predicted, "leap": predicted}, STEP_MODEL, n_requests=10, seeds=1,
                 best_baseline="leap")



def _two_splits():
    """Two splits of one pool whose LEAP differs: exact on the first, noisy on the second; the baseline each
    split's validation chose differs too."""
    prompt, out, predicted = _pool(n=200)
    worse = noisy_predictions(out, 0.1, seed=9)
    first = Split(prompt, out, {"good": predicted, "worse": worse, "leap": out.astype(float)}, "good")
    second = Split(prompt, out, {"good": predicted, "worse": worse, "leap": worse}, "worse")
    return first, second


def test_the_load_study_over_splits_pairs_each_split_with_its_own_seeds_and_baseline():
    """Each split replays its own seeds (seed + split) against the baseline its validation chose: the table and
    the ratios are those of the splits run one by one, pooled."""
    first, second = _two_splits()
    options = dict(loads=(0.9,), overloads=(), n_requests=150, seeds=3, decode_slots=4)
    both = run_load_over_splits([first, second], STEP_MODEL, **options)
    json.dumps(both, allow_nan=False)
    alone = [run_load(split.prompt_tokens, split.lengths, split.predictions, STEP_MODEL,
                      best_baseline=split.best_baseline, seed=k, **options) for k, split in enumerate((first, second))]
    assert both["splits"] == 2 and both["interval_over"] == ["splits", "seeds"] and both["seeds"] == 3
    assert both["best_baseline_by_split"] == ["good", "worse"] and both["best_baseline"] == "good"
    assert both["best_baseline_chosen_on"] == "validation"
    assert [row["best_baseline"] for row in both["by_split"]] == ["good", "worse"]
    head = [result["table"]["0.9"] for result in alone]
    for policy in ("leap", "fcfs", "oracle", "good"):
        assert both["table"]["0.9"][policy]["mean_ptl"] == pytest.approx(
            np.mean([h[policy]["mean_ptl"] for h in head]))
    leap = sum(h["leap"]["mean_ptl"] for h in head)
    assert both["ratios"]["leap_over_best_baseline"]["value"] == pytest.approx(
        leap / (head[0]["good"]["mean_ptl"] + head[1]["worse"]["mean_ptl"]))
    assert both["ratios"]["leap_over_fcfs"]["value"] == pytest.approx(leap / sum(h["fcfs"]["mean_ptl"] for h in head))
    # one split is run_load itself, figure for figure
    assert run_load_over_splits([first], STEP_MODEL, **options) == alone[0]
    assert alone[0]["splits"] == 1 and alone[0]["interval_over"] == ["seeds"]
    text = section_load(both, "x.png")
    assert "refits every predictor) x 3 paired seeds each" in text and "over splits, then seeds within each" in text
    chosen = [{"best_baseline": "good"}, {"best_baseline": "worse"}]
    assert "Each of the 2 splits chose on its own stream rows: good on 1, worse on 1" in section_load(
        {**both, "validation_by_split": chosen}, "x.png")


def test_the_interval_over_splits_spans_what_the_splits_disagree_on():
    """LEAP exact on one split and noisy on the other: the interval over splits and seeds holds both splits'
    own ratios and is wider than either split's interval over its seeds alone."""
    first, second = _two_splits()
    options = dict(loads=(0.9,), overloads=(), n_requests=150, seeds=4, decode_slots=4)
    both = run_load_over_splits([first, second], STEP_MODEL, **options)["ratios"]["leap_over_fcfs"]
    alone = [run_load(split.prompt_tokens, split.lengths, split.predictions, STEP_MODEL, seed=k,
                      **options)["ratios"]["leap_over_fcfs"] for k, split in enumerate((first, second))]
    assert alone[0]["ci_high"] < alone[1]["ci_low"]  # the splits disagree beyond their seeds' noise
    assert both["ci_low"] <= alone[0]["value"] and both["ci_high"] >= alone[1]["value"]
    assert both["ci_high"] - both["ci_low"] > max(r["ci_high"] - r["ci_low"] for r in alone)
    with pytest.raises(ValueError, match="same predictors"):
        run_load_over_splits([first, Split(first.prompt_tokens, first.lengths, {"leap": first.lengths})], STEP_MODEL,
                             **options)

class _HonestOn:
    """A fitted baseline stand-in: the true lengths on the rows of `ids`, their reverse order elsewhere."""

    input = "text"

    def __init__(self, ids, name: str):
        self.ids, self.name = set(ids), name
        self.best_params_, self.val_spearman_ = {"honest_on": name}, 0.5

    def get_params(self, deep: bool = False) -> dict:
        return {"honest_on": self.name}

    def predict(self, data) -> np.ndarray:
        honest = np.isin(data.ids, list(self.ids))
        return np.where(honest, data.lengths, data.max_tokens + 1 - data.lengths).astype(np.float64)


def test_the_load_study_chooses_its_best_baseline_on_the_stream_rows_not_the_test_pool():
    """One baseline exact on the feedback-stream rows and reversed on the evaluation rows, the other the
    opposite: the study's choice follows the stream rows (validation) although the other wins on test."""
    from evaluation.baselines import LengthData
    from evaluation.data import split_stream
    from evaluation.studies import validated_baseline
    from evaluation.transfer import domain_predictions

    n, counts = 240, (120,)
    prompt, out, _ = _pool(n=n, seed=4)
    out = np.minimum(out, 1024)
    target = LengthData(ids=np.array([f"r{i}" for i in range(n)], dtype=object), texts=["x"] * n,
                        prompt_tokens=prompt, features=np.random.default_rng(0).normal(size=(n, 6)).astype(np.float32),
                        lengths=out, max_tokens=1024)
    stream_rows, eval_rows = split_stream(n, counts, seed=0)
    fitted = {"stream_honest": _HonestOn(target.ids[stream_rows], "stream"),
              "test_honest": _HonestOn(target.ids[eval_rows], "evaluation")}
    options = dict(loads=(0.9,), overloads=(), n_requests=200, seeds=3, decode_slots=4)
    validation = validated_baseline(target, fitted, counts, STEP_MODEL, **options)
    json.dumps(validation, allow_nan=False)
    assert validation["best_baseline"] == "stream_honest" and validation["n_validation"] == len(stream_rows)
    chosen = validation["baseline_validation"]
    assert chosen["stream_honest"]["spearman"] == pytest.approx(1.0)
    assert chosen["test_honest"]["spearman"] == pytest.approx(-1.0)
    assert chosen["stream_honest"]["mean_ptl"] < validation["validation"]["fcfs"]["mean_ptl"] < \
        chosen["test_honest"]["mean_ptl"]
    for figures in chosen.values():
        assert figures["mean_ptl_ci_low"] <= figures["mean_ptl"] <= figures["mean_ptl_ci_high"]
    assert chosen["stream_honest"]["hyperparameters"] == {"params": {"honest_on": "stream"},
                                                          "chosen": {"honest_on": "stream"}, "val_spearman": 0.5}
    assert validation["validation"]["seeds"] == 8 and validation["validation"]["n_requests"] == 200

    evaluation, predictions = domain_predictions(synthetic_train(), target, fitted, counts=counts)
    # Another pool (the untouched slice's role) is predicted by the same predictors: the stream still feeds RLS.
    other, on_other = domain_predictions(synthetic_train(), target, fitted, counts=counts,
                                         pool=target.subset(eval_rows[:50]))
    assert list(other.ids) == list(evaluation.ids[:50])
    for name, values in predictions.items():
        np.testing.assert_allclose(on_other[name], values[:50])
    result = run_load(evaluation.prompt_tokens, evaluation.lengths, predictions, STEP_MODEL,
                      best_baseline=validation["best_baseline"], **options)
    head = result["table"]["0.9"]
    assert head["test_honest"]["mean_ptl"] < head["stream_honest"]["mean_ptl"]  # test would have chosen the other
    assert result["best_baseline"] == "stream_honest" and result["best_baseline_chosen_on"] == "validation"
    assert result["ratios"]["leap_over_best_baseline"]["value"] == pytest.approx(
        head["leap"]["mean_ptl"] / head["stream_honest"]["mean_ptl"])
    text = section_load({**result, **validation}, "x.png")
    assert "chosen on validation rows" in text and "| stream_honest |" in text
    final = section_load({**result, **validation, "untouched": {"set": "s", "n": 150, "rows": "rows nobody chose on"}},
                         "x.png")
    assert final.startswith("## The final table: simulated scheduling on the untouched test slice\n")
    assert f"untouched test slice ({result['n_pool']} rows: rows nobody chose on)" in final
    # a final table fitted on another training window than the chat one says which in its title
    wider = section_load({**result, **validation, "untouched": {"set": "s", "n": 150, "rows": "r"},
                          "train": "sharegpt:4800,arena_hard:100", "n_train": 4812}, "x.png")
    assert wider.startswith("## The final table: simulated scheduling on the untouched test slice, trained on "
                            "sharegpt:4800,arena_hard:100 (4812 rows)\n")


def synthetic_train(n: int = 80):
    """Training rows for LEAP's readout in the study test (features unrelated to the target's)."""
    from evaluation.baselines import LengthData

    rng = np.random.default_rng(1)
    return LengthData(ids=np.array([f"t{i}" for i in range(n)], dtype=object), texts=["x"] * n,
                      prompt_tokens=rng.integers(20, 200, n), features=rng.normal(size=(n, 6)).astype(np.float32),
                      lengths=rng.integers(1, 500, n), max_tokens=1024)


def test_hyperparameters_record_the_mlps_own_search():
    from evaluation.baseline_fits import hyperparameters
    from evaluation.baselines import HiddenStateMLP

    train = synthetic_train(120)
    mlp = HiddenStateMLP(hidden=(8,), alphas=(1.0, 10.0), learning_rates=(1e-3,), max_iter=20).fit(train)
    found = hyperparameters(mlp)
    assert found["params"]["alphas"] == (1.0, 10.0) and "num_threads" not in found["params"]
    assert found["chosen"]["alpha"] in (1.0, 10.0) and found["chosen"]["learning_rate"] == 1e-3
    assert found["val_spearman"] == max(t["val_spearman"] for t in mlp.trials_)


def test_loads_are_fractions_of_the_engine_measured_capacity():
    """An engine that sustains half of what the step model says: the simulator runs on the engine's time
    base (every step twice as long), so each load is the same fraction of a halved capacity, the ratios
    between policies do not move and every latency doubles; the capacity carries the engine's interval."""
    from evaluation.simulation import EngineCapacity

    prompt, out, predicted = _pool(n=200)
    engine = EngineCapacity(scale=0.5, ci_low=0.45, ci_high=0.55, source="engine")
    run = dict(loads=(0.9,), headline=0.9, overloads=(), n_requests=150, seeds=2)
    halved = run_load(prompt, out, {"noisy": predicted, "leap": predicted}, STEP_MODEL, engine=engine, **run)
    plain = run_load(prompt, out, {"noisy": predicted, "leap": predicted}, STEP_MODEL, **run)
    simulated = plain["capacity_rps"]["value"]
    assert halved["capacity_rps"] == pytest.approx({"value": 0.5 * simulated, "ci_low": 0.45 * simulated,
                                                     "ci_high": 0.55 * simulated, "scale": 0.5, "source": "engine"})
    for policy in ("fcfs", "noisy", "oracle"):
        assert halved["table"]["0.9"][policy]["mean_latency_s"] == pytest.approx(
            2 * plain["table"]["0.9"][policy]["mean_latency_s"])
    assert halved["ratios"]["leap_over_fcfs"] == pytest.approx(plain["ratios"]["leap_over_fcfs"])
    assert EngineCapacity(scale=0.5).rescale(STEP_MODEL).per_decode_s == pytest.approx(2 * STEP_MODEL.per_decode_s)


def test_the_load_study_reads_the_engine_capacity_of_the_saved_fidelity_study(tmp_path):
    """The engine's steady rate over this step model's on each saved saturated run, averaged with a t interval."""
    from scipy import stats

    from evaluation.fidelity import simulated_steady_rate
    from evaluation.studies import engine_capacity

    config = SimConfig(step_model=STEP_MODEL, decode_slots=8, max_resident=512)
    rng = np.random.default_rng(3)
    runs = []
    for factor in (0.7, 0.8, 0.9):
        prompt, out = rng.integers(20, 300, 24).tolist(), rng.integers(5, 500, 24).tolist()
        runs.append({"rps": factor * simulated_steady_rate(prompt, out, config), "prompt_tokens": prompt,
                     "output_tokens": out})
    saved = {"quick": False, "commit": "abc", "settings": {"decode_slots": 8, "max_resident": 512},
             "capacity": {"runs": runs}}
    path = tmp_path / "fidelity.json"
    path.write_text(json.dumps(saved))
    engine = engine_capacity(STEP_MODEL, path, decode_slots=8, max_resident=512)
    half = stats.t.ppf(0.975, 2) * 0.1 / np.sqrt(3)
    assert (engine.scale, engine.ci_low, engine.ci_high) == pytest.approx((0.8, 0.8 - half, 0.8 + half))
    assert "measured on the engine" in engine.source
    assert engine_capacity(STEP_MODEL, path, decode_slots=16, max_resident=512).scale == 1.0  # another K
    path.write_text(json.dumps({**saved, "quick": True}))  # shrunk lengths: not the studies' regime
    assert engine_capacity(STEP_MODEL, path, decode_slots=8, max_resident=512).scale == 1.0
    assert engine_capacity(STEP_MODEL, tmp_path / "missing.json").scale == 1.0


def test_the_simulations_price_steps_with_the_saved_fidelity_studys_model(tmp_path, monkeypatch):
    """The full fidelity study's model at its K and R; a quick one (shrunk lengths) or another shape is not
    used: the engine calibrates one then (stood in for here: no engine in this test), and the source says so."""
    import evaluation.live
    from evaluation.studies import step_model_from

    fitted = StepTimeModel(base_s=0.016, per_decode_s=0.0006, per_prefill_token_s=0.0008, per_context_token_s=1.7e-6)
    saved = {"study": "fidelity", "quick": False, "commit": "0123456789abcdef", "step_model": asdict(fitted),
             "step_model_fit": {"steps": 6000}, "request_error_wall": {"median": 0.061},
             "settings": {"decode_slots": 8, "max_resident": 512}}
    path = tmp_path / "fidelity.json"
    path.write_text(json.dumps(saved))
    model, source = step_model_from(path, 1024, None, print)
    assert model == fitted and "0123456789ab" in source and "6.1%" in source
    calibrated = StepTimeModel(base_s=0.03)
    monkeypatch.setattr(evaluation.live, "calibrated_step_model", lambda *args: (calibrated, {}))
    assert step_model_from(path, 1024, None, print, decode_slots=16)[0] == calibrated
    path.write_text(json.dumps({**saved, "quick": True}))
    model, source = step_model_from(path, 1024, None, print)
    assert model == calibrated and "not checked against the wall clock" in source
    assert step_model_from(tmp_path / "missing.json", 1024, None, print)[0] == calibrated


def test_bursty_arrivals_keep_a_trace_windows_shape_at_the_loads_mean_rate():
    from evaluation.simulation import bursty_arrivals

    gaps = np.array([0.1, 0.1, 5.0, 0.1, 0.1, 0.1, 3.0, 0.2] * 50)
    arrival = bursty_arrivals(gaps, 100, rate=4.0, seed=3)
    assert arrival.size == 100 and np.all(np.diff(arrival) >= 0)
    assert np.mean(np.diff(np.concatenate([[0.0], arrival]))) == pytest.approx(0.25)  # mean rate 4/s
    relative = np.diff(np.concatenate([[0.0], arrival])) / 0.25
    window_start = next(k for k in range(gaps.size - 99)
                        if np.allclose(gaps[k:k + 100] / gaps[k:k + 100].mean(), relative))
    assert window_start >= 0  # the gaps are a window of the trace's, in order, rescaled
    assert np.array_equal(arrival, bursty_arrivals(gaps, 100, rate=4.0, seed=3))
    with pytest.raises(ValueError, match="trace gaps"):
        bursty_arrivals(gaps[:10], 100, rate=4.0)


def test_run_load_with_trace_gaps_says_so_and_keeps_every_request():
    prompt, out, predicted = _pool(n=200)
    gaps = np.random.default_rng(0).exponential(1.0, 5000) * np.repeat([0.2, 3.0], 2500)  # a busy then a quiet hour
    result = run_load(prompt, out, {"noisy": predicted}, STEP_MODEL, loads=(0.9,), overloads=(), n_requests=150,
                      seeds=2, gaps=gaps)
    assert result["arrivals"].startswith("bursty")
    assert set(result["tail"]) == {"noisy", "fcfs", "oracle", "stock"} and "leap_over_fcfs" not in result["ratios"]
    assert "leap_over_stock" not in result["ratios"]  # no LEAP, no adaptive arm


def test_the_committed_trace_gaps_are_validated(tmp_path):
    from harness.datasets import trace_gaps

    gaps = trace_gaps()
    assert gaps.size > 10_000 and (gaps >= 0).all() and gaps.mean() > 0
    bad = tmp_path / "gaps.npy"
    np.save(bad, np.array([0.1, -1.0, 0.2]))
    with pytest.raises(ValueError, match="inter-arrival gaps"):
        trace_gaps(bad)
    np.save(bad, np.array([0.1, np.nan, 0.2]))
    with pytest.raises(ValueError, match="inter-arrival gaps"):
        trace_gaps(bad)


def test_sustained_capacity_excludes_the_drain_tail():
    """Steady-state throughput is above what one pool released at once reaches over its whole makespan."""
    from leap_core.simulator import SimConfig, simulate

    prompt, out, _ = _pool()
    config = SimConfig(step_model=STEP_MODEL, decode_slots=16, max_resident=64, policy="fcfs")
    sustained = fcfs_capacity(prompt, out, config)
    makespan = simulate(np.zeros(out.size), prompt, out, out, config).finish.max()
    assert sustained > out.size / makespan
    # at 0.9 of it every request finishes
    short = simulate(poisson_arrivals(out.size, 0.9 * sustained, seed=1), prompt, out, out, config)
    assert np.isfinite(short.latency).all()


def test_studies_reject_clashing_names_and_missing_costs():
    prompt, out, predicted = _pool(n=50)
    with pytest.raises(ValueError, match="oracle"):
        run_load(prompt, out, {"oracle": predicted}, STEP_MODEL, n_requests=10, seeds=1)
    with pytest.raises(ValueError, match="refreshed must be"):
        run_refresh(prompt, out, predicted, np.ones((3, 1)), (16,), STEP_MODEL, 0.0, n_requests=10, seeds=1)
    with pytest.raises(ValueError, match="policy"):
        run_load(prompt, out, {"noisy": predicted}, STEP_MODEL, n_requests=10, seeds=1, policy="fcfs")


def test_the_tail_intervals_over_splits_span_what_the_splits_disagree_on():
    """The tail block's intervals resample the splits, then the seeds, as the table's mean PTL does: LEAP
    exact on one split and noisy on the other, its P95 PTL interval holds both splits' own figures (an
    interval over the 8 workloads pooled, as the block had before, ended above the exact split's)."""
    first, second = _two_splits()
    options = dict(loads=(0.9,), overloads=(), n_requests=150, seeds=4, decode_slots=4)
    both = run_load_over_splits([first, second], STEP_MODEL, **options)["tail"]["leap"]["0.9"]
    alone = [run_load(split.prompt_tokens, split.lengths, split.predictions, STEP_MODEL, seed=k,
                      **options)["tail"]["leap"]["0.9"] for k, split in enumerate((first, second))]
    low, high = sorted(row["p95_ptl"] for row in alone)
    assert both["p95_ptl_ci"][0] <= low and both["p95_ptl_ci"][1] >= high
