"""Feedback rows judged against the segment schema, one by one, before they join a batch.

A row that does not fit (a missing column, a value that does not convert, a feature of another size)
raises `BadRow` with the reason, and is quarantined by the writer as one JSON line
(`quarantine_line`) that keeps the row's scalars and the kind and size of its feature, never its values.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

Converted = tuple[list[Any], np.ndarray]
"""A row as plain scalar values in schema order, and its feature as float32 of the schema's dim."""

_FAST_TYPES = {pa.string(): str, pa.float64(): float, pa.float32(): float}
_INT32 = (-(1 << 31), (1 << 31) - 1)


class BadRow(ValueError):
    """A row that does not fit the feedback schema; the message is the quarantine reason."""


class BatchBreaker(ValueError):
    """One row of a batch that converted alone but breaks the batch: `index` in it, `reason` why."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value if not isinstance(value, str) else value[:1000]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    return repr(value)[:200]


def _summary(feature: Any) -> dict[str, Any]:
    """What the quarantine keeps of a feature: its kind and size, never its values."""
    summary: dict[str, Any] = {"type": type(feature).__name__}
    shape = getattr(feature, "shape", None)
    if shape is not None:
        summary["shape"] = [int(s) for s in shape] if isinstance(shape, tuple) else repr(shape)[:100]
        summary["dtype"] = str(getattr(feature, "dtype", ""))
    elif isinstance(feature, (list, tuple)):
        summary["length"] = len(feature)
    return summary


def quarantine_line(row: Any, reason: str, replica_id: str) -> str:
    """One JSON line for the quarantine: when, whose, why, the row's scalars and its feature's summary."""
    record: dict[str, Any] = {"quarantined_at": time.time(), "replica_id": replica_id, "reason": reason}
    try:
        if isinstance(row, Mapping):
            record["row"] = {str(k)[:100]: _json_safe(v) for k, v in row.items() if k != "feature"}
            record["feature"] = _summary(row.get("feature"))
        else:
            record["row"] = _json_safe(row)
        return json.dumps(record, default=repr) + "\n"
    except Exception as exc:
        record["row"] = f"<a {type(row).__name__} that cannot be described: {type(exc).__name__}>"
        record.pop("feature", None)
        return json.dumps(record, default=repr) + "\n"


class RowConverter:
    """Checks one row against the schema and returns plain values that build a batch without error."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.dim = schema.field("feature").type.list_size
        self.scalars = [(f.name, f.type, f.nullable) for f in schema if f.name != "feature"]

    def convert(self, row: Any) -> Converted:
        if not isinstance(row, Mapping):
            raise BadRow(f"row is a {type(row).__name__}, not a mapping of column -> value")
        values = []
        for name, kind, nullable in self.scalars:
            value = row.get(name)
            if value is None:
                if not nullable:
                    raise BadRow(f"{name} is missing or null")
                values.append(None)
                continue
            fast = _FAST_TYPES.get(kind)
            if fast is not None and type(value) is fast:
                values.append(value)
                continue
            if kind == pa.int32() and type(value) is int and _INT32[0] <= value <= _INT32[1]:
                values.append(value)
                continue
            try:
                values.append(pa.scalar(value, type=kind).as_py())
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise BadRow(f"{name}: {type(value).__name__} {_json_safe(value)!r} does not convert to "
                             f"{kind}: {exc}") from None
        if "feature" not in row or row["feature"] is None:
            raise BadRow("feature is missing or null")
        try:
            feature = np.asarray(row["feature"], dtype=np.float32)
        except Exception as exc:
            raise BadRow(f"feature does not convert to float32: {type(exc).__name__}: {exc}") from None
        if feature.size != self.dim:
            raise BadRow(f"feature has {feature.size} values of shape {feature.shape}, expected dim {self.dim}")
        return values, feature.reshape(self.dim)

    def batch(self, rows: list[Converted]) -> pa.RecordBatch:
        columns = list(zip(*(values for values, _ in rows)))
        arrays = [pa.array(list(column), type=kind) for column, (_, kind, _) in zip(columns, self.scalars)]
        flat = np.concatenate([feature for _, feature in rows])
        arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), self.dim))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def checked_batch(self, rows: list[Converted]) -> pa.RecordBatch:
        """`batch(rows)`; when the per-row check let a bad row through, BatchBreaker names the first
        row that does not build a batch alone."""
        try:
            return self.batch(rows)
        except Exception as exc:
            first_error = exc
        for index, row in enumerate(rows):
            try:
                self.batch([row])
            except Exception as exc:
                raise BatchBreaker(index, f"row does not build a batch: {exc}") from first_error
        raise RuntimeError("a batch of rows that each convert does not convert together") from first_error

    def as_row(self, converted: Converted) -> dict[str, Any]:
        """A converted row as a mapping again (what the quarantine describes)."""
        values, feature = converted
        return dict(zip([name for name, _, _ in self.scalars], values), feature=feature)

