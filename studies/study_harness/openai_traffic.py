"""OpenAI-API servers as a user starts them, and traffic sent to them as a user's client sends it.

`OpenAIServer` starts one server command in its own process group, waits for `/health`, and stops the whole
group (engine core included) on exit. `send_traffic` releases requests at planned times through
`/v1/completions` with streaming, one connection each, and records when each was sent, when its first token
and its last arrived, how many tokens it got and why it stopped: what the client sees, on its own clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["OpenAIServer", "Outcome", "TrafficRequest", "free_port", "send_traffic"]


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OpenAIServer:
    """One server process group, started on enter and stopped (TERM, then KILL) on exit; its output goes to
    `log_path`. `started_s` is how long it took to answer `/health`."""

    def __init__(self, command: Sequence[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 start_timeout_s: float = 900.0) -> None:
        self.command, self.port, self.log_path = list(command), port, Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.start_timeout_s = start_timeout_s
        self.base_url = f"http://127.0.0.1:{port}"
        self.started_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> OpenAIServer:
        import httpx

        self._log = open(self.log_path, "w")
        started = time.perf_counter()
        self._process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"the server exited ({self._process.returncode}) before it answered; "
                                       f"see {self.log_path}:\n{self.tail()}")
                try:
                    if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - started > self.start_timeout_s:
                    raise RuntimeError(f"the server did not answer /health within {self.start_timeout_s:.0f} s; "
                                       f"see {self.log_path}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class TrafficRequest:
    """One completion request: a prompt as token ids, released `at` seconds after the traffic starts."""

    id: str
    prompt_token_ids: list[int]
    at: float
    max_tokens: int
    seed: int | None = None
    extras: dict[str, Any] | None = None  # vllm_xargs


@dataclass
class Outcome:
    """What the client saw of one request, in seconds after the traffic started."""

    id: str
    at: float
    sent: float
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    chunks: list[float] = field(default_factory=list, repr=False)  # arrival of every streamed chunk

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "chunks"}


async def _one(client, url: str, model: str, request: TrafficRequest, sampling: dict, start: float,
               keep_chunks: bool) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **sampling}
    if request.seed is not None:
        body["seed"] = request.seed
    if request.extras:
        body["vllm_xargs"] = request.extras
    outcome = Outcome(id=request.id, at=request.at, sent=time.perf_counter() - start)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - start
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    if outcome.first_token is None:
                        outcome.first_token = now
                    if keep_chunks:
                        outcome.chunks.append(now)
                    if choice.get("finish_reason"):
                        outcome.finish_reason = choice["finish_reason"]
                        outcome.finish = now
                usage = chunk.get("usage")
                if usage:
                    outcome.tokens = int(usage.get("completion_tokens") or 0)
    except Exception as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if outcome.finish is None and outcome.error is None:
        outcome.error = "the stream ended without a finish reason"
    return outcome


def send_traffic(base_url: str, model: str, requests: Sequence[TrafficRequest], sampling: dict,
                 keep_chunks: bool = False, timeout_s: float = 1800.0,
                 progress: Callable[[int, int], None] | None = None) -> list[Outcome]:
    """Release every request at its planned time (streaming `/v1/completions`), wait for all of them, and
    return what the client saw of each, in the order given."""
    import httpx

    async def run() -> list[Outcome]:
        limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=0)
        timeout = httpx.Timeout(timeout_s, connect=30.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            start = time.perf_counter()
            tasks = [asyncio.create_task(_one(client, f"{base_url}/v1/completions", model, r, sampling, start,
                                              keep_chunks)) for r in requests]
            if progress is not None:
                done = 0
                for finished in asyncio.as_completed(tasks):
                    await finished
                    done += 1
                    progress(done, len(tasks))
            return [await t for t in tasks]

    return asyncio.run(run())
