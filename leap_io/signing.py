"""Ed25519 signatures on what promotions publish, so that writing the bucket is not enough to steer replicas.

The promotion flow signs each champion publication with a private key (`LEAP_CHAMPION_SIGNING_KEY`, a
PEM file only the flow's host reads); a replica configured with the matching public key
(`LEAP_CHAMPION_PUBLIC_KEY`) serves a publication only when its signature verifies. The signature covers
the publication's metadata in one canonical JSON spelling (`canonical`), and that metadata names the
bundle's SHA-256, so the bundle is covered too.

Keys are PEM files: PKCS#8 for the private key (written mode 0600 from the start), SubjectPublicKeyInfo
for the public one (`leap keys generate`). The library is `cryptography`; nothing here is hand-rolled
but the choice of bytes to sign.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from leap_io.durable import write_bytes_durably

SIGNING_KEY_ENV = "LEAP_CHAMPION_SIGNING_KEY"
PUBLIC_KEY_ENV = "LEAP_CHAMPION_PUBLIC_KEY"


class SignatureRefused(ValueError):
    """A signature that is missing, malformed, or made by another key."""


def canonical(meta: dict[str, Any]) -> bytes:
    """The bytes a signature covers: `meta` as sorted, compact JSON."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def sign(meta: dict[str, Any], key: Ed25519PrivateKey) -> str:
    """The signature of `meta` (base64 text)."""
    return base64.b64encode(key.sign(canonical(meta))).decode()


def verify(meta: dict[str, Any], signature: object, key: Ed25519PublicKey) -> None:
    """Return when `signature` is `key`'s on `meta`; SignatureRefused else."""
    if not isinstance(signature, str) or not signature:
        raise SignatureRefused("the publication is not signed, and this replica serves only signed ones")
    try:
        raw = base64.b64decode(signature, validate=True)
        key.verify(raw, canonical(meta))
    except (ValueError, InvalidSignature) as exc:
        raise SignatureRefused("the publication's signature does not verify with this replica's public key "
                               "(another key signed it, or it was edited)") from exc


def generate_key_pair(folder: str | Path, name: str = "champion") -> dict[str, str]:
    """Write `<name>.key` (private, mode 0600) and `<name>.pub` under `folder`; their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    if private.exists():
        raise FileExistsError(f"{private} exists; a key is never overwritten (remove it to rotate)")
    key = Ed25519PrivateKey.generate()
    write_bytes_durably(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()), mode=0o600)
    write_bytes_durably(public, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    return {"private_key": str(private), "public_key": str(public)}
