"""The committed corpus snapshot: the length corpus every study and the demo read, kept in the repository.

A corpus costs an hour or more of engine time, so the rows behind the published figures live in
`corpus/` beside the code: one `rows.parquet` per corpus key (the key covers model fingerprint, layer,
output budget M, decoding settings and engine numerics, see `study_harness.corpus.corpus_key`), features
stored as float16 (the serving model computes in bfloat16, whose values float16 holds exactly within
its range), and `corpus/manifest.json` naming the model, layers, decoding, M, every prompt id and a
content hash of each file. `study_harness.corpus.load_corpus` reads a key's snapshot rows before the local
cache's shards, so a fresh clone runs the studies without an engine; `leap corpus build --snapshot`
generates what the cache lacks (resumable) and rewrites the snapshot with the union of both.

Every result JSON records `corpus_hash` (the manifest's hash over its files' content hashes) and the
commit it ran on, so a figure names the rows and code it came from.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from leap_io.durable import write_durably, write_text_durably
from study_harness import snapshot_files
from study_harness.corpus import ALL_LAYERS, ENGINE_NUMERICS, Corpus
from study_harness.snapshot_files import MANIFEST, ROWS, read_manifest, skipped_ids, snapshot_file  # noqa: F401  (the snapshot's public names, read as snapshot.X)

PROMPTS = "prompts.parquet"
FORMAT = 1

# What the snapshot holds: every study's prompts (seeded samples, see evaluation.selections), at least
# 3,000 ShareGPT rows (3,050 prompts: about 1.5% are longer than the engine's prompt limit), all 500
# Arena-Hard and 300 of each other shared set (all 252 of self_instruct), and the untouched test slice
# (evaluation.selections.UNTOUCHED: 600 more ShareGPT prompts that only the final table reads) ...
SELECTION = ("sharegpt:3050,sharegpt_untouched:600,arena_hard:500,alpaca:300,alpaca_eval:300,self_instruct:300,"
             "math:300,gsm8k:300,mgsm:300,llmzoo:300,mtbench_x:300,alpaca_zh:300")
# ... and every decoder layer's state for a ShareGPT subset (the layer study), kept small.
ALL_LAYERS_SELECTION = "sharegpt:400"


def write_prompts(ordered: dict[str, list[dict]], root: Path | None = None) -> dict:
    """Store the snapshot's prompts (texts included) so a checkout without the shared folder selects the same
    prompts and replays the same texts: `ordered[set]` is that set's prompts in the selections' seeded
    order, kept as `rank`. Returns the manifest's record of the file (count per set and content hash)."""
    rows = [{**{k: str(p.get(k) or "") for k in ("id", "set", "domain", "lang", "prompt")}, "rank": rank}
            for name in sorted(ordered) for rank, p in enumerate(ordered[name])]
    table = pa.table({name: [r[name] for r in rows] for name in ("id", "set", "domain", "lang", "prompt")}
                     | {"rank": pa.array([r["rank"] for r in rows], pa.int32())})
    folder = root or snapshot_files.ROOT
    folder.mkdir(parents=True, exist_ok=True)
    old = (read_manifest(folder) or {}).get("prompts") or {}
    write_durably(folder / PROMPTS, lambda partial: pq.write_table(table, partial, compression="zstd"))
    record = {"file": PROMPTS, "per_set": {name: len(ordered[name]) for name in sorted(ordered)},
              "content_hash": _prompts_digest(rows)}
    return {**record, "extends": _extended_prompts(old, record, rows)}


def _prompts_digest(rows: Sequence[dict]) -> str:
    """sha256 over the stored prompts (set, rank, id, text), in set then rank order."""
    return hashlib.sha256("\n".join(f"{r['set']}\t{r['rank']}\t{r['id']}\t{r['prompt']}" for r in rows).encode()
                          ).hexdigest()


def _extended_prompts(old: dict, record: dict, rows: Sequence[dict]) -> list[str]:
    """The prompt-file hashes the new file still holds unchanged: the old record's (and those it extended)
    when the old sets' prompts are the new file's first ones of each set, in the same order, same texts."""
    if not old or old.get("content_hash") == record["content_hash"]:
        return list(old.get("extends", []))
    counts = old.get("per_set", {})
    kept = [r for r in rows if r["rank"] < counts.get(r["set"], 0)]
    if len(kept) != sum(counts.values()) or _prompts_digest(kept) != old.get("content_hash"):
        return []
    return [*old.get("extends", []), old["content_hash"]]


