"""The readout file: an .npz held in memory (arrays plus one JSON metadata blob).

Bytes in, bytes out: callers decide where the file lives, so leap_core stays free of I/O. Loading
checks the file against what the caller is about to feed it (`expect`), because a readout applied
to another model's or layer's hidden states predicts plausible-looking nonsense instead of failing.
"""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import numpy as np

from leap_core import targets
from leap_core.readout import LinearReadout

FORMAT_VERSION = 1
_ARRAYS = ("mean", "scale", "coef", "intercept")
_METADATA_ARRAY = "metadata"
# Fields that describe the readout itself; everything else in the blob is the readout's metadata.
_STRUCTURE_KEYS = ("format_version", "dim", "target", "max_tokens", "alpha")
_IDENTITY_KEYS = ("model_id", "model_fingerprint", "layer", "version")
_OPTIONAL_KEYS = ("created_at", "n_train")


class ReadoutFormatError(ValueError):
    """The bytes are not a valid readout file."""


class ReadoutMismatchError(ValueError):
    """A valid readout file that does not fit the features it is about to be applied to."""


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as JSON-friendly Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def to_bytes(readout: LinearReadout) -> bytes:
    """Serialise a fitted readout to the bytes of an .npz file."""
    readout._check_fitted()
    metadata = {key: _plain(value) for key, value in readout.metadata.items()}
    blob: dict[str, Any] = dict(metadata)
    blob.update({key: metadata.get(key) for key in _IDENTITY_KEYS})
    blob.update({
        "format_version": FORMAT_VERSION,
        "dim": readout.dim_,
        "target": readout.target,
        "max_tokens": int(readout.max_tokens),
        "alpha": float(readout.alpha),
    })
    n_train = metadata.get("n_train", getattr(readout, "n_train_", None))
    if n_train is not None:
        blob["n_train"] = int(n_train)
    for key in _OPTIONAL_KEYS:
        if blob.get(key) is None:
            blob.pop(key, None)
    try:
        text = json.dumps(blob, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ReadoutFormatError(f"readout metadata is not JSON-serialisable: {exc}") from exc
    buffer = io.BytesIO()
    np.savez(
        buffer,
        mean=readout.mean_,
        scale=readout.scale_,
        coef=readout.coef_,
        intercept=np.array([readout.intercept_], dtype=np.float64),
        metadata=np.frombuffer(text.encode("utf-8"), dtype=np.uint8),
    )
    return buffer.getvalue()


def _read_arrays(data: bytes) -> dict[str, np.ndarray]:
    if not data.startswith(b"PK"):
        raise ReadoutFormatError(f"not a readout file: {len(data)} bytes without the zip signature "
                                 f"of an .npz archive")
    try:
        stored = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ReadoutFormatError(f"not a readout file (expected an .npz archive): {exc}") from exc
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise ReadoutFormatError("not a readout file: a single .npy array, expected an .npz archive")
    with stored:
        missing = [name for name in (*_ARRAYS, _METADATA_ARRAY) if name not in stored.files]
        if missing:
            raise ReadoutFormatError(f"not a readout file: missing arrays {missing}")
        try:
            return {name: stored[name] for name in (*_ARRAYS, _METADATA_ARRAY)}
        except Exception as exc:  # zipfile, zlib and the .npy reader fail in assorted ways
            raise ReadoutFormatError(f"corrupt readout file: {type(exc).__name__}: {exc}") from exc


def _read_metadata(raw: np.ndarray) -> dict[str, Any]:
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ReadoutFormatError("readout metadata must be UTF-8 JSON bytes")
    try:
        blob = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReadoutFormatError(f"readout metadata is not valid JSON: {exc}") from exc
    if not isinstance(blob, dict):
        raise ReadoutFormatError("readout metadata must be a JSON object")
    missing = [key for key in _STRUCTURE_KEYS if key not in blob]
    if missing:
        raise ReadoutFormatError(f"readout metadata lacks {missing}")
    if blob["format_version"] != FORMAT_VERSION:
        raise ReadoutFormatError(f"readout format_version {blob['format_version']!r} is not supported "
                                 f"(this code reads version {FORMAT_VERSION})")
    if blob["target"] not in targets.TARGETS:
        raise ReadoutFormatError(f"readout target {blob['target']!r} is unknown; expected one of "
                                 f"{targets.TARGETS}")
    dim, max_tokens, alpha = blob["dim"], blob["max_tokens"], blob["alpha"]
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ReadoutFormatError(f"readout dim must be a positive integer, got {dim!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ReadoutFormatError(f"readout max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not np.isfinite(alpha) or alpha < 0:
        raise ReadoutFormatError(f"readout alpha must be a finite number >= 0, got {alpha!r}")
    return blob


def _check_arrays(arrays: dict[str, np.ndarray], dim: int) -> None:
    for name in ("mean", "scale", "coef"):
        if arrays[name].shape != (dim,):
            raise ReadoutFormatError(f"readout array {name} has shape {arrays[name].shape}, "
                                     f"metadata says dim {dim}")
    if arrays["intercept"].size != 1:
        raise ReadoutFormatError(f"readout intercept must hold one value, got shape "
                                 f"{arrays['intercept'].shape}")
    for name in _ARRAYS:
        if not np.issubdtype(arrays[name].dtype, np.floating):
            raise ReadoutFormatError(f"readout array {name} has dtype {arrays[name].dtype}, expected float")
        if not np.isfinite(arrays[name]).all():
            raise ReadoutFormatError(f"readout array {name} holds non-finite values")
    if (arrays["scale"] <= 0).any():
        raise ReadoutFormatError("readout array scale holds values <= 0")


def _check_expect(blob: dict[str, Any], expect: dict[str, Any]) -> None:
    for key, expected in expect.items():
        if key not in blob:
            raise ReadoutMismatchError(f"readout {key} mismatch: the file does not record {key}, "
                                       f"expected {expected!r}")
        found = blob[key]
        if found != expected:
            raise ReadoutMismatchError(f"readout {key} mismatch: the file has {found!r}, "
                                       f"expected {expected!r}")


def from_bytes(data: bytes, expect: dict[str, Any] | None = None) -> LinearReadout:
    """Load and validate a readout file.

    `expect` maps metadata keys (model_fingerprint, layer, dim, target, max_tokens, ...) to the
    values the caller requires; any difference raises ReadoutMismatchError naming the key.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ReadoutFormatError(f"readout data must be bytes, got {type(data).__name__}")
    arrays = _read_arrays(bytes(data))
    blob = _read_metadata(arrays[_METADATA_ARRAY])
    _check_arrays(arrays, blob["dim"])
    _check_expect(blob, expect or {})
    metadata = {key: value for key, value in blob.items() if key not in _STRUCTURE_KEYS}
    return LinearReadout.from_weights(
        mean=arrays["mean"], scale=arrays["scale"], coef=arrays["coef"],
        intercept=float(arrays["intercept"].reshape(-1)[0]),
        alpha=float(blob["alpha"]), target=blob["target"], max_tokens=blob["max_tokens"],
        metadata=metadata,
    )
