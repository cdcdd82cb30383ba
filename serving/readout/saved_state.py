"""The last push a replica accepted, kept in one folder so a restart serves it again; and the readout
and RLS files an operator serves at start (`leap serve --readout --rls-state`).

Every accepted push is written there whole (`leap_io.durable`): `readout.bin`, `rls.npz`, and
`readout.json` last, naming the others' digests, so a torn write or an edited file is detected at
the next start and never served. `config_bundle` reads the files of a start (those two, a published
champion's bundle, or files of another origin) into one push bundle, checked as a push is after it.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from leap_io.durable import write_bytes_durably, write_text_durably
from leap_io.push_bundle import (
    MAX_MEMBERS,
    READOUT_KEY,
    READOUT_MAX_BYTES,
    RLS_MAX_ARRAY_BYTES,
    RLS_PREFIX,
    BundleError,
    make_bundle,
    max_bundle_bytes,
    open_bundle,
    read_bundle,
)
from leap_io.rls_arrays import unpack


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
    """The last accepted push of a replica, and its kill switch while it is on, kept in one folder so a
    restart serves them again."""

    READOUT = "readout.bin"
    RLS = "rls.npz"
    META = "readout.json"
    KILL_SWITCH = "fcfs.json"

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

    def save_kill_switch(self, on: bool, reason: str = "") -> None:
        """Keep the commanded kill switch across restarts: written while on, removed when turned off."""
        path = self.folder / self.KILL_SWITCH
        if on:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_text_durably(path, json.dumps({"on": True, "reason": reason, "at": time.time()}))
        else:
            path.unlink(missing_ok=True)

    def kill_switch(self) -> str | None:
        """The reason of a kill switch left on, or None. A file that cannot be read counts as on: FCFS is
        the safe order when what the operators asked for is unknown."""
        path = self.folder / self.KILL_SWITCH
        if not path.exists():
            return None
        try:
            state = json.loads(path.read_text())
            if isinstance(state, dict) and state.get("on") is True:
                return str(state.get("reason") or "")
        except (OSError, ValueError) as exc:
            return f"the kill switch file {path} is unreadable ({exc})"
        return f"the kill switch file {path} does not say it is off"

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


class StartFileRefused(ValueError):
    """A readout or RLS file given to serve at start that must not serve; the message says why, in one line."""


def _read_capped(path: str | Path, cap: int, what: str) -> bytes:
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise StartFileRefused(f"{what} {path} is not a file")
        if size > cap:
            raise StartFileRefused(f"{what} {path} has {size} bytes; at most {cap} are accepted")
        return path.read_bytes()
    except OSError as exc:
        raise StartFileRefused(f"{what} {path} cannot be read: {exc.strerror or exc}") from exc


def _is_bundle(data: bytes) -> bool:
    """Whether `data` is a push bundle (an npz with a `readout_bytes` member), not a bare readout file."""
    try:
        return READOUT_KEY + ".npy" in zipfile.ZipFile(io.BytesIO(data)).namelist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError):
        return False


def read_rls_file(path: str | Path) -> dict[str, np.ndarray]:
    """The RLS arrays of an npz file: a replica's saved `rls.npz` (its `rls_*` members), the arrays by name
    (`RLS.state_arrays()` saved with numpy), or the registry's at-rest form (P and A as upper triangles).
    Sizes are checked before anything is read; StartFileRefused says what is wrong."""
    data = _read_capped(path, max_bundle_bytes(), "the RLS state file")
    try:
        if _is_bundle(data):
            state = open_bundle(data).state
            if not state:
                raise StartFileRefused(f"the RLS state file {path} holds no {RLS_PREFIX}* arrays")
            return state
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except BundleError as exc:
        raise StartFileRefused(f"the RLS state file {path}: {exc}") from exc
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise StartFileRefused(f"the RLS state file {path} is not an npz archive ({exc})") from exc
    if len(infos) > MAX_MEMBERS:
        raise StartFileRefused(f"the RLS state file {path} has {len(infos)} members; at most {MAX_MEMBERS}")
    for info in infos:
        if not info.filename.endswith(".npy") or info.file_size > RLS_MAX_ARRAY_BYTES + 1024:
            raise StartFileRefused(f"the RLS state file {path}: member {info.filename!r} is not an array of at "
                                   f"most {RLS_MAX_ARRAY_BYTES} bytes")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise StartFileRefused(f"the RLS state file {path} does not read: {exc}") from exc
    try:
        return unpack(arrays)  # the registry's at-rest form, P and A as upper triangles
    except ValueError as exc:
        raise StartFileRefused(f"the RLS state file {path}: {exc}") from exc


def _check_beside_state(readout_path: Path, readout_bytes: bytes, rls_path: Path | None) -> None:
    """Files of a replica's state folder (a `readout.json` beside the readout) must be the ones it names."""
    meta_path = readout_path.parent / ReadoutState.META
    if readout_path.name != ReadoutState.READOUT or not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
        readout_digest, rls_digest = meta["readout_sha256"], meta.get("rls_sha256")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StartFileRefused(f"{meta_path} beside the readout is not a saved state's record: {exc}") from exc
    if _digest(readout_bytes) != readout_digest:
        raise StartFileRefused(f"{readout_path} is not the readout {meta_path} records (torn write or edited)")
    if rls_path is not None and rls_path.parent == readout_path.parent and rls_path.name == ReadoutState.RLS:
        if rls_digest is None or _digest(rls_path.read_bytes()) != rls_digest:
            raise StartFileRefused(f"{rls_path} is not the RLS state {meta_path} records (torn write, edited, or "
                                   "left from an earlier push)")


