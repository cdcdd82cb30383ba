"""The pieces every live experiment shares: an engine on the prepared model, the length corpus of a
prompt list, a readout fitted on training prompts only, and fixed-length replay requests.

`leap replay`, the gate flow and the evaluation studies all go through these, so they agree on the model,
the decoding settings, the output budget and how a training set is kept apart from the replayed slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.engine import EngineSettings, build_engine, leap_scheduler
from harness.model_prep import ModelInfo, describe_model, prepare_model
from harness.replay import DEFAULT_DECODING, ReplayRequest, encode_prompts
from leap_core.readout import LinearReadout
from leap_core.rls import fit_readout_with_anchor
from serving.config import LeapConfig
from study_harness.corpus import (
    ALL_LAYERS,
    Corpus,
    build_corpus,
    copy_layer_rows,
    corpus_dir,
    corpus_key,
    corpus_layer,
    load_corpus,
)

DEFAULT_MAX_TOKENS = 1024
DEFAULT_ALPHA = 1000.0


@dataclass
class LiveSetup:
    """An engine with LEAP active, and what it serves."""

    engine: Any
    runtime: Any
    model: ModelInfo
    max_tokens: int
    decoding: dict

    def corpus_folder(self):
        return corpus_dir(corpus_key(self.model.fingerprint, corpus_layer(self.runtime), self.max_tokens,
                                     self.decoding))

    def close(self) -> None:
        """Shut the engine down so the process can build another one."""
        try:
            self.engine.engine_core.shutdown()
        finally:
            self.engine = None


def resolve_model(model_path: str | None) -> ModelInfo:
    """A given HF folder, described; else the prepared default model."""
    return describe_model(model_path) if model_path else prepare_model()


def open_live(model_path: str | None = None, leap: LeapConfig | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
              decoding: dict | None = None, max_model_len: int = 4096, stock: bool = False) -> LiveSetup:
    """Prepare the model (or describe a given HF folder) and start an in-process engine on it."""
    model = resolve_model(model_path)
    # the replays force the corpus's recorded true lengths (ignore_eos): RLS may learn them
    leap = (leap or LeapConfig.from_environment()).model_copy(update={"rls_learns_forced_lengths": True})
    engine = build_engine(EngineSettings(model=model.path, max_model_len=max_model_len), leap, stock=stock)
    runtime = None if stock else leap_scheduler(engine).leap
    return LiveSetup(engine, runtime, model, max_tokens, dict(decoding or DEFAULT_DECODING))


def corpus_for(live: LiveSetup, prompts: Sequence[dict],
               on_progress: Callable[[int, int], None] | None = None) -> Corpus:
    """Lengths and features of `prompts` from the cache, generating the missing ones with all slots open."""
    folder = live.corpus_folder()
    runtime = live.runtime
    if not runtime.config.capture_all_layers:
        every = corpus_dir(corpus_key(live.model.fingerprint, ALL_LAYERS, live.max_tokens, live.decoding))
        copy_layer_rows(every, folder, runtime.layer, runtime.dim, live.max_tokens, [p["id"] for p in prompts])
    saved = (runtime.config.policy, runtime.config.decode_slots)
    runtime.configure(policy="fcfs", rls=False, decode_slots=runtime.config.max_resident)
    try:
        build_corpus(live.engine, runtime, prompts, folder, live.max_tokens, live.decoding,
                     max_prompt_tokens=_max_prompt_tokens(live), on_progress=on_progress)
    finally:
        runtime.configure(policy=saved[0], decode_slots=saved[1])
    return load_corpus(folder, corpus_layer(runtime), live.max_tokens, ids=[p["id"] for p in prompts])


def _max_prompt_tokens(live: LiveSetup) -> int:
    max_len = live.engine.vllm_config.model_config.max_model_len
    return max(16, max_len - live.max_tokens - 1)


def fit_on_corpus(corpus: Corpus, model: ModelInfo, alpha: float = DEFAULT_ALPHA,
                  version: str = "corpus") -> tuple[LinearReadout, dict[str, np.ndarray]]:
    """A sqrt-target readout and its RLS anchor, fitted on the given (training) rows only."""
    keep = corpus.finish_reasons != "abort"
    X, y = corpus.features[keep], corpus.output_tokens[keep]
    metadata = dict(model_id=model.model_id, model_fingerprint=model.fingerprint, layer=corpus.layer,
                    version=version, n_train=int(keep.sum()))
    readout, rls = fit_readout_with_anchor(X, y, alpha=alpha, max_tokens=corpus.max_tokens, metadata=metadata)
    return readout, rls.state_arrays()


def fixed_length_requests(live: LiveSetup, prompts: Sequence[dict], corpus: Corpus) -> list[ReplayRequest]:
    """Replay requests that decode exactly the corpus's recorded length (same work under every policy)."""
    lengths = {rid: int(n) for rid, n in zip(corpus.ids, corpus.output_tokens)}
    encoded, _ = encode_prompts(live.engine.get_tokenizer(), prompts, _max_prompt_tokens(live))
    return [ReplayRequest(id=p["id"], prompt_token_ids=p["prompt_token_ids"], max_tokens=live.max_tokens,
                          fixed_length=max(1, lengths[p["id"]]), domain=p.get("domain"))
            for p in encoded if p["id"] in lengths]
