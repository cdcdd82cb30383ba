"""The push bundle: what the push flow sends a replica, a readout file plus its RLS anchor arrays.

A body is a bare readout file or an npz with `readout_bytes`, `rls_*` arrays, an optional `force` flag and
an optional `sequence` (the champion publication it belongs to, `leap_io.champion`), so a restarted
replica orders pushes by counter, not by clocks. A body comes from the network, so every member's size,
dtype and shape are checked against caps before anything is decompressed (docs/security.md).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAX_DIM = 8192
"""The widest hidden state a replica serves (the caps below follow from it)."""
READOUT_MAX_BYTES = 16 << 20
"""A readout file (four arrays of dim floats plus JSON metadata) and every member in it."""
RLS_MAX_ARRAY_BYTES = (MAX_DIM + 1) ** 2 * 8
"""One RLS array: P and A are (dim + 1) x (dim + 1) float64."""
MAX_MEMBERS = 32
FORCE_KEY = "force"
SEQUENCE_KEY = "sequence"
READOUT_KEY = "readout_bytes"
RLS_PREFIX = "rls_"
_NPY_HEADER_MAX = 10_000


class BundleError(ValueError):
    """A push body that is refused before anything in it is loaded; `status` is the HTTP answer."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


class BundleTooLarge(BundleError):
    def __init__(self, message: str) -> None:
        super().__init__(message, 413)


@dataclass(frozen=True)
class PushBundle:
    readout_bytes: bytes
    state: dict[str, np.ndarray] | None
    force: bool = False
    sequence: int | None = None


def max_bundle_bytes(dim: int | None = None) -> int:
    """The largest body a replica of hidden size `dim` needs to accept (readout + a full RLS anchor)."""
    p = min(int(dim or MAX_DIM), MAX_DIM) + 1
    return READOUT_MAX_BYTES + 2 * p * p * 8 + 16 * p * 8 + (1 << 20)


def _is_zip(data: bytes) -> bool:
    return data[:4] == b"PK\x03\x04" or data[:4] == b"PK\x05\x06"


def _open_zip(data: bytes, what: str) -> zipfile.ZipFile:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise BundleError(f"{what} is not a readable npz archive: {exc}") from exc
    infos = archive.infolist()
    if len(infos) > MAX_MEMBERS:
        raise BundleError(f"{what} has {len(infos)} members; at most {MAX_MEMBERS} are accepted")
    names = [info.filename for info in infos]
    if len(set(names)) != len(names):
        raise BundleError(f"{what} names a member twice")
    return archive


