"""Sampled labels: the key, the median/IQR label, snapshot-then-cache reading and resuming at missing ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from study_harness import corpus as corpus_module
from study_harness import sampled_labels as sl
from study_harness import snapshot, snapshot_files


def _row(pid: str, lengths, max_tokens: int = 100, prompt_tokens: int = 9, set_name: str = "a") -> dict:
    median, iqr, capped = sl.label_stats(lengths, max_tokens)
    return {"id": pid, "set": set_name, "domain": "chat", "prompt_tokens": prompt_tokens, "lengths": list(lengths),
            "capped": capped, "median": median, "iqr": iqr}


def _labels(rows: list[dict], max_tokens: int = 100) -> sl.SampledLabels:
    return sl.SampledLabels(
        ids=np.array([r["id"] for r in rows], dtype=object), sets=np.array([r["set"] for r in rows], dtype=object),
        domains=np.array([r["domain"] for r in rows], dtype=object),
        prompt_tokens=np.array([r["prompt_tokens"] for r in rows]),
        lengths=np.array([r["lengths"] for r in rows], dtype=np.int32),
        median=np.array([r["median"] for r in rows]), iqr=np.array([r["iqr"] for r in rows]),
        capped=np.array([r["capped"] for r in rows]), max_tokens=max_tokens)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_files, "ROOT", tmp_path / "snapshot")
    monkeypatch.setattr(corpus_module, "READ", {})
    return tmp_path / "snapshot"


def test_the_key_names_a_sampled_table_and_covers_decoding_budget_and_samples():
    key = sl.sampled_key("fp", 1024, sl.SAMPLED_DECODING, 4)
    assert key.startswith("S-M1024-") and len(key) == len("S-M1024-") + 12
    assert key == sl.sampled_key("fp", 1024, dict(reversed(list(sl.SAMPLED_DECODING.items()))), 4)
    others = {sl.sampled_key("fp", 1024, sl.SAMPLED_DECODING, 2), sl.sampled_key("fp", 512, sl.SAMPLED_DECODING, 4),
              sl.sampled_key("fp2", 1024, sl.SAMPLED_DECODING, 4),
              sl.sampled_key("fp", 1024, {**sl.SAMPLED_DECODING, "temperature": 1.0}, 4)}
    assert key not in others and len(others) == 4
    assert sl.SAMPLED_DECODING == {"temperature": 0.7, "top_p": 0.9, "frequency_penalty": 0.5}


def test_median_iqr_and_capped_count_of_the_samples():
    assert sl.label_stats([40, 10, 30, 20], 100) == (25.0, 15.0, 0)  # p25 = 17.5, p75 = 32.5
    median, iqr, capped = sl.label_stats([100, 7, 100, 50], 100)
    assert median == 75.0 and capped == 2
    assert iqr == pytest.approx(np.percentile([7, 50, 100, 100], 75) - np.percentile([7, 50, 100, 100], 25))
    assert sl.label_stats([5, 5], 100) == (5.0, 0.0, 0)
    median, iqr, capped = sl.label_stats([], 100)
    assert np.isnan(median) and np.isnan(iqr) and capped == 0


def test_snapshot_rows_come_first_then_the_cache_and_ids_count_once(root, tmp_path):
    key = "S-M100-test"
    snap = _labels([_row("p0", [10, 20, 30, 40]), _row("p1", [100, 100, 100, 90])])
    path = sl.write_sampled_rows(snap, key)
    assert path == root / key / "rows.parquet"
    cache = tmp_path / "cache" / key
    cache.mkdir(parents=True)
    # the cache holds p0 again with other samples: the snapshot's row wins
    sl.write_sampled_shard(cache, [_row("p0", [1, 1, 1, 1]), _row("q0", [3, 5, 8, 13])])
    sl.write_sampled_shard(cache, [_row("q1", [2, 2, 2, 100])])
    rows = sl.load_sampled_labels(cache, 100)
    assert sorted(rows.ids.tolist()) == ["p0", "p1", "q0", "q1"]
    p0 = int(np.flatnonzero(rows.ids == "p0")[0])
    assert rows.lengths[p0].tolist() == [10, 20, 30, 40] and rows.median[p0] == 25.0
    assert rows.lengths.shape == (4, 4) and rows.lengths.dtype == np.int32
    assert corpus_module.READ[key] == 2  # q0, q1 came from outside the snapshot
    chosen = sl.load_sampled_labels(cache, 100, ids=["q1", "p1", "absent"])
    assert chosen.ids.tolist() == ["q1", "p1"]
    assert chosen.capped.tolist() == [1, 3] and chosen.median.tolist() == [2.0, 100.0]
    assert chosen.capped_fraction() == pytest.approx(4 / 8)


def test_missing_ids_skip_recorded_and_too_long_prompts(root, tmp_path):
    key = "S-M100-miss"
    cache = tmp_path / "cache" / key
    cache.mkdir(parents=True)
    assert sl.missing_sampled(cache, 100, ["a", "b"]) == ["a", "b"]
    assert len(sl.load_sampled_labels(cache, 100)) == 0
    sl.write_sampled_rows(_labels([_row("a", [1, 2, 3, 4])]), key)
    sl.write_sampled_shard(cache, [_row("b", [1, 2, 3, 4])])
    corpus_module.note_skipped(cache, ["long-1"])
    root.joinpath("manifest.json").write_text(json.dumps({"corpora": {key: {"skipped": ["long-2"]}}}))
    assert sl.missing_sampled(cache, 100, ["a", "b", "c", "long-1", "long-2", "d"]) == ["c", "d"]


class _Completion:
    def __init__(self, n: int, finish: str):
        self.token_ids, self.finish_reason = list(range(n)), finish


class _Output:
    def __init__(self, request_id: str, n: int, finish: str):
        self.request_id, self.finished, self.outputs = request_id, True, [_Completion(n, finish)]


class _FakeEngine:
    """Finishes one queued request per step with a length drawn from a fixed table (no model)."""

    def __init__(self, lengths: dict[str, int], max_tokens: int):
        self.queue, self.lengths, self.max_tokens, self.added = [], lengths, max_tokens, []

    def get_tokenizer(self):
        class Tokenizer:
            @staticmethod
            def apply_chat_template(messages, tokenize, add_generation_prompt):
                return list(range(len(messages[0]["content"])))
        return Tokenizer()

    def add_request(self, request_id, prompt, params):
        self.queue.append(request_id)
        self.added.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        request_id = self.queue.pop(0)
        n = min(self.lengths[request_id.removeprefix("sampled-")], self.max_tokens)
        return [_Output(request_id, n, "length" if n == self.max_tokens else "stop")]


def test_a_build_writes_one_row_per_prompt_and_resumes_at_the_missing_ones(root, tmp_path, monkeypatch):
    import study_harness.sampled_labels as module

    monkeypatch.setattr(module, "sampling_params", lambda request, decoding: None)
    cache = tmp_path / "cache" / "S-M50-build"
    cache.mkdir(parents=True)
    prompts = [{"id": f"p{i}", "set": "s", "domain": "chat", "prompt": "x" * (3 + i)} for i in range(5)]
    prompts.append({"id": "long", "set": "s", "domain": "chat", "prompt": "y" * 40})
    table = {sl.sample_id(f"p{i}", k): 10 * (i + 1) + k for i in range(5) for k in range(3)}
    engine = _FakeEngine(table, 50)
    result = sl.build_sampled_labels(engine, prompts[:3] + prompts[5:], cache, 50, samples=3, max_prompt_tokens=20,
                                     shard_rows=2)
    assert result["rows"] == 3 and result["dropped_too_long"] == 1 and not result["incomplete"]
    rows = sl.load_sampled_labels(cache, 50, ids=["p0", "p1", "p2"])
    assert rows.lengths.tolist() == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    assert rows.median.tolist() == [11.0, 21.0, 31.0] and rows.iqr.tolist() == [1.0, 1.0, 1.0]
    assert rows.prompt_tokens.tolist() == [3, 4, 5] and rows.capped.tolist() == [0, 0, 0]
    # resuming queues only the prompts without a row (and never the one too long for the engine)
    again = _FakeEngine(table, 50)
    result = sl.build_sampled_labels(again, prompts, cache, 50, samples=3, max_prompt_tokens=20)
    assert result["cached"] == 4 and result["rows"] == 2
    assert sorted({a.removeprefix("sampled-").split("#")[0] for a in again.added}) == ["p3", "p4"]
    rows = sl.load_sampled_labels(cache, 50)
    assert sorted(rows.ids.tolist()) == ["p0", "p1", "p2", "p3", "p4"]
    p4 = int(np.flatnonzero(rows.ids == "p4")[0])
    assert rows.lengths[p4].tolist() == [50, 50, 50] and rows.capped[p4] == 3  # 51, 52 capped at M = 50


def test_entry_and_hash_name_the_rows_not_their_order(root):
    a = _labels([_row("p0", [1, 2, 3, 4]), _row("p1", [100, 5, 6, 100]), _row("p2", [9, 9, 9, 9], set_name="b")])
    shuffled = a.subset(np.array([2, 0, 1]))
    assert sl.content_hash(a) == sl.content_hash(shuffled)
    changed = a.subset(np.arange(3))
    changed.lengths = changed.lengths.copy()
    changed.lengths[1, 1] += 1
    assert sl.content_hash(changed) != sl.content_hash(a)
    entry = sl.sampled_entry(shuffled, "pool", sl.SAMPLED_DECODING, 4, skipped=["long"])
    assert entry["kind"] == "sampled" and entry["rows"] == 3 and entry["ids"] == ["p0", "p1", "p2"]
    assert entry["per_set"] == {"a": 2, "b": 1} and entry["capped_fraction"] == pytest.approx(2 / 12)
    assert entry["skipped"] == ["long"] and entry["content_hash"] == sl.content_hash(a)
    sl.write_sampled_rows(shuffled, "S-M100-h")
    stored = sl.load_sampled_labels(root / "absent-cache" / "S-M100-h", 100)
    assert stored.ids.tolist() == ["p0", "p1", "p2"] and sl.content_hash(stored) == entry["content_hash"]


def test_the_committed_sampled_labels_match_their_manifest(tmp_path, monkeypatch):
    """Every sampled entry under corpus/ loads and hashes to what the manifest says (no engine, no cache)."""
    manifest = snapshot.read_manifest()
    entries = {k: e for k, e in (manifest or {}).get("corpora", {}).items() if e.get("kind") == sl.KIND}
    if not entries:
        pytest.skip("no sampled labels in the committed snapshot")
    monkeypatch.setattr(corpus_module, "READ", {})
    for key, entry in entries.items():
        rows = sl.load_sampled_labels(tmp_path / key, entry["max_tokens"])
        assert len(rows) == entry["rows"] and sorted(rows.ids.tolist()) == entry["ids"]
        assert sl.content_hash(rows) == entry["content_hash"]
        assert rows.lengths.shape[1] == entry["samples"]
        assert key == sl.sampled_key(manifest["model"]["fingerprint"], entry["max_tokens"], entry["decoding"],
                                     entry["samples"])
        stats = [sl.label_stats(r, entry["max_tokens"]) for r in rows.lengths]
        np.testing.assert_allclose(rows.median, [s[0] for s in stats])
        np.testing.assert_allclose(rows.iqr, [s[1] for s in stats])
        assert ((rows.capped >= 0) & (rows.capped <= entry["samples"])).all()
    assert corpus_module.READ == {key: 0 for key in entries}


@pytest.mark.engine
def test_the_real_engine_records_every_sample_of_every_prompt(tmp_path, monkeypatch):
    from serving.config import LeapConfig
    from study_harness.experiment import open_live
    from tests.engine_fixtures import PROMPTS

    monkeypatch.setattr(snapshot_files, "ROOT", tmp_path / "snapshot")
    prompts = [{"id": f"t{i}", "set": "test", "domain": "chat", "prompt": text} for i, text in enumerate(PROMPTS[:3])]
    folder = tmp_path / "S-M16-engine"
    folder.mkdir()
    live = open_live(None, LeapConfig(policy="fcfs", rls=False, max_resident=256), max_tokens=16,
                     decoding=sl.SAMPLED_DECODING)
    try:
        live.runtime.configure(policy="fcfs", rls=False, decode_slots=live.runtime.config.max_resident)
        result = sl.build_sampled_labels(live.engine, prompts, folder, 16, live.decoding, samples=2)
        assert not live.engine.has_unfinished_requests()
    finally:
        live.close()
    assert result["rows"] == 3 and not result["incomplete"]
    rows = sl.load_sampled_labels(folder, 16, ids=[p["id"] for p in prompts])
    assert rows.ids.tolist() == ["t0", "t1", "t2"] and rows.lengths.shape == (3, 2)
    assert ((rows.lengths >= 1) & (rows.lengths <= 16)).all()
    assert (rows.capped == (rows.lengths == 16).sum(axis=1)).all()
    np.testing.assert_allclose(rows.median, np.median(rows.lengths, axis=1))
