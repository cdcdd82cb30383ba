"""The offline readout studies: target ablation (Table 6) and layer study (Table 7) on synthetic states."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import KFold

from evaluation import offline
from evaluation.target_heads import HEADS, SoftBinClassifier, make_head
from leap_core import metrics
from leap_core.readout import LinearReadout

MAX_TOKENS = 1024
N_TRAIN, N_TEST, NUM_LAYERS, DIM, SIGNAL_LAYER = 240, 80, 5, 16, 3


def _lengths(rng, features):
    """sqrt(length) linear in one direction of `features`, plus noise: lengths fill every bucket."""
    direction = rng.standard_normal(features.shape[1])
    direction /= np.linalg.norm(direction)
    root = 16.0 + 8.0 * features @ direction + 1.5 * rng.standard_normal(features.shape[0])
    return np.clip(np.round(root ** 2), 1, MAX_TOKENS)


@pytest.fixture(scope="module")
def layer_data():
    """(n, L, d) states where only layer 3 carries the length; the other layers are noise."""
    rng = np.random.default_rng(7)
    n = N_TRAIN + N_TEST
    scales = rng.uniform(0.1, 10.0, (1, NUM_LAYERS, DIM))
    F = (rng.standard_normal((n, NUM_LAYERS, DIM)) * scales).astype(np.float32)
    y = _lengths(rng, F[:, SIGNAL_LAYER] / F[:, SIGNAL_LAYER].std(0))
    return F[:N_TRAIN], y[:N_TRAIN], F[N_TRAIN:], y[N_TRAIN:]


@pytest.fixture(scope="module")
def layer_result(layer_data):
    return offline.run_layers(*layer_data, max_tokens=MAX_TOKENS, default_layer=1)


@pytest.fixture(scope="module")
def target_result(layer_data):
    F_train, y_train, F_test, y_test = layer_data
    return offline.run_targets(F_train[:, SIGNAL_LAYER], y_train, F_test[:, SIGNAL_LAYER], y_test, MAX_TOKENS,
                               heads=HEADS)


# ------------------------------------------------------------------ cross-validation


@pytest.mark.parametrize("dim", [8, 300], ids=["primal", "dual"])
@pytest.mark.parametrize("target", ["raw", "sqrt", "rank", "softbin"])
def test_cv_mae_equals_refitting_the_readout_per_fold(dim, target):
    """The one-eigendecomposition alpha path must be the LinearReadout, fold by fold (a fitted target's map
    fitted on the fold's own rows, as the readout fits it)."""
    rng = np.random.default_rng(dim)
    X = rng.standard_normal((100, dim)) * rng.uniform(0.1, 5.0, dim) + rng.uniform(-3, 3, dim)
    y = _lengths(rng, X[:, :4] / X[:, :4].std(0))
    alphas = [1.0, 100.0]
    expected = []
    for alpha in alphas:
        pred = np.empty_like(y)
        for fit_rows, held_rows in KFold(5, shuffle=True, random_state=0).split(X):
            readout = LinearReadout(alpha=alpha, target=target, max_tokens=MAX_TOKENS)
            pred[held_rows] = readout.fit(X[fit_rows], y[fit_rows]).predict(X[held_rows])
        expected.append(metrics.mae(y, pred))
    np.testing.assert_allclose(offline.cv_mae(X, y, target, MAX_TOKENS, alphas), expected, rtol=1e-8)


def test_cv_refuses_a_zero_alpha():
    with pytest.raises(ValueError, match="alpha > 0"):
        offline.cv_mae(np.ones((10, 2)), np.arange(1, 11), "sqrt", MAX_TOKENS, [0.0])


# ------------------------------------------------------------------ target ablation


def test_run_targets_reports_every_target_and_bucket(target_result):
    result = target_result
    assert (result["n_train"], result["n_test"], result["max_tokens"]) == (N_TRAIN, N_TEST, MAX_TOKENS)
    assert list(result["targets"]) == ["raw", "log", "sqrt", "rank", "softbin", "softbin_clipped"]
    for row in result["targets"].values():
        assert row["alpha"] in offline.ALPHAS
        assert set(row["mae_by_bucket"]) == {"short", "medium", "long", "all"}
        assert all(np.isfinite(value) for value in row["mae_by_bucket"].values()), "every bucket is populated"
        assert row["mae_by_bucket"]["all"] == pytest.approx(row["mae"])
        assert np.isfinite(row["mae"]) and row["spearman"] > 0.8 and row["kendall"] > 0.6
    maes = {name: row["mae"] for name, row in result["targets"].items()}
    assert result["best_overall"] == min(maes, key=maes.get)


def test_the_clipped_softbin_head_recovers_lengths_it_can_see_and_its_bin_weights_are_a_distribution():
    rng = np.random.default_rng(0)
    lengths = np.round(np.exp(rng.uniform(0, np.log(MAX_TOKENS), 600)))
    X = np.column_stack([np.log(lengths), rng.standard_normal((600, 3))])  # the log length is a feature
    head = SoftBinClassifier(alpha=1e-3, max_tokens=MAX_TOKENS).fit(X, lengths)
    weights = head.predict_proba(X)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)
    assert (weights >= 0).all() and len(head.centers_) == 16
    assert np.corrcoef(np.log(head.predict(X)), np.log(lengths))[0, 1] > 0.9
    assert clone(head).get_params() == head.get_params()
    with pytest.raises(ValueError, match="unknown head"):
        make_head("bins", 1.0, MAX_TOKENS)


