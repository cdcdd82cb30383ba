"""The serving admin API from both ends: its paths, its token, and the client every caller uses.

The paths and the RLS info header are defined here once: the server (`serving/admin/api.py`) routes on
them and the client builds its URLs from them, so the two cannot drift apart. The admin token is created
here too (`create_token_file`), for `leap serve` and for the settings that read it. `AdminClient` makes
the calls the flows, `leap` commands, ops and studies make (readout, push, shadow, kill switch, RLS state,
feedback flush, metrics, health) with the token header; `push_verified` is the one call that retries,
under a `RetryPolicy`: refusals (4xx) are final, network errors, 5xx answers and a version that does not
show up are retried with exponential backoff.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from leap_io.durable import fsync_dir, write_text_durably

HEALTH_PATH = "/leap/health"
READOUT_PATH = "/leap/readout"
FEEDBACK_FLUSH_PATH = "/leap/feedback/flush"
FCFS_PATH = "/leap/fcfs"
SHADOW_PATH = "/leap/shadow"
RLS_PATH = "/leap/rls"
METRICS_PATH = "/metrics"
RLS_INFO_HEADER = "X-Leap-Rls"
"""On `GET /leap/rls`: the state's base version and rows folded, as JSON."""
TOKEN_FILE_NAME = "admin.token"
"""The token file's name in a LEAP home or state folder, unless a setting names another file."""


# ---------------------------------------------------------------------------- the token

def admin_headers(token: str) -> dict[str, str]:
    """What every admin API request but health and metrics carries."""
    return {"Authorization": f"Bearer {token}"}


@dataclass(frozen=True, repr=False)
class AdminTokens:
    """The control plane's admin token for each replica: the replica's own where `own` names its admin
    address (by `host_port` or `host`), else the shared one. Its repr shows no token."""

    shared: str | None = None
    own: Mapping[str, str] = field(default_factory=dict)

    def for_endpoint(self, endpoint: str) -> str | None:
        parts = urlsplit(endpoint if "//" in endpoint else f"//{endpoint}")
        host = parts.hostname or ""
        keys = (f"{host}_{parts.port}", host) if parts.port else (host,)
        return next((self.own[key] for key in keys if key in self.own), self.shared)

    def __repr__(self) -> str:
        return f"AdminTokens(own={sorted(self.own)}, shared={'set' if self.shared else 'none'})"


AdminToken = str | AdminTokens | None
"""What the flows hand an `AdminClient`: one token for every replica, or each replica's own."""

MAX_TOKEN_BYTES = 4096


def read_token_folder(folder: str | Path) -> dict[str, str]:
    """Each replica's token from a folder of files named by its admin address (`host_port` or `host`),
    laid out as a mounted Kubernetes Secret is (its `..data` links are skipped). A file that is empty,
    too large or not UTF-8 text raises ValueError naming it: a replica must not silently lose its token."""
    tokens = {}
    for path in sorted(Path(folder).iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        raw = path.read_bytes()[:MAX_TOKEN_BYTES + 1]
        try:
            token = raw.decode().strip()
        except UnicodeDecodeError:
            raise ValueError(f"admin token file {path} is not text") from None
        if not token or len(raw) > MAX_TOKEN_BYTES or any(c.isspace() for c in token):
            raise ValueError(f"admin token file {path} holds no single token of at most {MAX_TOKEN_BYTES} bytes")
        tokens[path.name] = token
    return tokens


def create_token_file(path: str | Path) -> None:
    """A random admin token at `path` unless a file is there already, readable by its owner alone from the
    first byte on.

    The token is written whole under another name and linked in: a reader never sees a half-written
    token, and of two processes creating it at once the first one's token stands (a link, unlike a
    rename, never replaces a file that exists).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}")
    write_text_durably(aside, secrets.token_urlsafe(32), mode=0o600)
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    finally:
        aside.unlink()
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------- the client

@dataclass(frozen=True)
class RetryPolicy:
    """`retries` further attempts after the first, pausing `backoff_s`, then twice that, and so on."""

    retries: int = 3
    backoff_s: float = 0.5

    def attempts(self) -> Iterator[int]:
        """1, 2, ... up to retries + 1, sleeping the backoff before each attempt but the first."""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            yield attempt + 1


class PushFailed(RuntimeError):
    """A replica did not end up serving the pushed readout; its old readout keeps serving."""

    def __init__(self, message: str, endpoint: str, status: int | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


def error_text(response: httpx.Response, limit: int = 500) -> str:
    """The `error` of an admin answer (and what still serves, when it says), else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:limit]
    if isinstance(body, dict) and "error" in body:
        serving = body.get("serving")
        return str(body["error"]) + (f" (still serving {serving!r})" if serving is not None else "")
    return str(body)[:limit]


