"""`leap bench rls`: time one RLS update at the serving model's hidden size.

RLS runs in the serving process after every batch of finished requests, so its per-update cost
must stay well below a decode step; this prints the figure instead of asserting it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import numpy as np
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from leap_cli.output import console, emit
from study_cli.apps import bench_app

if TYPE_CHECKING:
    from leap_core.rls import RLS


def _anchored_rls(X_train: np.ndarray, rng: np.random.Generator) -> RLS:
    """An RLS anchored on `X_train`; the readout weights are random, since fitting them would only
    add set-up time without changing the cost of an update."""
    from leap_core.readout import LinearReadout, Standardizer
    from leap_core.rls import RLS

    dim = X_train.shape[1]
    standardizer = Standardizer().fit(X_train)
    readout = LinearReadout.from_weights(standardizer.mean_, standardizer.scale_,
                                         coef=rng.standard_normal(dim) / np.sqrt(dim), intercept=15.0,
                                         alpha=1.0, target="sqrt", max_tokens=2048)
    return RLS.from_readout(readout, X_train)


@bench_app.command("rls")
def bench_rls(
    dim: Annotated[int, typer.Option(help="Hidden size d (the readout input dimension).")] = 4096,
    batch: Annotated[int, typer.Option(help="Finished requests folded in per update.")] = 8,
    repeats: Annotated[int, typer.Option(help="Timed updates (after one untimed warm-up).")] = 30,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Median and p95 wall time of one RLS update of `batch` rows at hidden size `dim`."""
    if dim < 1 or batch < 1 or repeats < 1:
        raise typer.BadParameter("--dim, --batch and --repeats must be positive")
    import leap_core.rls  # noqa: F401  (imported before the clock starts: scikit-learn loads slowly)

    rng = np.random.default_rng(0)
    # One untimed warm-up plus the timed updates, each on a fresh batch drawn before timing.
    batches = [(np.column_stack([np.ones(batch), rng.standard_normal((batch, dim))]),
                np.sqrt(rng.integers(1, 2048, batch).astype(np.float64)))
               for _ in range(repeats + 1)]
    times_ms: list[float] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=as_json) as progress:
        task = progress.add_task(f"anchoring RLS at d={dim}", total=None)
        X_train = rng.standard_normal((2 * dim, dim))
        start = time.perf_counter()
        rls = _anchored_rls(X_train, rng)
        del X_train
        setup_s = time.perf_counter() - start
        progress.update(task, description=f"timing {repeats} updates of {batch} rows", total=repeats)
        rls.update(*batches[0])
        for U, y in batches[1:]:
            tick = time.perf_counter()
            rls.update(U, y)
            times_ms.append((time.perf_counter() - tick) * 1e3)
            progress.advance(task)
    emit({
        "dim": dim,
        "batch": batch,
        "update_ms_median": float(np.median(times_ms)),
        "update_ms_p95": float(np.percentile(times_ms, 95)),
        "setup_s": setup_s,
    }, as_json, title="RLS update")
