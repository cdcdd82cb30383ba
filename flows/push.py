"""Push a readout bundle to one serving replica and check that it serves: the flows' form of the admin
client's verified push (`leap_io.admin_client`), which holds the paths, the token header and the retry
policy. A 200 from POST only says the replica accepted the bytes; the version it reports afterwards is
the proof. Refusals are final; network errors, 5xx answers and a version that does not show up are retried.
"""

from __future__ import annotations

from typing import Any

from leap_io.admin_client import AdminClient, AdminToken, PushFailed, RetryPolicy

__all__ = ["PushFailed", "push_readout", "serving_version"]


def serving_version(endpoint: str, token: AdminToken, timeout: float = 10.0) -> str:
    """The readout version a replica reports now ('' when it serves none)."""
    return AdminClient(endpoint, token, timeout).serving_version()


def push_readout(endpoint: str, token: AdminToken, bundle_bytes: bytes, expected_version: str, retries: int = 3,
                 timeout: float = 30.0, backoff_s: float = 0.5) -> dict[str, Any]:
    """POST `bundle_bytes` (see `leap_io.push_bundle.make_bundle`) and verify `expected_version` serves.

    Returns {"endpoint", "version", "previous", "attempts"}; raises PushFailed when the replica
    refuses the bundle or does not report `expected_version` after `retries` further attempts.
    """
    return AdminClient(endpoint, token, timeout).push_verified(bundle_bytes, expected_version,
                                                              RetryPolicy(retries, backoff_s))