def _check_publication(path: Path, public_key: str | None) -> bytes | None:
    """A published champion's bundle (`<name>.bundle` beside its `<name>.json`) as its publication reads it:
    digest checked, and signature when a public key is configured; None for other files."""
    from leap_io.champion import ChampionPublication, PublicationDamaged

    if path.suffix != ".bundle" or not path.with_suffix(".json").is_file():
        return None
    try:
        published = ChampionPublication(path.parent).load(path.stem, public_key=public_key)
    except (PublicationDamaged, ValueError, OSError) as exc:
        raise StartFileRefused(str(exc)) from exc
    return None if published is None else published.bundle


def _bundle_has_state(data: bytes, path: Path) -> bool:
    """Whether a bundle file carries RLS arrays (StartFileRefused when it is no bundle a replica takes)."""
    try:
        return open_bundle(data).state is not None
    except BundleError as exc:
        raise StartFileRefused(f"{path}: {exc}") from exc


def config_bundle(readout_path: str | Path, rls_path: str | Path | None = None,
                  public_key: str | None = None) -> bytes:
    """The push bundle of the files a replica serves at start: a readout file with its RLS file, or one
    bundle (a published champion's, checked against its publication and signature). StartFileRefused when
    they cannot be read together; what they hold is checked after, as a push is."""
    readout_path = Path(readout_path)
    rls = Path(rls_path) if rls_path else None
    data = _read_capped(readout_path, max_bundle_bytes(), "the readout file")
    if _is_bundle(data):
        published = _check_publication(readout_path, public_key)
        if published is not None:
            data = published
        if rls is not None and _bundle_has_state(data, readout_path):
            raise StartFileRefused(f"{readout_path} carries its own RLS state; give no RLS file with it")
        if rls is None:
            return data
        readout_bytes = open_bundle(data).readout_bytes
    else:
        if len(data) > READOUT_MAX_BYTES:
            raise StartFileRefused(f"the readout file {readout_path} has {len(data)} bytes; at most "
                                   f"{READOUT_MAX_BYTES} are accepted")
        readout_bytes = data
        _check_beside_state(readout_path, readout_bytes, rls)
    return make_bundle(readout_bytes, read_rls_file(rls) if rls is not None else None)
