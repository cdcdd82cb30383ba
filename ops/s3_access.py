"""The fleet's S3 access: one IAM policy document per principal, in AWS IAM JSON (MinIO takes the same).

Each replica may write only its own feedback folder and read the champion publication; the workers may
list, read and delete feedback and read and write the publication; MLflow may keep its artifacts, and
nothing else.
So no replica can forge another's rows or the champion, and no worker can forge a segment. Who may do
what, and why listing is not narrowed by prefix: docs/security.md ("S3 credentials"). The feedback and
champion locations must not overlap; bad inputs raise ValueError. Pure functions: no I/O, no credentials.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from leap_io.s3_locations import S3Location, parse_s3_url

POLICY_VERSION = "2012-10-17"
WORKER = "worker"
"""The workers' principal (one credential shared by every Prefect worker)."""
REPLICA_PREFIX = "replica-"
MLFLOW = "mlflow"
"""The MLflow server's principal: it proxies every artifact, so no client needs an S3 credential for them."""

_REPLICA_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
_INGEST_SKIPS = ("quarantine",)  # folders `store.segment_sources` never reads
_WILDCARDS = ("*", "?", "$")  # an IAM resource's wildcards and policy variables


def check_replica_id(replica_id: str) -> str:
    """`replica_id` when it is a folder name a replica writes and ingest reads; ValueError says why not.

    The feedback writer keeps letters, digits, '.', '_' and '-' (at most 64, no leading '.') and would ship
    any other id under another folder than the policy grants; ingest skips hidden names and `quarantine`.
    """
    if not isinstance(replica_id, str) or not _REPLICA_ID.match(replica_id):
        raise ValueError(f"replica id {replica_id!r} must be 1-64 letters, digits, '.', '_' or '-', not starting "
                         "with '.' (the folder name the replica ships under)")
    if replica_id in _INGEST_SKIPS:
        raise ValueError(f"replica id {replica_id!r} names a folder ingest never reads")
    return replica_id


def replica_principal(replica_id: str) -> str:
    """The principal (policy and file name) of replica `replica_id`: `replica-<id>`."""
    return REPLICA_PREFIX + check_replica_id(replica_id)


def _location(url: str, what: str) -> S3Location:
    location = parse_s3_url(url)
    if any(char in location.prefix for char in _WILDCARDS):
        raise ValueError(f"{what} {url!r}: '*', '?' and '$' would be wildcards or variables in a policy")
    return location


def _inside(outer: S3Location, inner: S3Location) -> bool:
    """Whether every key under `inner` is also under `outer`."""
    return outer.bucket == inner.bucket and (not outer.prefix or inner.prefix == outer.prefix
                                             or inner.prefix.startswith(outer.prefix + "/"))


def _locations(feedback_url: str, champion_url: str) -> tuple[S3Location, S3Location]:
    feedback, champion = _location(feedback_url, "feedback URL"), _location(champion_url, "champion URL")
    if _inside(feedback, champion) or _inside(champion, feedback):
        raise ValueError(f"the feedback location {feedback} and the champion location {champion} overlap: "
                         "give each its own prefix, neither inside the other")
    return feedback, champion


def _bucket_arn(location: S3Location) -> str:
    return f"arn:aws:s3:::{location.bucket}"


def _objects_arn(location: S3Location) -> str:
    """Every object under the location (the whole bucket for an empty prefix)."""
    return f"arn:aws:s3:::{location.url().removeprefix('s3://')}/*"


def _policy(*statements: dict[str, Any]) -> dict[str, Any]:
    return {"Version": POLICY_VERSION, "Statement": list(statements)}


def _allow(sid: str, actions: list[str], resources: list[str]) -> dict[str, Any]:
    return {"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": resources}


def replica_policy(feedback_url: str, champion_url: str, replica_id: str) -> dict[str, Any]:
    """What replica `replica_id` may do: write (and verify) segments under `<feedback_url>/<replica_id>/`
    and read the champion publication under `champion_url`. Nothing else: no listing, no delete."""
    feedback, champion = _locations(feedback_url, champion_url)
    own = feedback.child(check_replica_id(replica_id))
    return _policy(
        _allow("ShipOwnSegments", ["s3:PutObject", "s3:GetObject"], [_objects_arn(own)]),
        _allow("ReadChampion", ["s3:GetObject"], [_objects_arn(champion)]),
    )


def worker_policy(feedback_url: str, champion_url: str) -> dict[str, Any]:
    """What the workers may do: list the buckets, read and delete every replica's segments under
    `feedback_url`, read and write the champion publication under `champion_url`."""
    feedback, champion = _locations(feedback_url, champion_url)
    buckets = sorted({_bucket_arn(feedback), _bucket_arn(champion)})
    return _policy(
        _allow("ListBuckets", ["s3:ListBucket"], buckets),
        _allow("IngestAndPruneSegments", ["s3:GetObject", "s3:DeleteObject"], [_objects_arn(feedback)]),
        _allow("PublishChampion", ["s3:GetObject", "s3:PutObject"], [_objects_arn(champion)]),
    )


def mlflow_policy(artifacts_url: str) -> dict[str, Any]:
    """What the MLflow server may do: list its artifact bucket, and read, write and delete the objects
    under `artifacts_url` (its `--artifacts-destination`)."""
    artifacts = _location(artifacts_url, "artifacts URL")
    return _policy(
        _allow("ListArtifacts", ["s3:ListBucket"], [_bucket_arn(artifacts)]),
        _allow("KeepArtifacts", ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"], [_objects_arn(artifacts)]),
    )


def fleet_policies(feedback_url: str, champion_url: str, replica_ids: Iterable[str],
                   artifacts_url: str | None = None) -> dict[str, dict[str, Any]]:
    """Every principal's policy: `replica-<id>` for each replica (in the order given), then `worker`, then
    `mlflow` when `artifacts_url` is given (it must not overlap the feedback or the champion).
    ValueError for a bad location or id, or an id given twice."""
    if isinstance(replica_ids, str):
        raise ValueError("replica_ids is a list of ids, not one string")
    ids = list(replica_ids)
    seen: set[str] = set()
    for replica_id in ids:
        if replica_id in seen:
            raise ValueError(f"replica id {replica_id!r} is given twice")
        seen.add(replica_id)
    policies = {replica_principal(rid): replica_policy(feedback_url, champion_url, rid) for rid in ids}
    policies[WORKER] = worker_policy(feedback_url, champion_url)
    if artifacts_url is not None:
        artifacts = _location(artifacts_url, "artifacts URL")
        for other, what in zip(_locations(feedback_url, champion_url), ("feedback", "champion"), strict=True):
            if _inside(artifacts, other) or _inside(other, artifacts):
                raise ValueError(f"the artifacts location {artifacts} and the {what} location {other} overlap")
        policies[MLFLOW] = mlflow_policy(artifacts_url)
    return policies


def render(policy: dict[str, Any]) -> str:
    """A policy document as the file `mc admin policy create` (or IAM) is given: indented JSON, one newline."""
    return json.dumps(policy, indent=2) + "\n"


def policy_file_name(principal: str) -> str:
    return f"{principal}.json"