def _npy_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one .npy member from its header alone; its recorded size must match them."""
    try:
        with archive.open(info) as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(handle, max_header_size=_NPY_HEADER_MAX)
            elif version in ((2, 0), (3, 0)):
                shape, _, dtype = np.lib.format.read_array_header_2_0(handle, max_header_size=_NPY_HEADER_MAX)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            header_end = handle.tell()
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, RuntimeError, NotImplementedError) as exc:
        raise BundleError(f"{what}: member {info.filename} is not a valid .npy array: {exc}") from exc
    if dtype.hasobject:
        raise BundleError(f"{what}: member {info.filename} holds Python objects; only numeric arrays are accepted")
    if any(s < 0 for s in shape):
        raise BundleError(f"{what}: member {info.filename} has a negative shape {shape}")
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if header_end + nbytes != info.file_size:
        raise BundleError(f"{what}: member {info.filename} records {info.file_size} bytes but its header "
                          f"describes {header_end + nbytes} ({dtype} {shape})")
    return tuple(int(s) for s in shape), dtype


def _load(archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> np.ndarray:
    try:
        with archive.open(info) as handle:
            return np.lib.format.read_array(handle, allow_pickle=False, max_header_size=_NPY_HEADER_MAX)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, RuntimeError) as exc:
        raise BundleError(f"{what}: member {info.filename} does not read: {exc}") from exc


def check_readout_file(data: bytes, max_dim: int = MAX_DIM) -> None:
    """Refuse a readout file whose members are larger than a readout of `max_dim` can be.

    Bytes that are not a zip archive pass: the readout loader refuses them with its own message.
    """
    if len(data) > READOUT_MAX_BYTES:
        raise BundleTooLarge(f"the readout file has {len(data)} bytes; at most {READOUT_MAX_BYTES} are accepted")
    if not _is_zip(data):
        return
    archive = _open_zip(data, "the readout file")
    total = 0
    for info in archive.infolist():
        if info.file_size > READOUT_MAX_BYTES:
            raise BundleTooLarge(f"readout member {info.filename} unpacks to {info.file_size} bytes; at most "
                                 f"{READOUT_MAX_BYTES} are accepted")
        total += info.file_size
        if not info.filename.endswith(".npy"):
            continue
        shape, _ = _npy_header(archive, info, "the readout file")
        if info.filename in ("mean.npy", "scale.npy", "coef.npy") and any(s > max_dim for s in shape):
            raise BundleTooLarge(f"readout array {info.filename[:-4]} has shape {shape}; dims above {max_dim} "
                                 f"are not served")
    if total > READOUT_MAX_BYTES:
        raise BundleTooLarge(f"the readout file unpacks to {total} bytes; at most {READOUT_MAX_BYTES} are accepted")


def open_bundle(body: bytes, max_dim: int = MAX_DIM) -> PushBundle:
    """The readout, RLS anchor and force flag a push body carries; BundleError when it must not be loaded."""
    if not _is_zip(body):
        check_readout_file(body, max_dim)
        return PushBundle(body, None, False)
    archive = _open_zip(body, "the push body")
    names = {info.filename: info for info in archive.infolist()}
    if READOUT_KEY + ".npy" not in names:  # a bare readout file
        check_readout_file(body, max_dim)
        return PushBundle(body, None, False)
    side = max_dim + 1
    arrays: dict[str, zipfile.ZipInfo] = {}
    for name, info in names.items():
        key = name.removesuffix(".npy")
        if not name.endswith(".npy") or not (key in (READOUT_KEY, FORCE_KEY, SEQUENCE_KEY)
                                             or key.startswith(RLS_PREFIX)):
            raise BundleError(f"the bundle has an unknown member {name!r} (expected {READOUT_KEY}, {FORCE_KEY}, "
                              f"{SEQUENCE_KEY} and {RLS_PREFIX}* arrays)")
        shape, dtype = _npy_header(archive, info, "the bundle")
        if key == READOUT_KEY:
            if len(shape) != 1 or dtype != np.uint8:
                raise BundleError(f"bundle member {READOUT_KEY} must be a 1-D uint8 array, got {dtype} {shape}")
            if info.file_size > READOUT_MAX_BYTES + 1024:
                raise BundleTooLarge(f"the readout file in the bundle has {shape[0]} bytes; at most "
                                     f"{READOUT_MAX_BYTES} are accepted")
        elif key in (FORCE_KEY, SEQUENCE_KEY):
            if int(np.prod(shape)) != 1 or dtype.kind not in "biu":
                raise BundleError(f"bundle member {key} must be one bool or integer, got {dtype} {shape}")
        else:
            if len(shape) > 2 or any(s > side for s in shape):
                raise BundleTooLarge(f"RLS array {key[len(RLS_PREFIX):]} has shape {shape}; a readout of dim up to "
                                     f"{max_dim} needs at most ({side}, {side})")
            if info.file_size > RLS_MAX_ARRAY_BYTES + 1024:
                raise BundleTooLarge(f"RLS array {key[len(RLS_PREFIX):]} unpacks to {info.file_size} bytes; at "
                                     f"most {RLS_MAX_ARRAY_BYTES} are accepted")
            if dtype.kind not in "biuf":
                raise BundleError(f"RLS array {key[len(RLS_PREFIX):]} has dtype {dtype}; expected numbers")
        arrays[key] = info
    if sum(info.file_size for info in arrays.values()) > max_bundle_bytes(max_dim):
        raise BundleTooLarge(f"the bundle unpacks to more than {max_bundle_bytes(max_dim)} bytes")
    readout_bytes = _load(archive, arrays[READOUT_KEY], "the bundle").tobytes()
    check_readout_file(readout_bytes, max_dim)
    force = bool(_load(archive, arrays[FORCE_KEY], "the bundle").reshape(-1)[0]) if FORCE_KEY in arrays else False
    sequence = None
    if SEQUENCE_KEY in arrays:
        sequence = int(_load(archive, arrays[SEQUENCE_KEY], "the bundle").reshape(-1)[0])
        if sequence < 1:
            raise BundleError(f"bundle member {SEQUENCE_KEY} counts publications from 1, got {sequence}")
    state = {key[len(RLS_PREFIX):]: _load(archive, info, "the bundle")
             for key, info in arrays.items() if key.startswith(RLS_PREFIX)}
    return PushBundle(readout_bytes, state or None, force, sequence)


def read_bundle(body: bytes) -> tuple[bytes, dict[str, np.ndarray] | None]:
    """(readout bytes, RLS state or None) of a push body; see `open_bundle` for the checks."""
    bundle = open_bundle(body)
    return bundle.readout_bytes, bundle.state


def make_bundle(readout_bytes: bytes, rls_state: dict[str, np.ndarray] | None, force: bool = False,
                sequence: int | None = None) -> bytes:
    """The inverse of `open_bundle`: what the push flow sends. `force` lets an older version replace a
    newer one (a rollback); `sequence` is the champion publication it belongs to."""
    arrays = {READOUT_KEY: np.frombuffer(readout_bytes, dtype=np.uint8)}
    for key, value in (rls_state or {}).items():
        arrays[f"{RLS_PREFIX}{key}"] = np.asarray(value)
    if force:
        arrays[FORCE_KEY] = np.array(True)
    if sequence is not None:
        arrays[SEQUENCE_KEY] = np.array(int(sequence), dtype=np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _with_member(body: bytes, key: str, value: np.ndarray, rebuilt: Callable[[PushBundle], bytes]) -> bytes:
    """`body` with member `key` set to `value`: appended when the archive lacks it, so the rest (an RLS
    state of up to 134 MB) is kept byte for byte; else the bundle as `rebuilt` makes it again."""
    if not _is_zip(body):
        return rebuilt(PushBundle(body, None))
    names = _open_zip(body, "the push body").namelist()
    if READOUT_KEY + ".npy" not in names:
        return rebuilt(PushBundle(body, None))
    if key + ".npy" in names:
        return rebuilt(open_bundle(body))
    buffer = io.BytesIO(body)
    with zipfile.ZipFile(buffer, "a") as out:
        member = io.BytesIO()
        np.lib.format.write_array(member, value, allow_pickle=False)
        out.writestr(key + ".npy", member.getvalue())
    return buffer.getvalue()


def with_sequence(body: bytes, sequence: int) -> bytes:
    """The same push as part of champion publication `sequence` (a member it had is replaced)."""
    return _with_member(body, SEQUENCE_KEY, np.array(int(sequence), dtype=np.int64),
                        lambda bundle: make_bundle(bundle.readout_bytes, bundle.state, force=bundle.force,
                                                   sequence=sequence))


def with_force(body: bytes) -> bytes:
    """The same push with the force flag set (the admin API's `?force=1`)."""
    return _with_member(body, FORCE_KEY, np.array(True),
                        lambda bundle: make_bundle(bundle.readout_bytes, bundle.state, force=True,
                                                   sequence=bundle.sequence))
