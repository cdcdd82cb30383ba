"""Which decoder layer to read when nothing names one."""

from __future__ import annotations


def default_layer(num_layers: int) -> int:
    """A late but not final layer, used only when neither the settings nor the readout name one."""
    return max(0, min(num_layers - 2, round(0.73 * num_layers)))
