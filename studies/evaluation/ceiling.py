"""The label ceiling: how well one run's output length can be ranked at all, measured by generating again.

A predictor sees the prompt; the label is one generation's length. Where two generations of the same prompt
disagree, no predictor can match both, so the agreement between two runs bounds what any predictor of a
single run reaches. Two kinds of rerun, each on the held-out ShareGPT pool (evaluation.selections.ceiling_pool):

- greedy rerun: the corpus' greedy length (generated with 256 resident requests in the snapshot's interleaved
  order) against a second greedy run of the same prompts in another batch composition (a seeded shuffle of
  the pool, RERUN_RESIDENT resident requests). bf16 kernels round differently with the batch's shape, so
  greedy outputs are not exactly reproducible.
- sampled pair: the sampled labels' draws (study_harness.sampled_labels, SAMPLED_DECODING, 4 per prompt), two
  independent samples per pair; the figure is the mean Spearman over the 6 pairs of samples (each pair is
  an unbiased estimate of the same quantity; the mean has less variance than one pair).

Intervals are percentile bootstraps over prompts (leap_core.intervals.bootstrap_ci).

From agreement to a ceiling. If a run's (rank-transformed) length is y = f(prompt) + e with e independent
noise of the same law in every run, two runs correlate as r = var f / var y, and the best possible
predictor, f itself, correlates with one run as sqrt(r) (corr(f, y) = sd f / sd y). So sqrt(rerun Spearman)
is the ceiling of a predictor's Spearman against one run under that model (`ceiling`), and the rerun
Spearman itself is what a predictor reaches if it is as noisy as a second run. Spearman is Pearson on
ranks, so the algebra holds for ranks only approximately; both figures are printed. The readout fitted on
the chat training window is scored on the same pool against each kind of label, beside its ceiling.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from evaluation.corpora import load_or_build, load_or_build_sampled_labels, model_info
from evaluation.selections import RERUN_ORDER_SEED, RERUN_RESIDENT, SAMPLED_RESIDENT, SAMPLES, rerun_order
from harness.replay import DEFAULT_DECODING
from study_harness.sampled_labels import SAMPLED_DECODING


def load_or_build_ceiling(max_tokens: int = 1024, model: str | None = None,
                          say: Callable[[str], None] = lambda message: None, build: bool = True):
    """(pool, corpus rows, greedy rerun rows, sampled rows) of the ceiling pool, generating what the snapshot
    and the cache lack (the rerun first: it is the cheaper part)."""
    from evaluation.selections import ceiling_pool

    pool = ceiling_pool()
    corpus = load_or_build([pool], max_tokens, model, say=say, build=build)[0]
    say(f"ceiling: greedy rerun of {len(pool)} held-out ShareGPT prompts ({RERUN_RESIDENT} resident, shuffled)")
    rerun = load_or_build_sampled_labels(rerun_order(pool), max_tokens, model, say, build, samples=1,
                                         decoding=DEFAULT_DECODING, max_resident=RERUN_RESIDENT)
    say(f"ceiling: {SAMPLES} sampled draws of each of {len(pool)} prompts")
    sampled = load_or_build_sampled_labels(pool, max_tokens, model, say, build, samples=SAMPLES,
                                           max_resident=SAMPLED_RESIDENT)
    return pool, corpus, rerun, sampled


def _interval(figure: dict[str, float]) -> dict[str, float]:
    return {k: float(figure[k]) for k in ("value", "ci_low", "ci_high")}


def _root(figure: dict[str, float]) -> dict[str, float]:
    """sqrt of a correlation and its interval bounds (a bootstrap interval maps through a monotone
    function); a negative bound maps to 0."""
    return {k: float(np.sqrt(max(v, 0.0))) if np.isfinite(v) else float("nan") for k, v in figure.items()}


def ceiling_figures(greedy: np.ndarray, rerun: np.ndarray, samples: np.ndarray,
                    predictions: np.ndarray | None = None, n_boot: int = 2000, seed: int = 0) -> dict:
    """The ceiling's figures on aligned rows (one per prompt): `greedy` and `rerun` the two greedy lengths,
    `samples` (n, k >= 2) the sampled draws, `predictions` (optional) a readout's predicted lengths.

    Every interval resamples the same prompts (same seed, same row count), so the readout's figures and the
    ceilings are resampled alike."""
    from leap_core.intervals import bootstrap_ci
    from leap_core.metrics import spearman_batch

    greedy = np.asarray(greedy, dtype=np.float64)
    rerun = np.asarray(rerun, dtype=np.float64)
    samples = np.asarray(samples, dtype=np.float64)
    n, k = samples.shape
    if greedy.shape != (n,) or rerun.shape != (n,):
        raise ValueError(f"rows differ: greedy {greedy.shape}, rerun {rerun.shape}, samples {samples.shape}")
    if k < 2:
        raise ValueError("the sampled pair needs at least 2 samples per prompt")
    pairs = list(itertools.combinations(range(k), 2))
    columns = [samples[:, j] for j in range(k)]

    def pair_mean(*draws: np.ndarray) -> np.ndarray:
        return np.mean([spearman_batch(draws[a], draws[b]) for a, b in pairs], axis=0)

    boot = dict(n_boot=n_boot, seed=seed, vectorized=True)
    greedy_rerun = _interval(bootstrap_ci(spearman_batch, greedy, rerun, **boot))
    sampled_pair = _interval(bootstrap_ci(pair_mean, *columns, **boot))
    relative = np.abs(rerun - greedy) / np.maximum(greedy, 1.0)
    result = {
        "n": int(n), "samples": int(k), "pairs": len(pairs),
        "greedy_rerun_spearman": greedy_rerun,
        "sampled_pair_spearman": sampled_pair,
        "ceiling": {"greedy": _root(greedy_rerun), "sampled": _root(sampled_pair)},
        "greedy_rerun": {"exact_share": float(np.mean(rerun == greedy)),
                         "median_relative_difference": float(np.median(relative)),
                         "p90_relative_difference": float(np.quantile(relative, 0.9))},
        "sampled_spread": {"median_iqr_over_median": float(np.median(
            (np.quantile(samples, 0.75, axis=1) - np.quantile(samples, 0.25, axis=1))
            / np.maximum(np.median(samples, axis=1), 1.0)))},
    }
    if predictions is not None:
        predictions = np.asarray(predictions, dtype=np.float64)
        if predictions.shape != (n,):
            raise ValueError(f"predictions have shape {predictions.shape}, expected ({n},)")
        median = np.median(samples, axis=1)

        def one_sample(pred: np.ndarray, *draws: np.ndarray) -> np.ndarray:
            return np.mean([spearman_batch(d, pred) for d in draws], axis=0)

        result["readout"] = {
            "against_greedy": _interval(bootstrap_ci(spearman_batch, greedy, predictions, **boot)),
            "against_rerun": _interval(bootstrap_ci(spearman_batch, rerun, predictions, **boot)),
            "against_one_sample": _interval(bootstrap_ci(one_sample, predictions, *columns, **boot)),
            "against_sample_median": _interval(bootstrap_ci(spearman_batch, median, predictions, **boot)),
        }
    return result


def ceiling_study(max_tokens: int = 1024, model: str | None = None,
                  say: Callable[[str], None] = lambda message: None, build: bool = True,
                  n_boot: int = 2000) -> dict:
    """`leap eval ceiling`: the greedy-rerun and sampled-pair Spearman on the ceiling pool, the ceilings
    they imply, and the serving readout (last@22, sqrt target, fitted on the chat training window) scored
    against each kind of label on the same prompts."""
    from evaluation.corpora import load_or_build
    from evaluation.selections import CEILING_POOL, CHAT_TEST, CHAT_TRAIN, select
    from study_harness.experiment import fit_on_corpus

    pool, corpus, rerun, sampled = load_or_build_ceiling(max_tokens, model, say, build)
    index = {rid: i for i, rid in enumerate(corpus.ids.tolist()) if corpus.finish_reasons[i] != "abort"}
    rerun_at = {rid: i for i, rid in enumerate(rerun.ids.tolist())}
    sampled_at = {rid: i for i, rid in enumerate(sampled.ids.tolist())}
    ids = [p["id"] for p in pool if p["id"] in index and p["id"] in rerun_at and p["id"] in sampled_at]
    if len(ids) < 20:
        raise RuntimeError(f"ceiling: only {len(ids)} prompts have a corpus row, a rerun and samples "
                           "(run with --build to generate them)")
    rows = np.array([index[i] for i in ids])
    train = load_or_build([select(CHAT_TRAIN)], max_tokens, model, say=say, build=build)[0]
    readout, _ = fit_on_corpus(train, model_info(model))
    say(f"ceiling: {len(ids)} prompts; readout fitted on {readout.metadata.get('n_train', len(train))} rows")
    figures = ceiling_figures(
        greedy=corpus.output_tokens[rows], rerun=rerun.lengths[[rerun_at[i] for i in ids], 0],
        samples=sampled.lengths[[sampled_at[i] for i in ids]],
        predictions=readout.predict(corpus.features[rows]), n_boot=n_boot)
    capped = sampled.lengths[[sampled_at[i] for i in ids]] >= max_tokens
    return {
        **figures,
        "pool": f"the first {CEILING_POOL} prompts of {CHAT_TEST} held out from {CHAT_TRAIN}",
        "pool_prompts": len(pool), "max_tokens": int(max_tokens), "n_boot": int(n_boot),
        "greedy_runs": {"corpus": "the snapshot's greedy length (256 resident, the snapshot's interleaved order)",
                        "rerun": f"greedy again, {RERUN_RESIDENT} resident, seeded shuffle {RERUN_ORDER_SEED}"},
        "sampled_decoding": dict(SAMPLED_DECODING),
        "capped_share": {"greedy": float(np.mean(corpus.output_tokens[rows] >= max_tokens)),
                         "sampled": float(np.mean(capped))},
        "readout_recipe": {"layer": int(corpus.layer), "target": readout.target, "alpha": float(readout.alpha),
                           "train": CHAT_TRAIN, "n_train": int(readout.metadata.get("n_train", len(train)))},
    }

