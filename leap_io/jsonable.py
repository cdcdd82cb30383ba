"""numpy-bearing results as plain JSON values: the one encoder the CLI, the flows and the registry share.

Results carry numpy scalars and arrays, tuples, paths and non-finite floats (an empty bucket's MAE is
NaN). `to_jsonable` turns them into dicts, lists, str, int, float, bool and None, recursively; what it
does with a non-finite float is the caller's choice, since strict JSON has no spelling for it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Literal

import numpy as np

NonFinite = Literal["null", "string", "keep"]


def to_jsonable(value: Any, *, nonfinite: NonFinite = "null") -> Any:
    """`value` with numpy scalars and arrays, tuples, mapping keys and paths made plain, recursively.

    Mapping keys become str; numpy arrays, lists and tuples become lists; numpy scalars (and anything
    with a callable `item()`, such as a 0-d tensor) their Python value; paths their str.
    nonfinite: what a NaN or infinite float becomes: "null" (None, strict JSON, the default),
        "string" ("nan", "inf", "-inf") or "keep" (the float; `json.dumps` then writes NaN/Infinity).
    """
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item, nonfinite=nonfinite) for key, item in value.items()}
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return to_jsonable(value.item(), nonfinite=nonfinite)
    if isinstance(value, (list, tuple, np.ndarray)):
        return [to_jsonable(item, nonfinite=nonfinite) for item in value]
    if isinstance(value, float):  # np.float64 too: it subclasses float
        value = float(value)
        if math.isfinite(value) or nonfinite == "keep":
            return value
        return None if nonfinite == "null" else str(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "item") and callable(value.item):
        return to_jsonable(value.item(), nonfinite=nonfinite)
    return value


def dumps(value: Any, *, nonfinite: NonFinite = "null", **options: Any) -> str:
    """`json.dumps(to_jsonable(value, nonfinite=nonfinite), **options)`; strict unless nonfinite="keep"."""
    options.setdefault("allow_nan", nonfinite == "keep")
    return json.dumps(to_jsonable(value, nonfinite=nonfinite), **options)
