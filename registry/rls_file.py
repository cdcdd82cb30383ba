"""The RLS state of a registered version as a file: `leap_io.rls_arrays`' at-rest form (P and A as upper
triangles: about 134 MB instead of 268 MB at d = 4096) in one `.npz`. Files written before hold the full
matrices and load as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from leap_io.rls_arrays import pack, unpack


def save(path: str | Path | BinaryIO, arrays: Mapping[str, np.ndarray]) -> None:
    """Write the state packed, as one `.npz` file (a path or an open binary file)."""
    np.savez(path, **pack(arrays))


def load(path: str | Path) -> dict[str, np.ndarray]:
    """The full arrays of a state file `save` (or an older release) wrote."""
    with np.load(path) as stored:
        return unpack({key: stored[key] for key in stored.files})
