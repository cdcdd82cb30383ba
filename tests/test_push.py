"""The push client against real admin HTTP servers that validate pushes like a serving replica does."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from flows.push import PushFailed, push_readout, serving_version
from flows.settings import PipelineSettings
from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from serving.admin import AdminServer
from leap_io.push_bundle import make_bundle
from serving.push import validate_push

pytest.importorskip("mlflow")

from flows.tasks import push_champion  # noqa: E402
from registry.client import CHALLENGER, CHAMPION, ReadoutRegistry  # noqa: E402

MODEL_ID = "smol-test"
FINGERPRINT = "sha256:feedface"
LAYER = 20
DIM = 16
MAX_TOKENS = 512
TOKEN = "s3cret-token"


def _readout(dim: int, version: str, seed: int) -> tuple[LinearReadout, RLS]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(200, dim)).astype(np.float32)
    lengths = np.clip(np.exp(4 + 0.5 * features[:, 0]), 1, MAX_TOKENS).round()
    readout = LinearReadout(alpha=1.0, target="sqrt", max_tokens=MAX_TOKENS).fit(features, lengths)
    readout.metadata.update(model_id=MODEL_ID, model_fingerprint=FINGERPRINT, layer=LAYER, version=version)
    return readout, RLS.from_readout(readout, features)


class Replica:
    """The admin target of a serving process: validates a push against its features, then swaps.

    It validates with `serving.push.validate_push`, exactly as `LeapRuntime.push_readout` does, so
    any refusal leaves the old readout; only the engine is left out.
    """

    def __init__(self, dim: int = DIM, fail_next: int = 0) -> None:
        self.dim = dim
        self.readout: LinearReadout | None = None
        self.fail_next = fail_next
        self.metrics_registry = CollectorRegistry()

    @property
    def version(self) -> str:
        return "" if self.readout is None else str(self.readout.metadata.get("version", ""))

    def describe(self) -> dict:
        return {"version": self.version, "layer": LAYER, "dim": self.dim, "model_fingerprint": FINGERPRINT}

    def push_readout(self, body: bytes) -> dict:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("transient failure")
        expect = {"layer": LAYER, "dim": self.dim, "model_fingerprint": FINGERPRINT}
        readout, _ = validate_push(body, expect, self.readout)
        previous = self.version
        self.readout = readout
        return {"version": self.version, "previous": previous}


@pytest.fixture
def replica():
    target = Replica()
    server = AdminServer(target, "127.0.0.1", 0, TOKEN)
    yield target, f"http://127.0.0.1:{server.port}"
    server.close()


def _bundle(readout: LinearReadout, rls: RLS | None) -> bytes:
    return make_bundle(to_bytes(readout), rls.state_arrays() if rls is not None else None)


def test_push_swaps_the_readout_and_verifies_the_reported_version(replica):
    target, url = replica
    readout, rls = _readout(DIM, "v-one", seed=0)
    result = push_readout(url, TOKEN, _bundle(readout, rls), "v-one", retries=0)
    assert result["version"] == "v-one" and result["attempts"] == 1
    assert serving_version(url) == "v-one"
    np.testing.assert_allclose(target.readout.coef_, readout.coef_)


def test_wrong_token_is_refused_at_once_and_the_old_readout_keeps_serving(replica):
    target, url = replica
    first, rls = _readout(DIM, "v-one", seed=0)
    push_readout(url, TOKEN, _bundle(first, rls), "v-one", retries=0)
    second, rls2 = _readout(DIM, "v-two", seed=1)
    with pytest.raises(PushFailed) as failure:
        push_readout(url, "wrong", _bundle(second, rls2), "v-two", retries=3, backoff_s=5.0)
    assert failure.value.status == 401
    assert "token" in str(failure.value)
    assert serving_version(url) == "v-one"


def test_wrong_dim_is_refused_with_the_reason(replica):
    _, url = replica
    readout, rls = _readout(DIM + 4, "v-wide", seed=2)
    with pytest.raises(PushFailed) as failure:
        push_readout(url, TOKEN, _bundle(readout, rls), "v-wide", retries=0)
    assert failure.value.status == 409
    assert "dim" in str(failure.value)
    assert serving_version(url) == ""


def test_server_errors_are_retried_until_the_version_serves():
    target = Replica(fail_next=2)
    server = AdminServer(target, "127.0.0.1", 0, TOKEN)
    try:
        readout, rls = _readout(DIM, "v-retry", seed=3)
        url = f"http://127.0.0.1:{server.port}"
        result = push_readout(url, TOKEN, _bundle(readout, rls), "v-retry", retries=2, backoff_s=0.01)
        assert result["attempts"] == 3
        target.fail_next = 5
        with pytest.raises(PushFailed, match="after 2 attempts"):
            push_readout(url, TOKEN, _bundle(readout, rls), "v-retry", retries=1, backoff_s=0.01)
    finally:
        server.close()


def test_unreachable_replica_fails_after_its_retries():
    with pytest.raises(PushFailed, match="after 2 attempts"):
        push_readout("http://127.0.0.1:9", TOKEN, b"x", "v", retries=1, timeout=1.0, backoff_s=0.01)


@pytest.mark.pipeline
def test_refused_push_reverts_replicas_and_leaves_the_aliases(tmp_path):
    """Two replicas: the first takes the challenger, the second (other hidden size) refuses it; the first
    is put back on the champion and no alias moves."""
    registry = ReadoutRegistry(f"sqlite:///{tmp_path}/mlflow.db")
    champion, champion_rls = _readout(DIM, "v-champion", seed=4)
    challenger, challenger_rls = _readout(DIM, "v-challenger", seed=5)
    params = {"data_hash": "test"}
    v1 = registry.log_readout(champion, rls=champion_rls, params=params, metrics={"spearman": 0.5})
    v2 = registry.log_readout(challenger, rls=challenger_rls, params=params, metrics={"spearman": 0.6})
    registry.promote(v1.name, v1.version)
    registry.set_challenger(v2.name, v2.version)

    good, odd = Replica(), Replica()
    servers = [AdminServer(good, "127.0.0.1", 0, TOKEN), AdminServer(odd, "127.0.0.1", 0, TOKEN)]
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    try:
        pushed = push_champion.fn(registry.tracking_uri, v1.name, urls[:1], TOKEN, retries=0)
        assert pushed["version"] == v1.version and good.version == "v-champion"

        odd.dim = DIM + 1  # a replica of another model: every readout of this one is refused
        with pytest.raises(PushFailed) as failure:
            push_champion.fn(registry.tracking_uri, v1.name, urls, TOKEN, version=v2.version, retries=0)
        assert urls[1] in str(failure.value)
        assert good.version == "v-champion"  # reverted after taking the challenger
        assert odd.version == ""
        assert registry.get_alias(v1.name, CHAMPION) == v1.version
        assert registry.get_alias(v1.name, CHALLENGER) == v2.version
    finally:
        for server in servers:
            server.close()


def test_admin_token_is_created_once_private_and_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    monkeypatch.delenv("LEAP_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("LEAP_ADMIN_TOKEN_FILE", raising=False)
    first = PipelineSettings(mlflow_tracking_uri="sqlite:///unused.db")
    token = first.token()
    assert len(token) >= 32
    path = tmp_path / "admin.token"
    assert path.read_text().strip() == token
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert PipelineSettings(mlflow_tracking_uri="sqlite:///unused.db").token() == token
    monkeypatch.setenv("LEAP_ADMIN_TOKEN", "from-env")
    assert PipelineSettings(mlflow_tracking_uri="sqlite:///unused.db").token() == "from-env"
