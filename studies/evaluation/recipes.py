"""The recipe study: which prefill features rank output lengths best, at what cost, chosen as the fit flow would.

Rows come from the recipe corpus (`study_harness.recipe_corpus`): serving's capture of a wide recipe at prefill,
joined with the recorded greedy lengths, plus the sampled-label slice (temperature 0.7, top_p 0.9, the
median of several samples) when it is recorded. The corpus rows become one capture matrix, laid out
exactly as a serving capture of `WIDE_RECIPE + prompt + decoding + domain=...` would send it (the
non-state columns from each row's prompt length, decoding settings and domain), and every candidate
recipe is a column slice of it (`Recipe.columns`), so the study, the fit flow and serving read the same
numbers.

- **Choice**: `leap_core.recipe_choice` on the training window only (5-fold CV grouped by prompt, so a
  prompt's greedy and sampled rows never sit on both sides of a split).
- **Held-out figures**: each recipe is fitted on the whole training window (the CV's penalty) and scored
  per prompt set, greedy and sampled, with bootstrap intervals (`leap_core.metrics.per_set_metrics`).
- **Cost**: capture milliseconds per request measured in the engine by `leap bench recipes`
  (docs/results/recipe-costs.json), plus the readout's prediction measured here; bytes per feedback row.
- **RLS**: the anchored correction of the default and chosen recipes, with and without per-domain
  intercepts, on one mixed stream of half of each other domain's rows, scored per domain on the other half.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import GroupKFold

from leap_core import metrics
from leap_core.intervals import bootstrap_ci
from leap_core.readout import LinearReadout
from leap_core.recipe_choice import RULE as CHOICE_RULE
from leap_core.recipe_choice import choose_recipe, validate_recipes
from leap_core.recipes import GREEDY, Block, Recipe, decoding_columns, domain_columns, prompt_column
from leap_core.rls import RLS
from study_harness.corpus import Corpus
from study_harness.recipe_corpus import WIDE_RECIPE

Say = Callable[[str], None]
DEFAULT_RECIPE = "last@22"  # the paper's feature at the 0.73-depth layer: what serving captured before recipes
CANDIDATES = (
    "last@22", "last@17", "last@14",
    "last@17+last@22", "last@14+last@17+last@22",
    "mean@17", "mean@22", "entropy@17",
    "last@17+mean@17", "last@22+mean@22", "last@17+entropy@17",
    "last@17+mean@17+prompt", "last@17+mean@22+prompt", "last@14+last@17+last@22+mean@17+mean@22+prompt",
    "last@17+mean@17+prompt+decoding",
)
QUICK_CANDIDATES = ("last@22", "last@17", "last@17+last@22", "mean@17", "entropy@17", "last@17+mean@17",
                    "last@17+mean@17+prompt", "last@17+mean@17+prompt+decoding")
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "frequency_penalty": 0.5}  # study_harness.sampled_labels' settings
GREEDY_DECODING = {"temperature": 0.0, "frequency_penalty": 0.5}  # harness.replay.DEFAULT_DECODING
COSTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "recipe-costs.json"
N_SPLITS = 5
TARGETS = ("sqrt", "log", "rank", "softbin")  # the regression targets validated with every recipe (leap_core.targets)
TARGET_SETS = ("sharegpt", "sharegpt@sampled")  # where each (recipe, target) pair is scored with intervals


# ------------------------------------------------------------------------------------ the rows

class RecipeRows:
    """Study rows as a serving capture of `capture` would hold them, with labels and provenance."""

    def __init__(self, capture: Recipe, matrix: np.ndarray, lengths: np.ndarray, ids: np.ndarray, sets: np.ndarray,
                 domains: np.ndarray, censored: np.ndarray, hidden: int, max_tokens: int) -> None:
        self.capture, self.matrix, self.lengths, self.ids = capture, matrix, lengths, ids
        self.sets, self.domains, self.censored, self.hidden, self.max_tokens = sets, domains, censored, hidden, max_tokens

    def __len__(self) -> int:
        return int(self.lengths.size)

    def X(self, recipe: Recipe | str) -> np.ndarray:
        return self.matrix[:, Recipe.parse(recipe).columns(self.capture, self.hidden)]

    def take(self, mask: np.ndarray) -> RecipeRows:
        return RecipeRows(self.capture, self.matrix[mask], self.lengths[mask], self.ids[mask], self.sets[mask],
                          self.domains[mask], self.censored[mask], self.hidden, self.max_tokens)

    @staticmethod
    def concat(parts: Sequence[RecipeRows]) -> RecipeRows:
        first = parts[0]
        return RecipeRows(first.capture, np.concatenate([p.matrix for p in parts]),
                          *(np.concatenate([getattr(p, name) for p in parts])
                            for name in ("lengths", "ids", "sets", "domains", "censored")),
                          hidden=first.hidden, max_tokens=first.max_tokens)


def capture_of(domains: Sequence[str]) -> Recipe:
    """The capture recipe the study's matrix follows: the wide recipe, prompt, decoding and every domain."""
    blocks = [*WIDE_RECIPE.blocks, Block("prompt"), Block("decoding")]
    if domains:
        blocks.append(Block("domain", domains=tuple(domains)))
    return Recipe(tuple(blocks))


