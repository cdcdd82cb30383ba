"""The wall-clock study's progress file: a full run takes hours, so it is played a whole repeat at a time and
resumed where it stopped, in this session or a later one.

The file keeps the settings, the workload's key (the served readout's bytes and the held-out prompts: a
resumed study must serve the same readout on the same prompts), stock's capacity measured at the start (every
later repeat plays the same arrival rates) and each finished repeat's runs with the host that played them.
A repeat is the unit kept: its arms ran back to back on one machine, so each ratio over runs stays paired.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from leap_io.durable import write_text_durably
from leap_io.jsonable import dumps

FORMAT = 1


def workload_key(readout_bytes: bytes, test_ids: list[str], train_ids: list[str]) -> str:
    """What a resumed study must share with the repeats before it: the served readout and the prompts."""
    digest = hashlib.sha256(readout_bytes)
    digest.update(json.dumps([sorted(test_ids), sorted(train_ids)]).encode())
    return digest.hexdigest()[:24]


def load(path: Path, settings: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The progress kept at `path` (None when there is none yet); ValueError when it belongs to another study."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the progress file {path} cannot be read: {exc}") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"the progress file {path} is not a wall-clock study's progress (format {FORMAT})")
    if saved.get("settings") != settings:
        changed = sorted(k for k in set(settings) | set(saved.get("settings", {}))
                         if settings.get(k) != saved.get("settings", {}).get(k))
        raise ValueError(f"the progress file {path} was played with other settings ({', '.join(changed)}): "
                         "resume with the same options, or name a new file")
    if saved.get("workload_key") != key:
        raise ValueError(f"the progress file {path} served another readout or other prompts (the snapshot or "
                         "the prompt data changed since): name a new file")
    return saved


def start(settings: dict[str, Any], key: str, capacity: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "settings": settings, "workload_key": key, "capacity": capacity,
            "capacity_host": _host(), "runs": [], "played_on": []}


def add_repeat(progress: dict[str, Any], run: dict[str, dict], started: float, path: Path | None) -> None:
    """Keep one finished repeat, and write the file at once (durably) when there is one: a stop after it
    loses nothing."""
    progress["runs"].append(run)
    progress["played_on"].append({**_host(), "started": datetime.fromtimestamp(started, UTC).isoformat(
        timespec="seconds")})
    if path is not None:
        save(progress, path)


def save(progress: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_durably(path, dumps(progress, indent=1) + "\n")


def _host() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "machine": platform.machine()}