def test_run_targets_with_a_fixed_alpha_uses_it(layer_data):
    F_train, y_train, F_test, y_test = layer_data
    result = offline.run_targets(F_train[:, 0], y_train, F_test[:, 0], y_test, MAX_TOKENS, alpha=3.0)
    assert result["alpha_grid"] is None
    assert {row["alpha"] for row in result["targets"].values()} == {3.0}


# ------------------------------------------------------------------ layer study


def test_run_layers_finds_the_layer_that_carries_the_length(layer_result):
    result = layer_result
    assert result["chosen_layer"] == SIGNAL_LAYER
    cv = [row["cv_mae"] for row in result["layers"]]
    test_mae = [row["mae"] for row in result["layers"]]
    assert int(np.argmin(cv)) == SIGNAL_LAYER and int(np.argmin(test_mae)) == SIGNAL_LAYER
    assert {key: result["chosen"][key] for key in ("mae", "spearman", "mae_ci", "spearman_ci")} == {
        key: result["layers"][SIGNAL_LAYER][key] for key in ("mae", "spearman", "mae_ci", "spearman_ci")}
    assert result["chosen"]["spearman"] > 0.8
    assert result["default"]["mae"] == test_mae[1]


def test_run_layers_shapes_and_all_layers_figures(layer_result):
    result = layer_result
    assert (result["n_train"], result["n_test"], result["num_layers"], result["dim"]) == (
        N_TRAIN, N_TEST, NUM_LAYERS, DIM)
    assert result["default_layer"] == 1
    assert [row["layer"] for row in result["layers"]] == list(range(NUM_LAYERS))
    assert all(set(row) == {"layer", "cv_mae", "mae", "spearman", "mae_ci", "spearman_ci"} for row in result["layers"])
    for row in result["layers"]:
        for key in ("mae", "spearman"):
            interval = row[f"{key}_ci"]
            assert interval["value"] == row[key] and interval["ci_low"] <= row[key] <= interval["ci_high"]
    assert result["chosen"]["per_set"]["pooled"]["n"] == N_TEST
    everything = result["all_layers"]
    assert np.isfinite(everything["mae"]) and np.isfinite(everything["spearman"])
    assert everything["alpha"] in offline.ALPHAS
    assert result["one_layer_kib_per_request"] == DIM * 4 / 1024
    assert everything["kib_per_request"] == NUM_LAYERS * DIM * 4 / 1024
    change = (everything["mae"] - result["default"]["mae"]) / result["default"]["mae"]
    assert result["all_vs_default_mae_change"] == pytest.approx(change)
    assert change < 0, "all layers include the informative one, so they beat the noise-only default layer"


def test_run_layers_refuses_bad_inputs(layer_data):
    F_train, y_train, F_test, y_test = layer_data
    with pytest.raises(ValueError, match="out of range"):
        offline.run_layers(F_train, y_train, F_test, y_test, MAX_TOKENS, default_layer=NUM_LAYERS)
    with pytest.raises(ValueError, match=r"\(n, L, d\)"):
        offline.run_layers(F_train[:, 0], y_train, F_test[:, 0], y_test, MAX_TOKENS, default_layer=0)


# ------------------------------------------------------------------ figures and markdown


