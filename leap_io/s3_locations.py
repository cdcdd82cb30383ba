"""Object-storage locations: `s3://bucket/prefix` URLs and S3 endpoints, validated before any request.

Pure checks without a client, so the settings can validate `LEAP_FEEDBACK_URL` and `LEAP_S3_ENDPOINT_URL`
at start and `leap_io.object_store` builds on the same rules.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

SCHEME = "s3://"

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_KEY_PART = re.compile(r"^[A-Za-z0-9!_.*'()=+,;@-]+$")  # the S3 "safe" characters, per segment of a key
_MAX_KEY_BYTES = 1024


class ObjectURLError(ValueError):
    """An object-storage location that is not a valid `s3://bucket/prefix`."""


def is_object_url(location: Any) -> bool:
    """Whether `location` names object storage (an `s3://` URL) rather than a local folder."""
    return isinstance(location, str) and location.strip().lower().startswith(SCHEME)


def check_bucket(bucket: str, url: str) -> None:
    if not _BUCKET.match(bucket):
        raise ObjectURLError(f"{url!r}: bucket {bucket!r} must be 3-63 characters of lowercase letters, digits, "
                             "'.' and '-', starting and ending with a letter or digit")
    if ".." in bucket or ".-" in bucket or "-." in bucket:
        raise ObjectURLError(f"{url!r}: bucket {bucket!r} has '..', '.-' or '-.', which S3 refuses")
    try:
        ipaddress.ip_address(bucket)
    except ValueError:
        return
    raise ObjectURLError(f"{url!r}: bucket {bucket!r} is formatted as an IP address, which S3 refuses")


def check_key_part(part: str, what: str = "key part") -> str:
    """`part` as one segment of a key (a replica id, a segment name), or ObjectURLError saying why not."""
    if not isinstance(part, str) or not part or part in (".", "..") or not _KEY_PART.match(part):
        raise ObjectURLError(f"{what} {part!r} must be non-empty letters, digits and !_.*'()=+,;@- "
                             "(no '/', spaces or other characters), and not '.' or '..'")
    return part


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix without leading or trailing '/' ('' for the bucket's root)."""

    bucket: str
    prefix: str = ""

    def key(self, *parts: str) -> str:
        """The key of `parts` under the prefix; each part is checked as one key segment."""
        for part in parts:
            check_key_part(part)
        key = "/".join([p for p in (self.prefix, *parts) if p])
        if len(key.encode()) > _MAX_KEY_BYTES:
            raise ObjectURLError(f"key {key[:80]!r}... is longer than S3's {_MAX_KEY_BYTES} bytes")
        return key

    def url(self, key: str | None = None) -> str:
        """`s3://bucket/key` (the identity of an object), or this location's URL."""
        return f"{SCHEME}{self.bucket}/{self.prefix if key is None else key}".rstrip("/")

    def child(self, part: str) -> S3Location:
        return S3Location(self.bucket, self.key(part))

    def __str__(self) -> str:
        return self.url()


def parse_s3_url(url: str) -> S3Location:
    """Validate `s3://bucket/prefix` and return its parts; ObjectURLError says what is wrong."""
    if not isinstance(url, str):
        raise ObjectURLError(f"an object-storage location is a string s3://bucket/prefix, not {type(url).__name__}")
    text = url.strip()
    if not text.lower().startswith(SCHEME):
        raise ObjectURLError(f"{url!r} is not an object-storage location: expected s3://bucket/prefix")
    if any(ord(ch) < 0x20 or ch in "?#\\" for ch in text):
        raise ObjectURLError(f"{url!r}: control characters, '?', '#' and '\\' are not allowed")
    rest = text[len(SCHEME):]
    bucket, _, prefix = rest.partition("/")
    check_bucket(bucket, url)
    prefix = prefix.strip("/")
    if prefix:
        for part in prefix.split("/"):
            try:
                check_key_part(part, "prefix segment")
            except ObjectURLError as error:
                raise ObjectURLError(f"{url!r}: {error}") from None
    return S3Location(bucket, prefix)


def check_endpoint(endpoint: str | None) -> str | None:
    """An S3 endpoint as http(s)://host[:port][/path], or None; ValueError says what is wrong."""
    if endpoint is None or not str(endpoint).strip():
        return None
    text = str(endpoint).strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ObjectURLError(f"S3 endpoint {endpoint!r} must be an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as error:
        raise ObjectURLError(f"S3 endpoint {endpoint!r}: {error}") from None
    return text
