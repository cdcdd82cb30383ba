"""Where LEAP keeps its state: the model cache, feedback segments, the DuckDB file, MLflow, logs.

One folder, `$LEAP_HOME` (default `.leap` under the current directory; `leap_io.settings.LeapSettings.home`),
so a checkout is self-contained and `rm -rf .leap` resets everything.
"""

from pathlib import Path


def state_dir() -> Path:
    from leap_io.settings import read_settings

    path = read_settings().home
    path.mkdir(parents=True, exist_ok=True)
    return path


def sub_dir(name: str) -> Path:
    path = state_dir() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
