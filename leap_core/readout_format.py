"""The readout file: an .npz held in memory (arrays plus one JSON metadata blob).

Bytes in, bytes out: callers decide where the file lives, so leap_core stays free of I/O. Loading checks
the file against what the caller is about to feed it (`expect`), because a readout applied to another
model's or layer's hidden states predicts plausible-looking nonsense instead of failing. Optional blocks
(the length distribution for the Gittins order, a fitted target's map) are validated as strictly as the
weights.
"""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import numpy as np

from leap_core import targets
from leap_core.gittins import LengthGivenPrediction
from leap_core.readout import LinearReadout

FORMAT_VERSION = 1
_ARRAYS = ("mean", "scale", "coef", "intercept")
_METADATA_ARRAY = "metadata"
# Fields that describe the readout itself; everything else in the blob is the readout's metadata.
_STRUCTURE_KEYS = ("format_version", "dim", "target", "max_tokens", "alpha")
_IDENTITY_KEYS = ("model_id", "model_fingerprint", "layer", "version")
_OPTIONAL_KEYS = ("created_at", "n_train")
_DISTRIBUTION_KEY = "length_distribution"
_DISTRIBUTION_ARRAYS = ("length_edges", "length_samples", "length_bin_sizes")
_MAP_ARRAYS = ("target_knots", "target_values")


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
    metadata = {key: _plain(value) for key, value in readout.metadata.items() if key != _DISTRIBUTION_KEY}
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
    distribution = getattr(readout, "length_distribution_", None)
    block = {} if distribution is None else _distribution_arrays(distribution, int(readout.max_tokens))
    if distribution is not None:
        blob[_DISTRIBUTION_KEY] = {"n_bins": int(distribution.n_bins), "max_tokens": int(distribution.max_tokens),
                                   "weight": str(distribution.weight)}
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
        **block,
        **_map_arrays(getattr(readout, "target_map_", None)),
    )
    return buffer.getvalue()


def _distribution_arrays(distribution: LengthGivenPrediction, max_tokens: int) -> dict[str, np.ndarray]:
    """The block's arrays: inner edges, the bins' sorted lengths end to end (int16 where M fits), counts."""
    if int(distribution.max_tokens) != max_tokens:
        raise ReadoutFormatError(f"the length distribution's budget {distribution.max_tokens} is not the "
                                 f"readout's {max_tokens}")
    lengths = np.concatenate([np.asarray(s, dtype=np.float64).reshape(-1) for s in distribution.samples_])
    if not np.array_equal(lengths, np.round(lengths)):
        raise ReadoutFormatError("the length distribution holds lengths that are not whole tokens")
    dtype = np.int16 if max_tokens <= np.iinfo(np.int16).max else np.int32
    return {"length_edges": np.asarray(distribution.edges_, dtype=np.float64),
            "length_samples": lengths.astype(dtype),
            "length_bin_sizes": np.array([np.size(s) for s in distribution.samples_], dtype=np.int64)}


def _map_arrays(target_map: targets.TargetMap | None) -> dict[str, np.ndarray]:
    if target_map is None:
        return {}
    return {"target_knots": np.asarray(target_map.log_lengths, dtype=np.float64),
            "target_values": np.asarray(target_map.values, dtype=np.float64)}


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
        names = (*_ARRAYS, _METADATA_ARRAY,
                 *(name for name in (*_DISTRIBUTION_ARRAYS, *_MAP_ARRAYS) if name in stored.files))
        try:
            return {name: stored[name] for name in names}
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
    distribution = _read_distribution(arrays, blob)
    target_map = _read_map(arrays, blob)
    metadata = {key: value for key, value in blob.items() if key not in (*_STRUCTURE_KEYS, _DISTRIBUTION_KEY)}
    return LinearReadout.from_weights(
        mean=arrays["mean"], scale=arrays["scale"], coef=arrays["coef"],
        intercept=float(arrays["intercept"].reshape(-1)[0]),
        alpha=float(blob["alpha"]), target=blob["target"], max_tokens=blob["max_tokens"],
        metadata=metadata, length_distribution=distribution, target_map=target_map,
    )


