"""How to start one stack service and how to tell that it answers: what `ops.stack` runs and
`ops.stack_fleet` lays out."""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Service:
    """How to start one service and how to tell that it answers."""

    name: str
    argv: Sequence[str]
    url: str
    health_url: str
    ports: tuple[int, ...]
    start_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[], bool] | None = None
    """Whether it answers, when that is not an HTTP 200 from `health_url` (a database, a Prefect worker)."""
    after: tuple[str, ...] = ()
    """Services that must answer before this one starts."""
    prepare: Callable[[], None] | None = None
    """Work before the start (a schema, a database, a bucket); must be safe to repeat."""
    user: str | None = None
    """System user to run as (PostgreSQL refuses root); None: ours."""
    stop_signal: int = signal.SIGTERM
    cwd: Path | None = None
    admin_url: str | None = None
    """A serving replica's LEAP admin API (`status` reads its readout version and live figures there)."""
