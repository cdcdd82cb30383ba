"""Length corpora as `LengthData`: the engine's recorded rows joined with the prompt texts that produced them.

Every study reads its train and test rows through here, so a predictor that needs text (the encoders), one
that needs the hidden state (LEAP, the MLP head) and the truth always refer to the same requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evaluation.baselines import LengthData
from study_harness.corpus import Corpus


def length_data(corpus: Corpus, prompts: Sequence[dict]) -> LengthData:
    """Corpus rows (in corpus order) with the text of each prompt; rows without a prompt are dropped."""
    text_of = {p["id"]: p["prompt"] for p in prompts}
    keep = np.asarray([rid in text_of for rid in corpus.ids], dtype=bool)
    rows = corpus.subset(keep) if not keep.all() else corpus
    finished = rows.finish_reasons != "abort"
    rows = rows.subset(finished) if not finished.all() else rows
    return LengthData(ids=np.asarray(rows.ids, dtype=object), texts=[text_of[i] for i in rows.ids],
                      prompt_tokens=np.asarray(rows.prompt_tokens, dtype=np.int64),
                      features=np.asarray(rows.features, dtype=np.float32),
                      lengths=np.asarray(rows.output_tokens, dtype=np.int64), max_tokens=int(rows.max_tokens),
                      sets=np.asarray(rows.sets, dtype=object), layer=int(rows.layer))


def split_stream(n: int, counts: Sequence[int], min_eval_fraction: float = 0.15,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(feedback stream, evaluation rows) of a target domain, disjoint, in a seeded order.

    The stream is as long as the largest feedback count allows while keeping at least
    `min_eval_fraction` of the rows for evaluation.
    """
    order = np.random.default_rng(seed).permutation(n)
    n_eval = max(int(np.ceil(min_eval_fraction * n)), n - max(counts, default=0))
    n_eval = min(n_eval, n)
    return order[: n - n_eval], order[n - n_eval:]
