"""Boolean row masks between Arrow and numpy: how ingest's checks and both stores' writers pick rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def true_rows(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A boolean Arrow array as numpy, null counted as False."""
    return pc.fill_null(array, False).to_numpy(zero_copy_only=False).astype(bool)


def rows_in(values: pa.Array | pa.ChunkedArray, value_set: pa.Array) -> np.ndarray:
    """Which of `values` are in `value_set` (a null value never is)."""
    return true_rows(pc.is_in(values, value_set=value_set))


def rows_where(table: pa.Table, mask: np.ndarray) -> pa.Table:
    """The rows of `table` where `mask` holds; `table` itself, uncopied, when it holds for every row."""
    return table if mask.all() else table.filter(pa.array(mask))
