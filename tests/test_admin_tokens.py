"""Each replica its own admin token: the control plane reads them from a folder laid out as a mounted
Kubernetes Secret, and every flow call reaches each real admin server with that replica's token alone."""

from __future__ import annotations

import os

import pytest

from flows.push import push_readout, serving_version
from leap_io.admin_client import AdminTokens, PushFailed, read_token_folder
from leap_io.settings import LeapSettings
from serving.admin.api import AdminServer
from tests.test_admin_api import Target, _readout_bytes


def _secret_mount(folder, tokens: dict[str, str]):
    """What the kubelet writes for a Secret volume: the keys under a timestamped folder, `..data` linking
    to it and each key a link through `..data`."""
    stamped = folder / "..2026_12_07_12_00_00.000000001"
    stamped.mkdir(parents=True)
    for key, token in tokens.items():
        (stamped / key).write_text(token + "\n")
    os.symlink(stamped.name, folder / "..data")
    for key in tokens:
        os.symlink(f"..data/{key}", folder / key)
    return folder


def test_the_folder_of_a_mounted_secret_gives_each_replica_its_token(tmp_path):
    folder = _secret_mount(tmp_path / "tokens", {"leap-serving-0": "tok-0", "leap-serving-1": "tok-1"})
    assert read_token_folder(folder) == {"leap-serving-0": "tok-0", "leap-serving-1": "tok-1"}
    tokens = AdminTokens("shared", read_token_folder(folder))
    assert tokens.for_endpoint("http://leap-serving-1:8011") == "tok-1"
    assert tokens.for_endpoint("http://leap-serving-2:8011") == "shared"  # not named: the shared token
    assert "tok-" not in repr(tokens) and "shared'" not in repr(tokens)


@pytest.mark.parametrize("content, why", [(b"", "no single token"), (b"two tokens", "no single token"),
                                          (b"\xff\xfe", "not text"), (b"x" * 5000, "no single token")])
def test_a_token_file_that_holds_no_token_is_refused_by_name(tmp_path, content, why):
    (tmp_path / "leap-serving-0").write_bytes(content)
    with pytest.raises(ValueError, match=why) as refused:
        read_token_folder(tmp_path)
    assert "leap-serving-0" in str(refused.value)


def test_the_settings_read_the_folder_beside_the_shared_token(tmp_path, monkeypatch):
    _secret_mount(tmp_path / "tokens", {"127.0.0.1_8011": "own"})
    monkeypatch.setenv("LEAP_ADMIN_TOKENS_DIR", str(tmp_path / "tokens"))
    monkeypatch.setenv("LEAP_ADMIN_TOKEN", "shared")
    tokens = LeapSettings().admin_tokens()
    assert tokens.for_endpoint("http://127.0.0.1:8011") == "own"
    assert tokens.for_endpoint("http://127.0.0.1:8012") == "shared"


def test_flows_reach_each_real_admin_server_with_its_own_token_and_the_shared_one_is_refused():
    servers = [AdminServer(Target(), "127.0.0.1", 0, f"replica-{i}-token") for i in range(2)]
    try:
        endpoints = [f"http://127.0.0.1:{server.port}" for server in servers]
        tokens = AdminTokens("the-shared-token", {f"127.0.0.1_{s.port}": f"replica-{i}-token"
                                                  for i, s in enumerate(servers)})
        bundle = _readout_bytes("v7")  # a bare readout: the push the admin API takes without RLS state
        for endpoint in endpoints:
            assert push_readout(endpoint, tokens, bundle, "v7", retries=0)["version"] == "v7"
            assert serving_version(endpoint, tokens) == "v7"
        with pytest.raises(PushFailed):  # a token of one replica opens no other
            push_readout(endpoints[1], AdminTokens(None, {f"127.0.0.1_{servers[1].port}": "replica-0-token"}),
                         bundle, "v7", retries=0)
        with pytest.raises(PushFailed):
            push_readout(endpoints[0], "the-shared-token", bundle, "v7", retries=0)
    finally:
        for server in servers:
            server.close()
