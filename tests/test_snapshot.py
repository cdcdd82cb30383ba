"""The committed corpus snapshot: rows read before the cache, float16 on disk, hashes that name the rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from study_harness import corpus as corpus_module
from study_harness import snapshot, snapshot_files
from study_harness.corpus import Corpus, load_corpus, write_shard


def _corpus(n: int = 6, dim: int = 4, seed: int = 0, prefix: str = "p") -> Corpus:
    rng = np.random.default_rng(seed)
    ids = np.array([f"{prefix}{i}" for i in range(n)], dtype=object)
    return Corpus(ids=ids, sets=np.array(["a", "b"] * (n // 2), dtype=object),
                  domains=np.array(["chat"] * n, dtype=object), langs=np.array(["en"] * n, dtype=object),
                  prompt_tokens=rng.integers(5, 50, n), output_tokens=rng.integers(1, 100, n),
                  finish_reasons=np.array(["stop"] * (n - 1) + ["length"], dtype=object),
                  features=rng.normal(size=(n, dim)).astype(np.float32), layer=3, max_tokens=100)


def _joined(a: Corpus, b: Corpus) -> Corpus:
    return Corpus(*(np.concatenate([getattr(a, name), getattr(b, name)]) for name in
                    ("ids", "sets", "domains", "langs", "prompt_tokens", "output_tokens", "finish_reasons",
                     "features")), layer=a.layer, max_tokens=a.max_tokens)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_files, "ROOT", tmp_path / "snapshot")
    monkeypatch.setattr(corpus_module, "READ", {})
    return tmp_path / "snapshot"


def test_snapshot_rows_come_first_then_the_cache_and_ids_count_once(root, tmp_path):
    key = "L3-M100-test"
    snap = _corpus(6)
    path = snapshot.write_rows(snap, key)
    assert path == root / key / "rows.parquet"
    cache = tmp_path / "cache" / key
    cache.mkdir(parents=True)
    extra = _corpus(4, prefix="q", seed=1)
    # the cache also holds p0 with another length: the snapshot's row wins
    write_shard(cache, [{"id": "p0", "set": "a", "domain": "chat", "lang": "en", "prompt_tokens": 9,
                          "output_tokens": 77, "finish_reason": "stop", "feature": np.zeros(4, np.float32)}]
                 + [{"id": extra.ids[i], "set": "a", "domain": "chat", "lang": "en", "prompt_tokens": 9,
                     "output_tokens": int(extra.output_tokens[i]), "finish_reason": "stop",
                     "feature": extra.features[i]} for i in range(4)])
    loaded = load_corpus(cache, 3, 100)
    assert len(loaded) == 10 and len(set(loaded.ids.tolist())) == 10
    p0 = int(np.flatnonzero(loaded.ids == "p0")[0])
    assert loaded.output_tokens[p0] == snap.output_tokens[0]
    # float16 on disk, float32 in memory, equal to the float16 rounding of what was written
    assert loaded.features.dtype == np.float32
    order = np.argsort(snap.ids.astype(str))
    np.testing.assert_array_equal(loaded.features[:6], snap.features[order].astype(np.float16).astype(np.float32))
    # the process remembers how many rows came from outside the snapshot
    assert corpus_module.READ[key] == 4
    chosen = load_corpus(cache, 3, 100, ids=["q1", "p2", "missing"])
    assert chosen.ids.tolist() == ["q1", "p2"]


def test_content_hash_names_the_rows_not_their_order(root):
    a = _corpus(6)
    shuffled = a.subset(np.array([3, 1, 0, 5, 4, 2]))
    assert snapshot.content_hash(a) == snapshot.content_hash(shuffled)
    changed = a.subset(np.arange(6))
    changed.output_tokens = changed.output_tokens.copy()
    changed.output_tokens[2] += 1
    assert snapshot.content_hash(changed) != snapshot.content_hash(a)
    nudged = a.subset(np.arange(6))
    nudged.features = nudged.features.copy()
    nudged.features[0, 0] += 0.5
    assert snapshot.content_hash(nudged) != snapshot.content_hash(a)


def test_manifest_records_model_ids_hash_and_provenance_reports_it(root, tmp_path):
    from leap_io.model_identity import ModelInfo

    model = ModelInfo(path="/m", model_id="m", fingerprint="f" * 16, num_layers=4, hidden_size=4,
                      max_position_embeddings=64)
    key = "L3-M100-test"
    rows = _corpus(6)
    snapshot.write_rows(rows, key)
    manifest = snapshot.write_manifest({key: snapshot.corpus_entry(rows, "a:3,b:3")}, model,
                                       {"temperature": 0.0}, 100)
    on_disk = json.loads((root / "manifest.json").read_text())
    assert on_disk == manifest
    entry = manifest["corpora"][key]
    assert entry["rows"] == 6 and entry["per_set"] == {"a": 3, "b": 3} and entry["layer"] == 3
    assert entry["ids"] == sorted(rows.ids.tolist()) and entry["capped_fraction"] == pytest.approx(1 / 6)
    assert manifest["model"]["fingerprint"] == "f" * 16 and manifest["max_tokens"] == 100
    assert manifest["corpus_hash"] == snapshot.manifest_hash(manifest["corpora"])
    cache = tmp_path / "cache" / key
    cache.mkdir(parents=True)
    load_corpus(cache, 3, 100)
    info = snapshot.provenance()
    assert info["corpus_hash"] == manifest["corpus_hash"] and info["rows_outside_snapshot"] == {}
    assert info["commit"]
    other = tmp_path / "cache" / "L3-M100-other"
    other.mkdir()
    write_shard(other, [{"id": "z", "set": "a", "domain": "chat", "lang": "en", "prompt_tokens": 1,
                          "output_tokens": 1, "finish_reason": "stop", "feature": np.zeros(4, np.float32)}])
    load_corpus(other, 3, 100)
    assert snapshot.provenance()["corpus_hash"] == "cache:L3-M100-other"


def test_a_state_too_large_for_float16_is_refused(root):
    rows = _corpus(2)
    rows.features = rows.features.copy()
    rows.features[0, 0] = 1e6
    with pytest.raises(ValueError, match="float16"):
        snapshot.write_rows(rows, "L3-M100-big")


def test_the_committed_snapshot_matches_its_manifest(tmp_path, monkeypatch):
    """Every file under corpus/ loads and hashes to what the manifest says (no engine, no cache)."""
    manifest = snapshot.read_manifest()
    if manifest is None:
        pytest.skip("no committed snapshot in this checkout")
    monkeypatch.setattr(corpus_module, "READ", {})
    assert manifest["corpus_hash"] == snapshot.manifest_hash(manifest["corpora"], manifest.get("prompts"))
    if manifest.get("prompts"):
        stored = {name: snapshot.read_prompts(name) for name in manifest["prompts"]["per_set"]}
        assert {name: len(rows) for name, rows in stored.items()} == manifest["prompts"]["per_set"]
        assert snapshot.write_prompts(stored, tmp_path / "rewritten")["content_hash"] == \
            manifest["prompts"]["content_hash"]
    for key, entry in manifest["corpora"].items():
        if entry.get("kind") == "sampled":  # another table kind: tests/test_sampled_labels.py
            continue
        empty = tmp_path / key
        empty.mkdir()
        layer = -1 if entry["layer"] == "all" else entry["layer"]
        rows = load_corpus(empty, layer, entry.get("max_tokens", manifest["max_tokens"]))  # recipes: prefill only
        assert len(rows) == entry["rows"] and sorted(rows.ids.tolist()) == entry["ids"]
        assert snapshot.content_hash(rows) == entry["content_hash"]
        assert rows.features.shape[1] == entry["dim"]


def test_stored_prompts_keep_the_seeded_order_and_select_without_the_shared_folder(root, monkeypatch):
    from evaluation import selections

    ordered = {"sharegpt": [{"id": f"sharegpt-{i}", "set": "sharegpt", "domain": "chat", "lang": "en",
                             "prompt": f"text {i}"} for i in (7, 2, 9, 4)],
               "arena_hard": [{"id": "a1", "set": "arena_hard", "domain": "chat", "lang": "en", "prompt": "x"}]}
    record = snapshot.write_prompts(ordered)
    assert record["per_set"] == {"arena_hard": 1, "sharegpt": 4}
    assert [p["id"] for p in snapshot.read_prompts("sharegpt")] == ["sharegpt-7", "sharegpt-2", "sharegpt-9",
                                                                     "sharegpt-4"]
    assert snapshot.read_prompts("math") is None
    assert snapshot.stored_texts()["sharegpt-9"] == "text 9"
    monkeypatch.setenv("LEAP_SHARED", str(root / "absent"))
    chosen = selections.select("sharegpt:2,arena_hard:1", exclude={"sharegpt-7"})
    assert [p["id"] for p in chosen] == ["sharegpt-2", "sharegpt-9", "a1"]
    assert chosen[0]["prompt"] == "text 2"
    monkeypatch.setattr(snapshot, "SELECTION", "sharegpt:4,arena_hard:3")
    with pytest.raises(FileNotFoundError, match="stores 4 prompts of 'sharegpt'"):
        selections.select("sharegpt:5")
    # The snapshot asked for 3 Arena-Hard prompts and the set had 1: it holds the whole set.
    assert [p["id"] for p in selections.select("arena_hard:3")] == ["a1"]
    # the prompts' hash enters the snapshot's hash
    assert snapshot.manifest_hash({}, record) != snapshot.manifest_hash({})


def test_the_untouched_slice_is_cut_from_sharegpts_order_and_the_name_sharegpt_never_selects_it(root, tmp_path,
                                                                                                   monkeypatch):
    from evaluation import selections

    shared = tmp_path / "shared"
    (shared / "data" / "prompts").mkdir(parents=True)
    lines = [json.dumps({"id": f"sharegpt-{i}", "set": "sharegpt", "domain": "chat", "lang": "en",
                         "prompt": f"text {i}"}) for i in range(10)]
    (shared / "data" / "prompts" / "sharegpt.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("LEAP_SHARED", str(shared))
    monkeypatch.setattr(selections, "UNTOUCHED_START", 3)
    monkeypatch.setattr(selections, "UNTOUCHED_END", 6)
    whole = [p["id"] for p in selections._ordered("sharegpt")[0]]
    everything = selections.select("sharegpt")
    untouched = selections.select(selections.UNTOUCHED)
    assert [p["id"] for p in untouched] == whole[3:6]
    assert {p["set"] for p in untouched} == {selections.UNTOUCHED}
    assert [p["id"] for p in everything] == whole[:3] + whole[6:]
    assert [p["id"] for p in selections.select("sharegpt:5")] == whole[:3] + whole[6:8]

    # Stored in the snapshot under its own name, it selects the same prompts without the shared folder.
    snapshot.write_prompts({"sharegpt": selections.seeded_prompts("sharegpt")[:3], selections.UNTOUCHED: untouched})
    monkeypatch.setenv("LEAP_SHARED", str(tmp_path / "absent"))
    assert [p["id"] for p in selections.select(selections.UNTOUCHED)] == whole[3:6]
    assert [p["id"] for p in selections.select("sharegpt")] == whole[:3]
    # A snapshot storing ShareGPT prompts past the slice's place in the order: they are stored cut, so
    # neither set is cut again (the untouched slice comes from its own stored set, never from "sharegpt").
    monkeypatch.setenv("LEAP_SHARED", str(shared))
    beyond = selections.seeded_prompts("sharegpt")[:6]
    snapshot.write_prompts({"sharegpt": beyond, selections.UNTOUCHED: untouched})
    monkeypatch.setenv("LEAP_SHARED", str(tmp_path / "absent"))
    assert [p["id"] for p in selections.select("sharegpt")] == whole[:3] + whole[6:9]
    assert [p["id"] for p in selections.select("sharegpt:6")] == [p["id"] for p in beyond]
    assert [p["id"] for p in selections.select(selections.UNTOUCHED)] == whole[3:6]
    snapshot.write_prompts({"sharegpt": selections.seeded_prompts("sharegpt")[:3]})
    with pytest.raises(FileNotFoundError, match="sharegpt_untouched"):
        selections.select(selections.UNTOUCHED)


def test_prompts_the_engine_could_not_take_are_not_retried(root, tmp_path):
    key = "L3-M100-skip"
    rows = _corpus(2)
    entry = snapshot.corpus_entry(rows, "a:3", skipped=["long-1"])
    manifest = {"corpora": {key: entry}}
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(manifest))
    snapshot.write_rows(rows, key)
    cache = tmp_path / "cache" / key
    cache.mkdir(parents=True)
    assert corpus_module.missing_ids(cache, 3, 100, ["p0", "p1", "long-1", "new"]) == ["new"]


def test_adding_a_corpus_key_keeps_earlier_results_current_and_changing_one_does_not(root):
    from leap_io.model_identity import ModelInfo

    model = ModelInfo(path="/m", model_id="m", fingerprint="f" * 16, num_layers=4, hidden_size=4,
                      max_position_embeddings=64)
    first = _corpus(6)
    old = snapshot.write_manifest({"L3-a": snapshot.corpus_entry(first, "a")}, model, {}, 100)
    grown = snapshot.write_manifest({"L3-b": snapshot.corpus_entry(_corpus(4, seed=1), "b")}, model, {}, 100)
    assert grown["corpus_hash"] != old["corpus_hash"]
    assert snapshot.current_hashes(grown) == {grown["corpus_hash"], old["corpus_hash"]}
    rewritten = snapshot.write_manifest({"L3-b": snapshot.corpus_entry(_corpus(4, seed=1), "b")}, model, {}, 100)
    assert snapshot.current_hashes(rewritten) == snapshot.current_hashes(grown)  # same rows: nothing changes
    changed = snapshot.write_manifest({"L3-a": snapshot.corpus_entry(_corpus(6, seed=2), "a")}, model, {}, 100)
    assert snapshot.current_hashes(changed) == {changed["corpus_hash"]}


def test_adding_rows_to_a_key_keeps_earlier_results_current_only_when_the_old_rows_are_unchanged(root):
    from evaluation.corpora import extended_hashes
    from leap_io.model_identity import ModelInfo

    model = ModelInfo(path="/m", model_id="m", fingerprint="f" * 16, num_layers=4, hidden_size=4,
                      max_position_embeddings=64)

    def hash_of(rows: Corpus):
        return lambda ids: snapshot.content_hash(rows.subset(np.isin(rows.ids, ids)))

    first = _corpus(6)
    old_entry = snapshot.corpus_entry(first, "a")
    old = snapshot.write_manifest({"L3-a": old_entry}, model, {}, 100)
    grown_rows = _joined(first, _corpus(4, seed=1, prefix="q"))  # `first`'s rows and 4 more
    entry = snapshot.corpus_entry(grown_rows, "a, then more")
    entry["extends"] = extended_hashes(old_entry, entry, hash_of(grown_rows))
    assert entry["extends"] == [old_entry["content_hash"]]
    grown = snapshot.write_manifest({"L3-a": entry}, model, {}, 100)
    assert snapshot.current_hashes(grown) == {grown["corpus_hash"], old["corpus_hash"]}

    changed_rows = _joined(_corpus(6, seed=5), _corpus(4, seed=1, prefix="q"))  # same ids, other rows
    changed = snapshot.corpus_entry(changed_rows, "a, regenerated")
    assert extended_hashes(entry, changed, hash_of(changed_rows)) == []
    dropped_rows = grown_rows.subset(np.arange(1, 10))  # an old id is gone
    dropped = snapshot.corpus_entry(dropped_rows, "a, less")
    assert extended_hashes(old_entry, dropped, hash_of(dropped_rows)) == []
    changed["extends"] = []
    rewritten = snapshot.write_manifest({"L3-a": changed}, model, {}, 100)
    assert snapshot.current_hashes(rewritten) == {rewritten["corpus_hash"]}


def test_adding_prompts_keeps_earlier_results_current_only_when_the_old_prompts_are_unchanged(root):
    from leap_io.model_identity import ModelInfo

    model = ModelInfo(path="/m", model_id="m", fingerprint="f" * 16, num_layers=4, hidden_size=4,
                      max_position_embeddings=64)

    def prompts(name: str, ids: range, text: str = "text") -> list[dict]:
        return [{"id": f"{name}-{i}", "set": name, "domain": "chat", "lang": "en", "prompt": f"{text} {i}"} for i in ids]

    entries = {"L3-a": snapshot.corpus_entry(_corpus(6), "a")}
    old = snapshot.write_manifest(entries, model, {}, 100, prompts=snapshot.write_prompts({"a": prompts("a", range(3))}))
    # A new set, and more prompts of an old set after its stored ones: the old prompts are all still there.
    record = snapshot.write_prompts({"a": prompts("a", range(5)), "new": prompts("new", range(2))})
    assert record["extends"] == [old["prompts"]["content_hash"]]
    grown = snapshot.write_manifest(entries, model, {}, 100, prompts=record)
    assert snapshot.current_hashes(grown) == {grown["corpus_hash"], old["corpus_hash"]}
    # An old prompt's text changed: nothing earlier stays current.
    changed = snapshot.write_prompts({"a": prompts("a", range(5), "other"), "new": prompts("new", range(2))})
    assert changed["extends"] == []
    rewritten = snapshot.write_manifest(entries, model, {}, 100, prompts=changed)
    assert snapshot.current_hashes(rewritten) == {rewritten["corpus_hash"]}
    # Reordered (another seed's order): not the same selection either.
    snapshot.write_manifest(entries, model, {}, 100, prompts=snapshot.write_prompts({"a": prompts("a", range(3))}))
    assert snapshot.write_prompts({"a": prompts("a", range(2, -1, -1))})["extends"] == []


def test_the_commit_is_dirty_for_changed_code_but_not_for_written_results(tmp_path):
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    for path in ("code.py", "docs/results/a.json", "docs/results.md"):
        (tmp_path / path).write_text("1\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    head = snapshot.git_commit(tmp_path)
    assert len(head) == 40
    (tmp_path / "docs" / "results" / "a.json").write_text("2\n")
    (tmp_path / "docs" / "results.md").write_text("2\n")
    (tmp_path / "untracked.py").write_text("x\n")
    assert snapshot.git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("2\n")
    assert snapshot.git_commit(tmp_path) == head + "-dirty"
