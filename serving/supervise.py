"""Background threads that outlive their own bugs, and warnings that cannot flood the log.

Every LEAP thread in engine-core (capture receiver, predictor, RLS learner) serves all requests, so one
unexpected exception must cost one message or one batch, never the thread. Each loop guards its unit of
work itself and counts what it drops; `SupervisedThread` is the second line: if the loop still raises,
the error is logged and counted and the loop starts again after a backoff that grows while it keeps
failing, so a persistent fault shows as a rising error count (and `alive`), not as a silent stop.

`RateLimitedLog` is for faults a client can trigger at request rate (a malformed extra, a bad vector):
the first one in a window is logged with its details, the rest are only counted and summarised in the
next line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SupervisedThread:
    """Run `target()` on a daemon thread and restart it whenever it raises, until `stop()`.

    `target` is a loop that returns when `stopping` is set (or when its work is done); a return ends the
    thread, an exception restarts it. `on_error(exc)` is called for every exception, e.g. to count it in
    a Prometheus counter. The backoff doubles from `backoff_s` up to `max_backoff_s` while the target keeps
    failing within `healthy_after_s` of its start, and resets after a run that lasted longer.
    """

    def __init__(self, name: str, target: Callable[[], None], *, on_error: Callable[[BaseException], None] | None = None,
                 backoff_s: float = 0.05, max_backoff_s: float = 5.0, healthy_after_s: float = 10.0) -> None:
        self.name = name
        self._target = target
        self._on_error = on_error
        self._backoff_s, self._max_backoff_s, self._healthy_after_s = backoff_s, max_backoff_s, healthy_after_s
        self.stopping = threading.Event()
        self.errors = 0
        self.restarts = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)

    def start(self) -> SupervisedThread:
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` for a target that returns by itself (its own close), without asking it to."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the target to return and wait up to `timeout` for it."""
        self.stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stats(self) -> dict:
        return {"alive": self.alive, "errors": self.errors, "restarts": self.restarts, "last_error": self.last_error}

    def _supervise(self) -> None:
        backoff = self._backoff_s
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self._target()
                return
            except Exception as exc:  # surviving whatever the loop lets out is the point
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("LEAP thread %s failed (%d errors so far); restarting", self.name, self.errors)
                if self._on_error is not None:
                    try:
                        self._on_error(exc)
                    except Exception:  # a broken counter must not stop the supervisor
                        logger.exception("LEAP thread %s: error callback failed", self.name)
            if time.monotonic() - started > self._healthy_after_s:
                backoff = self._backoff_s
            if self.stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self._max_backoff_s)
            self.restarts += 1


class RateLimitedLog:
    """Log a warning per `key` at most once every `every_s` seconds; count the ones left out.

    The next line logged for a key says how many were suppressed since the previous one, so the log
    still shows the rate of a fault without one line per request.
    """

    def __init__(self, log: logging.Logger, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._every_s = every_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log `message % args` unless `key` was logged within the window; True when it was logged.

        `exc_info=True` adds the traceback of the exception being handled to the lines that are logged.
        """
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._every_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += " (%d similar since the last warning)"
            args = (*args, suppressed)
        self._log.warning(message, *args, exc_info=exc_info)
        return True
