"""Which prompts each study uses: named sets or files, per-set limits, and disjoint train/test slices.

Every selection samples a file in a seeded order (sets are often sorted by language), so the same
command always picks the same prompts and reuses the same corpus rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from harness.datasets import available_prompts, load_prompts, sample_prompts, shared_dir

DOMAINS = {
    "chat": ("sharegpt", "arena_hard"),
    "instruction": ("alpaca", "alpaca_eval", "self_instruct"),
    "math": ("math", "gsm8k"),
    "multilingual": ("mgsm", "llmzoo", "mtbench_x", "alpaca_zh"),
}
CHAT_TRAIN = "sharegpt:500,arena_hard:100"
SEED = 0


def prompts_of(name_or_path: str | Path) -> list[dict]:
    """A shared set by name (ShareGPT falls back to the embedded package) or any JSONL in the shared schema."""
    path = Path(name_or_path)
    if path.suffix == ".jsonl" or path.exists():
        return load_prompts(path)
    shared = shared_dir()
    if shared is not None and (shared / "data" / "prompts" / f"{name_or_path}.jsonl").exists():
        return load_prompts(shared / "data" / "prompts" / f"{name_or_path}.jsonl")
    if str(name_or_path) == "sharegpt":
        return available_prompts(None, sets=["sharegpt"])
    raise FileNotFoundError(f"no prompt set {name_or_path!r}: give a JSONL path in the shared schema")


def select(spec: str, default_limit: int | None = None, exclude: Iterable[str] = ()) -> list[dict]:
    """Prompts of `NAME_OR_FILE[:N],...`, each sampled in the seeded order, skipping excluded ids."""
    excluded = set(exclude)
    chosen: list[dict] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, _, count = part.rpartition(":") if part.rsplit(":", 1)[-1].isdigit() else (part, "", "")
        limit = int(count) if count else default_limit
        items = [p for p in sample_prompts(prompts_of(name), None, SEED) if p["id"] not in excluded]
        chosen.extend(items if limit is None else items[:limit])
    return chosen


def domain_spec(domain: str, limit: int) -> str:
    """`DOMAIN` as a selection spec over its shared sets, `limit` prompts each."""
    return ",".join(f"{name}:{limit}" for name in DOMAINS[domain])
