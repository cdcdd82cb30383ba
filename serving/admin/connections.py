"""The admin API's connection layer: how much of the server one client can hold, and for how long.

Caps on requests in progress (overall and per address) and deadlines on the request head and body, so a
slow or flooding client cannot lock the admin API. Connections beyond a cap go to one refuser thread that
reads their head and still answers health and metrics in full, so a flood never hides a replica's
health, and admits a control request that carries the admin token (a push, a rollback, the kill switch)
to a lane of its own (`control_slots` handlers no other request may take), so a flood from however many
addresses never locks the operators out. Details: docs/architecture.md; refusals are counted by reason
(`AdminConnections.counts()`), control-lane admissions as `control_lane`.
"""

from __future__ import annotations

import contextlib
import io
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from serving.supervise import SupervisedThread

REFUSAL_HEAD_S = 2.0
"""How long the refuser waits for a refused connection's request head before it answers 503 anyway."""
REFUSAL_QUEUE = 256
MAX_HEAD_BYTES = 65536

QuickAnswer = Callable[[str], "tuple[int, str, bytes] | None"]
"""Answers a GET path without a handler slot: (status, content type, body), or None to refuse it."""
IsControl = Callable[[bytes], bool]
"""Whether a whole request head is an authenticated control request (the control lane admits it)."""
CONTROL_SLOTS = 2


class DeadlinePassed(TimeoutError):
    """The request head or body did not arrive by its deadline."""


class DeadlineReader(io.RawIOBase):
    """A socket read with a per-read timeout and, while `deadline` is set, an overall deadline."""

    def __init__(self, sock: socket.socket, step_timeout: float) -> None:
        self._sock = sock
        self._step = step_timeout
        self.deadline: float | None = None
        self.expired = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.expired = True
                raise DeadlinePassed("the deadline passed")
            self._sock.settimeout(min(self._step, remaining))
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self.expired = True
                raise DeadlinePassed("the deadline passed") from None
            raise


def _busy_answer(max_handlers: int) -> bytes:
    body = (f'{{"error": "the admin API is busy ({max_handlers} requests in progress, or this address\'s '
            f'share of them); try again"}}').encode()
    return _http(503, "application/json", body, retry_after=True)


def _http(status: int, content_type: str, body: bytes, retry_after: bool = False) -> bytes:
    reason = {200: "OK", 503: "Service Unavailable"}.get(status, "Status")
    head = (f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            + ("Retry-After: 1\r\n" if retry_after else "") + "Connection: close\r\n\r\n")
    return head.encode() + body