def capture_rows(corpus: Corpus, capture: Recipe, decoding: dict, lengths: np.ndarray | None = None,
                 set_suffix: str = "", censored: np.ndarray | None = None) -> RecipeRows:
    """Corpus rows (wide features) laid out as `capture`, under the given decoding settings."""
    hidden = WIDE_RECIPE.hidden_for(corpus.features.shape[1])
    n = len(corpus)
    settings = {**GREEDY, **decoding}
    extra = np.concatenate([
        np.stack([prompt_column(int(t)) for t in corpus.prompt_tokens]) if n else np.zeros((0, 1), np.float32),
        np.tile(decoding_columns(settings, corpus.max_tokens), (n, 1)),
        np.stack([domain_columns(capture.domains, str(d)) for d in corpus.domains]) if capture.domains and n
        else np.zeros((n, len(capture.domains)), np.float32),
    ], axis=1)
    matrix = np.concatenate([corpus.features.astype(np.float32), extra.astype(np.float32)], axis=1)
    if matrix.shape[1] != capture.dim(hidden):
        raise ValueError(f"the corpus rows hold {matrix.shape[1]} columns; capture {capture} needs {capture.dim(hidden)}")
    lengths = np.asarray(corpus.output_tokens if lengths is None else lengths, dtype=np.float64)
    censored = (corpus.finish_reasons == "length") if censored is None else censored
    sets = np.asarray([f"{s}{set_suffix}" for s in corpus.sets], dtype=object)
    return RecipeRows(capture, matrix, lengths, np.asarray(corpus.ids, dtype=object), sets,
                      np.asarray(corpus.domains, dtype=object), np.asarray(censored, dtype=bool), hidden,
                      int(corpus.max_tokens))


# ------------------------------------------------------------------------------------ figures

def _fit(rows: RecipeRows, recipe: str, alpha: float, target: str = "sqrt") -> LinearReadout:
    return LinearReadout(alpha=alpha, target=target, max_tokens=rows.max_tokens,
                         metadata={"recipe": recipe}).fit(rows.X(recipe), rows.lengths)


