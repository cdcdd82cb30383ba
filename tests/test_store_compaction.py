"""Compaction of the DuckDB store's feature files (store/compaction.py): a real store, real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from store.compaction import compact_features
from store.duckdb import LogStore
from store.ingest import ingest_folder
from tests.segment_fuzz import write_segment


def _files(store: LogStore) -> set[str]:
    return {path.name for path in store.features_folder.glob("*.parquet")}


def test_small_feature_files_become_few_and_every_vector_reads_back_the_same(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "log.duckdb")
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    for index in range(6):
        write_segment(feedback / f"seg-{index}.parquet", 100, 8, seed=index, id_prefix=f"s{index}-",
                      start_time=1_700_000_000.0 + 1000 * index)
    ingest_folder(store, feedback)
    before = store.training_frame()
    originals = _files(store)
    assert len(originals) == 6

    report = compact_features(store, small_rows=1000, target_rows=250, grace_s=3600)

    assert (report["files_before"], report["files_compacted"], report["files_written"]) == (6, 6, 3)
    assert report["files_after"] == 3 and report["rows_moved"] == len(before.request_ids)
    after = store.training_frame()
    assert after.request_ids.tolist() == before.request_ids.tolist()
    np.testing.assert_array_equal(after.features, before.features)
    assert originals <= _files(store)  # the old files wait out their grace: a reader may still open them

    write_segment(feedback / "seg-6.parquet", 100, 8, seed=6, id_prefix="s6-", start_time=1_700_010_000.0)
    ingest_folder(store, feedback)  # ingest goes on beside compacted files
    again = compact_features(store, small_rows=1000, target_rows=250, grace_s=0)
    assert again["retired_files_deleted"] == 6 and not originals & _files(store)
    grown = store.training_frame()
    assert len(grown.request_ids) > len(before.request_ids)
    np.testing.assert_array_equal(grown.features[: len(before.request_ids)], before.features)
    with store.connect(read_only=True) as con:
        referenced = {name for (name,) in con.execute("SELECT DISTINCT file FROM features").fetchall()}
    assert referenced <= _files(store)