def read_prompts(name: str, root: Path | None = None) -> list[dict] | None:
    """One set's stored prompts in the selections' seeded order, or None when the snapshot has none."""
    path = (root or snapshot_files.ROOT) / PROMPTS
    if not path.is_file():
        return None
    table = pq.read_table(path, filters=[("set", "=", name)])
    if not table.num_rows:
        return None
    rows = table.sort_by("rank").to_pylist()
    return [{k: row[k] for k in ("id", "set", "domain", "lang", "prompt")} for row in rows]


def stored_texts(root: Path | None = None) -> dict[str, str]:
    """Every stored prompt's text by id (empty without stored prompts)."""
    path = (root or snapshot_files.ROOT) / PROMPTS
    if not path.is_file():
        return {}
    table = pq.read_table(path, columns=["id", "prompt"])
    return dict(zip(table.column("id").to_pylist(), table.column("prompt").to_pylist()))


def content_hash(corpus: Corpus) -> str:
    """sha256 over the rows in id order: ids, sets, prompt and output lengths, finish reasons and the
    float16 features, so equal rows give equal hashes wherever they were written."""
    order = np.argsort(corpus.ids.astype(str), kind="stable")
    digest = hashlib.sha256()
    for column in (corpus.ids, corpus.sets, corpus.finish_reasons):
        digest.update("\n".join(str(v) for v in column[order]).encode())
    for column in (corpus.prompt_tokens, corpus.output_tokens):
        digest.update(np.ascontiguousarray(column[order], dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(corpus.features[order], dtype="<f2").tobytes())
    return digest.hexdigest()


def _float16(features: np.ndarray) -> np.ndarray:
    if features.size and not (np.isfinite(features).all()
                              and float(np.abs(features).max()) <= float(np.finfo(np.float16).max)):
        raise ValueError("a feature does not fit float16 (|x| > 65504): the snapshot cannot hold this model's "
                         "states; keep the corpus in the cache")
    return features.astype(np.float16)


def write_rows(corpus: Corpus, key: str, root: Path | None = None) -> Path:
    """Write one key's rows (sorted by id, features float16) atomically; return the file."""
    folder = (root or snapshot_files.ROOT) / key
    folder.mkdir(parents=True, exist_ok=True)
    order = np.argsort(corpus.ids.astype(str), kind="stable")
    rows = corpus.subset(order)
    features = _float16(rows.features)
    table = pa.table({
        "id": rows.ids.tolist(), "set": rows.sets.tolist(), "domain": rows.domains.tolist(),
        "lang": rows.langs.tolist(), "prompt_tokens": pa.array(rows.prompt_tokens, pa.int32()),
        "output_tokens": pa.array(rows.output_tokens, pa.int32()), "finish_reason": rows.finish_reasons.tolist(),
        "feature": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), features.shape[1]),
    })
    write_durably(folder / ROWS, lambda partial: pq.write_table(table, partial, compression="zstd"))
    return folder / ROWS


def corpus_entry(corpus: Corpus, selection: str, skipped: Sequence[str] = ()) -> dict:
    """The manifest's record of one key: layer, counts per set, the budget share reached, ids and hash, and
    the selected ids the engine could not take (`skipped`, too long), so no build retries them."""
    sets, counts = np.unique(corpus.sets.astype(str), return_counts=True)
    order = np.argsort(corpus.ids.astype(str), kind="stable")
    return {"layer": "all" if corpus.layer == ALL_LAYERS else int(corpus.layer), "rows": len(corpus),
            "dim": int(corpus.features.shape[1]) if len(corpus) else 0, "selection": selection,
            "per_set": {str(s): int(c) for s, c in zip(sets, counts)},
            "capped_fraction": corpus.capped_fraction(),
            "content_hash": content_hash(corpus), "ids": corpus.ids[order].astype(str).tolist(),
            "skipped": sorted(set(skipped))}


