"""The corpora a study needs, read from the cache, with the engine started only for prompts not yet run.

Studies that only re-read recorded lengths and features (targets, layers, transfer, the simulations)
then cost seconds instead of an engine start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from serving.config import LeapConfig
from harness.corpus import ALL_LAYERS, Corpus, copy_layer_rows, corpus_dir, corpus_key, load_corpus, missing_ids
from harness.experiment import resolve_model as model_info  # noqa: F401 - the studies' name for it
from harness.replay import DEFAULT_DECODING


def load_or_build(prompt_lists: Sequence[Sequence[dict]], max_tokens: int, model: str | None = None,
                  all_layers: bool = False, layer: int | None = None,
                  say: Callable[[str], None] = lambda message: None, build: bool = True) -> list[Corpus]:
    """One corpus per prompt list (rows in prompt order), generating only what the cache lacks
    (`build=False`: use only the rows already recorded)."""
    from serving.worker import default_layer

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
        from harness.experiment import corpus_for, open_live

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
