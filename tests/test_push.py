"""The push client against real admin HTTP servers that validate pushes like a serving replica does."""

from __future__ import annotations

import io
import os
import stat
import tracemalloc
import zipfile

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from flows.push import PushFailed, push_readout, serving_version
from flows.settings import PipelineSettings
from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from leap_io.push_bundle import make_bundle
from serving.admin.api import AdminServer
from serving.readout.push import PushRefused, is_older, validate_push, version_key

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

    It validates with `serving.readout.push.validate_push`, exactly as `LeapRuntime.push_readout` does, so
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
    assert serving_version(url, TOKEN) == "v-one"
    np.testing.assert_allclose(target.readout.coef_, readout.coef_)


def test_wrong_token_is_refused_at_once_and_the_old_readout_keeps_serving(replica):
    _, url = replica
    first, rls = _readout(DIM, "v-one", seed=0)
    push_readout(url, TOKEN, _bundle(first, rls), "v-one", retries=0)
    second, rls2 = _readout(DIM, "v-two", seed=1)
    with pytest.raises(PushFailed) as failure:
        push_readout(url, "wrong", _bundle(second, rls2), "v-two", retries=3, backoff_s=5.0)
    assert failure.value.status == 401
    assert "token" in str(failure.value)
    assert serving_version(url, TOKEN) == "v-one"


def test_wrong_dim_is_refused_with_the_reason(replica):
    _, url = replica
    readout, rls = _readout(DIM + 4, "v-wide", seed=2)
    with pytest.raises(PushFailed) as failure:
        push_readout(url, TOKEN, _bundle(readout, rls), "v-wide", retries=0)
    assert failure.value.status == 409
    assert "dim" in str(failure.value)
    assert serving_version(url, TOKEN) == ""


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
    pytest.importorskip("mlflow")
    from flows.tasks import push_champion
    from registry.client import CHALLENGER, CHAMPION, ReadoutRegistry

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


# ---------------------------------------------------------------------------- hostile pushes

