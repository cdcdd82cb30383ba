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


def write_bytes_durably(final: Path, data: bytes, mode: int | None = None) -> None:
    """`data` as the whole of `final`, durably (`write_durably`); `mode` (for example 0o600 for a
    secret) is set on the temporary file before a byte is written, so the file never exists readable
    by others."""

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    write_durably(Path(final), write)


def write_text_durably(final: Path, text: str, mode: int | None = None) -> None:
    """`text` (UTF-8) as the whole of `final`, durably (`write_bytes_durably`)."""
    write_bytes_durably(final, text.encode("utf-8"), mode)
