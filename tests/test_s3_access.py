"""Least-privilege S3 credentials of the fleet (ops/s3_access.py, `leap s3 policies`, infra/compose.yaml).

The policies are enforced by a real moto S3 server (ops/servers.py) with IAM authentication on: the
test creates an administrator while moto still accepts anything, then `POST /moto-api/reset-auth` with
0 makes every later request need a signature of an IAM user's key and a policy that allows it. Each
principal then gets an IAM user, an access key and the generated policy (through moto's IAM API, which
validates the document), and runs the project's own code under that key, read by boto3 from an INI
credentials file as in compose (`AWS_SHARED_CREDENTIALS_FILE`): the replicas' shipper
(serving.feedback.shipper), the champion publication (leap_io.champion), ingest and retention (store.ingest,
store.retention) and `leap_io.object_store.ObjectStore` itself.

moto authorizes HEAD bucket as `s3:HeadBucket`, where AWS and MinIO authorize it as `s3:ListBucket`
(there is no `s3:HeadBucket` in IAM, and MinIO refuses a policy that names it), so the documents given
to moto carry `s3:HeadBucket` wherever they allow `s3:ListBucket`, and nothing else is changed.

The committed policies (infra/s3-policies) must be what the generator writes for the compose file's
locations and replicas, and the compose file must give each service its own credential.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import httpx
import pytest
import yaml
from botocore.exceptions import ClientError

from leap_io.champion import ChampionPublication
from leap_io.object_store import ObjectAccessDenied, ObjectStore, ObjectStoreError
from leap_io.s3_locations import ObjectURLError
from leap_io.signing import generate_key_pair
from ops.s3_access import MLFLOW, WORKER, fleet_policies, render, replica_policy, worker_policy
from serving.feedback.shipper import FeedbackShipper
from serving.feedback.writer import FeedbackWriter
from store import segment_sources
from store.duckdb import LogStore
from store.ingest import complete_segments, ingest_folder, totals
from store.retention import prune_ingested
from study_harness.servers import running_s3
from tests.object_feedback_fixtures import DIM, LAYER, feedback_row

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "infra" / "compose.yaml"
POLICY_DIR = REPO / "infra" / "s3-policies"
REGION = "us-east-1"
BOOT = {"aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap", "region_name": REGION}


# ------------------------------------------------------------------------------ the compose file

def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_settings() -> tuple[str, str, list[str], str]:
    """(feedback URL, champion URL, replica ids, MLflow's artifacts URL) as the compose file sets them."""
    compose = _compose()
    env = compose["x-leap-env"]
    replicas = [service["environment"]["LEAP_REPLICA_ID"] for service in compose["services"].values()
                if isinstance(service.get("environment"), dict) and "LEAP_REPLICA_ID" in service["environment"]]
    artifacts = re.search(r"--artifacts-destination (\S+)", compose["services"]["mlflow"]["command"][0])
    return env["LEAP_FEEDBACK_URL"], env["LEAP_CHAMPION_URL"], replicas, artifacts.group(1)


FEEDBACK_URL, CHAMPION_URL, REPLICAS, ARTIFACTS_URL = compose_settings()
BUCKET = FEEDBACK_URL.removeprefix("s3://").split("/")[0]
FLEET = FEEDBACK_URL.removeprefix(f"s3://{BUCKET}/")
CHAMPION = CHAMPION_URL.removeprefix(f"s3://{BUCKET}/")


def test_the_committed_policies_are_the_generators_for_the_compose_settings():
    assert REPLICAS == ["serving-0", "serving-1"] and CHAMPION_URL.startswith(f"s3://{BUCKET}/")
    expected = {f"{principal}.json": render(policy)
                for principal, policy in fleet_policies(FEEDBACK_URL, CHAMPION_URL, REPLICAS, ARTIFACTS_URL).items()}
    committed = {path.name: path.read_text() for path in POLICY_DIR.iterdir()}
    assert committed == expected  # regenerate with the command in the compose file's header


def _secrets(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's secrets."""
    out = {}
    for entry in service.get("secrets", []):
        source, target = (entry, entry) if isinstance(entry, str) else (entry["source"], entry.get("target"))
        out[target or source] = source
    return out


def test_compose_gives_each_service_its_own_s3_credential_and_no_root_one():
    compose = _compose()
    env, services = compose["x-leap-env"], compose["services"]
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/run/secrets/s3_credentials"
    holders = {}
    for name, service in services.items():
        environment = service.get("environment") or {}
        if not isinstance(environment, dict):
            continue
        assert "AWS_SECRET_ACCESS_KEY" not in environment, name
        if environment.get("AWS_SHARED_CREDENTIALS_FILE"):
            holders[name] = _secrets(service).get("s3_credentials")
    workers = sorted(name for name, service in services.items()
                     if service.get("command", [])[:2] == ["prefect", "worker"])
    assert len(workers) == 2
    for replica in REPLICAS:
        assert holders[replica] == f"s3-replica-{replica}"
    for worker in workers:
        assert holders[worker] == f"s3-{WORKER}"
    assert holders.get("prefect-deploy") is None  # registers a deployment: no S3 at all
    assert holders["mlflow"] == f"s3-{MLFLOW}"  # its own, never root's
    assert "pip install" not in services["mlflow"]["command"][0]  # what it runs was installed with its image
    principals = [f"replica-{replica}" for replica in REPLICAS] + [WORKER, MLFLOW]
    for principal in principals:
        assert compose["secrets"][f"s3-{principal}"]["file"] == f"./secrets/s3-{principal}.ini"
    init = services["minio-bucket"]
    assert sorted(_secrets(init).values()) == sorted(f"s3-{p}" for p in principals)
    assert "./s3-policies:/s3-policies:ro" in init["volumes"]
    loop = re.search(r"for p in ([^;]+); do", init["command"][0])
    assert loop and loop.group(1).split() == principals


# ------------------------------------------------------------------------------ policies, no server

def test_each_principal_gets_only_its_own_actions_and_places():
    policies = fleet_policies(FEEDBACK_URL, CHAMPION_URL, REPLICAS)
    assert list(policies) == ["replica-serving-0", "replica-serving-1", WORKER]

    def grants(policy: dict[str, Any]) -> set[tuple[str, str]]:
        assert policy["Version"] == "2012-10-17"
        assert all(statement["Effect"] == "Allow" and "Condition" not in statement
                   for statement in policy["Statement"])
        return {(action, resource) for statement in policy["Statement"]
                for action in statement["Action"] for resource in statement["Resource"]}

    arn = f"arn:aws:s3:::{BUCKET}"
    assert grants(policies["replica-serving-0"]) == {
        ("s3:PutObject", f"{arn}/{FLEET}/serving-0/*"), ("s3:GetObject", f"{arn}/{FLEET}/serving-0/*"),
        ("s3:GetObject", f"{arn}/{CHAMPION}/*")}
    assert grants(policies[WORKER]) == {
        ("s3:ListBucket", arn), ("s3:GetObject", f"{arn}/{FLEET}/*"), ("s3:DeleteObject", f"{arn}/{FLEET}/*"),
        ("s3:GetObject", f"{arn}/{CHAMPION}/*"), ("s3:PutObject", f"{arn}/{CHAMPION}/*")}
    # locations in two buckets: the workers list both, a bucket-wide feedback location is the bucket's keys
    other = worker_policy("s3://leap-fleet", "s3://leap-champion/pub")
    assert grants(other) >= {("s3:ListBucket", "arn:aws:s3:::leap-fleet"),
                             ("s3:ListBucket", "arn:aws:s3:::leap-champion"),
                             ("s3:DeleteObject", "arn:aws:s3:::leap-fleet/*")}
    assert grants(replica_policy("s3://leap-fleet", "s3://leap-champion/pub", "r-1")) == {
        ("s3:PutObject", "arn:aws:s3:::leap-fleet/r-1/*"), ("s3:GetObject", "arn:aws:s3:::leap-fleet/r-1/*"),
        ("s3:GetObject", "arn:aws:s3:::leap-champion/pub/*")}
    with_mlflow = fleet_policies(FEEDBACK_URL, CHAMPION_URL, REPLICAS, "s3://mlflow")
    assert list(with_mlflow)[-1] == MLFLOW and grants(with_mlflow[MLFLOW]) == {
        ("s3:ListBucket", "arn:aws:s3:::mlflow"), ("s3:GetObject", "arn:aws:s3:::mlflow/*"),
        ("s3:PutObject", "arn:aws:s3:::mlflow/*"), ("s3:DeleteObject", "arn:aws:s3:::mlflow/*")}
    with pytest.raises(ValueError, match="overlap"):  # MLflow must not reach the feedback or the champion
        fleet_policies(FEEDBACK_URL, CHAMPION_URL, REPLICAS, f"s3://{BUCKET}")


@pytest.mark.parametrize("replica_id", ["", ".", "..", ".hidden", "a/b", "a*", "*", "a?", "${aws:username}",
                                        "quarantine", "x" * 65, "caf\u00e9", "a b", None, 7])
def test_a_replica_id_that_is_not_a_safe_folder_name_is_refused(replica_id):
    with pytest.raises(ValueError, match="replica id"):
        replica_policy(FEEDBACK_URL, CHAMPION_URL, replica_id)


@pytest.mark.parametrize(("feedback", "champion", "match"), [
    ("http://leap-feedback/fleet", CHAMPION_URL, "not an object-storage location"),
    ("/var/lib/leap/feedback", CHAMPION_URL, "not an object-storage location"),
    (FEEDBACK_URL, "s3://Leap_Feedback/champion", "bucket"),
    (FEEDBACK_URL, "s3://leap-feedback/../champion", "prefix segment"),
    ("s3://leap-feedback/fle*t", CHAMPION_URL, "wildcards"),
    (FEEDBACK_URL, "s3://leap-feedback/champ*", "wildcards"),
    (FEEDBACK_URL, "s3://leap-feedback/fleet/serving-0", "overlap"),  # a replica could write the champion
    (FEEDBACK_URL, "s3://leap-feedback/fleet", "overlap"),
    ("s3://leap-feedback/champion/fleet", CHAMPION_URL, "overlap"),  # the workers could delete it
    ("s3://leap-feedback", CHAMPION_URL, "overlap"),
    (FEEDBACK_URL, "s3://leap-feedback", "overlap"),
    (None, CHAMPION_URL, "string"),
])
def test_bad_or_overlapping_locations_are_refused(feedback, champion, match):
    for make in (lambda: replica_policy(feedback, champion, "serving-0"), lambda: worker_policy(feedback, champion)):
        with pytest.raises(ValueError, match=match):
            make()


def test_neighbouring_prefixes_do_not_overlap_and_duplicates_are_refused():
    assert worker_policy("s3://leap-feedback/fleet", "s3://leap-feedback/fleet2")  # no error: siblings
    with pytest.raises(ValueError, match="twice"):
        fleet_policies(FEEDBACK_URL, CHAMPION_URL, ["serving-0", "serving-0"])
    with pytest.raises(ValueError, match="list of ids"):
        fleet_policies(FEEDBACK_URL, CHAMPION_URL, "serving-0")
    assert issubclass(ObjectURLError, ValueError)


# ------------------------------------------------------------------------------ the command

def test_the_command_prints_and_writes_one_private_file_per_principal(tmp_path):
    from typer.testing import CliRunner

    import leap_cli.cmd_s3  # noqa: F401  (registers the commands)
    from leap_cli.apps import app

    out = tmp_path / "policies"
    out.mkdir()
    (out / "worker.json").write_text("{}")  # an older file readable by all is replaced, not reused
    os.chmod(out / "worker.json", 0o644)
    args = ["s3", "policies", "--feedback-url", FEEDBACK_URL, "--champion-url", CHAMPION_URL]
    for replica in REPLICAS:
        args += ["--replica", replica]
    previous = os.umask(0)  # the mode must not depend on the umask
    try:
        answer = CliRunner().invoke(app, [*args, "--out", str(out), "--json"])
    finally:
        os.umask(previous)
    assert answer.exit_code == 0, answer.output
    result = json.loads(answer.stdout)
    expected = fleet_policies(FEEDBACK_URL, CHAMPION_URL, REPLICAS)
    assert result["status"] == "ok" and result["policies"] == expected
    assert sorted(path.name for path in out.iterdir()) == sorted(f"{p}.json" for p in expected)
    for principal, policy in expected.items():
        path = Path(result["files"][principal])
        assert path.parent == out and path.read_text() == render(policy)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    printed = CliRunner().invoke(app, [*args, "--json"])  # without --out: printed only
    assert printed.exit_code == 0 and json.loads(printed.stdout)["files"] == {}

    refused = CliRunner().invoke(app, [*args, "--replica", "../serving-1", "--out", str(tmp_path / "no"), "--json"])
    assert refused.exit_code == 1
    answer = json.loads(refused.stdout)
    assert answer["status"] == "failed" and "replica id '../serving-1'" in answer["error"]
    assert not (tmp_path / "no").exists()


# ------------------------------------------------------------------------------ moto with IAM on

def for_moto(policy: dict[str, Any]) -> dict[str, Any]:
    """The policy in moto's action names: HEAD bucket is `s3:HeadBucket` there, `s3:ListBucket` elsewhere."""
    policy = copy.deepcopy(policy)
    for statement in policy["Statement"]:
        if "s3:ListBucket" in statement["Action"]:
            statement["Action"].append("s3:HeadBucket")
    return policy


class Fleet:
    """A moto server with IAM enforced, the feedback bucket, and one credentials file per principal."""

    def __init__(self, endpoint: str, folder: Path, admin: dict[str, str]) -> None:
        self.endpoint, self.folder, self.admin = endpoint, folder, admin
        self.files: dict[str, Path] = {}

    def client(self, service: str = "s3"):
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, **self.admin)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under `prefix`, as the administrator sees it."""
        answer = self.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        return sorted(item["Key"] for item in answer.get("Contents", []))

    @contextmanager
    def principal(self, name: str) -> Iterator[None]:
        """The environment of a service holding `name`'s credentials file, as compose sets it up; clients
        made inside use that key (boto3 resolves it when a client is made)."""
        environ = {key: value for key, value in os.environ.items()
                   if key not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                                  "AWS_DEFAULT_PROFILE")}
        environ.update(AWS_SHARED_CREDENTIALS_FILE=str(self.files[name]),
                       AWS_CONFIG_FILE=str(self.folder / "no-config"), AWS_DEFAULT_REGION=REGION,
                       LEAP_S3_ENDPOINT_URL=self.endpoint)
        with mock.patch.dict(os.environ, environ, clear=True), mock.patch.object(segment_sources, "_STORES", {}):
            yield


@pytest.fixture
def fleet(tmp_path) -> Iterator[Fleet]:
    with running_s3() as endpoint:
        iam = boto3.client("iam", endpoint_url=endpoint, **BOOT)
        boto3.client("s3", endpoint_url=endpoint, **BOOT).create_bucket(Bucket=BUCKET)
        boto3.client("s3", endpoint_url=endpoint, **BOOT).create_bucket(Bucket="mlflow")

        def user(name: str, policy: dict[str, Any]) -> dict[str, str]:
            iam.create_user(UserName=name)
            arn = iam.create_policy(PolicyName=f"leap-{name}", PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
            iam.attach_user_policy(UserName=name, PolicyArn=arn)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            return {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}

        admin = user("admin", {"Version": "2012-10-17",
                               "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
        fleet = Fleet(endpoint, tmp_path, admin)
        for principal, policy in fleet_policies(FEEDBACK_URL, CHAMPION_URL, REPLICAS, ARTIFACTS_URL).items():
            key = user(principal, for_moto(policy))
            path = fleet.files[principal] = tmp_path / f"s3-{principal}.ini"
            path.write_text(f"[default]\naws_access_key_id = {key['aws_access_key_id']}\n"
                            f"aws_secret_access_key = {key['aws_secret_access_key']}\n")
        answer = httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"0")  # from now on: IAM decides
        assert answer.status_code == 200, answer.text
        yield fleet


def _segments(folder: Path, replica: str, rows: int = 12) -> list[Path]:
    """Real closed feedback segments of `replica` in `folder` (serving.feedback.writer.FeedbackWriter)."""
    writer = FeedbackWriter(folder, DIM, LAYER, "m", "fp", replica_id=replica, flush_seconds=0.01, max_rows=8)
    for i in range(rows):
        writer.write(feedback_row(i, prefix=replica))
    assert writer.close()
    return sorted(path for path in folder.iterdir() if path.suffix == ".parquet")


def _denied(call) -> str:
    with pytest.raises(ObjectAccessDenied) as caught:  # the store's own error for a refused key
        call()
    assert "AccessDenied" in str(caught.value) or "403" in str(caught.value), caught.value
    return str(caught.value)


def test_iam_is_enforced_unknown_and_root_style_keys_are_refused(fleet):
    for key in ("leap", "bootstrap"):  # what every service held before: any key moto did not issue
        client = boto3.client("s3", endpoint_url=fleet.endpoint, region_name=REGION, aws_access_key_id=key,
                              aws_secret_access_key="whatever")
        with pytest.raises(ClientError, match="InvalidAccessKeyId"):
            client.list_objects_v2(Bucket=BUCKET)
    assert fleet.keys() == []  # the administrator's key works


def test_a_replica_ships_to_its_own_folder_and_nowhere_else(fleet, tmp_path):
    mine, theirs = _segments(tmp_path / "spool-0", "serving-0"), _segments(tmp_path / "spool-1", "serving-1")
    with fleet.principal("replica-serving-0"):
        shipper = FeedbackShipper(tmp_path / "spool-0", "serving-0", FEEDBACK_URL)  # its bucket check is refused
        stats = shipper.ship(deadline_s=20.0)
        assert (stats["segments_shipped"], stats["failures"], stats["pending_segments"]) == (len(mine), 0, 0)

        # the other replica's segments, shipped with this replica's key, stay on disk
        impostor = FeedbackShipper(tmp_path / "spool-1", "serving-1", FEEDBACK_URL, max_backoff_s=0.5)
        stats = impostor.ship(deadline_s=5.0)
        assert stats["segments_shipped"] == 0 and stats["failures"] >= 1 and "AccessDenied" in stats["last_error"]
        assert impostor.pending() == theirs

        store = ObjectStore()
        _denied(lambda: store.put(BUCKET, f"{FLEET}/serving-1/forged.parquet", b"x"))
        _denied(lambda: store.put(BUCKET, f"{FLEET}/forged.parquet", b"x"))  # ingest reads the top level too
        _denied(lambda: store.put(BUCKET, "elsewhere/x", b"x"))
        _denied(lambda: store.put("mlflow", "artifacts/x", b"x"))
        _denied(lambda: list(store.list(BUCKET, f"{FLEET}/serving-0/")))  # it lists nothing, not even its own
        _denied(lambda: segment_sources.object_segments(FEEDBACK_URL))
        own = f"{FLEET}/serving-0/{mine[0].name}"
        assert store.get(BUCKET, own)[:4] == b"PAR1"
        _denied(lambda: store.delete(BUCKET, own))
        _denied(lambda: store.ensure_bucket("leap-other"))

    shipped = fleet.keys(f"{FLEET}/")
    assert shipped == [f"{FLEET}/serving-0/{path.name}" for path in mine]
    fleet.client().put_object(Bucket=BUCKET, Key=f"{FLEET}/serving-1/theirs.parquet", Body=b"PAR1")
    with fleet.principal("replica-serving-0"):
        _denied(lambda: ObjectStore().get(BUCKET, f"{FLEET}/serving-1/theirs.parquet"))  # reads no other folder
    assert "leap-other" not in [b["Name"] for b in fleet.client().list_buckets()["Buckets"]]


def test_the_workers_publish_the_champion_replicas_read_it_and_cannot_replace_it(fleet, tmp_path):
    keys = generate_key_pair(tmp_path / "keys")
    bundle = b"bundle bytes of the champion"
    with fleet.principal(WORKER):
        published = ChampionPublication(CHAMPION_URL).publish("leap-model", bundle, "v1", 3,
                                                              registry="http://mlflow:5000",
                                                              signing_key=keys["private_key"])
        assert published["sequence"] == 1
        assert ChampionPublication(CHAMPION_URL).next_sequence("leap-model") == 2  # it reads what it wrote
    assert fleet.keys(f"{CHAMPION}/") == [f"{CHAMPION}/leap-model.bundle", f"{CHAMPION}/leap-model.json"]
    meta = fleet.client().get_object(Bucket=BUCKET, Key=f"{CHAMPION}/leap-model.json")["Body"].read()

    for replica in REPLICAS:
        with fleet.principal(f"replica-{replica}"):
            publication = ChampionPublication(CHAMPION_URL)
            loaded = publication.load("leap-model", public_key=keys["public_key"])
            assert loaded is not None and (loaded.bundle, loaded.version, loaded.sequence) == (bundle, "v1", 1)
            assert publication.load("no-such-model") is None  # a missing publication is absent, not an error
            with pytest.raises(ObjectStoreError, match="403|AccessDenied"):
                publication.publish("leap-model", b"a replica's own choice", "v2", 4)
            store = ObjectStore()
            _denied(lambda store=store: store.put(BUCKET, f"{CHAMPION}/leap-model.json", b"{}"))
            _denied(lambda store=store: store.put(BUCKET, f"{CHAMPION}/leap-model.bundle", b"forged"))
            _denied(lambda store=store: store.delete(BUCKET, f"{CHAMPION}/leap-model.json"))
    assert fleet.client().get_object(Bucket=BUCKET, Key=f"{CHAMPION}/leap-model.json")["Body"].read() == meta

    with fleet.principal(WORKER):  # the workers cannot take the publication away either
        _denied(lambda: ObjectStore().delete(BUCKET, f"{CHAMPION}/leap-model.json"))
    assert f"{CHAMPION}/leap-model.json" in fleet.keys(f"{CHAMPION}/")


def test_the_workers_ingest_and_prune_every_replicas_segments_but_write_none(fleet, tmp_path):
    shipped = {}
    for replica in REPLICAS:
        folder = tmp_path / f"spool-{replica}"
        shipped[replica] = _segments(folder, replica, rows=10 + len(shipped))
        with fleet.principal(f"replica-{replica}"):
            assert FeedbackShipper(folder, replica, FEEDBACK_URL).ship(deadline_s=20.0)["pending_segments"] == 0
    listed = fleet.keys(f"{FLEET}/")
    assert listed == sorted(f"{FLEET}/{r}/{path.name}" for r, paths in shipped.items() for path in paths)

    log = LogStore(tmp_path / "log.duckdb")
    with fleet.principal(WORKER):
        summary = totals(ingest_folder(log, FEEDBACK_URL, endpoint_url=fleet.endpoint))
        assert summary["segments"] == len(listed) and summary["accepted"] == 10 + 11 and summary["failed"] == 0
        with log.connect() as con:
            stored = con.execute("SELECT replica_id, count(*) FROM requests GROUP BY 1 ORDER BY 1").fetchall()
        assert stored == [("serving-0", 10), ("serving-1", 11)]

        store = ObjectStore()
        _denied(lambda: store.put(BUCKET, f"{FLEET}/serving-0/forged.parquet", b"PAR1"))  # a forged segment
        _denied(lambda: store.put(BUCKET, f"{FLEET}/forged.parquet", b"PAR1"))
        _denied(lambda: store.put(BUCKET, "elsewhere/x", b"x"))
        _denied(lambda: store.get("mlflow", "artifacts/x"))
        _denied(lambda: list(store.list("mlflow")))
        _denied(lambda: store.ensure_bucket("leap-other"))

        removed = prune_ingested(log, complete_segments(FEEDBACK_URL, endpoint_url=fleet.endpoint), older_than_s=0)
        assert removed["removed"] == len(listed) and removed["remove_failed"] == 0
    assert fleet.keys(f"{FLEET}/") == []
    assert "leap-other" not in [b["Name"] for b in fleet.client().list_buckets()["Buckets"]]



def test_mlflow_keeps_its_artifacts_and_touches_nothing_else(fleet):
    artifacts = ARTIFACTS_URL.removeprefix("s3://").split("/")[0]
    with fleet.principal(MLFLOW):
        client = boto3.client("s3", endpoint_url=fleet.endpoint, region_name=REGION)
        client.put_object(Bucket=artifacts, Key="1/run/artifacts/readout.bin", Body=b"weights")
        assert client.get_object(Bucket=artifacts, Key="1/run/artifacts/readout.bin")["Body"].read() == b"weights"
        listed = client.list_objects_v2(Bucket=artifacts, Prefix="1/")
        assert [item["Key"] for item in listed["Contents"]] == ["1/run/artifacts/readout.bin"]
        client.delete_object(Bucket=artifacts, Key="1/run/artifacts/readout.bin")
        for call in (lambda: client.list_objects_v2(Bucket=BUCKET),
                     lambda: client.put_object(Bucket=BUCKET, Key=f"{CHAMPION}/x.json", Body=b"{}"),
                     lambda: client.get_object(Bucket=BUCKET, Key=f"{FLEET}/serving-0/x.parquet"),
                     lambda: client.create_bucket(Bucket="another")):
            with pytest.raises(ClientError, match="AccessDenied|403"):
                call()
