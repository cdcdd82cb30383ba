"""A replica that starts or restarts takes the published champion when it is newer than its own saved push:
real runtimes (no engine), a real publication folder; damaged or foreign publications never keep a
replica down."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from leap_core.readout_format import to_bytes
from leap_io.champion import ChampionPublication, PublicationDamaged, default_location
from leap_io.model_identity import registered_model_name
from leap_io.push_bundle import make_bundle
from tests.fleet_fixtures import champion_readout
from tests.object_feedback_fixtures import bucket, s3_endpoint, s3_env  # noqa: F401 - fixtures
from tests.runtime_fixtures import LAYER, MODEL, build  # noqa: F401  (pytest fixtures, used by name)

NAME = registered_model_name(MODEL, LAYER)


def _bundle(version: str, seed: int = 0, **metadata) -> bytes:
    readout, rls, _, _ = champion_readout(version, np.random.default_rng(seed))
    readout.metadata.update(metadata)
    return make_bundle(to_bytes(readout), rls.state_arrays())


def _start(build, tmp_path, state: str = "state", **leap):
    return build(policy="leap", rls=True, state_dir=str(tmp_path / state), champion_url=str(tmp_path / "champion"),
                 **leap)


def test_a_publication_reads_back_and_a_torn_one_is_refused(tmp_path):
    publication = ChampionPublication(tmp_path / "champion")
    assert publication.load(NAME) is None
    written = publication.publish(NAME, b"bundle bytes", "v7", 3)
    loaded = publication.load(NAME)
    assert (loaded.bundle, loaded.version, loaded.registry_version) == (b"bundle bytes", "v7", "3")
    assert loaded.published_at == written["published_at"]
    (tmp_path / "champion" / f"{NAME}.bundle").write_bytes(b"another publication's bundle")
    with pytest.raises(PublicationDamaged, match="not the one"):
        publication.load(NAME)
    with pytest.raises(ValueError, match="publication name"):
        publication.load("../escape")


def test_the_default_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LEAP_CHAMPION_URL", raising=False)
    monkeypatch.setenv("LEAP_HOME", str(tmp_path))
    assert default_location() == str(tmp_path.resolve() / "champion")
    monkeypatch.setenv("LEAP_CHAMPION_URL", "s3://leap-champions/fleet")
    assert default_location() == "s3://leap-champions/fleet"


def test_a_new_replica_serves_the_published_champion_and_keeps_it(build, tmp_path):
    ChampionPublication(tmp_path / "champion").publish(NAME, _bundle("20250105T000000-champ001"), "20250105T000000-champ001", 4)

    runtime = _start(build, tmp_path)

    described = runtime.describe()
    assert (described["source"], described["version"]) == ("champion", "20250105T000000-champ001")
    assert described["champion"]["state"] == "loaded" and described["rls"]["active"] is True
    assert runtime.readouts.state.saved()[0] == "20250105T000000-champ001"  # a restart restores it


def test_a_restarted_replica_takes_a_champion_published_after_its_last_push(build, tmp_path):
    first = _start(build, tmp_path)
    first.push_readout(_bundle("20250101T000000-old00001"))
    first.close()
    time.sleep(0.01)
    ChampionPublication(tmp_path / "champion").publish(NAME, _bundle("20250106T000000-new00001", 1),
                                                       "20250106T000000-new00001", 5)

    restarted = _start(build, tmp_path)

    assert (restarted.describe()["source"], restarted.readouts.version) == ("champion", "20250106T000000-new00001")


def test_a_push_saved_after_the_publication_wins(build, tmp_path):
    ChampionPublication(tmp_path / "champion").publish(NAME, _bundle("20250105T000000-champ001"),
                                                       "20250105T000000-champ001", 4)
    first = _start(build, tmp_path)
    first.push_readout(_bundle("20250107T000000-pushed01", 2))
    first.close()

    restarted = _start(build, tmp_path)

    assert (restarted.describe()["source"], restarted.readouts.version) == ("state", "20250107T000000-pushed01")
    assert restarted.describe()["champion"]["state"] == "older-than-state"


@pytest.mark.parametrize("damage", ["torn", "foreign"])
def test_an_unusable_publication_is_counted_and_never_keeps_the_replica_down(build, tmp_path, damage):
    first = _start(build, tmp_path)
    first.push_readout(_bundle("20250101T000000-old00001"))
    first.close()
    publication = ChampionPublication(tmp_path / "champion")
    if damage == "torn":
        publication.publish(NAME, _bundle("20250106T000000-new00001"), "20250106T000000-new00001", 5)
        (tmp_path / "champion" / f"{NAME}.bundle").write_bytes(b"PK\x03\x04 half a bundle")
    else:  # a readout of a layer this replica does not capture: refused exactly as a push would be
        bundle = _bundle("20250106T000000-new00001", layer=LAYER + 1)
        publication.publish(NAME, bundle, "20250106T000000-new00001", 5)

    restarted = _start(build, tmp_path)

    described = restarted.describe()
    assert (described["source"], described["version"]) == ("state", "20250101T000000-old00001")
    assert described["champion"]["state"] == "failed" and restarted.health()["healthy"]
    assert restarted.telemetry.dropped("champion", "unusable") == 1


def test_a_publication_in_a_bucket_serves_a_new_replica(build, tmp_path, bucket):
    """The same publication in object storage (a real S3 endpoint: moto's server)."""
    location = f"s3://{bucket}/champion"
    ChampionPublication(location).publish(NAME, _bundle("20250108T000000-bucket01"), "20250108T000000-bucket01", 6)
    assert ChampionPublication(location).load(NAME).version == "20250108T000000-bucket01"

    runtime = build(policy="leap", rls=True, state_dir=str(tmp_path / "state"), champion_url=location)

    assert (runtime.describe()["source"], runtime.readouts.version) == ("champion", "20250108T000000-bucket01")


def test_a_damaged_saved_push_gives_way_to_an_older_publication(build, tmp_path):
    ChampionPublication(tmp_path / "champion").publish(NAME, _bundle("20250105T000000-champ001"),
                                                       "20250105T000000-champ001", 4)
    first = _start(build, tmp_path)
    first.push_readout(_bundle("20250107T000000-pushed01", 2))
    first.close()
    (tmp_path / "state" / "readout.bin").write_bytes(b"edited")

    restarted = _start(build, tmp_path)

    assert (restarted.describe()["source"], restarted.readouts.version) == ("champion", "20250105T000000-champ001")


def test_a_publication_names_its_registry_in_one_spelling(tmp_path, monkeypatch):
    from leap_io.champion import registry_key

    monkeypatch.chdir(tmp_path)
    assert registry_key("sqlite:///mlflow/mlflow.db") == f"sqlite:///{tmp_path.resolve()}/mlflow/mlflow.db"
    assert registry_key("HTTP://MLflow.example:5000/") == registry_key("http://mlflow.example:5000")
    assert registry_key("http://a:5000") != registry_key("http://b:5000")
    publication = ChampionPublication(tmp_path / "champion")
    written = publication.publish(NAME, b"bundle bytes", "v7", 3, "http://MLflow.example:5000/")
    assert written["registry"] == publication.load(NAME).registry == "http://mlflow.example:5000"
    publication.publish(NAME, b"bundle bytes", "v8", 4)  # a promoter that names no registry
    assert publication.load(NAME).registry is None


def test_a_replica_leaves_another_registrys_champion_alone(build, tmp_path):
    """Two registries share one home: a replica of registry B keeps its own saved push when A publishes,
    and one of A (spelled with a trailing slash) takes A's publication."""
    first = _start(build, tmp_path)
    first.push_readout(_bundle("20250101T000000-old00001"))
    first.close()
    time.sleep(0.01)
    ChampionPublication(tmp_path / "champion").publish(NAME, _bundle("20250106T000000-new00001", 1),
                                                       "20250106T000000-new00001", 5, "http://registry-a:5000")

    other = _start(build, tmp_path, registry_uri="http://registry-b:5000")
    described = other.describe()
    assert (described["source"], described["version"]) == ("state", "20250101T000000-old00001")
    assert described["champion"]["state"] == "other-registry"
    assert described["champion"]["registry"] == "http://registry-a:5000"
    other.close()

    same = _start(build, tmp_path, registry_uri="http://registry-a:5000/")
    assert (same.describe()["source"], same.readouts.version) == ("champion", "20250106T000000-new00001")


# -- signed publications ---------------------------------------------------------------------------------

def test_a_signed_publication_reads_back_with_its_key_and_a_forged_one_never(tmp_path):
    from leap_io.signing import generate_key_pair

    keys = generate_key_pair(tmp_path / "keys")
    other = generate_key_pair(tmp_path / "other-keys")
    assert (tmp_path / "keys" / "champion.key").stat().st_mode & 0o777 == 0o600
    publication = ChampionPublication(tmp_path / "champion")
    publication.publish(NAME, b"the champion", "v7", 3, signing_key=keys["private_key"])
    assert publication.load(NAME, public_key=keys["public_key"]).bundle == b"the champion"
    with pytest.raises(PublicationDamaged, match="does not verify"):
        publication.load(NAME, public_key=other["public_key"])

    # whoever can write the folder, but holds no key: a new bundle with its digest, the old signature kept
    meta_path = tmp_path / "champion" / f"{NAME}.json"
    signed = json.loads(meta_path.read_text())
    (tmp_path / "champion" / f"{NAME}.bundle").write_bytes(b"a forged champion")
    meta_path.write_text(json.dumps({**signed, "sha256": "sha256:" + hashlib.sha256(b"a forged champion").hexdigest(),
                                     "bytes": 17}))
    assert publication.load(NAME).bundle == b"a forged champion"  # without a key, only the digest is checked
    with pytest.raises(PublicationDamaged, match="does not verify"):
        publication.load(NAME, public_key=keys["public_key"])
    publication.publish(NAME, b"unsigned", "v8", 4)
    with pytest.raises(PublicationDamaged, match="not signed"):
        publication.load(NAME, public_key=keys["public_key"])
    with pytest.raises(FileExistsError):
        generate_key_pair(tmp_path / "keys")  # a key is never overwritten


def test_a_replica_with_a_public_key_refuses_an_unsigned_champion_and_serves_a_signed_one(build, tmp_path):
    from leap_io.signing import generate_key_pair

    keys = generate_key_pair(tmp_path / "keys")
    first = _start(build, tmp_path, champion_public_key=keys["public_key"])
    first.push_readout(_bundle("20250101T000000-old00001"))
    first.close()
    publication = ChampionPublication(tmp_path / "champion")
    publication.publish(NAME, _bundle("20250106T000000-new00001", 1), "20250106T000000-new00001", 5)

    refused = _start(build, tmp_path, champion_public_key=keys["public_key"])
    described = refused.describe()
    assert (described["source"], described["version"]) == ("state", "20250101T000000-old00001")
    assert described["champion"]["state"] == "failed" and "not signed" in described["champion"]["error"]
    assert refused.telemetry.dropped("champion", "unusable") == 1
    refused.close()

    publication.publish(NAME, _bundle("20250106T000000-new00001", 1), "20250106T000000-new00001", 5,
                        signing_key=keys["private_key"])
    signed = _start(build, tmp_path, champion_public_key=keys["public_key"])
    assert (signed.describe()["source"], signed.readouts.version) == ("champion", "20250106T000000-new00001")


# -- publication sequence: which came later, without clocks ----------------------------------------------

def test_a_bundle_carries_its_publication_sequence_and_refuses_a_bad_one():
    from leap_io.push_bundle import BundleError, make_bundle, open_bundle, with_force, with_sequence

    bundle = _bundle("v1")
    assert open_bundle(bundle).sequence is None
    numbered = with_sequence(bundle, 7)
    assert open_bundle(numbered).sequence == 7 and open_bundle(with_force(numbered)).sequence == 7
    assert open_bundle(with_sequence(numbered, 8)).sequence == 8
    readout = open_bundle(bundle).readout_bytes
    with pytest.raises(BundleError, match="counts publications from 1"):
        open_bundle(make_bundle(readout, None, sequence=0))


def test_publications_count_up_and_the_count_is_signed(tmp_path):
    from leap_io.signing import generate_key_pair

    keys = generate_key_pair(tmp_path / "keys")
    publication = ChampionPublication(tmp_path / "champion")
    assert publication.next_sequence(NAME) == 1
    assert publication.publish(NAME, b"a", "v1", 1)["sequence"] == 1
    assert publication.publish(NAME, b"b", "v2", 2, signing_key=keys["private_key"])["sequence"] == 2
    assert publication.load(NAME, public_key=keys["public_key"]).sequence == 2
    meta_path = tmp_path / "champion" / f"{NAME}.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "sequence": 99}))
    with pytest.raises(PublicationDamaged, match="does not verify"):  # the count cannot be raised unseen
        publication.load(NAME, public_key=keys["public_key"])
    assert publication.next_sequence(NAME) == 100


def test_the_sequence_decides_between_a_saved_push_and_a_publication_whatever_the_clocks_say():
    from leap_io.champion import Publication
    from serving.readout.saved_state import Saved
    from serving.readout.sources import published_is_newer

    now = time.time()
    ahead = Saved("v5", now + 3600, 5)  # this host's clock runs an hour ahead of the publisher's
    assert published_is_newer(ahead, Publication(b"", "v6", "6", now, sequence=6))
    behind = Saved("v7", now - 3600, 7)  # a push that came after publication 6, on a slow clock
    assert not published_is_newer(behind, Publication(b"", "v6", "6", now, sequence=6))
    assert not published_is_newer(Saved("v6", now - 3600, None), Publication(b"", "v6", "6", now, sequence=6))
    # a push without a sequence (by hand, or from an older LEAP): only the clocks can tell
    assert not published_is_newer(Saved("v5", now + 3600, None), Publication(b"", "v6", "6", now, sequence=6))
    assert published_is_newer(Saved("v5", now - 1, None), Publication(b"", "v6", "6", now, sequence=6))


def test_a_replica_whose_clock_runs_ahead_takes_the_champion_published_after_its_push(build, tmp_path):
    from leap_io.push_bundle import with_sequence

    first = _start(build, tmp_path)
    first.push_readout(with_sequence(_bundle("20250101T000000-old00001"), 1))  # a promotion's push
    first.close()
    meta_path = tmp_path / "state" / "readout.json"
    saved = json.loads(meta_path.read_text())
    assert saved["sequence"] == 1
    meta_path.write_text(json.dumps({**saved, "saved_at": time.time() + 3600}))  # this host: an hour ahead
    ChampionPublication(tmp_path / "champion").publish(
        NAME, with_sequence(_bundle("20250106T000000-new00001", 1), 2), "20250106T000000-new00001", 5, sequence=2)

    restarted = _start(build, tmp_path)

    assert (restarted.describe()["source"], restarted.readouts.version) == ("champion", "20250106T000000-new00001")
    assert restarted.readouts.state.saved().sequence == 2
