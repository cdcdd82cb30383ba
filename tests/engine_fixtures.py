"""Shared set-up for tests that run the real vLLM engine with the real model (SmolLM2-135M)."""

from __future__ import annotations

import numpy as np

from leap_core.readout import LinearReadout

LAYER = 22


def chat_ids(engine, text: str) -> list[int]:
    ids = engine.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)


def spread_readout(model, dim: int, seed: int = 0, max_tokens: int = 64, version: str = "test-1",
                   layer: int = LAYER) -> LinearReadout:
    """A readout whose predictions differ from prompt to prompt (weights random, not fitted)."""
    rng = np.random.default_rng(seed)
    return LinearReadout.from_weights(
        mean=np.zeros(dim), scale=np.full(dim, 4.0), coef=rng.normal(scale=0.3, size=dim), intercept=5.0,
        alpha=1.0, target="sqrt", max_tokens=max_tokens,
        metadata={"model_id": model.model_id, "model_fingerprint": model.fingerprint, "layer": layer,
                  "version": version})


PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis in detail.",
    "List three prime numbers.", "Describe how a bicycle works.", "Say hello.",
    "Give me a recipe for pancakes.", "What is 17 times 23?", "Summarize the plot of Hamlet.",
    "Translate 'good morning' to Spanish.", "Why is the sky blue?", "Name a famous painter.",
]
