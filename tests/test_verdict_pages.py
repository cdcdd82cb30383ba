"""The gate's verdict where reviewers look, read in a real browser.

A verdict of paired replays (`leap_core.gate_verdict`) is recorded by the gate's own task into a real
`mlflow server`, and the gate flow, run on a real `prefect server start`, publishes it as its artifacts.
Headless Chromium then renders the challenger version's MLflow page and the Prefect artifact's page, and
each must show the outcome and the ratio; a screenshot of each is kept. Chromium is a Debian package
(infra/system-packages.sh): without it this test fails and says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("mlflow")
pytest.importorskip("prefect")

from experiments.faults.pipeline import fitted_readout
from flows.gate_artifacts import FIGURES_KEY, VERDICT_KEY, version_page
from leap_core.gate_verdict import gate_verdict
from registry.client import ReadoutRegistry
from study_harness.servers import MlflowServer
from tests.flow_fixtures import pipeline_home
from tests.prefect_server_fixtures import PrefectServer, prefect_server

pytestmark = pytest.mark.pipeline
CHROMIUM = "chromium"
RENDER_TIMEOUT_S = 120
VIRTUAL_TIME_MS = 20000  # the pages are single-page apps: the DOM is read after their requests settle


def _chromium() -> str:
    found = shutil.which(CHROMIUM)
    if found is None:
        pytest.fail("Chromium is not installed: apt-get install -y --no-install-recommends chromium "
                    "(infra/system-packages.sh installs it)", pytrace=False)
    return found


def _browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1800",
               f"--virtual-time-budget={VIRTUAL_TIME_MS}", *extra, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)


def rendered(url: str, folder: Path, shot_name: str) -> tuple[str, Path]:
    """The page's DOM once its scripts have run, and a screenshot of it."""
    folder.mkdir(parents=True, exist_ok=True)
    dom = _browse(url, folder / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = folder / shot_name
    taken = _browse(url, folder / "profile-shot", f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    return dom.stdout, shot


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[MlflowServer, PrefectServer]]:
    _chromium()
    with MlflowServer(tmp_path_factory.mktemp("mlflow"), start_timeout_s=120.0) as mlflow, \
            prefect_server(tmp_path_factory.mktemp("prefect")) as prefect:
        yield mlflow, prefect


def _paired_replays() -> dict:
    """Two arms over the same 40 requests, twice each: the challenger a fifth faster on every request."""
    rng = np.random.default_rng(11)
    tokens = np.tile(rng.integers(10, 400, 40), 2)
    fcfs = rng.lognormal(-3.0, 0.4, 80)
    return {policy: {"mean_ptl": float(ptl.mean()), "ptl": ptl.tolist(), "output_tokens": tokens.tolist(),
                     "repeats": 2} for policy, ptl in (("fcfs", fcfs), ("challenger", 0.8 * fcfs))}


def test_the_verdict_reads_the_same_on_the_mlflow_version_page_and_the_prefect_artifact(servers, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import gate_flow
    from flows.tasks import record_gate
    from store.stores import store_location

    mlflow, prefect = servers
    home = tmp_path / "home"
    with pipeline_home(home, LEAP_MLFLOW_TRACKING_URI=mlflow.url), \
            temporary_settings({PREFECT_API_URL: prefect.api_url}):
        registry = ReadoutRegistry(mlflow.url)
        readout, rls = fitted_readout("20260101T000000-verdict1", seed=3)
        logged = registry.log_readout(readout, rls=rls, params={"data_hash": "verdict"}, metrics={"spearman": 0.5})
        results = _paired_replays()
        verdict = gate_verdict(results)
        assert verdict["outcome"] == "better" and verdict["passed"]
        from flows.settings import PipelineSettings

        record_gate.fn(store_location(PipelineSettings()), mlflow.url, logged.name, logged.version, None, results,
                       verdict)
        answer = gate_flow(version=logged.version, name=logged.name)
    assert answer["status"] == "recorded" and set(answer["artifacts"]) == {"markdown", "table"}
    ratio = f"x{verdict['mean_ptl_ratio']:.3f}"
    title = "Gate: better against fcfs, passed"

    version = registry.client.get_model_version(logged.name, logged.version)
    assert version.tags["leap.gate.outcome"] == "better" and title in version.description
    page = version_page(mlflow.url, logged.name, logged.version)
    dom, shot = rendered(page, tmp_path / "mlflow-page", "mlflow-version.png")
    assert title in dom and f"{ratio} of the fcfs's" in dom and "<table" in dom, dom[-3000:]
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one

    api = httpx.Client(base_url=prefect.api_url, timeout=30)
    markdown = api.get(f"/artifacts/{answer['artifacts']['markdown']}").json()
    assert markdown["key"] == VERDICT_KEY and markdown["type"] == "markdown" and title in markdown["data"]
    assert api.get(f"/artifacts/{VERDICT_KEY}/latest").json()["data"] == markdown["data"]
    table = api.get(f"/artifacts/{answer['artifacts']['table']}").json()
    assert table["key"] == FIGURES_KEY and table["flow_run_id"] == markdown["flow_run_id"]
    rows = json.loads(table["data"])  # a table artifact keeps its rows as JSON text
    assert {"figure": "outcome", "value": "better, passed (rule on no difference: keep)"} in rows
    # the key's page lists every gate's verdict by its one-line summary; the artifact's page renders the table
    dom, shot = rendered(f"{prefect.url}/artifacts/key/{VERDICT_KEY}", tmp_path / "prefect-key", "prefect-key.png")
    assert f"{title}: mean PTL {ratio}" in dom, dom[-3000:]
    assert shot.stat().st_size > 10_000
    dom, shot = rendered(f"{prefect.url}/artifacts/artifact/{markdown['id']}", tmp_path / "prefect-artifact",
                         "prefect-artifact.png")
    assert title in dom and f"{ratio} of the fcfs's" in dom and "<table" in dom, dom[-3000:]
    assert shot.stat().st_size > 10_000
