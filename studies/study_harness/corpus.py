"""The length corpus: run prompts through the real engine and record each one's true output length and
its layer-L feature, exactly as the serving process would see them.

Results are cached in Parquet shards under `$LEAP_HOME/corpus/<key>/`, where the key covers the model
fingerprint, the layer, the output budget and the decoding settings, so a rerun skips every prompt id
already done (resumable) and a change of any of those starts a separate corpus.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from harness.replay import DEFAULT_DECODING, ReplayRequest, encode_prompts, sampling_params
from leap_io.durable import write_durably
from leap_io.paths import sub_dir


@dataclass
class Corpus:
    """Rows of a corpus as numpy arrays, aligned by index."""

    ids: np.ndarray
    sets: np.ndarray
    domains: np.ndarray
    langs: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    finish_reasons: np.ndarray
    features: np.ndarray  # (n, d) float32
    layer: int
    max_tokens: int

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def subset(self, mask: np.ndarray) -> Corpus:
        return Corpus(self.ids[mask], self.sets[mask], self.domains[mask], self.langs[mask],
                      self.prompt_tokens[mask], self.output_tokens[mask], self.finish_reasons[mask],
                      self.features[mask], self.layer, self.max_tokens)

    def capped_fraction(self) -> float:
        return float(np.mean(self.finish_reasons == "length")) if len(self) else float("nan")


ALL_LAYERS = -1  # the `layer` of a corpus whose features are every decoder layer, concatenated in order


# How the engine computes: greedy outputs and features depend on it. Corpora recorded by the eager
# float32 engine (before the compiled capture) have other keys and are never mixed with these.
ENGINE_NUMERICS = "compiled, model dtype"


def corpus_key(fingerprint: str, layer: int, max_tokens: int, decoding: dict) -> str:
    blob = json.dumps({"fp": fingerprint, "layer": layer, "M": max_tokens, "decoding": decoding,
                       "engine": ENGINE_NUMERICS}, sort_keys=True)
    name = "Lall" if layer == ALL_LAYERS else f"L{layer}"
    return f"{name}-M{max_tokens}-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def corpus_dir(key: str) -> Path:
    path = sub_dir("corpus") / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def _read_rows(path: Path) -> pa.Table:
    """One shard or snapshot file, its features widened to float32 (the snapshot stores float16)."""
    table = pq.read_table(path)
    feature = table.column("feature").combine_chunks()
    if feature.type.value_type != pa.float32():
        values = feature.values.to_numpy(zero_copy_only=False).astype(np.float32)
        widened = pa.FixedSizeListArray.from_arrays(pa.array(values), feature.type.list_size)
        table = table.set_column(table.column_names.index("feature"), "feature", widened)
    return table


def stacked_rows(folder: Path, read: Callable[[Path], pa.Table]) -> tuple[pa.Table, np.ndarray] | None:
    """(the committed snapshot's rows for this key, then every shard of `folder`, each prompt id once with
    its first row; which rows came from the cache), or None when there are none. Shared by every table
    kind kept this way (length corpora, sampled labels)."""
    from study_harness.snapshot_files import snapshot_file

    snapshot = snapshot_file(folder.name)
    sources = ([snapshot] if snapshot is not None else []) + sorted(folder.glob("shard-*.parquet"))
    if not sources:
        return None
    tables = [read(s) for s in sources]
    n_snapshot = tables[0].num_rows if snapshot is not None else 0
    table = pa.concat_tables(tables)
    _, first = np.unique(np.asarray(table.column("id").to_pylist(), dtype=object), return_index=True)
    kept = np.sort(first)
    if kept.size < table.num_rows:
        table = table.take(pa.array(kept))
    return table, kept >= n_snapshot


def load_corpus(folder: Path, layer: int, max_tokens: int, ids: Sequence[str] | None = None) -> Corpus:
    """Read a corpus: the committed snapshot's rows for this key (if any), then every shard of `folder`
    (optionally only the given prompt ids, in that order). A prompt id recorded twice counts once, the
    snapshot's row first."""
    stacked = stacked_rows(folder, _read_rows)
    if stacked is None:
        empty = np.array([], dtype=object)
        return Corpus(empty, empty, empty, empty, np.array([], int), np.array([], int), empty,
                      np.zeros((0, 0), np.float32), layer, max_tokens)
    table, from_cache = stacked
    features = table.column("feature").combine_chunks()
    dim = features.type.list_size
    matrix = features.values.to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32, copy=False)
    columns = {name: np.asarray(table.column(name).to_pylist(), dtype=object) for name in
               ("id", "set", "domain", "lang", "finish_reason")}
    corpus = Corpus(columns["id"], columns["set"], columns["domain"], columns["lang"],
                    table.column("prompt_tokens").to_numpy(), table.column("output_tokens").to_numpy(),
                    columns["finish_reason"], matrix, layer, max_tokens)
    return kept_and_counted(corpus, from_cache, ids, folder)


