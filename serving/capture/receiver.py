"""The engine-core end of the capture channel: (request id, float32 vector) messages from the workers.

Workers push one two-frame ZeroMQ message per request whose prompt ended in a step
(`serving.capture.hidden_states.FeatureSender`). Anything can arrive on that socket (a stale worker of another
version, a stray process on a reused address), and one bad message must not end the thread every
request's prediction depends on. `decode_message` checks each message and names what is wrong with it;
the receive loop drops a bad one with that reason (`leap:dropped_total{what="capture"}`) and goes on,
and the loop itself runs under `SupervisedThread`, which restarts it should anything else escape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

import numpy as np
import zmq

from serving.supervise import RateLimitedLog, SupervisedThread
from serving.telemetry import Telemetry

logger = logging.getLogger(__name__)

MAX_ID_BYTES = 1024  # vLLM request ids are a client id plus a suffix; anything longer is not one
_FLOAT32 = np.dtype(np.float32).itemsize


class BadMessage(ValueError):
    """A capture message that is dropped; `reason` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def decode_message(frames: list[bytes], sizes: Collection[int]) -> tuple[str, np.ndarray]:
    """(request id, feature vector) of one message, or BadMessage saying why it must be dropped.

    `sizes` are the vector lengths this engine captures (the hidden size, and layers x hidden size in
    the layer study). The vector must be finite: a NaN would become a NaN prediction and a NaN
    feedback row.
    """
    if len(frames) != 2:
        raise BadMessage("bad_frame", f"expected 2 frames (id, vector), got {len(frames)}")
    raw_id, payload = frames
    if not raw_id or len(raw_id) > MAX_ID_BYTES:
        raise BadMessage("bad_id", f"request id of {len(raw_id)} bytes")
    try:
        request_id = bytes(raw_id).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadMessage("bad_id", f"request id is not UTF-8: {exc}") from None
    if len(payload) % _FLOAT32:
        raise BadMessage("not_float32", f"{len(payload)} bytes is not a whole number of float32 values")
    n = len(payload) // _FLOAT32
    if n not in sizes:
        raise BadMessage("wrong_dim", f"vector of {n} values; this engine captures {sorted(sizes)}")
    feature = np.frombuffer(payload, dtype=np.float32)
    if not np.isfinite(feature).all():
        raise BadMessage("non_finite", "vector has NaN or infinite values")
    return request_id, feature


class CaptureReceiver:
    """Binds the capture channel and hands every valid (request id, vector) to `deliver`.

    `deliver` runs on the receiver thread; an exception from it is counted as a dropped message
    (reason `deliver_error`), like a malformed one, so it cannot end the loop either.
    """

    def __init__(self, address: str, sizes: Collection[int], deliver: Callable[[str, np.ndarray], None],
                 telemetry: Telemetry, name: str = "leap-capture-receiver", high_water_mark: int = 100_000,
                 deliver_batch: Callable[[list[str], list[np.ndarray]], None] | None = None) -> None:
        self.address = address
        self._sizes = frozenset(int(s) for s in sizes)
        self._deliver = deliver
        self._deliver_batch = deliver_batch
        self._telemetry = telemetry
        self._high_water_mark = high_water_mark
        self._warn = RateLimitedLog(logger)
        self._bound = threading.Event()
        self.received = 0
        self.delivered = 0
        self._thread = SupervisedThread(name, self._run, on_error=lambda exc: telemetry.thread_error("receiver"))
        telemetry.watch_thread("receiver", lambda: self._thread.alive)

    def start(self, timeout: float = 5.0) -> CaptureReceiver:
        """Start the thread and wait until the socket is bound, so no early message is lost.

        Workers in this process (one device) skip the socket: `deliver_local` takes their batches.
        """
        from serving.capture.hidden_states import register_local_receiver

        register_local_receiver(self.address, self)
        self._thread.start()
        if not self._bound.wait(timeout):
            logger.warning("LEAP capture receiver did not bind %s within %.0f s", self.address, timeout)
        return self

    def close(self, timeout: float = 5.0) -> None:
        from serving.capture.hidden_states import unregister_local_receiver

        unregister_local_receiver(self.address, self)
        self._thread.stop(timeout)

    def deliver_local(self, request_ids: list[str], features: np.ndarray) -> None:
        """A step's batch from a worker in this process, checked row by row like a message.

        Runs on the engine's thread, between the forward pass and sampling. The valid rows go to
        `deliver_batch` in one call (the runtime predicts them there, before the next schedule), or
        one by one to `deliver` when no batch handler is given.
        """
        ids, rows = [], []
        for request_id, row in zip(request_ids, features):
            self.received += 1
            try:
                request_id, feature = decode_message([request_id.encode("utf-8", "replace"), row.tobytes()],
                                                     self._sizes)
            except BadMessage as exc:
                self._telemetry.drop("capture", exc.reason)
                self._warn.warning(exc.reason, "LEAP capture: dropped a vector (%s): %s", exc.reason, exc)
                continue
            ids.append(request_id)
            rows.append(feature)
        if not ids:
            return
        try:
            if self._deliver_batch is not None:
                self._deliver_batch(ids, rows)
            else:
                for request_id, feature in zip(ids, rows):
                    self._deliver(request_id, feature)
        except Exception:
            self._telemetry.drop("capture", "deliver_error", len(ids))
            self._telemetry.thread_error("receiver")
            self._warn.warning("deliver", "LEAP capture: handing over %d vectors failed", len(ids), exc_info=True)
            return
        self.delivered += len(ids)

    def stats(self) -> dict:
        return {**self._thread.stats(), "received": self.received, "delivered": self.delivered,
                "address": self.address}

    def _run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.PULL)
        try:
            socket.setsockopt(zmq.RCVHWM, self._high_water_mark)
            socket.bind(self.address)
            self._bound.set()
            poller = zmq.Poller()
            poller.register(socket, zmq.POLLIN)
            stopping = self._thread.stopping
            while not stopping.is_set():
                if not poller.poll(100):
                    continue
                while True:
                    try:
                        frames = socket.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
        finally:
            socket.close(linger=0)

    def _handle(self, frames: list[bytes]) -> None:
        self.received += 1
        try:
            request_id, feature = decode_message(frames, self._sizes)
        except BadMessage as exc:
            self._telemetry.drop("capture", exc.reason)
            self._warn.warning(exc.reason, "LEAP capture: dropped a message (%s): %s", exc.reason, exc)
            return
        try:
            self._deliver(request_id, feature)
        except Exception:
            self._telemetry.drop("capture", "deliver_error")
            self._telemetry.thread_error("receiver")
            self._warn.warning("deliver", "LEAP capture: handling the vector of %s failed", request_id, exc_info=True)
            return
        self.delivered += 1
