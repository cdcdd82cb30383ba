"""Files that survive a crash whole or not at all: temporary name, flush to disk, atomic rename,
flush of the folder (so the rename itself is on disk)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Flush `folder`'s entries (a rename or a delete in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(final: Path, write: Callable[[Path], None]) -> None:
    """Have `write` fill a temporary file (given by its path, so that a native writer keeps its own
    I/O) beside `final`, then make it `final`: a reader, or a crash, sees the old file or the whole
    new one, never a part; the temporary file goes if `write` raises."""
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