@pytest.mark.parametrize("study", ["targets", "layers"])
def test_plots_write_a_png(study, target_result, layer_result, tmp_path):
    path = tmp_path / f"{study}.png"
    plot = getattr(offline, f"plot_{study}")
    plot({"targets": target_result, "layers": layer_result}[study], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_section_targets_has_table_image_command_and_goals(target_result):
    result = {**target_result, "command": "leap eval offline --study targets",
              "goals": {"sqrt_beats_raw": {"target": "sqrt MAE < raw MAE", "measured": 1.0, "met": True}}}
    text = offline.section_targets(result, "img/targets.png")
    assert text.startswith("## ")
    assert "| Target | alpha | MAE | MAE short | MAE medium | MAE long | Spearman | Kendall |" in text
    assert all(f"| {name}" in text or f"| **{name}**" in text for name in ("raw", "log", "sqrt"))
    assert "![Readout target ablation](img/targets.png)" in text
    assert "Regenerate: `leap eval offline --study targets`" in text
    assert "sqrt_beats_raw" in text and "met" in text


def test_section_layers_has_tables_image_and_command(layer_result):
    result = {**layer_result, "command": "leap eval offline --study layers"}
    text = offline.section_layers(result, "img/layers.png")
    assert text.startswith("## ")
    assert "| Layer | CV MAE (train) | Test MAE | Test Spearman |" in text
    assert "| Readout | Features sent (KiB/request) | Test MAE | Test Spearman |" in text
    assert f"| {SIGNAL_LAYER} (chosen) |" in text and "| 1 (default) |" in text
    assert "![Readout layer study](img/layers.png)" in text
    assert "Regenerate: `leap eval offline --study layers`" in text
    assert "Regenerate" not in offline.section_layers(layer_result, "img/layers.png")


# ------------------------------------------------------------------ intervals, sets and censoring


def test_run_targets_carries_intervals_per_set_and_the_censored_share(layer_data):
    F_train, y_train, F_test, y_test = layer_data
    sets = np.where(np.arange(N_TEST) % 2 == 0, "even", "odd")
    result = offline.run_targets(F_train[:, SIGNAL_LAYER], y_train, F_test[:, SIGNAL_LAYER], y_test, MAX_TOKENS,
                                 sets_test=sets, n_boot=400)
    assert result["censored_share"] == pytest.approx(np.mean(y_test >= MAX_TOKENS))
    assert result["bootstrap"]["n_boot"] == 400
    for row in result["targets"].values():
        assert row["mae_ci"]["ci_low"] < row["mae"] < row["mae_ci"]["ci_high"]
        assert row["spearman_ci"]["ci_low"] < row["spearman"] < row["spearman_ci"]["ci_high"] <= 1.0
        figures = row["per_set"]
        assert set(figures["per_set"]) == {"even", "odd"}
        assert sum(entry["n"] for entry in figures["per_set"].values()) == figures["pooled"]["n"] == N_TEST
        assert figures["pooled"]["spearman"]["value"] == pytest.approx(row["spearman"])
        within = figures["within_set_spearman"]
        assert within["sets"] == ["even", "odd"] and within["ci_low"] <= within["value"] <= within["ci_high"]
    text = offline.section_targets(result, "img/targets.png")
    assert "| even |" in text and "within-set mean" in text and "bootstrap interval" in text


def test_choose_alpha_is_the_shared_alpha_path(layer_data):
    """offline.choose_alpha and the fit flow's select_alpha are leap_core.alpha on their own split."""
    from leap_core import alpha as alpha_path
    from training.fit import ALPHA_GRID, select_alpha

    F_train, y_train, _, _ = layer_data
    X = F_train[:, SIGNAL_LAYER]
    assert offline.ALPHAS == ALPHA_GRID == alpha_path.ALPHAS
    shared = alpha_path.select_alpha(X, y_train, target="sqrt", max_tokens=MAX_TOKENS, cv=KFold(5, shuffle=True,
                                                                                               random_state=0))
    assert offline.choose_alpha(X, y_train, "sqrt", MAX_TOKENS) == shared.alpha
    newest = alpha_path.select_alpha(X, y_train, target="sqrt", max_tokens=MAX_TOKENS, scoring="mse_target",
                                     cv=alpha_path.newest_split(len(y_train), 0.2))
    assert select_alpha(X, y_train, max_tokens=MAX_TOKENS) == newest
