"""The training frame: finished requests joined with their feature vectors, as both stores return them."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from store.feature_encoding import features_from_bytes


class TrainingFrame(NamedTuple):
    """Finished requests joined with their features, ordered by arrival time then request id."""

    request_ids: np.ndarray  # object (n,)
    features: np.ndarray  # float32 (n, d)
    output_tokens: np.ndarray  # int64 (n,)
    finish_reason: np.ndarray  # object (n,)
    domain: np.ndarray  # object (n,), None where unknown
    arrival_time: np.ndarray  # float64 (n,)
    max_tokens: np.ndarray | None = None  # int64 (n,), the request's output budget; 0 where unknown
    policy: np.ndarray | None = None  # object (n,), the scheduling policy it was served under
    decoding: np.ndarray | None = None  # object (n,), the JSON of its sampling settings

    def take(self, rows: np.ndarray | slice) -> TrainingFrame:
        """The frame restricted to `rows` (indices, a boolean mask, or a slice for views), in that order."""
        return TrainingFrame(*(None if column is None else column[rows] for column in self))


def frame_from_arrow(table: pa.Table, features: Callable[[int], np.ndarray] | None = None) -> TrainingFrame:
    """The frame of a query's rows (`store.sql.FRAME_COLUMNS`); `features(dim)` reads their vectors, else
    the `feature` column holds them as `store.feature_encoding` blobs.

    ValueError when the rows mix feature dims or capture recipes: a frame's columns mean one thing.
    """
    dims = pc.unique(table.column("dim")).to_pylist()
    if len(dims) > 1:
        raise ValueError(
            f"the selection mixes feature dims {sorted(dims)}; filter by model_fingerprint and layer"
        )
    recipes = pc.unique(table.column("recipe")).to_pylist()
    if len(recipes) > 1:
        raise ValueError(
            f"the selection mixes capture recipes {sorted(recipes)}; filter by model_fingerprint, layer and recipe"
        )
    dim = dims[0] if dims else 0
    return TrainingFrame(
        request_ids=table.column("request_id").to_numpy(zero_copy_only=False),
        features=features(dim) if features is not None else features_from_bytes(table.column("feature"), dim),
        output_tokens=table.column("output_tokens").to_numpy(zero_copy_only=False).astype(np.int64),
        finish_reason=table.column("finish_reason").to_numpy(zero_copy_only=False),
        domain=table.column("domain").to_numpy(zero_copy_only=False),
        arrival_time=table.column("arrival_time").to_numpy(zero_copy_only=False).astype(np.float64),
        max_tokens=pc.fill_null(table.column("max_tokens"), 0).to_numpy(zero_copy_only=False).astype(np.int64),
        policy=table.column("policy").to_numpy(zero_copy_only=False),
        decoding=table.column("decoding").to_numpy(zero_copy_only=False),
    )