def kept_and_counted(rows, from_cache: np.ndarray, ids: Sequence[str] | None, folder: Path):
    """`rows` (anything with `ids` and `subset`) cut to `ids` in their order when given, the rows among
    them read from the cache counted in `READ` under the folder's name (provenance)."""
    if ids is not None:
        position = {rid: i for i, rid in enumerate(rows.ids)}
        keep = np.asarray([position[i] for i in ids if i in position], dtype=np.int64)
        rows, from_cache = rows.subset(keep), from_cache[keep]
    READ[folder.name] = READ.get(folder.name, 0) + int(from_cache.sum())
    return rows


# Corpus keys read in this process, each with how many of the rows it returned came from the local
# cache rather than the committed snapshot (what `study_harness.snapshot.provenance` reports).
READ: dict[str, int] = {}


def length_report(corpus: Corpus) -> dict[str, dict]:
    """Output-length distribution per prompt set, and how many hit the budget."""
    report = {}
    for name in sorted(set(corpus.sets.tolist())):
        mask = corpus.sets == name
        lengths = corpus.output_tokens[mask]
        p10, p50, p90 = (float(v) for v in np.percentile(lengths, [10, 50, 90]))
        report[name] = {"n": int(mask.sum()), "mean": float(lengths.mean()), "p10": p10, "p50": p50, "p90": p90,
                        "capped_fraction": float(np.mean(corpus.finish_reasons[mask] == "length"))}
    return report


SKIPPED = "skipped-too-long.txt"


def noted_skipped(folder: Path) -> set[str]:
    """Prompt ids this cache found too long for the engine."""
    path = folder / SKIPPED
    return set(path.read_text(encoding="utf-8").split()) if path.exists() else set()


def note_skipped(folder: Path, ids: Sequence[str]) -> None:
    """Remember prompts too long for the engine, so a cache check does not count them as missing."""
    if ids:
        with open(folder / SKIPPED, "a", encoding="utf-8") as handle:
            handle.writelines(f"{i}\n" for i in ids)


def missing_ids(folder: Path, layer: int, max_tokens: int, ids: Sequence[str]) -> list[str]:
    """Prompt ids neither recorded in the corpus nor known to be too long for the engine (noted in the
    cache or in the snapshot's manifest)."""
    from study_harness.snapshot_files import skipped_ids

    done = set(load_corpus(folder, layer, max_tokens).ids.tolist()) | skipped_ids(folder.name)
    done |= noted_skipped(folder)
    return [i for i in ids if i not in done]


def add_shard(folder: Path, table: pa.Table) -> Path:
    """Add `table` to a cache folder as one new Parquet shard, written durably (`leap_io.durable`): a
    crash leaves no part of a shard for a later read to take."""
    shard = folder / f"shard-{time.strftime('%Y%m%dT%H%M%S')}-{len(list(folder.glob('shard-*')))}.parquet"
    write_durably(shard, lambda partial: pq.write_table(table, partial))
    return shard


