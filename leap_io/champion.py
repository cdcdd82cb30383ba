"""The published champion: the push bundle of the registry's champion at a well-known place, so a replica
that starts or restarts serves it without talking to MLflow.

Every promotion and rollback (`flows.promotion`) publishes the new champion here (a local folder or
`s3://bucket/prefix`); a replica reads it at start and serves it when it is newer than its saved state
(`serving.readout.sources`), validated exactly as a push is. Publications are ordered by a sequence
number and may be signed (docs/security.md); a replica ignores a publication of another registry than
its own. Layout and write order: docs/architecture.md. No MLflow and no vLLM imports: the serving plugin
reads it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from leap_io import signing
from leap_io.durable import write_bytes_durably
from leap_io.s3_locations import is_object_url


class PublicationDamaged(ValueError):
    """A publication that must not serve: unreadable JSON, a bundle whose digest is not the recorded one."""


@dataclass(frozen=True)
class Publication:
    bundle: bytes
    version: str
    registry_version: str
    published_at: float
    registry: str | None = None  # `registry_key` of the publishing registry; None in older publications
    sequence: int | None = None  # 1, 2, ... per location and name; None in older publications


def registry_key(uri: str) -> str:
    """`uri` spelled one way: an sqlite database or a folder by its absolute path, a server URL with its
    scheme and host in lower case and no trailing slash."""
    uri = uri.strip()
    if uri.startswith("sqlite:///"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    if "://" not in uri:
        return str(Path(uri).resolve())
    if uri.startswith("file://"):
        return str(Path(urlsplit(uri).path).resolve())
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), parts.query, ""))


def default_location(home: str | Path | None = None) -> str | None:
    """`$LEAP_CHAMPION_URL`, else `<home>/champion` (home: the argument, else `$LEAP_HOME`), else None."""
    from leap_io.settings import read_settings

    settings = read_settings()
    explicit = (settings.given_value("champion_url") or "").strip()
    if explicit:
        return explicit
    home = home if home is not None else settings.given_value("home")
    return str(Path(home).resolve() / "champion") if home else None


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _check_name(name: str) -> str:
    if not name or "/" in name or name in (".", "..") or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"a publication name is letters, digits, '.', '_' and '-', not {name!r}")
    return name


class ChampionPublication:
    """Publish and read champions under one location (a folder or an `s3://bucket/prefix` URL)."""

    def __init__(self, location: str | Path, endpoint_url: str | None = None) -> None:
        self.location = str(location)
        self._s3 = None
        if is_object_url(self.location):
            from leap_io.object_store import ObjectStore
            from leap_io.s3_locations import parse_s3_url

            self._where = parse_s3_url(self.location)
            self._s3 = ObjectStore(endpoint_url)
        else:
            self._folder = Path(self.location)

    def __repr__(self) -> str:
        return f"ChampionPublication({self.location!r})"

    # -- storage ---------------------------------------------------------------------------------
    def _write(self, file_name: str, data: bytes) -> None:
        if self._s3 is not None:
            self._s3.ensure_bucket(self._where.bucket)
            self._s3.put(self._where.bucket, self._where.key(file_name), data)
            return
        self._folder.mkdir(parents=True, exist_ok=True)
        write_bytes_durably(self._folder / file_name, data)

    def _read(self, file_name: str) -> bytes | None:
        if self._s3 is not None:
            from leap_io.object_store import ObjectNotFound

            try:
                return self._s3.get(self._where.bucket, self._where.key(file_name))
            except ObjectNotFound:
                return None
        try:
            return (self._folder / file_name).read_bytes()
        except FileNotFoundError:
            return None

    # -- publications ----------------------------------------------------------------------------
    def next_sequence(self, name: str) -> int:
        """The sequence number the next publication of `name` takes: one past the current one's (1 when
        there is none, or it predates sequences or cannot be read)."""
        raw = self._read(f"{_check_name(name)}.json")
        try:
            current = json.loads(raw)["sequence"] if raw is not None else 0
        except (ValueError, KeyError, TypeError):
            current = 0
        return int(current) + 1 if isinstance(current, int) and not isinstance(current, bool) and current > 0 else 1

    def publish(self, name: str, bundle: bytes, version: str, registry_version: str | int,
                registry: str | None = None, signing_key: str | Path | None = None,
                sequence: int | None = None) -> dict[str, Any]:
        """Write `bundle` as the champion of `name` in the registry at tracking URI `registry` (bundle
        first, JSON last) as publication `sequence` (default `next_sequence`; the promotion flow takes it
        first, under the alias lock, and pushes it inside the bundle), signed with the Ed25519 private key
        at `signing_key` when one is given (`leap_io.signing`); what was written."""
        name = _check_name(name)
        meta = {"version": str(version), "registry_version": str(registry_version),
                "registry": None if registry is None else registry_key(registry), "published_at": time.time(),
                "sha256": _digest(bundle), "bytes": len(bundle),
                "sequence": int(sequence) if sequence is not None else self.next_sequence(name)}
        if signing_key is not None:
            meta["signature"] = signing.sign(meta, signing.load_private_key(signing_key))
        self._write(f"{name}.bundle", bundle)
        self._write(f"{name}.json", json.dumps(meta, indent=1).encode())
        return {"location": self.location, "name": name, **meta}

    def load(self, name: str, public_key: str | Path | None = None) -> Publication | None:
        """The champion published for `name`; None when none is; PublicationDamaged when it must not serve
        (with a `public_key`: also when it is unsigned or its signature does not verify)."""
        name = _check_name(name)
        raw = self._read(f"{name}.json")
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            if public_key is not None:
                if not isinstance(meta, dict):
                    raise TypeError(f"the metadata is a {type(meta).__name__}, not an object")
                signed = {key: value for key, value in meta.items() if key != "signature"}
                signing.verify(signed, meta.get("signature"), signing.load_public_key(public_key))
            expected, version = str(meta["sha256"]), str(meta["version"])
            published_at = float(meta["published_at"])
            registry_version = str(meta.get("registry_version", ""))
            registry = meta.get("registry")
            if registry is not None and not isinstance(registry, str):
                raise TypeError(f"registry is {type(registry).__name__}, not a string")
            sequence = meta.get("sequence")
            if sequence is not None and (not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 1):
                raise TypeError(f"sequence is {sequence!r}, not a count from 1")
        except signing.SignatureRefused as exc:
            raise PublicationDamaged(f"{self.location}/{name}.json is refused: {exc}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise PublicationDamaged(f"{self.location}/{name}.json is not a publication: {exc}") from exc
        bundle = self._read(f"{name}.bundle")
        if bundle is None or _digest(bundle) != expected:
            raise PublicationDamaged(f"{self.location}/{name}.bundle is missing or is not the one {name}.json "
                                     "names (a publication in progress, or an edited file)")
        return Publication(bundle, version, registry_version, published_at, registry, sequence)
