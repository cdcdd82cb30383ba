"""Where the committed corpus snapshot lies and what its manifest says: read by the corpus loader
(`study_harness.corpus`) and written by the snapshot builder (`study_harness.snapshot`)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "corpus"
MANIFEST = "manifest.json"
ROWS = "rows.parquet"


def snapshot_file(key: str, root: Path | None = None) -> Path | None:
    """The snapshot's rows for a corpus key, or None when the snapshot has none."""
    path = (root or ROOT) / key / ROWS
    return path if path.is_file() else None


def read_manifest(root: Path | None = None) -> dict | None:
    path = (root or ROOT) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def skipped_ids(key: str, root: Path | None = None) -> set[str]:
    """Prompt ids of a key the engine could not take (longer than its prompt limit), as the manifest records."""
    manifest = read_manifest(root) or {"corpora": {}}
    return set(manifest["corpora"].get(key, {}).get("skipped", []))
