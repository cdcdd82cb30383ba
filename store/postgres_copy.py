"""PostgreSQL's COPY data, both ways: how the PostgreSQL store moves rows in bulk, never a value at a time.

Into the store, scalar columns travel as CSV written by Arrow's C++ writer (`csv_rows`), and feature
vectors as binary COPY whose rows Arrow assembles around a segment's float32 buffer (`binary_copy`,
`int4_field`). Out of it, a query's scalars come back as CSV parsed by Arrow (`read_csv`) and its
feature vectors as binary COPY viewed as one array of blobs (`feature_blobs`).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from store.feature_encoding import FEATURE_DTYPE

_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TRAILER = struct.pack(">h", -1)
_COPY_PREFIX = 2 + 4  # a binary COPY row: int16 field count, then per field int32 length and the bytes


def csv_rows(table: pa.Table) -> bytes:
    """`table` as CSV rows for `COPY .. (FORMAT csv)`: NULL is an unquoted empty field, strings are
    quoted (so an empty string stays one), floats are written to round-trip."""
    sink = pa.BufferOutputStream()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False, quoting_style="needed"))
    return sink.getvalue().to_pybytes()


def _big_endian(values: np.ndarray, dtype: str) -> pa.Array:
    raw = np.ascontiguousarray(values, dtype=dtype)
    width = raw.dtype.itemsize
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(raw), [None, pa.py_buffer(raw.view(np.uint8))])


def int4_field(values: np.ndarray) -> pa.Array:
    """Integers as the bytes of binary COPY `integer` fields (4 bytes, big-endian), one value per row."""
    return _big_endian(values, ">i4")


def binary_copy(fields: Sequence[pa.Array]) -> bytes:
    """Binary COPY data of rows whose fields are given column by column as the bytes each field holds
    (`text` and `bytea` as they are, `integer` from `int4_field`; NULL stays NULL).

    Each row is its field count (2 bytes), then per field a 4-byte length (-1: NULL) and the bytes;
    Arrow's element-wise binary join assembles every row from those pieces in C++, so no row is
    built in Python.
    """
    n = len(fields[0])
    empty = pa.scalar(b"", pa.large_binary())
    pieces = [_big_endian(np.full(n, len(fields)), ">i2").cast(pa.large_binary())]
    for field in fields:
        values = field.cast(pa.large_binary())
        lengths = pc.fill_null(pc.binary_length(values), -1).to_numpy(zero_copy_only=False)
        pieces += [int4_field(lengths).cast(pa.large_binary()), pc.fill_null(values, empty)]
    rows = pc.binary_join_element_wise(*pieces, empty)
    offsets = np.frombuffer(rows.buffers()[1], np.int64)[rows.offset:rows.offset + n + 1]
    body = memoryview(rows.buffers()[2])[int(offsets[0]):int(offsets[-1])] if n else b""
    return b"".join((_COPY_HEADER, body, _COPY_TRAILER))


def feature_blobs(data: bytes, n: int, dim: int) -> pa.Array:
    """The binary COPY output of n rows of one `bytea` column, each `dim` float32 values, as Arrow blobs."""
    width = dim * FEATURE_DTYPE.itemsize
    record = _COPY_PREFIX + width
    header = len(_COPY_HEADER)
    if len(data) != header + n * record + len(_COPY_TRAILER):
        raise ValueError(f"stored feature rows do not all hold {dim} float32 values ({width} bytes)")
    rows = np.frombuffer(data, np.uint8, count=n * record, offset=header).reshape(n, record)
    lengths = rows[:, 2:6].copy().view(">i4").reshape(n)
    if n and not (lengths == width).all():
        raise ValueError(f"stored feature rows do not all hold {dim} float32 values ({width} bytes)")
    values = np.ascontiguousarray(rows[:, _COPY_PREFIX:])
    offsets = np.arange(n + 1, dtype=np.int64) * width
    return pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(values)])


def copy_out(cursor: Any, statement: str, params: Sequence[Any]) -> bytes:
    """All the data a `COPY (...) TO STDOUT` statement sends."""
    chunks = []
    with cursor.copy(statement, list(params) or None) as copy:
        for chunk in copy:
            chunks.append(bytes(chunk))
    return b"".join(chunks)


def read_csv(data: bytes, types: Mapping[str, pa.DataType]) -> pa.Table:
    """PostgreSQL's CSV of columns `types` names, in that order (NULL unquoted empty, an empty string quoted)."""
    if not data:
        return pa.table({name: pa.array([], kind) for name, kind in types.items()})
    return pacsv.read_csv(
        io.BytesIO(data),
        read_options=pacsv.ReadOptions(column_names=list(types), use_threads=False),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types=dict(types), strings_can_be_null=True,
                                             quoted_strings_can_be_null=False),
    )


def copy_in(cursor: Any, statement: str, data: bytes) -> None:
    """Send `data` to a `COPY ... FROM STDIN` statement."""
    with cursor.copy(statement) as copy:
        copy.write(data)