class HeadFirst:
    """A socket whose first reads return bytes already read from it (the head the refuser read)."""

    def __init__(self, sock: socket.socket, first: bytes) -> None:
        self._sock, self._first = sock, first

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if self._first:
            n = min(len(buffer) if not nbytes else nbytes, len(self._first))
            buffer[:n] = self._first[:n]
            self._first = self._first[n:]
            return n
        return self._sock.recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self._first:
            chunk, self._first = self._first[:bufsize], self._first[bufsize:]
            return chunk
        return self._sock.recv(bufsize, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class AdminConnections(ThreadingHTTPServer):
    """A threading HTTP server with the caps above; `quick` answers the reads a refused client may make and
    `is_control` picks the refused requests the control lane admits."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_handlers: int,
                 max_per_address: int, quick: QuickAnswer, is_control: IsControl | None = None,
                 control_slots: int = CONTROL_SLOTS) -> None:
        if max_handlers < 1 or max_per_address < 1:
            raise ValueError("max_handlers and max_per_address must be >= 1")
        self.max_handlers = max_handlers
        self.max_per_address = max_per_address
        self._quick = quick
        self._is_control = is_control
        self._control_slots = threading.BoundedSemaphore(max(1, control_slots))
        self._slots = threading.BoundedSemaphore(max_handlers)
        self._lock = threading.Lock()
        self._per_address: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._refusals: queue.Queue[socket.socket | None] = queue.Queue(maxsize=REFUSAL_QUEUE)
        self._busy = _busy_answer(max_handlers)
        super().__init__(address, handler)
        self._refuser = SupervisedThread("leap-admin-refuser", self._refuse_loop).start()

    # -- counting ------------------------------------------------------------------------------------
    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        """Refusals by reason: busy, per_address, refusal_queue_full, head_deadline, body_deadline; and
        control_lane: refused requests the control lane served instead."""
        with self._lock:
            return dict(self._counts)

    # -- admission -----------------------------------------------------------------------------------
    def process_request(self, request: socket.socket, client_address: Any) -> None:
        host = str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
        with self._lock:
            if self._per_address[host] >= self.max_per_address:
                reason = "per_address"
            elif not self._slots.acquire(blocking=False):
                reason = "busy"
            else:
                reason = None
                self._per_address[host] += 1
        if reason is not None:
            self._refuse(request, reason)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(host)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]) if isinstance(client_address, tuple) else str(client_address))

    def _release(self, host: str) -> None:
        with self._lock:
            self._per_address[host] -= 1
            if self._per_address[host] <= 0:
                del self._per_address[host]
            self._slots.release()

    def _refuse(self, request: socket.socket, reason: str) -> None:
        self.count(reason)
        try:
            self._refusals.put_nowait(request)
        except queue.Full:
            self.count("refusal_queue_full")
            self.shutdown_request(request)

    # -- the refuser -----------------------------------------------------------------------------------
    def _refuse_loop(self) -> None:
        selector = selectors.DefaultSelector()
        pending: dict[socket.socket, list] = {}  # socket -> [head so far, deadline]
        running = True
        while running or pending:
            while True:  # take every newly refused socket
                try:
                    request = self._refusals.get(timeout=0.05 if not pending else 0)
                except queue.Empty:
                    break
                if request is None:
                    running = False
                    break
                try:
                    request.setblocking(False)
                    selector.register(request, selectors.EVENT_READ)
                    pending[request] = [b"", time.monotonic() + REFUSAL_HEAD_S]
                except (OSError, ValueError):
                    self.shutdown_request(request)
            if not pending:
                continue
            for key, _ in selector.select(timeout=0.05):
                request = key.fileobj
                try:
                    chunk = request.recv(MAX_HEAD_BYTES)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                state = pending[request]
                state[0] += chunk
                if not chunk or b"\r\n\r\n" in state[0] or len(state[0]) >= MAX_HEAD_BYTES:
                    self._answer(selector, pending, request)
            now = time.monotonic()
            for request in [r for r, (_, deadline) in pending.items() if deadline <= now or not running]:
                self._answer(selector, pending, request)
        selector.close()

    def _answer(self, selector: selectors.BaseSelector, pending: dict, request: socket.socket) -> None:
        head = pending.pop(request)[0]
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(request)
        if b"\r\n\r\n" in head and self._control_request(head) and self._control_slots.acquire(blocking=False):
            self.count("control_lane")
            SupervisedThread("leap-admin-control", lambda: self._serve_control(request, head)).start()
            return
        answer = self._busy
        line = head.split(b"\r\n", 1)[0].split(b" ")
        if len(line) >= 2 and line[0] == b"GET" and b"\r\n\r\n" in head:
            try:
                quick = self._quick(urlsplit(line[1].decode("latin-1")).path)
            except Exception:
                quick = None
            if quick is not None:
                answer = _http(*quick)
        try:
            request.setblocking(True)
            request.settimeout(1.0)
            request.sendall(answer)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def _control_request(self, head: bytes) -> bool:
        if self._is_control is None:
            return False
        try:
            return bool(self._is_control(head.split(b"\r\n\r\n", 1)[0]))
        except Exception:
            return False

    def _serve_control(self, request: socket.socket, head: bytes) -> None:
        """Serve one control request whose head (and maybe part of its body) the refuser already read."""
        try:
            request.setblocking(True)
            connection = HeadFirst(request, head)
            try:
                address = request.getpeername()
            except OSError:
                address = ("", 0)
            self.finish_request(connection, address)
        except Exception:
            self.handle_error(request, ("", 0))
        finally:
            self.shutdown_request(request)
            self._control_slots.release()

    def server_close(self) -> None:
        super().server_close()
        with contextlib.suppress(queue.Full):
            self._refusals.put_nowait(None)
