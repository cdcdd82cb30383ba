"""Pid files of the stack's services: `<stack dir>/<service>.pid`, one line with the process id.

The stack writes them when it starts a service; the stack, the CLI and the pipeline settings (which
point at the stack's MLflow server while it runs) read them. A pid file only counts while its process
is alive and still runs the service's program, so a stale file from a reboot or a reused pid never
passes for a running service.
"""

from __future__ import annotations

import os
from pathlib import Path

PROGRAM_MARKERS = {"mlflow": ("mlflow",), "prefect": ("prefect",), "serving": ("leap", "vllm"),
                   "postgres": ("postgres",), "s3": ("moto",), "worker": ("prefect",)}
"""What the command line of each kind of service contains (a kind not listed: its own name)."""


def pid_file(stack_dir: str | Path, name: str) -> Path:
    return Path(stack_dir) / f"{name}.pid"


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an exited child of ours is reaped here)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def runs_program(pid: int, name: str) -> bool:
    """Whether process `pid` runs service `name`'s program (`worker-0`, `serving-1`: of their kind)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc here: trust the pid file
    kind = name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name
    return any(marker in cmdline for marker in PROGRAM_MARKERS.get(kind, (kind,)))


def service_pid(stack_dir: str | Path, name: str) -> int | None:
    """The pid of a running service started by the stack, or None (a stale pid file counts as none)."""
    try:
        pid = int(pid_file(stack_dir, name).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) and runs_program(pid, name) else None
