"""A real `leap serve` process for the fault suite, and the clients the scenarios use against it.

`ServeProcess` starts `leap serve` (vLLM's OpenAI server with LEAP's scheduler, worker and middleware)
as its own session on loopback ports, waits until vLLM answers `/health`, and stops it: gracefully
(SIGTERM to the whole process group, SIGKILL after a grace period) or as a crash (`kill9`, SIGKILL to
the group: the API server and its engine-core process die together, as on a host failure). Nothing it
starts outlives `stop()`.

The clients: `raw_http` writes bytes to a socket and parses whatever comes back (a client library would
refuse to send most of what the scenarios send), `Admin` talks to the LEAP admin API, `openai_request`
sends one OpenAI request, and `fault_readout` fits a small readout of the served model's feature space
(metadata taken from what the replica reports) to push.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from leap_io.admin_client import READOUT_PATH, AdminClient
from leap_io.durable import write_text_durably
from ops.stack import group_alive

LOOPBACK = "127.0.0.1"
DEFAULT_START_TIMEOUT_S = 600.0
MAX_TOKENS_BUDGET = 1024
"""The output budget M of every readout the suite pushes (a push must keep the serving readout's M)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def base_version(version: str | None) -> str:
    """A readout version without the `+rlsN` suffix of its online corrections."""
    return re.sub(r"\+rls\d+$", "", str(version or ""))


class ServeFailed(RuntimeError):
    """`leap serve` exited or did not answer while starting; the message carries its log tail."""


class ServeProcess:
    """One `leap serve` replica on free loopback ports, its own session, its log in `workdir`.

    `feedback_dir` and `state_dir` are passed as they are, so a restart on the same folders (and the
    same admin port, which names the replica's feedback folder) recovers what the previous run left.
    """

    def __init__(self, workdir: str | Path, *, feedback_dir: str | Path, state_dir: str | Path, token: str,
                 port: int | None = None, admin_port: int | None = None, name: str = "serve",
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, max_model_len: int = 2048) -> None:
        self.workdir = Path(workdir)
        self.feedback_dir = Path(feedback_dir)
        self.state_dir = Path(state_dir)
        self.token = token
        self.port = port or free_port()
        self.admin_port = admin_port or free_port()
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.max_model_len = max_model_len
        self.process: subprocess.Popen | None = None
        self.log_path = self.workdir / f"{name}.log"
        self.started_s: float | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("LEAP_REGISTRY_URI", "LEAP_MLFLOW_TRACKING_URI", "LEAP_READOUT_PATH", "LEAP_RLS_STATE_PATH",
                    "LEAP_FEEDBACK_DIR", "LEAP_REPLICA_ID"):
            env.pop(key, None)  # the replica serves what this suite gives it, nothing from the caller
        token_file = self.workdir / "admin.token"
        write_text_durably(token_file, self.token, mode=0o600)  # never readable by others, not even briefly
        env.update({"LEAP_ADMIN_TOKEN_FILE": str(token_file), "LEAP_ADMIN_TOKEN": self.token,
                    "LEAP_STATE_DIR": str(self.state_dir), "PYTHONUNBUFFERED": "1"})
        return env

    def start(self) -> ServeProcess:
        """Start and wait until vLLM's `/health` and the admin API answer; ServeFailed otherwise."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("this replica is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.feedback_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "leap_cli.main", "serve", "--host", LOOPBACK, "--port", str(self.port),
                "--admin-port", str(self.admin_port), "--feedback-dir", str(self.feedback_dir),
                "--max-model-len", str(self.max_model_len)]
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=self._env(), start_new_session=True)
        self.starts += 1
        deadline = began + self.start_timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise ServeFailed(f"leap serve exited with {self.process.returncode} while starting:\n"
                                      f"{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise ServeFailed(f"leap serve did not answer within {self.start_timeout_s:.0f}s:\n"
                                      f"{self.log_tail()}")
                if self.vllm_healthy() and self.admin_answers():
                    break
                time.sleep(0.5)
        except BaseException:
            self.stop(grace_s=5.0)
            raise
        self.started_s = time.monotonic() - began
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def vllm_healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def admin_answers(self, timeout: float = 2.0) -> bool:
        try:
            return AdminClient(self.admin_url, None, timeout=timeout).metrics().status_code == 200
        except httpx.HTTPError:
            return False

    def serving(self) -> bool:
        """The process runs and both the OpenAI server and the admin API answer."""
        return self.alive() and self.vllm_healthy() and self.admin_answers()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill9(self) -> float:
        """SIGKILL the whole process group at once (API server and engine core); the time of the kill."""
        if self.process is None:
            return time.time()
        killed_at = time.time()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap(10.0)
        return killed_at

    def stop(self, grace_s: float = 45.0) -> str:
        """SIGTERM the group (vLLM shuts the engine down and LEAP closes its feedback segment), then
        SIGKILL whatever is left after `grace_s`. Returns how it ended."""
        if self.process is None:
            return "not started"
        pgid = self.process.pid
        if not group_alive(pgid) and self.process.poll() is not None:
            return "gone"
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.process.poll()
            if self.process.returncode is not None and not group_alive(pgid):
                return "terminated"
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap(10.0)
        return "killed"

    def _reap(self, timeout: float) -> None:
        assert self.process is not None
        pgid = self.process.pid
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------- clients

@dataclass
class RawAnswer:
    status: int | None  # None: the server closed the connection without an HTTP answer
    headers: dict[str, str]
    body: bytes
    error: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            return None


def raw_http(port: int, data: bytes, *, half_close: bool = False, timeout: float = 15.0,
             max_bytes: int = 1 << 20) -> RawAnswer:
    """Send `data` as it is and read the answer until the server closes (or `max_bytes`, or timeout).

    `half_close` shuts the sending side after `data`, so a server waiting for a declared body sees the
    body end early instead of waiting for its timeout.
    """
    received = b""
    error = None
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as conn:
            try:
                conn.sendall(data)
                if half_close:
                    conn.shutdown(socket.SHUT_WR)
            except OSError as exc:  # the server may answer and close before taking everything
                error = f"send: {exc}"
            deadline = time.monotonic() + timeout
            while len(received) < max_bytes and time.monotonic() < deadline:
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    error = "read timed out"
                    break
                except OSError as exc:
                    error = f"recv: {exc}"
                    break
                if not chunk:
                    break
                received += chunk
    except OSError as exc:
        return RawAnswer(None, {}, b"", f"connect: {exc}")
    head, _, body = received.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/\d(?:\.\d)? (\d{3})", head)
    if match is None:
        # http.server answers a request line it cannot parse as HTTP/0.9 would: the error page without
        # a status line; the page names the code
        page = re.search(rb"Error code: (\d{3})", received)
        if page is not None:
            return RawAnswer(int(page.group(1)), {}, received, "answered without a status line (HTTP/0.9 style)")
        return RawAnswer(None, {}, received, error or "no HTTP answer")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        headers[key.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    return RawAnswer(int(match.group(1)), headers, body, error)


class Admin:
    """The LEAP admin API of one replica, through the product's client (`leap_io.admin_client`)."""

    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        self.url = url
        self.token = token
        self.timeout = timeout
        self.client = AdminClient(url, token, timeout)

    def readout(self) -> dict:
        response = self.client.readout()
        response.raise_for_status()
        return response.json()

    def health(self) -> tuple[int, dict]:
        response = self.client.health()
        return response.status_code, response.json()

    def metrics(self) -> str:
        response = self.client.metrics()
        response.raise_for_status()
        return response.text

    def push(self, body: bytes, query: str = "") -> httpx.Response:
        """POST `body` to the readout path with any `query`, well-formed or not (the faults try both)."""
        return self.client.request("POST", READOUT_PATH + query, content=body)

    def flush(self) -> httpx.Response:
        return self.client.flush_feedback()

    def anchor(self) -> tuple[str, int]:
        """(base version, generation): what changes with a push or a restore, never with an RLS publish."""
        described = self.readout()
        return base_version(described.get("version")), int(described.get("generation", -1))


def prometheus_values(text: str, name: str) -> dict[str, float]:
    """{label text: value} of one metric family in Prometheus text ('' for a metric without labels)."""
    values = {}
    for line in text.splitlines():
        if line.startswith(name):
            rest = line[len(name):]
            if rest[:1] not in ("{", " "):
                continue
            labels, _, value = rest.rpartition(" ")
            try:
                values[labels.strip()] = float(value)
            except ValueError:
                continue
    return values


def served_model(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


PROMPTS = ("Say hello.", "List three prime numbers.", "Name a famous painter.", "What is 17 times 23?",
           "Write one sentence about the sea.", "Why is the sky blue?", "Give me a word that rhymes with cat.",
           "Translate 'good morning' to Spanish.")


def openai_body(model: str, endpoint: str, index: int, max_tokens: int, xargs: Any = None,
                stream: bool = False) -> dict:
    """The JSON body of one chat or completion request (`endpoint` "chat" or "completions")."""
    prompt = PROMPTS[index % len(PROMPTS)]
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return body


def openai_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def openai_request(client: httpx.Client, url: str, body: dict, endpoint: str = "chat") -> tuple[int, dict | None]:
    """(status, JSON answer) of one request; status -1 when no answer came."""
    try:
        response = client.post(f"{url}{openai_path(endpoint)}", json=body)
    except httpx.HTTPError:
        return -1, None
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, None


def completed(status: int, answer: dict | None) -> bool:
    """A complete OpenAI answer: 200 with a choice that has a finish reason."""
    if status != 200 or not isinstance(answer, dict):
        return False
    choices = answer.get("choices") or []
    return bool(choices) and choices[0].get("finish_reason") is not None


# ---------------------------------------------------------------------------------------- readouts

def fault_readout(described: dict, version: str, seed: int, n: int = 256):
    """A LinearReadout (and its RLS anchor) of the replica's feature space under `version`.

    Fitted on random features of the replica's dim, with the model id, fingerprint and layer the replica
    reports, so it passes every identity check; what it predicts does not matter to the suite.
    """
    from leap_core.rls import fit_readout_with_anchor

    dim = int(described["dim"])
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, dim)).astype(np.float32)
    lengths = np.clip(np.exp(3.0 + 0.4 * features[:, 0]), 1, MAX_TOKENS_BUDGET).round()
    metadata = dict(model_id=described.get("model_id"), model_fingerprint=described.get("model_fingerprint") or "",
                    layer=int(described["layer"]), version=version)
    return fit_readout_with_anchor(features, lengths, alpha=1.0, max_tokens=MAX_TOKENS_BUDGET, metadata=metadata)


