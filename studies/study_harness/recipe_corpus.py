"""The recipe corpus: every feature recipe of a prompt, read by serving's own capture in one prefill.

The serving engine captures one wide recipe (`WIDE_RECIPE`, the union of the blocks the recipe study
compares) with `max_tokens=1`: the prompt's prefill is the same computation whatever follows, so these
features belong with the output lengths the length corpus recorded for the same prompt ids (same
model, same engine). Any recipe the wide one covers is a column slice of it (`Recipe.columns`).

Rows are cached in Parquet shards under `$LEAP_HOME/corpus/<key>/` like the length corpus; the key covers
the model fingerprint and the wide recipe, so another recipe list starts another corpus.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from leap_core.recipes import Recipe
from study_harness.corpus import ENGINE_NUMERICS, Corpus, build_corpus, load_corpus, missing_ids

# The blocks the recipe study compares: the last token of three late-middle layers (the layer study's CV
# choice 17, the 0.73-depth default 22, and 14), mean pooling of two of them and entropy pooling of one.
WIDE_RECIPE = Recipe.parse("last@14+last@17+last@22+mean@17+mean@22+entropy@17")
RECIPE_LAYER = -2  # the `layer` of a recipe corpus (its features are a recipe, not one layer)


def recipe_corpus_key(fingerprint: str, recipe: Recipe | str) -> str:
    blob = json.dumps({"fp": fingerprint, "recipe": str(Recipe.parse(recipe)), "engine": ENGINE_NUMERICS},
                      sort_keys=True)
    return "R-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def recipe_rows(folder: Path, ids: Sequence[str] | None = None) -> Corpus:
    return load_corpus(folder, RECIPE_LAYER, 1, ids=ids)


def build_recipe_rows(live, prompts: Sequence[dict], folder: Path,
                      on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Prefill every prompt not yet in `folder` on an engine that captures the wide recipe (max_tokens 1)."""
    runtime = live.runtime
    runtime.configure(policy="fcfs", rls=False, decode_slots=runtime.config.max_resident)
    max_len = live.engine.vllm_config.model_config.max_model_len
    return build_corpus(live.engine, runtime, prompts, folder, 1, live.decoding, max_prompt_tokens=max_len - 2,
                        on_progress=on_progress)


def joined(features: Corpus, labels: Corpus) -> Corpus:
    """The recipe features of the prompts `labels` recorded, with its lengths, in the labels' order."""
    position = {rid: i for i, rid in enumerate(features.ids)}
    keep = np.asarray([i for i, rid in enumerate(labels.ids) if rid in position], dtype=np.int64)
    rows = labels.subset(keep)
    rows.features = features.features[[position[rid] for rid in rows.ids]]
    rows.layer = RECIPE_LAYER
    return rows


def missing(folder: Path, ids: Sequence[str]) -> list[str]:
    return missing_ids(folder, RECIPE_LAYER, 1, ids)
