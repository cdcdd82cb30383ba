"""The baselines by name (`BASELINES`, `make_predictor`), what a fitted one costs (`measure_cost`) and was
tuned to (`hyperparameters`, `pinned`), and the fit cache (`cache_key`, `fit_cached`) that makes reruns of a
study cheap.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator

from evaluation.baselines import (
    EncoderRidgePredictor,
    HiddenStateMLP,
    LengthData,
    MultilingualUseRidge,
    OraclePredictor,
    PromptLengthPredictor,
)
from evaluation.finetuned import EncoderRanker, EncoderRegressor, _FineTunedEncoder
from leap_io.durable import write_durably
from leap_io.jsonable import dumps

BASELINES: dict[str, type] = {cls.name: cls for cls in (
    PromptLengthPredictor, EncoderRidgePredictor, MultilingualUseRidge, EncoderRegressor, EncoderRanker,
    HiddenStateMLP, OraclePredictor)}


def make_predictor(name: str, **params: Any) -> BaseEstimator:
    """A fresh baseline by its registry name."""
    if name not in BASELINES:
        raise ValueError(f"unknown predictor {name!r}; expected one of {sorted(BASELINES)}")
    return BASELINES[name](**params)


def measure_cost(predictor: BaseEstimator, data: LengthData, batch_size: int = 1,
                 repeats: int = 3) -> dict[str, Any]:
    """Prediction wall time per request on at most 64 rows, in batches of `batch_size`.

    One untimed call first loads anything lazy (the shared encoder); the median over `repeats`
    passes is reported.
    """
    sample = data.subset(slice(0, min(64, len(data))))
    batches = [sample.subset(slice(start, start + batch_size)) for start in range(0, len(sample), batch_size)]
    predictor.predict(batches[0])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            predictor.predict(batch)
        times.append(time.perf_counter() - start)
    return {"ms_per_request": float(np.median(times)) * 1000.0 / len(sample), "batch_size": batch_size,
            "n_params": int(predictor.n_params_), "input": predictor.input}


def _settings(predictor: BaseEstimator) -> dict[str, Any]:
    """The predictor's hyper-parameters (`get_params`), `num_threads` left out: it changes how fast a model
    trains, not which model it is. A predictor that is not a scikit-learn estimator (only `predict`) has none."""
    get_params = getattr(predictor, "get_params", None)
    params = get_params(deep=False) if callable(get_params) else {}
    return {key: value for key, value in params.items() if key != "num_threads"}


def hyperparameters(predictor: BaseEstimator) -> dict[str, Any]:
    """What a fitted predictor was given (`params`: its hyper-parameters, grids included) and, where it
    searched them on a validation split of its training rows, what it chose (`chosen`: `best_params_`)
    and the validation Spearman of that choice (`val_spearman`)."""
    found: dict[str, Any] = {"params": _settings(predictor)}
    if hasattr(predictor, "best_params_"):
        found["chosen"] = dict(predictor.best_params_)
    if hasattr(predictor, "val_spearman_"):
        found["val_spearman"] = float(predictor.val_spearman_)
    return found


def pinned(predictor: BaseEstimator) -> BaseEstimator:
    """A fresh, unfitted copy of a fitted predictor with its own search narrowed to what it chose
    (`best_params_`), so refitting it on other rows (another train/test split) trains one model, not its
    whole grid again. A predictor that searched nothing comes back as a plain copy."""
    from sklearn.base import clone

    fresh, chosen = clone(predictor), getattr(predictor, "best_params_", None)
    if not chosen:
        return fresh
    if isinstance(predictor, HiddenStateMLP):
        return fresh.set_params(hidden=tuple(chosen["hidden"]), alphas=(chosen["alpha"],),
                                learning_rates=(chosen["learning_rate"],))
    if isinstance(predictor, EncoderRidgePredictor):
        return fresh.set_params(alphas=(chosen["alpha"],))
    if isinstance(predictor, _FineTunedEncoder):
        return fresh.set_params(lr_encoder=chosen["lr_encoder"], epochs=chosen["epochs"])
    return fresh


CACHE_VERSION = 3  # bumped when a predictor's training changes in a way its hyper-parameters do not show, or
# when a pickled predictor's class moves: 3, the fine-tuned encoders moved to evaluation.finetuned, so version 2
# pickles name a module that no longer holds their class


def _digest(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array)
    header = f"{array.dtype.str}{array.shape}".encode()
    return hashlib.sha256(header + array.tobytes()).hexdigest()


def cache_key(predictor: BaseEstimator, data: LengthData, corpus_hash: str | None = None) -> str:
    """sha256 over everything a fit depends on: the predictor's name and hyper-parameters, and the
    training rows (ids, lengths, M, and hashes of their texts, prompt sizes and features) with the
    capture layer and the corpus hash (`corpus_hash`, else `data.corpus_hash`) when known.

    Rows are keyed in id order, so the same rows in another order are the same fit. The features are
    hashed for every predictor (a text predictor is refitted when only the features change: cheap
    safety), so another layer or another corpus is never served a stale model. `num_threads` is left
    out: it changes how fast a model trains, not which model it is.
    """
    params = _settings(predictor)
    ids = np.asarray(data.ids, dtype=str)
    order = np.argsort(ids, kind="stable")
    texts = hashlib.sha256("\x00".join(data.texts[i] for i in order).encode("utf-8", "surrogatepass"))
    payload = {"version": CACHE_VERSION, "name": predictor.name, "params": params,
               "ids": ids[order].tolist(),
               "lengths": np.asarray(data.lengths, dtype=np.int64)[order].tolist(),
               "max_tokens": int(data.max_tokens),
               "texts": texts.hexdigest(),
               "prompt_tokens": _digest(np.asarray(data.prompt_tokens, dtype=np.int64)[order]),
               "features": _digest(np.asarray(data.features)[order]),
               "layer": None if data.layer is None else int(data.layer),
               "corpus": corpus_hash if corpus_hash is not None else data.corpus_hash}
    text = dumps(payload, nonfinite="keep", sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fit_cached(predictor: BaseEstimator, data: LengthData, cache_dir: Path | None,
               corpus_hash: str | None = None) -> BaseEstimator:
    """`predictor.fit(data)`, or the fitted predictor pickled by an earlier identical call (`cache_key`).

    The fine-tuned encoders take minutes per epoch on CPU; the cache makes reruns of a study cheap.
    The file is written durably (`leap_io.durable`), so a crash never leaves a half file.
    """
    if cache_dir is None:
        return predictor.fit(data)
    path = Path(cache_dir) / f"{predictor.name}-{cache_key(predictor, data, corpus_hash)}.pkl"
    if path.exists():
        with path.open("rb") as handle:
            return pickle.load(handle)
    predictor.fit(data)
    path.parent.mkdir(parents=True, exist_ok=True)

    def dump(partial: Path) -> None:
        with partial.open("wb") as handle:
            pickle.dump(predictor, handle, protocol=pickle.HIGHEST_PROTOCOL)

    write_durably(path, dump)
    return predictor
