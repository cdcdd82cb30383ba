"""Feedback segments in an S3-compatible bucket: `s3://bucket/prefix` locations and a small boto3 client.

Replicas upload closed segments to `<prefix>/<replica id>/<segment name>` and ingest reads them there, so
a fleet shares one bucket instead of a feedback volume no two machines can share safely. The same code
talks to AWS S3, MinIO and moto. Locations are validated before any request (`ObjectURLError`), and every
upload is verified (Content-MD5, then a HEAD read-back) before a caller may delete its local copy. Service
errors raise `ObjectStoreError`, a missing object `ObjectNotFound` (a `FileNotFoundError`). No vLLM or
flows imports: serving and the flows both use it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from leap_io.s3_locations import check_bucket, check_endpoint


class ObjectStoreError(RuntimeError):
    """The object store refused or could not be reached; the message names the operation and location."""


class ObjectNotFound(ObjectStoreError, FileNotFoundError):
    """The object (or its bucket) does not exist."""


class ObjectAccessDenied(ObjectStoreError):
    """The store refused the credentials this operation (a least-privilege key, docs/security.md)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key, size and ETag (quotes removed)."""

    key: str
    size: int
    etag: str


def content_md5(data: bytes) -> tuple[str, str]:
    """(hex digest, base64 digest for the Content-MD5 header) of `data`."""
    digest = hashlib.md5(data, usedforsecurity=False).digest()
    return digest.hex(), base64.b64encode(digest).decode()


class ObjectStore:
    """put / list / get / ensure_bucket over one S3-compatible endpoint (thread-safe: one boto3 client).

    Timeouts are short and boto3 retries once: the callers (the shipper, ingest) have their own retry
    with backoff, and a serving process must not hang on a dead endpoint.
    """

    def __init__(self, endpoint_url: str | None = None, *, connect_timeout_s: float = 3.0,
                 read_timeout_s: float = 30.0, max_attempts: int = 2) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as error:  # the fleet extra is not installed
            raise ObjectStoreError(f"object storage needs boto3 (pip install '.[fleet]'): {error}") from None

        if endpoint_url is None:
            from leap_io.settings import read_settings

            endpoint_url = read_settings().s3_endpoint_url
        self.endpoint_url = check_endpoint(endpoint_url)
        self.region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                        retries={"max_attempts": max_attempts, "mode": "standard"},
                        # path-style: MinIO and moto serve buckets under the endpoint's path
                        s3={"addressing_style": "path" if self.endpoint_url else "auto"})
        self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url,
                                                      region_name=self.region, config=config)

    def __repr__(self) -> str:
        return f"ObjectStore({self.endpoint_url or 'aws'})"

    def _error(self, what: str, where: str, error: Exception) -> ObjectStoreError:
        from botocore.exceptions import ClientError

        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = f"{what} {where} at {self.endpoint_url or 'AWS'}: {code or status}: {error}"
            if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
                return ObjectNotFound(message)
            if code in ("AccessDenied", "403", "Forbidden"):
                return ObjectAccessDenied(message)
            return ObjectStoreError(message)
        return ObjectStoreError(f"{what} {where} at {self.endpoint_url or 'AWS'}: {type(error).__name__}: {error}")

    def _call(self, what: str, where: str, method: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, method)(**kwargs)
        except (ClientError, BotoCoreError) as error:
            raise self._error(what, where, error) from error

    def ensure_bucket(self, bucket: str) -> bool:
        """Create `bucket` unless it exists; True when this call created it."""
        check_bucket(bucket, bucket)
        try:
            self._call("checking bucket", bucket, "head_bucket", Bucket=bucket)
            return False
        except ObjectNotFound:
            pass
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self._call("creating bucket", bucket, "create_bucket", **kwargs)
        except ObjectStoreError as error:
            if "BucketAlreadyOwnedByYou" in str(error):  # another replica created it in between
                return False
            raise
        return True

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Upload `data` and verify it arrived whole; returns the MD5 hex. Raises ObjectStoreError otherwise.

        The server checks the Content-MD5 against the body it received; the HEAD afterwards checks the
        stored object's size (and its ETag where that is a plain MD5, as for a single-part upload
        without KMS), so an upload the caller did not see fail is still caught before it deletes its copy.
        """
        where = f"s3://{bucket}/{key}"
        md5_hex, md5_b64 = content_md5(data)
        answer = self._call("uploading", where, "put_object", Bucket=bucket, Key=key, Body=data, ContentMD5=md5_b64)
        etag = str(answer.get("ETag", "")).strip('"')
        if re.fullmatch(r"[0-9a-f]{32}", etag) and etag != md5_hex:
            raise ObjectStoreError(f"uploading {where}: the stored ETag {etag} is not the body's MD5 {md5_hex}")
        head = self._call("verifying", where, "head_object", Bucket=bucket, Key=key)
        size = int(head.get("ContentLength", -1))
        stored = str(head.get("ETag", "")).strip('"')
        if size != len(data):
            raise ObjectStoreError(f"verifying {where}: {size} bytes stored, {len(data)} uploaded")
        if re.fullmatch(r"[0-9a-f]{32}", stored) and stored != md5_hex:
            raise ObjectStoreError(f"verifying {where}: the stored ETag {stored} is not the body's MD5 {md5_hex}")
        return md5_hex

    def list(self, bucket: str, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order, page by page."""
        where = f"s3://{bucket}/{prefix}"
        paginator = self._client.get_paginator("list_objects_v2")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []) or []:
                    yield ObjectInfo(str(item["Key"]), int(item.get("Size", 0)), str(item.get("ETag", "")).strip('"'))
        except (ClientError, BotoCoreError) as error:
            raise self._error("listing", where, error) from error

    def get(self, bucket: str, key: str) -> bytes:
        """The object's bytes; ObjectNotFound when it is gone."""
        where = f"s3://{bucket}/{key}"
        answer = self._call("reading", where, "get_object", Bucket=bucket, Key=key)
        from botocore.exceptions import BotoCoreError

        try:
            with answer["Body"] as body:
                return body.read()
        except BotoCoreError as error:
            raise self._error("reading", where, error) from error

    def delete(self, bucket: str, key: str) -> None:
        self._call("deleting", f"s3://{bucket}/{key}", "delete_object", Bucket=bucket, Key=key)
