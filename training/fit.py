"""Fitting a readout from the log store: the training window, a split by arrival time, the fit.

Plain functions (the fit flow wraps them in Prefect tasks). The test set is the newest part of the
window, because a readout is always applied to requests that arrive after it was fitted; the ridge
penalty is chosen the same way, on the newest part of the training split, so the test set stays
unseen until the final figures. Only rows whose finish reason is a training label (`stop`,
`length`: `store.duckdb.TRAINING_FINISH_REASONS`) are fitted on; `abort`, `error` and `repetition`
rows are left out, because their length is where they were cut off, not where the model would have
stopped, and the fit's params count them by reason (`n_excluded_<reason>`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from threadpoolctl import threadpool_limits

from leap_core import alpha as alpha_path
from leap_core import metrics
from leap_core.alpha import AlphaSelection
from leap_core.cross_fit import cross_fitted_distribution
from leap_core.gittins import LengthGivenPrediction
from leap_core.readout import LinearReadout
from leap_core.recipe_choice import choose_recipe, validate_recipes
from leap_core.recipes import RECIPE_VERSION, Recipe, readout_recipe
from leap_core.rls import RLS, fit_readout_with_anchor
from leap_io.feedback_schema import NOT_TRAINING_FINISH_REASONS
from leap_io.labels import LABEL_PROBLEMS, label_problems
from store.duckdb import LogStore, TrainingFrame

DEFAULT_MAX_TOKENS = 1024
"""The output budget M when neither the caller nor the window's rows say what it is."""

ALPHA_GRID = alpha_path.ALPHAS
"""Ridge penalties tried by alpha="auto": the one grid of `leap_core.alpha` (1 to 1e6, two per decade)."""

VALIDATION_FRACTION = 0.2
"""The newest share of the training split that scores each penalty of the grid."""

MIN_DOMAIN_TEST_ROWS = 10
"""Fewest test rows of a domain for its own Spearman figure (fewer gives a number, not a measurement)."""

ABORT = "abort"


class NotEnoughRowsError(ValueError):
    """The training window holds fewer usable requests (finished by `stop` or `length`) than the fit needs."""


@dataclass(frozen=True)
class FitResult:
    """A fitted readout with what the registry records next to it."""

    readout: LinearReadout
    rls_state: dict[str, np.ndarray]  # RLS anchored at the training rows: RLS.from_state_arrays resumes it
    metrics: dict[str, float]
    params: dict[str, Any]
    eval_arrays: dict[str, np.ndarray]  # "true" and "pred" output lengths of the test rows
    validation: list[dict[str, Any]] | None = None  # the recipe choice's table (None: no choice made)


def _problems(frame: TrainingFrame, max_length: int | None = None) -> np.ndarray:
    """Why each row's length is not a training label (`leap_io.labels`), None where it is one; `max_length`
    is the budget M of the fit (default: the largest of the frame, as the fit's)."""
    return label_problems(frame.finish_reason, frame.max_tokens, _budget(frame, max_length), frame.policy,
                          frame.decoding)


def _usable(frame: TrainingFrame, max_length: int | None = None) -> np.ndarray:
    """Rows whose length is a training label."""
    return np.equal(_problems(frame, max_length), None)


def excluded_by_reason(frame: TrainingFrame, max_length: int | None = None) -> dict[str, int]:
    """How many rows the frame holds whose length is not a training label, by reason: each finish reason
    that is not a label, and each `leap_io.labels.LABEL_PROBLEMS` (others too, should a frame hold a finish
    reason the store does not know)."""
    return _count_problems(_problems(frame, max_length))


def _count_problems(problems: np.ndarray) -> dict[str, int]:
    reasons, counts = np.unique(np.asarray([str(p) for p in problems if p is not None], dtype=object),
                                return_counts=True)
    found = {str(reason): int(count) for reason, count in zip(reasons.tolist(), counts.tolist())}
    return {**{reason: 0 for reason in (*NOT_TRAINING_FINISH_REASONS, *LABEL_PROBLEMS)}, **found}


