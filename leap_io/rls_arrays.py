"""The RLS state at rest: its two symmetric matrices kept as upper triangles.

`RLS.state_arrays` builds P and A from their upper triangles, so keeping only those is exact and halves
what a stored state weighs ((d+1)(d+2)/2 float64 each instead of (d+1)^2). The registry stores versions in
this form (`registry.rls_file`) and a replica reads it back when it is given such a file to serve, so both
use these two functions. Arrays already full pass through as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

SYMMETRIC = ("P", "A")
_UPPER = "{}_upper"


def _upper_mask(n: int) -> np.ndarray:
    return np.triu(np.ones((n, n), dtype=bool))


def pack(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` with P and A as their upper triangles, row by row."""
    packed = dict(arrays)
    mask = None
    for key in SYMMETRIC:
        matrix = np.asarray(packed.pop(key))
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"RLS state array {key} is not a square matrix: shape {matrix.shape}")
        mask = _upper_mask(matrix.shape[0]) if mask is None or mask.shape != matrix.shape else mask
        packed[_UPPER.format(key)] = matrix[mask]
    return packed


def unpack(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The full arrays of a stored state, packed (`pack`) or not; ValueError for a triangle of no square."""
    full = dict(arrays)
    for key in SYMMETRIC:
        name = _UPPER.format(key)
        if name not in full:
            continue
        upper = np.asarray(full.pop(name), dtype=np.float64).reshape(-1)
        n = int(round((np.sqrt(8 * upper.size + 1) - 1) / 2))
        if n * (n + 1) // 2 != upper.size:
            raise ValueError(f"RLS state array {name} has {upper.size} values: not an upper triangle")
        matrix = np.zeros((n, n), dtype=np.float64)
        matrix[_upper_mask(n)] = upper
        full[key] = matrix + np.triu(matrix, 1).T
    return full
