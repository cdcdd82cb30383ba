"""The last push a replica accepted, kept in one folder so a restart serves it again.

Every accepted push is written there whole (`leap_io.durable`): `readout.bin`, `rls.npz`, and
`readout.json` last, naming the others' digests, so a torn write or an edited file is detected at
the next start and never served.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from leap_io.durable import write_bytes_durably, write_text_durably
from leap_io.push_bundle import make_bundle, read_bundle


class StateDamaged(RuntimeError):
    """The state folder holds a readout that must not serve (torn write, edited file)."""


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Saved(NamedTuple):
    """What a replica's saved push says of itself."""

    version: str
    saved_at: float  # this host's clock
    sequence: int | None  # the champion publication it belongs to; None: a push that named none


class ReadoutState:
    """The last accepted push of a replica, kept in one folder so a restart serves it again."""

    READOUT = "readout.bin"
    RLS = "rls.npz"
    META = "readout.json"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def save(self, readout_bytes: bytes, rls_state: dict[str, np.ndarray] | None, version: str,
             sequence: int | None = None) -> None:
        """Write the push; `readout.json` goes last and names the digests of what it belongs to, and the
        champion publication the push belongs to (`sequence`, when it came with one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        write_bytes_durably(self.folder / self.READOUT, readout_bytes)
        rls_bytes = None
        if rls_state is not None:
            rls_bytes = make_bundle(b"", rls_state)  # an npz of the rls_* arrays (and an empty readout)
            write_bytes_durably(self.folder / self.RLS, rls_bytes)
        meta = {"version": version, "saved_at": time.time(), "readout_sha256": _digest(readout_bytes),
                "rls_sha256": _digest(rls_bytes) if rls_bytes is not None else None, "sequence": sequence}
        write_text_durably(self.folder / self.META, json.dumps(meta, indent=1))
        if rls_bytes is None:  # the anchor of an earlier push must not look like this one's
            (self.folder / self.RLS).unlink(missing_ok=True)

    def load(self) -> tuple[bytes, dict[str, np.ndarray] | None, dict] | None:
        """(readout bytes, RLS state or None, metadata), None when nothing was saved, StateDamaged else."""
        meta_path = self.folder / self.META
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            readout_bytes = (self.folder / self.READOUT).read_bytes()
            if _digest(readout_bytes) != meta["readout_sha256"]:
                raise StateDamaged(f"{self.READOUT} does not match {self.META} (torn write or edited)")
            rls_state = None
            if meta.get("rls_sha256"):
                rls_bytes = (self.folder / self.RLS).read_bytes()
                if _digest(rls_bytes) != meta["rls_sha256"]:
                    raise StateDamaged(f"{self.RLS} does not match {self.META} (torn write or edited)")
                rls_state = read_bundle(rls_bytes)[1]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StateDamaged(f"unreadable state in {self.folder}: {exc}") from exc
        return readout_bytes, rls_state, meta

    def saved(self) -> Saved | None:
        """The last saved push's version, time and publication sequence, from its metadata alone; None when
        none is readable."""
        try:
            meta = json.loads((self.folder / self.META).read_text())
            sequence = meta.get("sequence")
            return Saved(str(meta["version"]), float(meta["saved_at"]),
                         int(sequence) if isinstance(sequence, int) and not isinstance(sequence, bool) else None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