def _training_rows(frame: TrainingFrame, max_length: int | None = None,
                   problems: np.ndarray | None = None) -> TrainingFrame:
    """The frame without the rows whose length is not a training label (aborted, errored, cut for
    repetition, capped or steered by the client); `problems`: the frame's `_problems`, when known."""
    usable = np.equal(_problems(frame, max_length) if problems is None else problems, None)
    return frame if usable.all() else frame.take(usable)  # no copy of the features when nothing is dropped


def select_window(
    store: LogStore,
    *,
    since: float | None = None,
    until: float | None = None,
    domains: Sequence[str] | None = None,
    model_fingerprint: str | None = None,
    layer: int | None = None,
    min_rows: int = 50,
    recipe: str | None = None,
) -> TrainingFrame:
    """The finished requests arriving in [since, until), of one feature space when given (`recipe`:
    the capture recipe of the rows, see `LogStore.training_frame`).

    Raises NotEnoughRowsError when fewer than `min_rows` of them finished without an abort, and
    ValueError (from the store) when the selection mixes feature dims or capture recipes.
    """
    frame = store.training_frame(since=since, until=until, domains=domains,
                                 model_fingerprint=model_fingerprint, layer=layer, recipe=recipe)
    usable = int(_usable(frame).sum())
    if usable < min_rows:
        excluded = ", ".join(f"{count} {reason}" for reason, count in excluded_by_reason(frame).items() if count)
        raise NotEnoughRowsError(
            f"{usable} usable finished requests in the window ({len(frame.request_ids)} in all; not training "
            f"labels, excluded: {excluded or 'none'}); the fit needs at least {min_rows}")
    return frame


