"""Push a readout bundle to one serving replica's admin API and check that it serves.

A 200 from POST only says the replica accepted the bytes; the version it reports afterwards is the
proof. Refusals (bad token, wrong model or dim, malformed file) are final and raised at once; network
errors, 5xx answers and a version that does not show up are retried with exponential backoff.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

READOUT_PATH = "/leap/readout"


class PushFailed(RuntimeError):
    """A replica did not end up serving the pushed readout; its old readout keeps serving."""

    def __init__(self, message: str, endpoint: str, status: int | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "error" in body:
        serving = body.get("serving")
        return str(body["error"]) + (f" (still serving {serving!r})" if serving is not None else "")
    return str(body)[:500]


def admin_headers(token: str) -> dict[str, str]:
    """What every admin API request but health and metrics carries."""
    return {"Authorization": f"Bearer {token}"}


def serving_version(endpoint: str, token: str, timeout: float = 10.0) -> str:
    """The readout version a replica reports now ('' when it serves none)."""
    response = httpx.get(endpoint.rstrip("/") + READOUT_PATH, headers=admin_headers(token), timeout=timeout)
    response.raise_for_status()
    return str(response.json().get("version", ""))


def push_readout(endpoint: str, token: str, bundle_bytes: bytes, expected_version: str, retries: int = 3,
                 timeout: float = 30.0, backoff_s: float = 0.5) -> dict[str, Any]:
    """POST `bundle_bytes` (see `leap_io.push_bundle.make_bundle`) and verify `expected_version` serves.

    Returns {"endpoint", "version", "previous", "attempts"}; raises PushFailed when the replica
    refuses the bundle or does not report `expected_version` after `retries` further attempts.
    """
    url = endpoint.rstrip("/") + READOUT_PATH
    headers = {**admin_headers(token), "Content-Type": "application/octet-stream"}
    last_problem = ""
    attempts = 0
    with httpx.Client(timeout=timeout) as client:
        for attempt in range(retries + 1):
            attempts = attempt + 1
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
            try:
                response = client.post(url, content=bundle_bytes, headers=headers)
            except httpx.HTTPError as exc:
                last_problem = f"POST failed: {type(exc).__name__}: {exc}"
                continue
            if 400 <= response.status_code < 500:
                raise PushFailed(f"{endpoint} refused readout {expected_version!r} "
                                 f"(HTTP {response.status_code}): {_error_text(response)}",
                                 endpoint, response.status_code)
            if response.status_code != 200:
                last_problem = f"HTTP {response.status_code}: {_error_text(response)}"
                continue
            previous = response.json().get("previous")
            try:
                check = client.get(url, headers=admin_headers(token))
                check.raise_for_status()
                reported = str(check.json().get("version", ""))
            except (httpx.HTTPError, ValueError) as exc:
                last_problem = f"could not read the serving version back: {exc}"
                continue
            if reported == expected_version:
                return {"endpoint": endpoint, "version": reported, "previous": previous, "attempts": attempts}
            last_problem = f"the replica reports version {reported!r} after the push"
    raise PushFailed(f"push of readout {expected_version!r} to {endpoint} failed after {attempts} attempts: "
                     f"{last_problem}", endpoint)