def predict_ms(readout: LinearReadout, X: np.ndarray, repeats: int = 200) -> float:
    """Milliseconds to predict one request, as serving does (float32 row, one product), median of repeats."""
    row = X[:1].astype(np.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        readout.predict(row)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def recorded_costs(path: Path = COSTS) -> dict[str, Any]:
    """`leap bench recipes`' measurement: capture ms per request per block, or {} when none is recorded."""
    return json.loads(path.read_text()) if path.is_file() else {}


def capture_ms(recipe: Recipe, costs: dict[str, Any]) -> float | None:
    """Capture cost per request of a recipe: measured on its own engine when it was benchmarked, else the
    widest benchmarked recipe's per-block costs of its blocks plus the per-step base, summed."""
    measured = (costs.get("recipes") or {}).get(str(recipe))
    if measured is not None:
        return float(measured["capture_ms_per_request"])
    from study_harness.recipe_bench import block_cost_key

    blocks = costs.get("capture_ms_per_block") or {}
    total = float(costs.get("capture_ms_base", 0.0))
    for block in recipe.blocks:
        if block_cost_key(block) not in blocks:
            return None
        total += float(blocks[block_cost_key(block)])
    return total


def _per_set(rows: RecipeRows, pred: np.ndarray, n_boot: int) -> dict[str, Any]:
    figures = metrics.per_set_metrics(rows.sets, rows.lengths, pred, rows.censored, rows.max_tokens, n_boot=n_boot)
    out = {"spearman": {}, "mae": {}, "n": {}}
    for name, fig in [*figures["per_set"].items(), ("pooled", figures["pooled"])]:
        out["spearman"][name] = fig["spearman"]
        out["mae"][name] = fig["mae"]
        out["n"][name] = fig["n"]
    out["within_set_spearman"] = figures["within_set_spearman"]
    return out


def target_figures(rows: RecipeRows, pred: np.ndarray, sqrt_pred: np.ndarray, n_boot: int) -> dict[str, Any]:
    """Per set of TARGET_SETS present: the held-out Spearman of `pred` with its interval, and its paired
    difference from the same recipe's sqrt-target prediction (both resampled together)."""
    values, _ = metrics.censor(rows.lengths, rows.max_tokens, rows.censored)
    out: dict[str, Any] = {"spearman": {}, "spearman_vs_sqrt": {}, "n": {}}
    for name in TARGET_SETS:
        mask = rows.sets == name
        if not mask.any():
            continue
        out["spearman"][name] = bootstrap_ci(metrics.spearman_batch, values[mask], pred[mask],
                                             n_boot=n_boot, vectorized=True)
        out["spearman_vs_sqrt"][name] = bootstrap_ci(metrics.spearman_difference, values[mask], pred[mask],
                                                     sqrt_pred[mask], n_boot=n_boot, vectorized=True)
        out["n"][name] = int(mask.sum())
    return out


def _paired_difference(rows: RecipeRows, pred: np.ndarray, default: np.ndarray, n_boot: int) -> dict[str, Any]:
    """Per set and pooled: this recipe's held-out Spearman minus the default recipe's on the same rows, with
    a paired bootstrap interval (both predictions resampled together)."""
    values, _ = metrics.censor(rows.lengths, rows.max_tokens, rows.censored)
    out = {}
    for name in [*sorted(set(rows.sets.tolist())), "pooled"]:
        mask = np.ones(len(rows), bool) if name == "pooled" else rows.sets == name
        out[name] = bootstrap_ci(metrics.spearman_difference, values[mask], pred[mask], default[mask],
                                 n_boot=n_boot, vectorized=True)
    return out


def rls_study(train: RecipeRows, held: RecipeRows, recipes: Sequence[str], alphas: dict[str, float],
              seed: int = 0) -> dict[str, Any]:
    """Anchored RLS per recipe on a mixed stream: half of each other domain's rows (in a seeded order) as
    feedback, all domains interleaved as a shared replica sees them; the other halves scored per domain
    against the frozen readout. Spearman within the domain, MAE in tokens. With one intercept, RLS can
    only shift all domains together; per-domain intercepts (a `domain=` block) move each on its own."""
    domains = sorted(d for d in set(held.domains.tolist()) if d != "chat")
    rng = np.random.default_rng(seed)
    feedback, scored = [], {}
    for domain in domains:
        index = rng.permutation(np.flatnonzero(held.domains == domain))
        feedback.append(index[: index.size // 2])
        scored[domain] = index[index.size // 2:]
    stream = rng.permutation(np.concatenate(feedback)) if feedback else np.zeros(0, dtype=np.int64)
    out: dict[str, Any] = {}
    for recipe in recipes:
        readout = _fit(train, recipe, alphas[recipe])
        X = held.X(recipe)
        corrected = RLS.from_readout(readout, train.X(recipe)).partial_fit(X[stream], held.lengths[stream]).readout()
        per_domain = {}
        for domain, rows in scored.items():
            true, censored = held.lengths[rows], held.censored[rows]
            frozen, fixed = readout.predict(X[rows]), corrected.predict(X[rows])
            per_domain[domain] = {
                "feedback": int(np.isin(stream, np.flatnonzero(held.domains == domain)).sum()),
                "scored": int(rows.size),
                "frozen": {"spearman": metrics.censored_spearman(true, frozen, held.max_tokens, censored),
                           "mae": metrics.mae(true, frozen)},
                "rls": {"spearman": metrics.censored_spearman(true, fixed, held.max_tokens, censored),
                        "mae": metrics.mae(true, fixed)},
            }
        out[recipe] = per_domain
    return out


def run_recipes(train: RecipeRows, held: RecipeRows, candidates: Sequence[str], *, n_boot: int,
                costs: dict[str, Any], say: Say = lambda message: None, groups: np.ndarray | None = None) -> dict:
    """Validate every candidate on the training window, choose, and score each on the held-out rows."""
    candidates = list(dict.fromkeys([DEFAULT_RECIPE, *candidates]))  # today's recipe is always compared
    say(f"validating {len(candidates)} recipes x targets {', '.join(TARGETS)} on {len(train)} training rows "
        f"({N_SPLITS}-fold, grouped by prompt)")
    table = validate_recipes({name: train.X(name) for name in candidates}, train.lengths, targets=TARGETS,
                             max_tokens=train.max_tokens, cv=GroupKFold(N_SPLITS),
                             groups=train.ids if groups is None else groups)
    chosen = choose_recipe(table)
    by_pair = {(row["recipe"], row["target"]): row for row in table}
    alphas = {name: by_pair[(name, "sqrt")]["alpha"] for name in candidates}  # the sqrt figures below
    recipes = {}
    predictions = {}
    for name in candidates:
        say(f"held-out figures of {name}")
        recipe = Recipe.parse(name)
        readout = _fit(train, name, alphas[name])
        predictions[name] = readout.predict(held.X(name))
        figures = _per_set(held, predictions[name], n_boot)
        row = by_pair[(name, "sqrt")]
        predict = predict_ms(readout, held.X(name))
        capture = capture_ms(recipe, costs)
        recipes[name] = {
            **{key: figures[key] for key in ("spearman", "mae", "within_set_spearman")},
            "cost_ms": None if capture is None else capture + predict,
            "capture_ms": capture, "predict_ms": predict,
            "bytes_per_row": 4 * recipe.dim(train.hidden), "dim": recipe.dim(train.hidden),
            "alpha": row["alpha"], "validation_spearman": row["spearman"], "validation_mae": row["mae"],
        }
    for name in candidates:
        recipes[name]["spearman_vs_default"] = _paired_difference(held, predictions[name],
                                                                  predictions[DEFAULT_RECIPE], n_boot)
    say(f"held-out figures per target on {', '.join(TARGET_SETS)}")
    targets: dict[str, dict[str, Any]] = {}
    for name in candidates:
        targets[name] = {}
        for target in TARGETS:
            row = by_pair[(name, target)]
            pred = predictions[name] if target == "sqrt" else _fit(train, name, row["alpha"], target).predict(held.X(name))
            targets[name][target] = {**target_figures(held, pred, predictions[name], n_boot), "alpha": row["alpha"],
                                     "validation_spearman": row["spearman"], "validation_mae": row["mae"]}
    default_and_chosen = list(dict.fromkeys([DEFAULT_RECIPE, chosen["recipe"]]))
    with_domains = [f"{name}+domain={'/'.join(train.capture.domains)}" for name in default_and_chosen]
    say("RLS with and without per-domain intercepts")
    for name in with_domains:
        alphas[name] = alphas[name.split("+domain=")[0]]
    return {
        "recipes": recipes, "chosen": chosen["recipe"], "chosen_target": chosen["target"], "default": DEFAULT_RECIPE,
        "choice": {"rule": CHOICE_RULE, "best_spearman": max(row["spearman"] for row in table),
                   **{key: chosen[key] for key in ("spearman", "gap", "gap_ci_low", "gap_ci_high", "gap_se")}},
        "targets": targets, "target_sets": list(TARGET_SETS), "rls_target": "sqrt",
        "validation": table, "validation_split": f"{N_SPLITS}-fold grouped by prompt, training window only",
        "n_train": len(train), "n_held_out": {name: int((held.sets == name).sum()) for name in sorted(set(held.sets))},
        "sets_held_out": sorted(set(held.sets.tolist())),
        "rls": rls_study(train, held, [*default_and_chosen, *with_domains], alphas),
        "cost_source": costs.get("source", "none: run `leap bench recipes --save` to measure capture in the engine"),
        "bootstrap": {"n_boot": n_boot, "level": 0.95, "resampled": "held-out rows"},
    }


# ------------------------------------------------------------------------------------ the study

BASELINES = ("prompt_length", "minilm_ridge", "trail_mlp")  # those that train within minutes on 2 CPU cores


def baseline_figures(held: RecipeRows, names: Sequence[str], max_tokens: int, model: str | None, say: Say,
                     build: bool, n_boot: int) -> dict[str, Any]:
    """Per-set figures of the baselines on the study's held-out rows (fitted on the same training window's
    greedy rows; a prompt's sampled row is scored with the same prediction, against its median label)."""
    from evaluation.selections import CHAT_TRAIN, RECIPE_HELD_OUT
    from evaluation.studies import datasets, fitted_baselines

    train_data, held_data = datasets([CHAT_TRAIN, RECIPE_HELD_OUT], max_tokens, model, say, build=build)
    out = {}
    for name, predictor in fitted_baselines(train_data, names, say).items():
        by_id = dict(zip(held_data.ids.tolist(), np.asarray(predictor.predict(held_data), dtype=np.float64)))
        keep = np.asarray([rid in by_id for rid in held.ids], dtype=bool)
        rows = held.take(keep)
        figures = _per_set(rows, np.asarray([by_id[rid] for rid in rows.ids]), n_boot)
        out[name] = {key: figures[key] for key in ("spearman", "mae", "within_set_spearman")}
    return out


def recipe_study(quick: bool = False, candidates: Sequence[str] | None = None, max_tokens: int = 1024,
                 model: str | None = None, say: Say = lambda message: None, build: bool = True,
                 baselines: Sequence[str] | None = None) -> dict:
    """The recipe study on the committed corpus (building what it lacks unless `build` is False), with the
    baselines (default: `BASELINES`, none with `quick`) scored on the same held-out rows."""
    from evaluation.corpora import load_or_build_recipe_corpus
    from evaluation.selections import recipe_pool

    train_prompts, held_prompts = recipe_pool()
    rows = load_or_build_recipe_corpus(train_prompts + held_prompts, max_tokens, model, say, build)
    rows = rows.subset(rows.finish_reasons != "abort")
    domains = sorted(set(rows.domains.tolist()))
    capture = capture_of(domains)
    train_ids = {p["id"] for p in train_prompts}
    in_train = np.asarray([rid in train_ids for rid in rows.ids], dtype=bool)
    greedy = capture_rows(rows, capture, GREEDY_DECODING)
    train, held = greedy.take(in_train), greedy.take(~in_train)
    sampled = sampled_rows(rows, capture, model, say, build)
    if sampled is not None:
        sampled_train = sampled.take(np.isin(sampled.ids, list(train_ids)))
        train = RecipeRows.concat([train, sampled_train])
        held = RecipeRows.concat([held, sampled.take(~np.isin(sampled.ids, list(train_ids)))])
    result = run_recipes(train, held, QUICK_CANDIDATES if quick and candidates is None else candidates or CANDIDATES,
                         n_boot=500 if quick else 2000, costs=recorded_costs(), say=say)
    names = (() if quick else BASELINES) if baselines is None else tuple(baselines)
    n_boot = 500 if quick else 2000
    result["baselines"] = baseline_figures(held, names, max_tokens, model, say, build, n_boot) if names else {}
    result.update(quick=quick, max_tokens=max_tokens, capture=str(capture), wide_recipe=str(WIDE_RECIPE),
                  sampled_rows=0 if sampled is None else len(sampled), sampled_settings=SAMPLED)
    return result


def sampled_rows(rows: Corpus, capture: Recipe, model: str | None, say: Say, build: bool) -> RecipeRows | None:
    """The sampled-label slice as study rows (label: the median of the samples), or None when not recorded."""
    try:
        from evaluation.corpora import load_or_build_sampled_labels
        from evaluation.selections import sampled_pool
    except ImportError:
        return None
    train, held = sampled_pool()
    labels = load_or_build_sampled_labels(train + held, rows.max_tokens, model, say=say, build=build)
    if labels is None or not len(labels.ids):
        return None
    position = {rid: i for i, rid in enumerate(rows.ids)}
    keep = [k for k, rid in enumerate(labels.ids) if rid in position]
    corpus = rows.subset(np.asarray([position[labels.ids[k]] for k in keep], dtype=np.int64))
    median = np.asarray(labels.median, dtype=np.float64)[keep]
    return capture_rows(corpus, capture, SAMPLED, lengths=median, set_suffix="@sampled",
                        censored=median >= rows.max_tokens)