def time_split(frame: TrainingFrame, test_fraction: float = 0.2) -> tuple[TrainingFrame, TrainingFrame]:
    """(train, test): the newest `test_fraction` of the rows by arrival time is the test set.

    Rows are ordered by arrival time, then request id, so the split is the same on every run.
    Both parts keep at least one row.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n = len(frame.request_ids)
    if n < 2:
        raise ValueError(f"a split needs at least 2 rows, the frame has {n}")
    by_id = np.argsort(np.asarray(frame.request_ids, dtype=str), kind="stable")
    order = by_id[np.argsort(np.asarray(frame.arrival_time)[by_id], kind="stable")]
    n_test = min(max(round(n * test_fraction), 1), n - 1)
    if np.array_equal(order, np.arange(n)):  # the store's order already: views, not copies
        return frame.take(slice(0, n - n_test)), frame.take(slice(n - n_test, n))
    return frame.take(order[: n - n_test]), frame.take(order[n - n_test:])


def select_alpha(
    X: ArrayLike,
    lengths: ArrayLike,
    *,
    target: str = "sqrt",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    alphas: Sequence[float] = ALPHA_GRID,
    validation_fraction: float = VALIDATION_FRACTION,
) -> AlphaSelection:
    """The penalty of `alphas` whose readout, fitted on the older rows, best predicts the newest.

    Rows must be in arrival order. `leap_core.alpha.select_alpha` on one newest-rows split, scored by
    mean squared error in the target space (predictions clipped to [1, M]); the whole grid costs
    about one fit.
    """
    if not len(alphas) or min(alphas) <= 0:
        raise ValueError(f"alphas must be a non-empty sequence of penalties > 0, got {alphas}")
    n = np.asarray(X).shape[0]
    return alpha_path.select_alpha(X, lengths, target=target, max_tokens=int(max_tokens), alphas=alphas,
                                   cv=alpha_path.newest_split(n, validation_fraction), scoring="mse_target")


def _budget(frame: TrainingFrame, max_tokens: int | None) -> int:
    if max_tokens is not None:
        return int(max_tokens)
    column = frame.max_tokens
    if column is not None and len(column) and int(np.max(column)) > 0:
        return int(np.max(column))
    return DEFAULT_MAX_TOKENS


def _data_hash(request_ids: NDArray[Any]) -> str:
    digest = hashlib.sha256()
    for request_id in sorted(str(request_id) for request_id in request_ids):
        digest.update(request_id.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _metric_name(domain: str, prefix: str = "spearman_") -> str:
    return prefix + re.sub(r"[^0-9A-Za-z_.-]", "_", domain)


def domain_mae_metric(domain: str) -> str:
    """The name a fit logs one domain's held-out MAE under (the drift watch judges that domain's live
    MAE against it)."""
    return _metric_name(domain, "mae_domain_")


def _test_metrics(test: TrainingFrame, true: np.ndarray, pred: np.ndarray, max_tokens: int) -> dict[str, float]:
    by_bucket = metrics.mae_by_bucket(true, pred, max_tokens)
    figures = {
        "spearman": metrics.spearman(true, pred),
        "kendall": metrics.kendall(true, pred),
        "mae": by_bucket["all"],
        "mae_short": by_bucket["short"],
        "mae_medium": by_bucket["medium"],
        "mae_long": by_bucket["long"],
    }
    domains = np.asarray([d if d is not None else "" for d in test.domain], dtype=str)
    names, counts = np.unique(domains, return_counts=True)
    for domain, count in zip(names.tolist(), counts.tolist()):
        if domain and count >= MIN_DOMAIN_TEST_ROWS:
            rows = domains == domain
            figures[_metric_name(domain)] = metrics.spearman(true[rows], pred[rows])
            figures[domain_mae_metric(domain)] = metrics.mae(true[rows], pred[rows])
    return figures


def fit_readout(
    frame_train: TrainingFrame,
    frame_test: TrainingFrame,
    *,
    alpha: float | str = "auto",
    target: str = "sqrt",
    max_tokens: int | None = None,
    model_id: str,
    model_fingerprint: str,
    layer: int,
    version: str,
    alphas: Sequence[float] = ALPHA_GRID,
    blas_threads: int | None = 1,
    anchor: RLS | None = None,
    capture_recipe: str | None = None,
    recipes: Sequence[str] | None = None,
    targets: Sequence[str] | None = None,
) -> FitResult:
    """Fit a readout on `frame_train`, score it on `frame_test`, and anchor RLS at the training rows.

    anchor: an RLS state (the champion's: anchored at its own training rows, plus any feedback it
        took). The training rows then correct it in one batch update, which equals one ridge solve on
        the anchor's rows and these together; alpha and the budget are the anchor's, and the result's
        RLS state keeps both. Without it the readout is fitted on these rows alone.

    alpha: a penalty, or "auto" to pick one of `alphas` on the newest rows of `frame_train` (see
        `select_alpha`); the choice is recorded in params["alpha"].
    max_tokens: the output budget M; by default the largest max_tokens among the training rows,
        else DEFAULT_MAX_TOKENS. It must match the budget serving runs with, since predictions are
        clipped to [1, M].
    capture_recipe: the recipe the rows' features were captured with (`leap_core.recipes`; default
        `last@<layer>`): the readout records which of its columns it reads.
    recipes: candidate recipes to choose from (each covered by `capture_recipe`), by validation on the
        newest rows of `frame_train` only (`choose_recipe`); the readout is fitted on the chosen one and
        the table is returned as `FitResult.validation`. None: the whole capture recipe, no choice.
        Not with `anchor` (the anchor fixes the recipe).
    targets: candidate regression targets (`leap_core.targets.TARGETS`), chosen with the recipe by the same
        validation: each (recipe, target) pair is a row of the table. None: `target`, no choice. Not with
        `anchor` (RLS corrects in the anchor's target space).
    blas_threads: BLAS threads for the fit (None: the library's default). One by default: the fit
        shares its host with the serving process, and on a loaded 2-core machine two BLAS threads
        made the fit on 100k rows at d = 576 2-4x slower than one (36-70 s against 16-21 s).
    Rows that are not training labels (abort, error, repetition) are dropped from both frames.
    """
    with threadpool_limits(limits=blas_threads, user_api="blas"):
        capture = Recipe.parse(capture_recipe) if capture_recipe else Recipe.last(layer)
        validation = None
        if recipes or targets:
            if anchor is not None:
                raise ValueError("an anchored fit keeps the anchor's recipe and target; choose them without "
                                 "an anchor")
            validation = validate_window(frame_train, capture, recipes or [str(capture)], targets=targets or [target],
                                         max_tokens=_budget(frame_train, max_tokens), alphas=alphas)
            row = choose_recipe(validation)
            chosen, target = Recipe.parse(row["recipe"]), row["target"]
            columns = chosen.columns(capture, capture.hidden_for(np.asarray(frame_train.features).shape[1]))
            frame_train, frame_test = _columns(frame_train, columns), _columns(frame_test, columns)
            capture = chosen
        elif anchor is not None and str(readout_recipe(anchor.readout_.metadata)) != str(capture):
            kept = readout_recipe(anchor.readout_.metadata)  # the anchor reads part of the capture
            columns = kept.columns(capture, capture.hidden_for(np.asarray(frame_train.features).shape[1]))
            frame_train, frame_test = _columns(frame_train, columns), _columns(frame_test, columns)
            capture = kept
        fit = _fit(frame_train, frame_test, alpha=alpha, target=target, max_tokens=max_tokens,
                   model_id=model_id, model_fingerprint=model_fingerprint, layer=layer, version=version,
                   alphas=alphas, anchor=anchor, recipe=capture)
        return replace(fit, validation=validation)


def fit_length_distribution(X: ArrayLike, lengths: ArrayLike, *, alpha: float, target: str,
                            max_tokens: int) -> LengthGivenPrediction:
    """The readout's length distribution (`leap_core.cross_fit.cross_fitted_distribution`: on cross-fitted
    predictions of the training rows at the readout's alpha, target and budget). ValueError when the rows
    are too few to cross-fit and fill the bins, or the table would be too large."""
    return cross_fitted_distribution(X, lengths, alpha=alpha, target=target, max_tokens=max_tokens)[0]


def _columns(frame: TrainingFrame, columns: np.ndarray) -> TrainingFrame:
    return frame._replace(features=np.asarray(frame.features)[:, columns])


def validate_window(frame_train: TrainingFrame, capture: Recipe, recipes: Sequence[str], *,
                    targets: Sequence[str], max_tokens: int, alphas: Sequence[float] = ALPHA_GRID,
                    validation_fraction: float = VALIDATION_FRACTION) -> list[dict[str, Any]]:
    """`leap_core.recipe_choice.validate_recipes` over the candidates the capture covers and the candidate
    targets, on the training rows in arrival order: the newest `validation_fraction` scores, the older rows
    fit."""
    train = _training_rows(frame_train, max_tokens)
    X = np.asarray(train.features)
    hidden = capture.hidden_for(X.shape[1])
    covered = [Recipe.parse(name) for name in recipes if Recipe.parse(name).covered_by(capture, hidden)]
    if not covered:
        raise ValueError(f"none of the recipes {list(recipes)} is covered by the capture recipe {capture}")
    arrival = np.asarray(train.arrival_time)
    order = np.argsort(arrival, kind="stable")
    lengths = np.asarray(train.output_tokens, dtype=np.float64)[order]
    matrices = {str(r): X[order][:, r.columns(capture, hidden)] for r in covered}
    return validate_recipes(matrices, lengths, max_tokens=int(max_tokens), targets=targets, alphas=alphas,
                            cv=alpha_path.newest_split(len(order), validation_fraction))


def _fit(frame_train: TrainingFrame, frame_test: TrainingFrame, *, alpha: float | str, target: str,
         max_tokens: int | None, model_id: str, model_fingerprint: str, layer: int, version: str,
         alphas: Sequence[float], recipe: Recipe, anchor: RLS | None = None) -> FitResult:
    budget = int(anchor.readout_.max_tokens) if anchor is not None else _budget(frame_train, max_tokens)
    problems_train, problems_test = _problems(frame_train, budget), _problems(frame_test, budget)  # once each
    excluded_train, excluded_test = _count_problems(problems_train), _count_problems(problems_test)
    excluded = {reason: excluded_train.get(reason, 0) + excluded_test.get(reason, 0)
                for reason in {*excluded_train, *excluded_test}}
    train = _training_rows(frame_train, problems=problems_train)
    test = _training_rows(frame_test, problems=problems_test)
    aborted = (len(frame_train.request_ids) - len(train.request_ids)
               + len(frame_test.request_ids) - len(test.request_ids))
    if len(train.request_ids) < 3 or len(test.request_ids) < 1:
        raise NotEnoughRowsError(f"{len(train.request_ids)} training and {len(test.request_ids)} test rows "
                                 "remain after dropping rows that are not training labels (abort, error, "
                                 "repetition, or a length the client capped or steered); need at least 3 and 1")
    X_train = np.asarray(train.features)
    lengths_train = np.asarray(train.output_tokens, dtype=np.float64)

    selection = None
    if anchor is not None:
        chosen = float(anchor.alpha_)
    elif isinstance(alpha, str):
        if alpha.strip().lower() != "auto":
            raise ValueError(f"alpha must be a number or 'auto', got {alpha!r}")
        arrival = np.asarray(train.arrival_time)
        order = slice(None) if np.all(np.diff(arrival) >= 0) else np.argsort(arrival, kind="stable")
        selection = select_alpha(X_train[order], lengths_train[order], target=target, max_tokens=budget,
                                 alphas=alphas)
        chosen = selection.alpha
    else:
        chosen = float(alpha)

    metadata = {
        "model_id": model_id,
        "model_fingerprint": model_fingerprint,
        "layer": int(layer),
        "recipe": str(recipe),
        "recipe_version": RECIPE_VERSION,
        "version": version,
        "n_train": int(X_train.shape[0]),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if anchor is not None:
        if anchor.readout_.target != target:
            raise ValueError(f"the anchor's target is {anchor.readout_.target!r}, not {target!r}")
        rls = anchor.partial_fit(X_train, lengths_train)
        readout = rls.readout()
        metadata["n_train"] = int(readout.metadata.get("n_train", 0)) + int(X_train.shape[0])
        readout.metadata.update(metadata)
    else:
        readout, rls = fit_readout_with_anchor(X_train, lengths_train, alpha=chosen, max_tokens=budget,
                                               target=target, metadata=metadata)
    rls_state = rls.state_arrays()
    del rls
    try:
        readout.length_distribution_ = fit_length_distribution(X_train, lengths_train, alpha=chosen, target=target,
                                                               max_tokens=budget)
        distribution_note = "fitted on cross-fitted predictions of the training rows"
    except ValueError as exc:  # an anchored readout keeps its anchor's; otherwise the readout has none
        distribution_note = f"not fitted: {exc}"

    true = np.asarray(test.output_tokens, dtype=np.int64)
    pred = readout.predict(np.asarray(test.features))
    figures = _test_metrics(test, true, pred, budget)
    figures.update(n_train=len(train.request_ids), n_test=len(test.request_ids))
    if selection is not None:
        figures["validation_mse"] = min(selection.scores)

    arrivals = np.concatenate([train.arrival_time, test.arrival_time])
    params: dict[str, Any] = {
        "layer": int(layer),
        "recipe": str(recipe),
        "alpha": chosen,
        "alpha_selection": "anchor" if anchor is not None else "auto" if selection is not None else "given",
        "target": target,
        "max_tokens": budget,
        "dim": int(X_train.shape[1]),
        "window_since": float(arrivals.min()),
        "window_until": float(arrivals.max()),
        "n_train": len(train.request_ids),
        "n_test": len(test.request_ids),
        "n_aborted_excluded": int(aborted),  # every row left out, whatever its reason (see n_excluded_*)
        **{f"n_excluded_{reason}": int(count) for reason, count in sorted(excluded.items())},
        "data_hash": _data_hash(train.request_ids),
        "length_distribution": distribution_note,
    }
    if selection is not None:
        params["alpha_scoring"] = selection.scoring
        params["alpha_grid"] = ",".join(f"{a:g}" for a in selection.alphas)
        params["validation_fraction"] = VALIDATION_FRACTION
    return FitResult(readout=readout, rls_state=rls_state, metrics=figures, params=params,
                     eval_arrays={"true": true, "pred": pred})