class AdminClient:
    """One replica's admin API at `endpoint` (e.g. http://127.0.0.1:8001), with `token` (that replica's own,
    when `token` is an `AdminTokens`).

    Use it in a `with` block to keep one connection for several calls; a call outside one opens its own.
    Each call answers the `httpx.Response` (or raises `httpx.HTTPError`): what an answer means is the
    caller's to judge, except in `serving_version` and `push_verified`.
    """

    def __init__(self, endpoint: str, token: AdminToken, timeout: float = 30.0) -> None:
        self.endpoint = endpoint  # as given: reports name the replica the way its caller does
        self.token = token.for_endpoint(endpoint) if isinstance(token, AdminTokens) else token
        self.timeout = timeout
        self._http: httpx.Client | None = None

    def __enter__(self) -> AdminClient:
        self._http = httpx.Client(timeout=self.timeout)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def url(self, path: str) -> str:
        return self.endpoint.rstrip("/") + path

    def request(self, method: str, path: str, authorized: bool = True, **kwargs: Any) -> httpx.Response:
        headers = {**(admin_headers(self.token) if authorized and self.token else {}),
                   **kwargs.pop("headers", {})}
        if self._http is not None:
            return self._http.request(method, self.url(path), headers=headers, **kwargs)
        return httpx.request(method, self.url(path), headers=headers, timeout=self.timeout, **kwargs)

    # the calls, one per endpoint of serving/admin/api.py
    def health(self) -> httpx.Response:
        return self.request("GET", HEALTH_PATH, authorized=False)

    def metrics(self) -> httpx.Response:
        return self.request("GET", METRICS_PATH, authorized=False)

    def readout(self) -> httpx.Response:
        """The serving readout's description (version, model, layer, recipes, RLS figures)."""
        return self.request("GET", READOUT_PATH)

    def push(self, body: bytes, force: bool = False) -> httpx.Response:
        """POST a readout file or push bundle; `force` lets an older version replace a newer one."""
        return self.request("POST", READOUT_PATH + ("?force=1" if force else ""), content=body,
                            headers={"Content-Type": "application/octet-stream"})

    def hold_shadow(self, body: bytes) -> httpx.Response:
        """Hold a push bundle in shadow; an empty body lets the shadow go."""
        return self.request("POST", SHADOW_PATH, content=body, headers={"Content-Type": "application/octet-stream"})

    def switch_fcfs(self, on: bool, reason: str = "") -> httpx.Response:
        """The kill switch: FCFS from the next step (`on`), or back to the policy."""
        return self.request("POST", FCFS_PATH, json={"on": on, "reason": reason})

    def rls(self) -> httpx.Response:
        """The RLS state learned since the last push, as a push bundle; its info in `RLS_INFO_HEADER`."""
        return self.request("GET", RLS_PATH)

    def flush_feedback(self) -> httpx.Response:
        return self.request("POST", FEEDBACK_FLUSH_PATH, content=b"")

    def serving_version(self) -> str:
        """The readout version the replica reports now ('' when it serves none)."""
        response = self.readout()
        response.raise_for_status()
        return str(response.json().get("version", ""))

    def push_verified(self, bundle: bytes, expected_version: str,
                      policy: RetryPolicy = RetryPolicy()) -> dict[str, Any]:
        """POST `bundle` (see `leap_io.push_bundle.make_bundle`) and verify `expected_version` serves.

        A 200 only says the replica took the bytes; the version it reports afterwards is the proof.
        Returns {"endpoint", "version", "previous", "attempts"}; raises PushFailed when the replica refuses
        the bundle or does not report `expected_version` within the policy's attempts.
        """
        if self._http is None:
            with self:
                return self.push_verified(bundle, expected_version, policy)
        last_problem, attempts = "", 0
        for attempts in policy.attempts():
            try:
                response = self.push(bundle)
            except httpx.HTTPError as exc:
                last_problem = f"POST failed: {type(exc).__name__}: {exc}"
                continue
            if 400 <= response.status_code < 500:
                raise PushFailed(f"{self.endpoint} refused readout {expected_version!r} "
                                 f"(HTTP {response.status_code}): {error_text(response)}",
                                 self.endpoint, response.status_code)
            if response.status_code != 200:
                last_problem = f"HTTP {response.status_code}: {error_text(response)}"
                continue
            previous = response.json().get("previous")
            try:
                reported = self.serving_version()
            except (httpx.HTTPError, ValueError) as exc:
                last_problem = f"could not read the serving version back: {exc}"
                continue
            if reported == expected_version:
                return {"endpoint": self.endpoint, "version": reported, "previous": previous, "attempts": attempts}
            last_problem = f"the replica reports version {reported!r} after the push"
        raise PushFailed(f"push of readout {expected_version!r} to {self.endpoint} failed after {attempts} "
                         f"attempts: {last_problem}", self.endpoint)