def _read_map(arrays: dict[str, np.ndarray], blob: dict[str, Any]) -> targets.TargetMap | None:
    """The fitted target's map, validated; None for a fixed target (whose file must not carry one)."""
    present = [name for name in _MAP_ARRAYS if name in arrays]
    fitted = blob["target"] in targets.FITTED_TARGETS
    if not fitted:
        if present:
            raise ReadoutFormatError(f"readout target {blob['target']!r} is fixed but the file carries {present}")
        return None
    if len(present) != len(_MAP_ARRAYS):
        raise ReadoutFormatError(f"readout target {blob['target']!r} is fitted: the file needs {list(_MAP_ARRAYS)}, "
                                 f"has {present}")
    knots, values = (arrays[name] for name in _MAP_ARRAYS)
    for name, array in zip(_MAP_ARRAYS, (knots, values)):
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.floating):
            raise ReadoutFormatError(f"readout {name} must be a 1-D float array, got {array.dtype} {array.shape}")
    try:
        target_map = targets.TargetMap(blob["target"], knots, values)
    except ValueError as exc:
        raise ReadoutFormatError(f"invalid readout target map: {exc}") from exc
    if not np.isclose(target_map.log_lengths[-1], np.log(blob["max_tokens"]), rtol=0.0, atol=1e-9):
        raise ReadoutFormatError(f"readout target map ends at length {np.exp(target_map.log_lengths[-1]):.6g}, "
                                 f"not at the readout's max_tokens {blob['max_tokens']}")
    return target_map


def _read_distribution(arrays: dict[str, np.ndarray], blob: dict[str, Any]) -> LengthGivenPrediction | None:
    """The optional length distribution block, validated; None when the file has none."""
    present = [name for name in _DISTRIBUTION_ARRAYS if name in arrays]
    if not present and _DISTRIBUTION_KEY not in blob:
        return None
    missing = [name for name in (*_DISTRIBUTION_ARRAYS, _DISTRIBUTION_KEY)
               if name not in arrays and name not in blob]
    if missing:
        raise ReadoutFormatError(f"readout length distribution is incomplete: missing {missing}")
    settings = blob[_DISTRIBUTION_KEY]
    if not isinstance(settings, dict) or sorted(settings) != ["max_tokens", "n_bins", "weight"]:
        raise ReadoutFormatError("readout length_distribution must be an object of n_bins, max_tokens and weight, "
                                 f"got {settings!r}")
    if settings["max_tokens"] != blob["max_tokens"]:
        raise ReadoutFormatError(f"readout length distribution's max_tokens {settings['max_tokens']!r} is not the "
                                 f"readout's {blob['max_tokens']}")
    edges, lengths, sizes = (arrays[name] for name in _DISTRIBUTION_ARRAYS)
    if edges.ndim != 1 or not np.issubdtype(edges.dtype, np.floating):
        raise ReadoutFormatError(f"readout length_edges must be a 1-D float array, got {edges.dtype} {edges.shape}")
    for name, values in (("length_samples", lengths), ("length_bin_sizes", sizes)):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise ReadoutFormatError(f"readout {name} must be a 1-D integer array, got {values.dtype} "
                                     f"{values.shape}")
    if (sizes < 0).any() or int(sizes.sum()) != lengths.size:
        raise ReadoutFormatError(f"readout length_bin_sizes {sizes.tolist()[:20]} do not count the "
                                 f"{lengths.size} length_samples")
    try:
        return LengthGivenPrediction.from_samples(edges, np.split(lengths, np.cumsum(sizes)[:-1]),
                                                  n_bins=settings["n_bins"], max_tokens=settings["max_tokens"],
                                                  weight=settings["weight"])
    except (ValueError, TypeError) as exc:
        raise ReadoutFormatError(f"invalid readout length distribution: {exc}") from exc
