"""Feature vectors as the stores keep them: `dim` little-endian float32 values as one binary value per row.

`feature_bytes` views a segment's float32 buffer as fixed-size binary values without copying it, and
`features_from_bytes` views the values a query or a file returns as one (n, dim) array, so features
never travel row by row in either direction.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FEATURE_DTYPE = np.dtype("<f4")
"""How the store encodes one feature value: little-endian float32, whatever the host's byte order."""


def feature_bytes(feature: pa.Array | pa.ChunkedArray, dim: int) -> pa.Array:
    """Feature vectors of `dim` floats each (a list or fixed-size list of float32, without NULL rows
    or elements) as the values the store keeps: `dim * 4` little-endian bytes per row.

    A fixed-size list's float buffer becomes fixed-size binary values without a copy (on a
    little-endian host), so DuckDB receives each vector as one value. ValueError when a row does
    not hold exactly `dim` floats.
    """
    if isinstance(feature, pa.ChunkedArray):  # one chunk is used as it is: combining copies it
        feature = feature.chunk(0) if feature.num_chunks == 1 else feature.combine_chunks()
    n = len(feature)
    if n == 0:  # e.g. a segment whose rows all failed: their list type need not match `dim`
        return pa.array([], pa.binary())
    if feature.null_count:
        raise ValueError(f"{feature.null_count} feature rows are NULL; the store keeps no NULL feature")
    if pa.types.is_fixed_size_list(feature.type):
        if feature.type.list_size != dim:
            raise ValueError(f"the features hold {feature.type.list_size} floats per row, not {dim}")
        values = feature.values.slice(feature.offset * dim, n * dim)
    else:
        lengths = pc.list_value_length(feature).to_numpy(zero_copy_only=False)
        if n and not (lengths == dim).all():
            raise ValueError(f"feature rows hold {sorted(set(lengths.tolist()) - {dim})} floats, not {dim}")
        values = pc.list_flatten(feature)
    if values.type != pa.float32() or values.null_count:
        raise ValueError(f"features must be float32 values without NULL elements, not {values.type} "
                         f"with {values.null_count} NULL")
    return matrix_bytes(values.to_numpy(zero_copy_only=True).reshape(n, dim))


def matrix_bytes(matrix: np.ndarray) -> pa.Array:
    """An (n, dim) matrix of float32 values as one binary value per row, a view of its buffer where it
    is little-endian and contiguous already."""
    n, dim = matrix.shape
    floats = np.ascontiguousarray(matrix, dtype=FEATURE_DTYPE)
    width = dim * FEATURE_DTYPE.itemsize
    if width == 0:  # no fixed-size binary of width 0 to view: every row is the empty blob
        return pa.array([b""] * n, pa.binary())
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(floats)])


def features_from_bytes(blobs: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    """The (n, dim) float32 matrix of feature blobs as `feature_bytes` wrote them, read from the
    blobs' buffers without a per-row step (a view of them when the query returned one chunk)."""
    chunks = blobs.chunks if isinstance(blobs, pa.ChunkedArray) else [blobs]
    width = dim * FEATURE_DTYPE.itemsize
    parts = []
    for chunk in chunks:
        if not len(chunk):
            continue
        if chunk.null_count:
            raise ValueError(f"{chunk.null_count} stored feature rows are NULL")
        if pa.types.is_fixed_size_binary(chunk.type):
            if chunk.type.byte_width != width:
                raise ValueError(f"stored feature rows hold {chunk.type.byte_width} bytes, not {dim} float32 values")
            values = np.frombuffer(chunk.buffers()[1], dtype=FEATURE_DTYPE, count=len(chunk) * dim,
                                   offset=chunk.offset * width)
            parts.append(values.reshape(len(chunk), dim))
            continue
        if not (pa.types.is_binary(chunk.type) or pa.types.is_large_binary(chunk.type)):
            raise TypeError(f"feature blobs must be binary, not {chunk.type}")
        offset_type = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
        offsets = np.frombuffer(chunk.buffers()[1], dtype=offset_type)[chunk.offset:chunk.offset + len(chunk) + 1]
        if not (np.diff(offsets) == width).all():
            raise ValueError(f"stored feature rows do not all hold {dim} float32 values ({width} bytes)")
        values = np.frombuffer(chunk.buffers()[2], dtype=FEATURE_DTYPE, count=len(chunk) * dim,
                               offset=int(offsets[0]))
        parts.append(values.reshape(len(chunk), dim))
    if not parts:
        return np.zeros((0, dim), dtype=np.float32)
    matrix = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return matrix.astype(np.float32, copy=False)
