"""Pure numpy math of LEAP: linear readout, RLS correction, countdown policy, simulator, metrics.

No file or network I/O and no engine imports live here, so serving, registry and flows can all
depend on it.
"""
