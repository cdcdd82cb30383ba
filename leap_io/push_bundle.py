"""The push bundle: what the push flow sends a replica, a readout file plus its RLS anchor arrays.

A body is either a bare leap_core readout file or an npz archive with `readout_bytes` and `rls_*` arrays.
"""

from __future__ import annotations

import io

import numpy as np


def read_bundle(body: bytes) -> tuple[bytes, dict[str, np.ndarray] | None]:
    """A push body is a readout file, or an npz bundle {readout_bytes, rls_*} carrying the RLS anchor."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as npz:
            if "readout_bytes" in npz.files:
                state = {k[4:]: npz[k] for k in npz.files if k.startswith("rls_")}
                return npz["readout_bytes"].tobytes(), state or None
    except Exception:
        pass
    return body, None


def make_bundle(readout_bytes: bytes, rls_state: dict[str, np.ndarray] | None) -> bytes:
    """The inverse of `read_bundle`: what the push flow sends."""
    arrays = {"readout_bytes": np.frombuffer(readout_bytes, dtype=np.uint8)}
    for key, value in (rls_state or {}).items():
        arrays[f"rls_{key}"] = np.asarray(value)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()