def write_manifest(entries: dict[str, dict], model: Any, decoding: dict, max_tokens: int,
                   root: Path | None = None, prompts: dict | None = None) -> dict:
    """Merge `entries` (key -> corpus_entry) into the manifest and write it; return the manifest.
    `prompts` is `write_prompts`' record of the stored prompt texts (kept from the old manifest if None)."""
    import vllm

    root = root or snapshot_files.ROOT
    old = read_manifest(root) or {}
    corpora = {**old.get("corpora", {}), **entries}
    kept_prompts = prompts if prompts is not None else old.get("prompts")
    corpus_hash = manifest_hash(corpora, kept_prompts)
    manifest = {
        "format": FORMAT,
        "corpus_hash": corpus_hash,
        "supersedes": _superseded(old, corpora, kept_prompts, corpus_hash),
        "model": {"model_id": model.model_id, "fingerprint": model.fingerprint, "num_layers": model.num_layers,
                  "hidden_size": model.hidden_size},
        "engine": {"numerics": ENGINE_NUMERICS, "vllm": vllm.__version__},
        "decoding": decoding, "max_tokens": int(max_tokens), "feature_dtype": "float16",
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
        "prompts": prompts if prompts is not None else old.get("prompts"),
        "corpora": corpora,
    }
    root.mkdir(parents=True, exist_ok=True)
    write_text_durably(root / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _superseded(old: dict, corpora: dict[str, dict], prompts: dict | None, corpus_hash: str) -> list[str]:
    """Earlier corpus hashes whose rows this snapshot still holds unchanged: a rewrite that only adds corpus
    keys, or rows to a key (the key's entry lists the old content hash in `extends`), or prompts to the
    prompt file (likewise), keeps every result recorded on the earlier snapshot current (it read the same
    rows). A changed key or prompt file clears the list."""
    if not old or old.get("corpus_hash") in (None, corpus_hash):
        return list(old.get("supersedes", []))
    same = all(entry.get("content_hash") == corpora.get(key, {}).get("content_hash")
               or entry.get("content_hash") in corpora.get(key, {}).get("extends", [])
               for key, entry in old.get("corpora", {}).items())
    old_prompts = (old.get("prompts") or {}).get("content_hash")
    same = same and (old_prompts == (prompts or {}).get("content_hash")
                     or old_prompts in (prompts or {}).get("extends", []))
    return [*old.get("supersedes", []), old["corpus_hash"]] if same else []


def current_hashes(manifest: dict | None) -> set[str]:
    """The corpus hashes a result may record and still be current: the snapshot's and those it supersedes."""
    if not manifest:
        return set()
    return {manifest.get("corpus_hash"), *manifest.get("supersedes", [])} - {None}


def manifest_hash(corpora: dict[str, dict], prompts: dict | None = None) -> str:
    """One hash for the whole snapshot: sha256 over `key:content_hash` lines in key order, and the stored
    prompt texts' hash when there are any."""
    lines = "\n".join(f"{key}:{corpora[key]['content_hash']}" for key in sorted(corpora))
    if prompts:
        lines += f"\nprompts:{prompts['content_hash']}"
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


RESULT_PATHS = ("docs/results", "docs/results.md")  # what the studies write: outputs, not the code they ran


def git_commit(cwd: Path | None = None) -> str:
    """The checkout's commit, `-dirty` when tracked files other than the study results (RESULT_PATHS)
    differ from it; "unknown" outside git. Results written by one study leave the next one's code clean,
    so `leap eval report --rerun` saves study after study."""
    cwd = cwd or Path(__file__).resolve().parents[2]
    excluded = [f":(exclude){path}" for path in RESULT_PATHS]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded],
                               cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def provenance() -> dict:
    """What a result JSON records about its inputs: the snapshot's corpus_hash, the commit, and how many
    rows the study read from outside the snapshot (`rows_outside_snapshot`, per corpus key).

    A key the snapshot lacks (another model, another M) makes the hash `cache:<key>,...`: those rows
    live only on this machine."""
    from study_harness.corpus import READ

    manifest = read_manifest() or {"corpora": {}}
    outside_keys = sorted(k for k in READ if k not in manifest["corpora"])
    corpus_hash = "cache:" + ",".join(outside_keys) if outside_keys else manifest.get("corpus_hash", "none")
    return {"corpus_hash": corpus_hash, "commit": git_commit(),
            "rows_outside_snapshot": {k: n for k, n in sorted(READ.items()) if n}}
