"""Pid files of the stack's services: `<stack dir>/<service>.pid`, one line with the process id and the
process's start time (older files: the id alone).

The stack writes them when it starts a service; the stack, the CLI and the pipeline settings (which
point at the stack's MLflow server while it runs) read them. A pid file only counts while its process
is alive, still runs the service's program and started when the file says, so a stale file from a
reboot, or a pid another process reuses (the number wraps at 32768 here), never passes for a running
service, and no `stack down` ever signals another home's process.
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
    fields = _stat_fields(pid)
    return fields is None or fields[0] != "Z"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the program's name (field 3, the state, first), None without it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def runs_program(pid: int, name: str) -> bool:
    """Whether process `pid` runs service `name`'s program (`worker-0`, `serving-1`: of their kind)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc here: trust the pid file
    kind = name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name
    return any(marker in cmdline for marker in PROGRAM_MARKERS.get(kind, (kind,)))


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), None without /proc:
    with the pid it names one process, never a later one that reuses the number."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def pid_line(pid: int) -> str:
    """What a pid file holds: the pid and, where /proc tells it, the process's start time."""
    ticks = start_ticks(pid)
    return f"{pid}\n" if ticks is None else f"{pid} {ticks}\n"


def service_pid(stack_dir: str | Path, name: str) -> int | None:
    """The pid of a running service started by the stack, or None (a stale pid file counts as none: its
    process gone, or its number reused by a process that started at another time)."""
    try:
        fields = pid_file(stack_dir, name).read_text().split()
        pid, ticks = int(fields[0]), (int(fields[1]) if len(fields) > 1 else None)
    except (OSError, ValueError, IndexError):
        return None
    if not alive(pid) or not runs_program(pid, name):
        return None
    if ticks is not None and start_ticks(pid) not in (None, ticks):
        return None  # another process that reuses the number: never signalled for the service
    return pid