def write_shard(folder: Path, rows: list[dict]) -> None:
    """Append `rows` to a corpus folder as one Parquet shard (`add_shard`)."""
    if not rows:
        return
    dim = len(rows[0]["feature"])
    flat = np.concatenate([np.asarray(r["feature"], dtype=np.float32) for r in rows])
    table = pa.table({
        "id": [r["id"] for r in rows], "set": [r["set"] for r in rows], "domain": [r["domain"] for r in rows],
        "lang": [r["lang"] for r in rows], "prompt_tokens": pa.array([r["prompt_tokens"] for r in rows], pa.int32()),
        "output_tokens": pa.array([r["output_tokens"] for r in rows], pa.int32()),
        "finish_reason": [r["finish_reason"] for r in rows],
        "feature": pa.FixedSizeListArray.from_arrays(pa.array(flat), dim),
    })
    add_shard(folder, table)


def copy_layer_rows(all_layers: Path, folder: Path, layer: int, dim: int, max_tokens: int,
                    ids: Sequence[str]) -> int:
    """Fill a layer-L corpus from an all-layers one with the same key otherwise (no generation needed)."""
    have = set(load_corpus(folder, layer, max_tokens).ids.tolist())
    missing = [i for i in ids if i not in have]
    if not missing or not any(all_layers.glob("shard-*.parquet")):
        return 0
    source = load_corpus(all_layers, ALL_LAYERS, max_tokens, ids=missing)
    rows = [{"id": source.ids[k], "set": source.sets[k], "domain": source.domains[k], "lang": source.langs[k],
             "prompt_tokens": int(source.prompt_tokens[k]), "output_tokens": int(source.output_tokens[k]),
             "finish_reason": source.finish_reasons[k],
             "feature": source.features[k, layer * dim:(layer + 1) * dim]} for k in range(len(source))]
    write_shard(folder, rows)
    return len(rows)


def corpus_layer(runtime) -> int:
    """The layer a runtime's captured features belong to (ALL_LAYERS in the layer study)."""
    return ALL_LAYERS if runtime.config.capture_all_layers else runtime.layer


def build_corpus(engine, runtime, prompts: Sequence[dict], folder: Path, max_tokens: int,
                 decoding: dict | None = None, max_prompt_tokens: int = 2048, shard_rows: int = 64,
                 on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Generate for every prompt not yet in `folder`; all are queued at once for throughput."""
    decoding = decoding or DEFAULT_DECODING
    done_ids = set(load_corpus(folder, corpus_layer(runtime), max_tokens).ids.tolist())
    todo = [p for p in prompts if p["id"] not in done_ids]
    encoded, dropped = encode_prompts(engine.get_tokenizer(), todo, max_prompt_tokens)
    kept = {p["id"] for p in encoded}
    note_skipped(folder, [p["id"] for p in todo if p["id"] not in kept])
    meta = {p["id"]: p for p in encoded}
    rows: list[dict] = []
    collected = [0]

    def collect(row: dict) -> None:
        item = meta.get(row["client_request_id"])
        if item is None:
            return
        rows.append({"id": item["id"], "set": item.get("set"), "domain": item.get("domain"),
                     "lang": item.get("lang"), "prompt_tokens": row["prompt_tokens"],
                     "output_tokens": row["output_tokens"], "finish_reason": row["finish_reason"],
                     "feature": row["feature"]})

    runtime.recorder.listeners.append(collect)
    try:
        for item in encoded:
            request = ReplayRequest(id=item["id"], prompt_token_ids=item["prompt_token_ids"], max_tokens=max_tokens)
            engine.add_request(f"corpus-{item['id']}", {"prompt_token_ids": item["prompt_token_ids"]},
                               sampling_params(request, decoding))
        finished = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished += 1
                    if on_progress is not None:
                        on_progress(finished, len(encoded))
            if len(rows) >= shard_rows:
                write_shard(folder, rows)
                collected[0] += len(rows)
                rows.clear()
        write_shard(folder, rows)
        collected[0] += len(rows)
        rows.clear()
    finally:
        runtime.recorder.listeners.remove(collect)
    return {"requested": len(prompts), "cached": len(prompts) - len(todo), "generated": collected[0],
            "dropped_too_long": dropped}
