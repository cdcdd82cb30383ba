"""What the flow tests share: a LEAP_HOME whose settings point the pipeline at local parts only, and the
loop's first two steps run once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def pipeline_home(folder: Path, **env: str) -> Iterator[Path]:
    """`folder` as LEAP_HOME: MLflow on a sqlite file in it, no replicas to push to, 100 rows to fit on,
    settings that would pick another budget, layer or model cleared; `env` sets more LEAP_* values."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LEAP_HOME", str(folder))
        patch.setenv("LEAP_MLFLOW_TRACKING_URI", f"sqlite:///{folder}/mlflow/mlflow.db")
        patch.setenv("LEAP_ENDPOINTS", "")
        patch.setenv("LEAP_MIN_ROWS", "100")
        for key, value in env.items():
            patch.setenv(key, value)
        for key in ("LEAP_MAX_TOKENS", "LEAP_LAYER", "LEAP_MODEL_FINGERPRINT", "LEAP_ADMIN_TOKEN"):
            patch.delenv(key, raising=False)
        yield folder


def ingest_and_fit(home: Path) -> dict:
    """Run the ingest and fit flows once; their results, the registry URI and the store."""
    from flows.pipeline import fit_flow, ingest_flow
    from store.duckdb import LogStore

    ingested = ingest_flow()
    fit = fit_flow()
    return {"ingest": ingested, "fit": fit, "uri": f"sqlite:///{home}/mlflow/mlflow.db",
            "store": LogStore(home / "leap.duckdb")}
