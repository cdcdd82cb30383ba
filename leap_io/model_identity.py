"""The identity of a serving model: its id and a fingerprint of its weight files.

Every readout records the fingerprint: a readout fitted on one set of weights must not serve another.
Any Hugging Face decoder folder (SmolLM2, Qwen3-8B, ...) is described the same way.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

INFO_FILE = "leap_model.json"
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelInfo:
    """What LEAP needs to know about a serving model: where it is, what it is, and its fingerprint."""

    path: str
    model_id: str
    fingerprint: str
    num_layers: int
    hidden_size: int
    max_position_embeddings: int

    def to_dict(self) -> dict:
        return asdict(self)


def registered_model_name(model_id: str, layer: int) -> str:
    """`leap-readout-<model id>-L<layer>`: the registered model of a serving model and layer (the registry
    names its versions by it; serving finds the published champion by it without importing MLflow)."""
    sanitised = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9._-]+", "-", str(model_id).lower())).strip("-.")
    return f"leap-readout-{sanitised}-L{int(layer)}"


def weights_fingerprint(folder: Path) -> str:
    """sha256 over the weight files (names and contents), so the same weights give the same id anywhere."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weight files in {folder}")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()[:32]


def describe_model(folder: str | Path, model_id: str | None = None) -> ModelInfo:
    """Read (or compute once and cache beside the weights) the ModelInfo of a Hugging Face folder."""
    folder = Path(folder).resolve()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    info_file = folder / INFO_FILE
    if info_file.is_file():
        cached = json.loads(info_file.read_text())
        if cached.get("path") == str(folder):
            return ModelInfo(**cached)
    info = ModelInfo(
        path=str(folder),
        model_id=model_id or folder.name,
        fingerprint=weights_fingerprint(folder),
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 0)),
    )
    try:
        info_file.write_text(json.dumps(info.to_dict(), indent=2))
    except OSError:  # a read-only model folder: the fingerprint is recomputed next time
        pass
    return info


def serves(reported: str, expected: str) -> bool:
    """Whether a replica reporting `reported` serves the readout pushed as `expected`: the same, or
    the same corrected online by RLS since (the replica publishes `<version>+rls<n>`)."""
    return bool(expected) and (reported == expected or reported.startswith(expected + "+rls"))
