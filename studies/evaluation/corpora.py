"""The corpora a study needs, read from the cache, with the engine started only for prompts not yet run.

Studies that only re-read recorded lengths and features (targets, layers, transfer, the simulations)
then cost seconds instead of an engine start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from harness.replay import DEFAULT_DECODING
from serving.config import LeapConfig
from study_harness.corpus import ALL_LAYERS, Corpus, copy_layer_rows, corpus_dir, corpus_key, load_corpus, missing_ids
from study_harness.experiment import resolve_model as model_info


def load_or_build(prompt_lists: Sequence[Sequence[dict]], max_tokens: int, model: str | None = None,
                  all_layers: bool = False, layer: int | None = None,
                  say: Callable[[str], None] = lambda message: None, build: bool = True) -> list[Corpus]:
    """One corpus per prompt list (rows in prompt order), generating only what the cache lacks
    (`build=False`: use only the rows already recorded)."""
    from leap_core.layers import default_layer

    info = model_info(model)
    layer = ALL_LAYERS if all_layers else (default_layer(info.num_layers) if layer is None else layer)
    folder = corpus_dir(corpus_key(info.fingerprint, layer, max_tokens, DEFAULT_DECODING))
    wanted = [p["id"] for prompts in prompt_lists for p in prompts]
    if not all_layers:
        every = corpus_dir(corpus_key(info.fingerprint, ALL_LAYERS, max_tokens, DEFAULT_DECODING))
        copy_layer_rows(every, folder, layer, info.hidden_size, max_tokens, wanted)
    missing = set(missing_ids(folder, layer, max_tokens, wanted))
    if missing and not build:
        say(f"{len(missing)} prompts not in the corpus yet: left out (no build)")
    elif missing:
        from study_harness.experiment import corpus_for, open_live

        say(f"running {len(missing)} prompts through the engine")
        todo = [p for prompts in prompt_lists for p in prompts if p["id"] in missing]
        live = open_live(model, LeapConfig(policy="fcfs", rls=False, layer=None if all_layers else layer,
                                           capture_all_layers=all_layers, max_resident=256),
                         max_tokens=max_tokens)
        try:
            corpus_for(live, todo)
        finally:
            live.close()
    return [load_corpus(folder, layer, max_tokens, ids=[p["id"] for p in prompts]) for prompts in prompt_lists]


def decode_key(info, layer: int, max_tokens: int) -> str:
    from study_harness.decode_states import decode_states_key

    return decode_states_key(info.fingerprint, layer, max_tokens, DEFAULT_DECODING)


def load_or_build_decode_states(prompts: Sequence[dict], max_tokens: int, model: str | None = None,
                                say: Callable[[str], None] = lambda message: None, build: bool = True) -> Corpus:
    """The decode-state rows (study_harness.decode_states) of `prompts` at the serving layer, generating only
    the prompts the snapshot and the cache lack (`build=False`: only the rows already recorded)."""
    from leap_core.layers import default_layer
    from study_harness.decode_states import build_decode_states, missing_prompts, split_ids
    from study_harness.experiment import open_live

    info = model_info(model)
    layer = default_layer(info.num_layers)
    folder = corpus_dir(decode_key(info, layer, max_tokens))
    missing = missing_prompts(folder, layer, max_tokens, [p["id"] for p in prompts])
    if missing and not build:
        say(f"{len(missing)} prompts without decode states yet: left out (no build)")
    elif missing:
        say(f"decode states: running {len(missing)} prompts through the engine (two passes)")
        live = open_live(model, LeapConfig(policy="fcfs", rls=False, layer=layer, max_resident=256),
                         max_tokens=max_tokens)
        try:
            live.runtime.configure(policy="fcfs", rls=False, decode_slots=live.runtime.config.max_resident)
            wanted = set(missing)
            build_decode_states(live.engine, live.runtime, [p for p in prompts if p["id"] in wanted], folder,
                                max_tokens, live.decoding,
                                max_prompt_tokens=max(16, live.engine.vllm_config.model_config.max_model_len
                                                      - max_tokens - 1),
                                on_progress=lambda done, total: say(f"decode states: {done}/{total} prompts"))
        finally:
            live.close()
    rows = load_corpus(folder, layer, max_tokens)
    if not len(rows):
        return rows
    owners, _ = split_ids(rows.ids)
    return rows.subset(np.isin(owners.astype(str), [p["id"] for p in prompts]))


def load_or_build_recipe_corpus(prompts: Sequence[dict], max_tokens: int = 1024, model: str | None = None,
                                say: Callable[[str], None] = lambda message: None, build: bool = True) -> Corpus:
    """The wide recipe's features (study_harness.recipe_corpus) of `prompts` with the lengths the serving layer's
    corpus recorded for them, prefilling only what the snapshot and the cache lack."""
    from study_harness.experiment import open_live
    from study_harness.recipe_corpus import (
        WIDE_RECIPE,
        build_recipe_rows,
        joined,
        missing,
        recipe_corpus_key,
        recipe_rows,
    )

    info = model_info(model)
    labels = load_or_build([prompts], max_tokens, model, say=say, build=build)[0]
    folder = corpus_dir(recipe_corpus_key(info.fingerprint, WIDE_RECIPE))
    todo = set(missing(folder, labels.ids.tolist()))
    if todo and not build:
        say(f"recipes: {len(todo)} prompts without recipe features yet: left out (no build)")
    elif todo:
        say(f"recipes: prefilling {len(todo)} prompts with recipe {WIDE_RECIPE}")
        live = open_live(model, LeapConfig(policy="fcfs", rls=False, recipe=str(WIDE_RECIPE), max_resident=256),
                         max_tokens=1)
        try:
            build_recipe_rows(live, [p for p in prompts if p["id"] in todo], folder,
                              on_progress=lambda done, total: say(f"recipes: {done}/{total} prompts")
                              if done % 250 == 0 or done == total else None)
        finally:
            live.close()
    return joined(recipe_rows(folder, labels.ids.tolist()), labels)


def load_or_build_sampled_labels(prompts: Sequence[dict], max_tokens: int = 1024, model: str | None = None,
                                 say: Callable[[str], None] = lambda message: None, build: bool = True,
                                 samples: int = 4, decoding: dict | None = None, max_resident: int = 256):
    """The sampled labels (study_harness.sampled_labels: `samples` outputs per prompt under `decoding`, default
    SAMPLED_DECODING, label = their median) of `prompts`, in prompt order, generating only the prompts the
    snapshot and the cache lack (`build=False`: only the rows already recorded). Missing prompts are queued
    in the given order with `max_resident` requests decoded together: the order and the resident count set
    the batch compositions the outputs were generated in (which moves greedy outputs, see
    evaluation.ceiling)."""
    from study_harness.experiment import open_live
    from study_harness.sampled_labels import (
        SAMPLED_DECODING,
        build_sampled_labels,
        load_sampled_labels,
        missing_sampled,
        sampled_key,
    )

    decoding = dict(SAMPLED_DECODING if decoding is None else decoding)
    info = model_info(model)
    folder = corpus_dir(sampled_key(info.fingerprint, max_tokens, decoding, samples))
    wanted = [p["id"] for p in prompts]
    missing = set(missing_sampled(folder, max_tokens, wanted))
    if missing and not build:
        say(f"sampled labels: {len(missing)} prompts not recorded yet: left out (no build)")
    elif missing:
        say(f"sampled labels: running {len(missing)} prompts x {samples} samples through the engine")
        live = open_live(model, LeapConfig(policy="fcfs", rls=False, max_resident=max_resident),
                         max_tokens=max_tokens, decoding=decoding)
        try:
            live.runtime.configure(policy="fcfs", rls=False, decode_slots=live.runtime.config.max_resident)
            started = time.monotonic()
            step = max(1, len(missing) // 24)

            def progress(done: int, total: int) -> None:
                if done % step == 0 or done == total:
                    say(f"sampled labels: {done}/{total} prompts ({time.monotonic() - started:.0f} s)")

            result = build_sampled_labels(live.engine, [p for p in prompts if p["id"] in missing], folder,
                                          max_tokens, live.decoding, samples, on_progress=progress,
                                          max_prompt_tokens=max(16, live.engine.vllm_config.model_config.max_model_len
                                                                - max_tokens - 1))
            say(f"sampled labels: {result['rows']} rows, {result['generated_tokens']} tokens generated in "
                f"{time.monotonic() - started:.0f} s, {result['dropped_too_long']} prompts too long")
        finally:
            live.close()
    return load_sampled_labels(folder, max_tokens, ids=wanted)


def interleave_sets(prompts: Sequence[dict]) -> list[dict]:
    """Prompts reordered so every set advances at its share of the whole (the engine admits in order):
    a build stopped early leaves each set covered in proportion, not the first sets complete and the
    last ones empty. Within a set the order is kept."""
    by_set: dict[str, list[dict]] = {}
    for p in prompts:
        by_set.setdefault(str(p.get("set")), []).append(p)
    keyed = [((i + 0.5) / len(items), name, i) for name, items in by_set.items() for i in range(len(items))]
    return [by_set[name][i] for _, name, i in sorted(keyed)]


def build_snapshot(selection: str, all_layers_selection: str, max_tokens: int = 1024, model: str | None = None,
                   say: Callable[[str], None] = lambda message: None, build: bool = True,
                   decode_states: bool = True, sampled: bool | None = None) -> dict:
    """Generate what the cache lacks for the snapshot's prompts (resumable), then rewrite the committed
    snapshot as the union of its rows and the cache's for those prompts; return the manifest.
    `sampled` (default: as `decode_states`, the other study-specific part a `--select` build leaves out)
    adds the sampled labels of the sampled pool last."""
    from evaluation.selections import seeded_prompts, select
    from leap_core.layers import default_layer
    from study_harness import snapshot
    from study_harness.corpus import noted_skipped

    info = model_info(model)
    layer = default_layer(info.num_layers)
    already = ((snapshot.read_manifest() or {}).get("prompts") or {}).get("per_set", {})  # an extension keeps them
    stored = snapshot.write_prompts(_stored_prompts([selection, all_layers_selection,
                                                     ",".join(f"{name}:{n}" for name, n in already.items())],
                                                    seeded_prompts))
    manifest = snapshot.write_manifest({}, info, DEFAULT_DECODING, max_tokens, prompts=stored)
    # The serving layer first, then the refresh study's decode states, then the every-layer subset; the
    # manifest is rewritten after each, so a stopped build leaves a consistent snapshot.
    for part, spec in (("layer", selection), ("decode", "refresh" if decode_states else ""),
                       ("every", all_layers_selection)):
        if not spec:
            continue
        if part == "decode":
            from evaluation.selections import refresh_pool

            prompts = refresh_pool()
            key, spec = decode_key(info, layer, max_tokens), f"decode states of the refresh pool ({len(prompts)})"
            say(f"decode states: {len(prompts)} prompts (the refresh study's pool)")
            corpus = load_or_build_decode_states(prompts, max_tokens, model, say, build)
            wanted = [p["id"] for p in prompts]
        else:
            every = part == "every"
            key = corpus_key(info.fingerprint, ALL_LAYERS if every else layer, max_tokens, DEFAULT_DECODING)
            kept = (snapshot.read_manifest() or {"corpora": {}})["corpora"].get(key, {}).get("ids", [])
            prompts = interleave_sets(select(spec))
            say(f"{'every layer' if every else f'layer {layer}'}: {len(prompts)} prompts of {spec}")
            load_or_build([prompts], max_tokens, model, all_layers=every, say=say, build=build)
            wanted = list(dict.fromkeys([*kept, *(p["id"] for p in prompts)]))
            corpus = load_corpus(corpus_dir(key), ALL_LAYERS if every else layer, max_tokens, ids=wanted)
        if not len(corpus):
            say(f"snapshot {key}: no rows recorded yet, left out")
            continue
        skipped = (noted_skipped(corpus_dir(key)) | snapshot.skipped_ids(key)) & set(wanted)
        snapshot.write_rows(corpus, key)
        old = (snapshot.read_manifest() or {"corpora": {}})["corpora"].get(key, {})
        entry = snapshot.corpus_entry(corpus, merged_selection(old.get("selection", ""), spec) if part != "decode"
                                      else spec, skipped)
        entry["extends"] = extended_hashes(
            old, entry, lambda ids, rows=corpus: snapshot.content_hash(rows.subset(np.isin(rows.ids, ids))))
        manifest = snapshot.write_manifest({key: entry}, info, DEFAULT_DECODING, max_tokens, prompts=stored)
        say(f"snapshot {key}: {len(corpus)} rows, {len(skipped)} prompts too long for the engine")
    include_sampled = decode_states if sampled is None else sampled
    if include_sampled:  # the "sampled" part, after "every"; then the recipe corpus
        manifest = sampled_snapshot_part(max_tokens, model, say, build, prompts_record=stored) or manifest
        manifest = recipes_snapshot_part(max_tokens, model, say, build, prompts_record=stored) or manifest
    return manifest


def recipes_snapshot_part(max_tokens: int = 1024, model: str | None = None,
                          say: Callable[[str], None] = lambda message: None, build: bool = True,
                          prompts_record: dict | None = None) -> dict | None:
    """Prefill what the cache lacks of the recipe study's prompts (evaluation.selections.recipe_pool) with
    the wide recipe, and write those rows into the committed snapshot with a manifest entry that names the
    recipe; return the manifest (None when no row is recorded yet)."""
    from evaluation.selections import RECIPE_HELD_OUT, recipe_pool
    from study_harness import snapshot
    from study_harness.corpus import noted_skipped
    from study_harness.recipe_corpus import WIDE_RECIPE, recipe_corpus_key, recipe_rows

    info = model_info(model)
    train, held = recipe_pool()
    joined_rows = load_or_build_recipe_corpus(train + held, max_tokens, model, say, build)
    key = recipe_corpus_key(info.fingerprint, WIDE_RECIPE)
    rows = recipe_rows(corpus_dir(key), joined_rows.ids.tolist())
    if not len(rows):
        say(f"snapshot {key}: no rows recorded yet, left out")
        return None
    wanted = {p["id"] for p in train + held}
    skipped = (noted_skipped(corpus_dir(key)) | snapshot.skipped_ids(key)) & wanted
    snapshot.write_rows(rows, key)
    entry = {**snapshot.corpus_entry(rows, f"recipe pool: training window + {RECIPE_HELD_OUT}", skipped),
             "kind": "recipes", "recipe": str(WIDE_RECIPE), "max_tokens": 1}
    manifest = snapshot.write_manifest({key: entry}, info, DEFAULT_DECODING, max_tokens, prompts=prompts_record)
    say(f"snapshot {key}: {len(rows)} rows of recipe {WIDE_RECIPE}")
    return manifest


def sampled_snapshot_part(max_tokens: int = 1024, model: str | None = None,
                          say: Callable[[str], None] = lambda message: None, build: bool = True,
                          samples: int = 4, prompts_record: dict | None = None) -> dict | None:
    """Generate what the cache lacks for the sampled pool (evaluation.selections.sampled_pool) and the label
    ceiling's pool (evaluation.ceiling), write their rows into the committed snapshot with a manifest entry
    of kind "sampled", then the ceiling's greedy rerun under its own key; return the manifest (None when no
    row is recorded yet). `prompts_record` as in study_harness.snapshot.write_manifest."""
    from evaluation.selections import (
        CEILING_POOL,
        RERUN_RESIDENT,
        SAMPLED_POOL,
        SAMPLED_RESIDENT,
        ceiling_pool,
        rerun_order,
        sampled_pool,
    )
    from study_harness.sampled_labels import SAMPLED_DECODING

    train, held = sampled_pool()
    ceiling = ceiling_pool()
    prompts = list({p["id"]: p for p in train + held + ceiling}.values())
    say(f"sampled labels: {len(prompts)} prompts (the sampled pool and the ceiling pool), {samples} samples each")
    spec = (f"sampled pool: {SAMPLED_POOL} ShareGPT of the training window + {SAMPLED_POOL} held out; "
            f"ceiling pool: {CEILING_POOL} held out")
    manifest = _sampled_key_part(prompts, spec, SAMPLED_DECODING, samples, SAMPLED_RESIDENT, max_tokens, model,
                                 say, build, prompts_record)
    say(f"greedy rerun: {len(ceiling)} prompts (the ceiling pool)")
    spec = f"greedy rerun of the ceiling pool ({CEILING_POOL} held out; shuffled, {RERUN_RESIDENT} resident)"
    return _sampled_key_part(rerun_order(ceiling), spec, DEFAULT_DECODING, 1, RERUN_RESIDENT, max_tokens, model,
                             say, build, prompts_record) or manifest


def _sampled_key_part(prompts: Sequence[dict], spec: str, decoding: dict, samples: int, max_resident: int,
                      max_tokens: int, model: str | None, say: Callable[[str], None], build: bool,
                      prompts_record: dict | None) -> dict | None:
    """One sampled-label key of the snapshot: build what is missing, write the rows the snapshot already
    held for the key and those of `prompts`, and its manifest entry (with `extends` when the old rows are
    kept unchanged, so results recorded on them stay current)."""
    from study_harness import snapshot
    from study_harness.corpus import noted_skipped
    from study_harness.sampled_labels import (
        content_hash,
        load_sampled_labels,
        sampled_entry,
        sampled_key,
        write_sampled_rows,
    )

    info = model_info(model)
    key = sampled_key(info.fingerprint, max_tokens, decoding, samples)
    old = (snapshot.read_manifest() or {"corpora": {}})["corpora"].get(key, {})
    load_or_build_sampled_labels(prompts, max_tokens, model, say, build, samples, decoding, max_resident)
    wanted = list(dict.fromkeys([*old.get("ids", []), *(p["id"] for p in prompts)]))
    rows = load_sampled_labels(corpus_dir(key), max_tokens, ids=wanted)
    if not len(rows):
        say(f"snapshot {key}: no rows recorded yet, left out")
        return None
    skipped = (noted_skipped(corpus_dir(key)) | snapshot.skipped_ids(key)) & set(wanted)
    entry = sampled_entry(rows, spec, decoding, samples, skipped)
    entry["extends"] = extended_hashes(old, entry, lambda ids: content_hash(rows.subset(np.isin(rows.ids, ids))))
    write_sampled_rows(rows, key)
    manifest = snapshot.write_manifest({key: entry}, info, DEFAULT_DECODING, max_tokens, prompts=prompts_record)
    say(f"snapshot {key}: {len(rows)} rows, {len(skipped)} prompts too long for the engine")
    return manifest


def extended_hashes(old: dict, new: dict, hash_of_ids: Callable[[list[str]], str]) -> list[str]:
    """The content hashes a rewritten key's rows still contain unchanged: the old entry's (and those it
    extended) when every old id is kept and the new rows of those ids hash to the old entry's hash."""
    if not old or old.get("content_hash") == new.get("content_hash"):
        return list(old.get("extends", []))
    ids = list(old.get("ids", []))
    if not set(ids) <= set(new.get("ids", [])) or hash_of_ids(ids) != old.get("content_hash"):
        return []
    return [*old.get("extends", []), old["content_hash"]]


def merged_selection(old: str, new: str) -> str:
    """The selection a key holds after adding `new` to `old`: each set once, at the larger count, in the
    order first named ("sharegpt:3050,math:300" + "sharegpt:4000" -> "sharegpt:4000,math:300")."""
    from evaluation.selections import spec_parts

    counts: dict[str, float] = {}
    for name, count in (part for spec in (old, new) for part in spec_parts(spec)):
        counts[name] = max(counts.get(name, 0), float("inf") if count is None else count)  # no count: all of it
    return ",".join(name if count == float("inf") else f"{name}:{int(count)}" for name, count in counts.items())


def _stored_prompts(specs: Sequence[str], seeded: Callable[[str], list[dict]]) -> dict[str, list[dict]]:
    """For each set the selections name, the longest prefix of its seeded order they take (texts included):
    what a checkout without the shared folder needs to select the same prompts."""
    counts: dict[str, int] = {}
    for spec in specs:
        for part in (p.strip() for p in (spec or "").split(",") if p.strip()):
            name, _, count = part.rpartition(":")
            counts[name] = max(counts.get(name, 0), int(count))
    return {name: seeded(name)[:count] for name, count in counts.items()}