def bundle_of(readout, rls=None, force: bool = False) -> bytes:
    from leap_core.readout_format import to_bytes
    from leap_io.push_bundle import make_bundle

    return make_bundle(to_bytes(readout), rls.state_arrays() if rls is not None else None, force=force)


def with_array_value(readout_bytes: bytes, array: str, value: float, index: int = 3) -> bytes:
    """A well-formed readout file with one stored weight replaced (NaN, inf, 1e39 ...), written past
    the readout's own checks by editing the stored arrays."""
    def edit(values: np.ndarray) -> np.ndarray:
        values = values.astype(np.float64)
        values.reshape(-1)[index % values.size] = value
        return values

    return with_array(readout_bytes, array, edit)


def with_array(readout_bytes: bytes, array: str, edit: Callable[[np.ndarray], np.ndarray]) -> bytes:
    """A readout file with one stored array replaced by `edit(copy)`, its dtype kept unless `edit` changes
    it: written past the readout's own checks."""
    with np.load(io.BytesIO(readout_bytes)) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays[array] = edit(np.array(arrays[array]))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def with_length_distribution(readout, n: int = 256, seed: int = 0):
    """`readout` carrying a length distribution (what a Gittins-ranking readout pushes), fitted on random
    predicted and true lengths in [1, M]."""
    from leap_core.gittins import LengthGivenPrediction

    rng = np.random.default_rng(seed)
    budget = int(readout.max_tokens)
    true = np.clip(np.exp(rng.normal(4.0, 1.0, n)), 1, budget).round()
    predicted = np.clip(true * np.exp(rng.normal(0.0, 0.5, n)), 1, budget)
    readout.length_distribution_ = LengthGivenPrediction(n_bins=4, max_tokens=budget).fit(predicted, true)
    return readout


def npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def zip_bomb(member: str, shape: tuple[int, ...], *, inflate_bytes: int | None = None,
             readout_bytes: bytes | None = None) -> bytes:
    """A small zip whose deflated .npy member of zeros claims `shape` (float64) in its header.

    `inflate_bytes` is how much the member really inflates to (default: all the shape claims, so the
    zip directory agrees with the header); the file itself stays a few hundred KiB per GiB of zeros.
    `readout_bytes`, when given, go in as the bundle's `readout_bytes` member beside it.
    """
    claimed = int(np.prod(shape)) * 8
    left = claimed if inflate_bytes is None else int(inflate_bytes)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        if readout_bytes is not None:
            archive.writestr("readout_bytes.npy", npy_bytes(np.frombuffer(readout_bytes, dtype=np.uint8)))
        with archive.open(member, "w", force_zip64=True) as sink:
            sink.write(header.getvalue())
            zeros = bytes(16 << 20)
            while left > 0:
                sink.write(zeros[:min(left, len(zeros))])
                left -= len(zeros)
    return buffer.getvalue()
