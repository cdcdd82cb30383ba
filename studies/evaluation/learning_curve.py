"""The learning curve: held-out ShareGPT Spearman of the serving readout against its number of training rows.

The test rows are the chat test slice every held-out ShareGPT figure uses (CHAT_TEST without CHAT_TRAIN's
prompts); the training pool is every other ShareGPT row of the corpus (the untouched slice is never
selected by the name "sharegpt"). At each size the readout is fitted as the fit flow fits it (ridge alpha
by 5-fold CV on the training rows, `evaluation.offline.choose_alpha`) on `draws` seeded subsamples of the
pool (the whole pool once, at the pool's size), for the sqrt and the log target.

Intervals carry both sources of variance: each bootstrap replicate resamples the test prompts and, at
every size, picks one of the draws at random, so a size's interval spreads over the test prompts and over
which training rows were drawn. Every size shares a replicate's test resample, which pairs the sizes: the
slope per doubling of the training rows (least squares of Spearman on log2 rows over the sizes from
`SLOPE_FROM`) is computed per replicate, and so is its interval. `rows_for_goal` extends that straight
line to the Spearman goal: an extrapolation, printed as such.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from evaluation.offline import choose_alpha, readout_predictions
from leap_core.intervals import percentile_interval, resample_rows
from leap_core.metrics import spearman_batch

SIZES = (250, 500, 1000, 1500, 2000, 3000, 4000, 6000, 8000)  # those below the pool's size, then the pool
DRAWS = 5
TARGETS = ("sqrt", "log")
SLOPE_FROM = 1000  # the slope is fitted over sizes from here up (below it the curve bends)
N_BOOT = 2000
LEVEL = 0.95


def curve_sizes(pool: int, sizes: Sequence[int] = SIZES) -> list[int]:
    """The sizes below the pool's, then the pool's own."""
    return [s for s in sizes if s < pool] + [pool]


def subsamples(pool: int, size: int, draws: int, seed: int = 0) -> list[np.ndarray]:
    """`draws` seeded subsamples of `size` rows of a pool of `pool` (one, the whole pool, at its size)."""
    if size >= pool:
        return [np.arange(pool)]
    return [np.sort(np.random.default_rng([seed, size, d]).choice(pool, size, replace=False))
            for d in range(draws)]


def fit_predict(X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, target: str,
                max_tokens: int) -> tuple[np.ndarray, float]:
    """The readout fitted as the fit flow fits it (alpha by CV on these rows); its test predictions and alpha."""
    alpha = choose_alpha(X_train, y_train, target, max_tokens)
    return readout_predictions(X_train, y_train, X_test, alpha, target, max_tokens), float(alpha)


def curve_figures(y_test: np.ndarray, predictions: dict[int, np.ndarray], n_boot: int = N_BOOT, seed: int = 0,
                  slope_from: int = SLOPE_FROM, goal: float | None = None) -> dict:
    """Figures of one target's curve. `predictions[size]` is (draws, n_test): each draw's test predictions.

    Per size: the mean Spearman over draws, its interval (replicates resample the test rows and pick a
    draw), and the spread between draws. Over sizes: the slope per doubling and, with `goal`, the rows a
    straight line in log2(rows) reaches it at, each with the replicates' interval."""
    y_test = np.asarray(y_test, dtype=np.float64)
    n = y_test.size
    sizes = sorted(predictions)
    rng = np.random.default_rng(seed)
    rows = resample_rows(n, n_boot, rng)
    true = y_test[rows]
    points, replicate_curves = [], []
    for size in sizes:
        preds = np.asarray(predictions[size], dtype=np.float64).reshape(-1, n)
        per_draw = spearman_batch(np.broadcast_to(y_test, preds.shape), preds)
        picked = rng.integers(0, preds.shape[0], size=n_boot)
        replicates = spearman_batch(true, preds[picked[:, None], rows])
        replicate_curves.append(replicates)
        points.append({"rows": int(size), "draws": int(preds.shape[0]),
                       "spearman": percentile_interval(float(np.mean(per_draw)), replicates, LEVEL),
                       "draw_spread": [float(per_draw.min()), float(per_draw.max())]})
    result: dict = {"n_test": int(n), "points": points}
    fitted = [i for i, s in enumerate(sizes) if s >= slope_from]
    if len(fitted) >= 2:
        x = np.log2(np.asarray(sizes, dtype=np.float64)[fitted])
        x_centered = x - x.mean()
        curves = np.stack(replicate_curves)[fitted]  # (sizes, n_boot)
        values = np.array([points[i]["spearman"]["value"] for i in fitted])

        def slope(y: np.ndarray) -> np.ndarray:
            return (x_centered @ (y - y.mean(axis=0))) / (x_centered @ x_centered)

        value, replicates = float(slope(values[:, None])[0]), slope(curves)
        result["slope_per_doubling"] = {**percentile_interval(value, replicates, LEVEL),
                                        "over_rows": [int(sizes[i]) for i in fitted]}
        if goal is not None:
            last = sizes[fitted[-1]]

            def reach(at: np.ndarray, per_doubling: np.ndarray) -> np.ndarray:
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    rows_needed = last * np.exp2((goal - at) / per_doubling)
                return np.where(per_doubling > 0, np.maximum(rows_needed, last), np.inf)

            point = float(reach(np.array(values[-1]), np.array(value)))
            spread = reach(curves[-1], replicates)
            tail = (1.0 - LEVEL) / 2.0
            # inf where a replicate's slope is <= 0: order statistics, no interpolation between infinities
            low, high = np.quantile(spread, [tail, 1.0 - tail], method="inverted_cdf")
            result["rows_for_goal"] = {"goal": float(goal), "value": point, "ci_low": float(low),
                                       "ci_high": float(high), "extrapolated_from": int(last)}
    return result


