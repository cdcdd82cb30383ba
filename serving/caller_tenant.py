"""Whose request this is: the tenant comes from the authenticated caller, never from the request's extras.

The tenant cap on what RLS learns and the tenant weights of the quality figures (`serving.feedback`) only
protect tenants from each other if no client can name its own tenant. So the API front end
(`serving.api_middleware`) drops any `leap_tenant` a client sends and sets the one this rule finds:

- the API key: `tenant_keys_file` is a JSON object mapping the SHA-256 (hex) of each key a caller sends as
  `Authorization: Bearer <key>` to its tenant (no key is kept in clear on the replica);
- else the header `tenant_header` (for example `x-leap-tenant`), which only a trusted gateway in front of
  the replicas may set: the gateway must strip it from what clients send;
- else none.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MAX_TENANT_CHARS = 256
MAX_KEYS_FILE_BYTES = 4 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


class TenantKeysError(ValueError):
    """The tenant keys file cannot be used (missing, too large, not the documented JSON)."""


def key_digest(key: str) -> str:
    """The form a key takes in the tenant keys file: the SHA-256 of its UTF-8 bytes, in hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def read_tenant_keys(path: str | Path) -> dict[str, str]:
    """{key digest: tenant} from a tenant keys file, validated whole (`TenantKeysError` naming the problem)."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_KEYS_FILE_BYTES:
            raise TenantKeysError(f"{path}: larger than {MAX_KEYS_FILE_BYTES} bytes")
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, TenantKeysError):
            raise
        raise TenantKeysError(f"{path}: {exc}") from exc
    if not isinstance(parsed, dict):
        raise TenantKeysError(f"{path}: must be a JSON object of key digest to tenant")
    for digest, tenant in parsed.items():
        if not _DIGEST.fullmatch(digest):
            raise TenantKeysError(f"{path}: {digest[:16]!r}... is not a SHA-256 hex digest (lower case)")
        if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
            raise TenantKeysError(f"{path}: the tenant of {digest[:12]}... must be a string of 1 to "
                                  f"{MAX_TENANT_CHARS} characters")
    return parsed


@dataclass(frozen=True)
class TenantRule:
    """Finds the tenant of a request from its headers (module docstring)."""

    keys: Mapping[str, str] = field(default_factory=dict)
    header: str | None = None

    @classmethod
    def from_settings(cls, tenant_header: str | None, tenant_keys_file: str | None) -> TenantRule:
        keys = read_tenant_keys(tenant_keys_file) if tenant_keys_file else {}
        return cls(keys=keys, header=tenant_header.strip().lower() if tenant_header else None)

    def tenant(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """The caller's tenant from ASGI headers (lower-case names, as servers give them), or None."""
        if self.keys:
            key = _bearer(headers)
            if key is not None and (tenant := self.keys.get(key_digest(key))) is not None:
                return tenant
        if self.header:
            name = self.header.encode("latin-1")
            values = [value for key, value in headers if key.lower() == name]
            if len(values) == 1:  # two values: which one the gateway set is unknown, so neither
                text = values[0].decode("latin-1").strip()
                if 0 < len(text) <= MAX_TENANT_CHARS:
                    return text
        return None


def _bearer(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None