def _post(url: str, body: bytes, query: str = "") -> httpx.Response:
    return httpx.post(f"{url}/leap/readout{query}", content=body, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"})


def _zip_member_of_zeros(archive: zipfile.ZipFile, name: str, shape: tuple[int, ...]) -> None:
    """A deflated .npy member of zeros: a few hundred KiB that unpack to shape x 8 bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    with archive.open(name, "w", force_zip64=True) as member:
        member.write(header.getvalue())
        zeros, left = bytes(8 << 20), int(np.prod(shape)) * 8
        while left > 0:
            member.write(zeros[:min(left, len(zeros))])
            left -= len(zeros)


@pytest.fixture(scope="module")
def rls_bomb() -> bytes:
    """A bundle whose rls_P unpacks to 538 MB: beyond what a readout of dim 8192 needs."""
    readout, _ = _readout(DIM, "v-bomb", seed=9)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("readout_bytes.npy", _npy(np.frombuffer(to_bytes(readout), dtype=np.uint8)))
        _zip_member_of_zeros(archive, "rls_P.npy", (8200, 8200))
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def test_a_compressed_bomb_is_refused_from_its_headers_before_it_is_unpacked(replica, rls_bomb):
    target, url = replica
    assert len(rls_bomb) < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(PushRefused) as refused:
            validate_push(rls_bomb, {"layer": LAYER, "dim": DIM, "model_fingerprint": FINGERPRINT}, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status == 413 and "P" in str(refused.value) and "(8200, 8200)" in str(refused.value)
    assert peak < 64 << 20  # nothing near the 538 MB it claims was allocated
    response = _post(url, rls_bomb)
    assert response.status_code == 413 and "RLS array P" in response.json()["error"]
    assert target.version == ""


def test_a_readout_file_that_unpacks_past_its_cap_is_refused(replica):
    _, url = replica
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        _zip_member_of_zeros(archive, "coef.npy", (3_000_000,))  # 24 MB of weights in a few KiB
    bare = buffer.getvalue()
    response = _post(url, bare)
    assert response.status_code == 413 and "coef" in response.json()["error"]
    inside = make_bundle(bare, None)
    response = _post(url, inside)
    assert response.status_code == 413 and "coef" in response.json()["error"]


def test_object_arrays_and_unknown_members_are_refused(replica):
    readout, _ = _readout(DIM, "v-odd", seed=10)
    _, url = replica
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("readout_bytes.npy", _npy(np.frombuffer(to_bytes(readout), dtype=np.uint8)))
        archive.writestr("rls_theta.npy", _npy(np.zeros(DIM + 1)))
        archive.writestr("payload.npy", _npy(np.zeros(3)))
    response = _post(url, buffer.getvalue())
    assert response.status_code == 422 and "unknown member 'payload.npy'" in response.json()["error"]

    pickled = io.BytesIO()
    with zipfile.ZipFile(pickled, "w") as archive:
        archive.writestr("readout_bytes.npy", _npy(np.frombuffer(to_bytes(readout), dtype=np.uint8)))
        member = io.BytesIO()
        np.lib.format.write_array(member, np.array([{"x": 1}], dtype=object), allow_pickle=True)
        archive.writestr("rls_theta.npy", member.getvalue())
    response = _post(url, pickled.getvalue())
    assert response.status_code == 422 and "Python objects" in response.json()["error"]


def test_a_bare_readout_file_still_serves(replica):
    target, url = replica
    readout, _ = _readout(DIM, "v-bare", seed=11)
    response = _post(url, to_bytes(readout))
    assert response.status_code == 200 and target.version == "v-bare"


@pytest.mark.parametrize(("array", "value", "reason"), [
    ("coef", 1e39, "beyond float32"),
    ("mean", -3e38 * 10, "beyond float32"),
    ("scale", 1e-40, "must be at least"),
])
def test_weights_that_overflow_float32_are_refused(replica, array, value, reason):
    target, url = replica
    readout, _ = _readout(DIM, "v-huge", seed=12)
    getattr(readout, f"{array}_")[3] = value
    response = _post(url, to_bytes(readout))
    assert response.status_code == 422, response.text
    assert f"readout {array}" in response.json()["error"] and reason in response.json()["error"]
    assert target.version == ""


def test_rls_state_with_non_finite_weights_is_refused(replica):
    target, url = replica
    readout, rls = _readout(DIM, "v-nan-theta", seed=13)
    state = rls.state_arrays()
    state["theta"] = state["theta"].copy()
    state["theta"][0] = np.inf
    response = _post(url, make_bundle(to_bytes(readout), state))
    assert response.status_code == 422 and "RLS array theta" in response.json()["error"]
    state["theta"][0] = 1e300
    response = _post(url, make_bundle(to_bytes(readout), state))
    assert response.status_code == 422 and "beyond float32" in response.json()["error"]
    assert target.version == ""


def test_an_older_version_does_not_replace_a_newer_one_unless_forced(replica):
    target, url = replica
    newer, newer_rls = _readout(DIM, "v12", seed=14)
    older, older_rls = _readout(DIM, "v11", seed=15)
    assert _post(url, _bundle(newer, newer_rls)).status_code == 200
    refused = _post(url, _bundle(older, older_rls))
    assert refused.status_code == 409
    assert "older than the serving 'v12'" in refused.json()["error"] and "force" in refused.json()["error"]
    assert target.version == "v12"
    assert _post(url, _bundle(older, older_rls), "?force=1").status_code == 200
    assert target.version == "v11"
    assert _post(url, _bundle(newer, newer_rls)).status_code == 200
    forced = make_bundle(to_bytes(older), older_rls.state_arrays(), force=True)
    assert _post(url, forced).status_code == 200 and target.version == "v11"
    assert _post(url, to_bytes(newer)).status_code == 200
    assert _post(url, to_bytes(older), "?force=true").status_code == 200  # a bare readout, forced
    assert target.version == "v11"
    unordered, unordered_rls = _readout(DIM, "hand-made", seed=16)
    assert _post(url, _bundle(unordered, unordered_rls)).status_code == 200  # no scheme: accepted


def test_versions_compare_only_within_one_scheme():
    assert version_key("v12") == ("v", 12) and version_key("v12+rls3") == ("v", 12)
    assert version_key("leap-readout/3") == ("named:leap-readout", 3)
    assert version_key("20250102T030405-ab12cd34") == ("time", "20250102T030405")
    assert version_key("push-2") is None and version_key("") is None
    assert is_older("v9", "v12")  # numbers, not text: v9 < v12
    assert not is_older("v12", "v12+rls4")  # the same readout before its online updates
    assert is_older("leap-readout/2", "leap-readout/3")
    assert not is_older("other/1", "leap-readout/3")
    assert is_older("20250101T000000-aaaa", "20250102T000000-bbbb")
    assert not is_older("20250103T000000-aaaa", "20250102T000000-bbbb")
    assert not is_older("v1", "20250102T000000-bbbb") and not is_older("v1", "")


def test_a_slope_that_overflows_float32_is_refused(replica):
    _, url = replica
    readout, _ = _readout(DIM, "v-steep", seed=17)
    readout.coef_[2], readout.scale_[2] = 1e35, 1e-5  # each fits float32; coef / scale does not
    response = _post(url, to_bytes(readout))
    assert response.status_code == 422 and "coef / scale" in response.json()["error"]


def test_a_fitted_target_serves_with_its_map_and_a_pushed_map_out_of_order_is_refused(replica):
    """A rank readout pushes like any other and decodes through the map it carries; a later push whose map is not
    increasing is refused with the reason over HTTP, and the rank readout keeps serving."""
    target, url = replica
    rng = np.random.default_rng(9)
    features = rng.normal(size=(200, DIM)).astype(np.float32)
    lengths = np.clip(np.exp(4 + 0.5 * features[:, 0]), 1, MAX_TOKENS).round()
    readout = LinearReadout(alpha=1.0, target="rank", max_tokens=MAX_TOKENS).fit(features, lengths)
    readout.metadata.update(model_id=MODEL_ID, model_fingerprint=FINGERPRINT, layer=LAYER, version="v-rank")
    push_readout(url, TOKEN, _bundle(readout, RLS.from_readout(readout, features)), "v-rank", retries=0)
    assert target.readout.target_map_ == readout.target_map_
    np.testing.assert_array_equal(target.readout.predict(features), readout.predict(features))

    readout.metadata["version"] = "v-rank-2"
    with np.load(io.BytesIO(to_bytes(readout))) as stored:
        arrays = {name: stored[name] for name in stored.files}
    arrays["target_values"] = arrays["target_values"][::-1].copy()
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with pytest.raises(PushFailed) as failure:
        push_readout(url, TOKEN, make_bundle(buffer.getvalue(), None), "v-rank-2", retries=0)
    assert failure.value.status == 422 and "strictly increasing" in str(failure.value)
    assert serving_version(url, TOKEN) == "v-rank"