def learning_curve(X_pool: np.ndarray, y_pool: np.ndarray, X_test: np.ndarray, y_test: np.ndarray,
                   max_tokens: int, sizes: Sequence[int] = SIZES, draws: int = DRAWS,
                   targets: Sequence[str] = TARGETS, n_boot: int = N_BOOT, seed: int = 0,
                   goal: float | None = None, say: Callable[[str], None] = lambda message: None) -> dict:
    """The curve for each target on these rows (no I/O): see the module docstring."""
    X_pool, X_test = np.asarray(X_pool), np.asarray(X_test)
    y_pool = np.asarray(y_pool, dtype=np.float64).reshape(-1)
    y_test = np.asarray(y_test, dtype=np.float64).reshape(-1)
    if X_pool.shape[0] != y_pool.size or X_test.shape[0] != y_test.size:
        raise ValueError("features and lengths must have one row per request")
    chosen = curve_sizes(len(y_pool), sizes)
    per_target = {}
    for target in targets:
        predictions, alphas = {}, {}
        for size in chosen:
            say(f"learning curve: {target} target, {size} training rows")
            fits = [fit_predict(X_pool[idx], y_pool[idx], X_test, target, max_tokens)
                    for idx in subsamples(len(y_pool), size, draws, seed)]
            predictions[size] = np.stack([pred for pred, _ in fits])
            alphas[size] = [alpha for _, alpha in fits]
        figures = curve_figures(y_test, predictions, n_boot=n_boot, seed=seed, goal=goal)
        for point in figures["points"]:
            point["alphas"] = alphas[point["rows"]]
        per_target[target] = figures
    return {"n_pool": int(y_pool.size), "n_test": int(y_test.size), "max_tokens": int(max_tokens),
            "sizes": chosen, "draws": int(draws), "n_boot": int(n_boot), "level": LEVEL, "seed": int(seed),
            "targets": per_target}


def pool_size_default() -> int:
    """The ShareGPT prompts the committed snapshot stores (its `sharegpt` selection), the pool's default."""
    from study_harness.snapshot import read_manifest

    per_set = ((read_manifest() or {}).get("prompts") or {}).get("per_set", {})
    return int(per_set.get("sharegpt", 0))


def learning_curve_study(pool: int | None = None, max_tokens: int = 1024, model: str | None = None,
                         say: Callable[[str], None] = lambda message: None, build: bool = True,
                         draws: int = DRAWS, n_boot: int = N_BOOT) -> dict:
    """`leap eval curve`: the learning curve on the chat test slice, the pool the first `pool` ShareGPT
    prompts (default: the snapshot's) without the test slice's."""
    from evaluation.corpora import load_or_build
    from evaluation.data import length_data
    from evaluation.selections import CHAT_TEST, CHAT_TRAIN, select
    from evaluation.studies import SHAREGPT_SPEARMAN_GOAL

    pool = pool or pool_size_default()
    if pool <= 0:
        raise RuntimeError("no ShareGPT rows in the snapshot: pass --pool N (and build them)")
    test_prompts = select(CHAT_TEST, exclude={p["id"] for p in select(CHAT_TRAIN)})
    test_ids = {p["id"] for p in test_prompts}
    pool_prompts = [p for p in select(f"sharegpt:{pool}") if p["id"] not in test_ids]
    say(f"learning curve: {len(pool_prompts)} pool prompts, {len(test_prompts)} test prompts")
    corpora = load_or_build([pool_prompts, test_prompts], max_tokens, model, say=say, build=build)
    train, test = (length_data(corpus, prompts) for corpus, prompts in zip(corpora, (pool_prompts, test_prompts)))
    result = learning_curve(train.features, train.lengths, test.features, test.lengths, max_tokens, draws=draws,
                            n_boot=n_boot, goal=SHAREGPT_SPEARMAN_GOAL, say=say)
    result.update(pool=f"sharegpt:{pool} without the test slice", test=f"{CHAT_TEST} without {CHAT_TRAIN}",
                  layer=int(corpora[0].layer), goal=SHAREGPT_SPEARMAN_GOAL)
    return result
