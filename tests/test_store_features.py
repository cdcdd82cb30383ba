"""How the log store encodes feature vectors (little-endian float32 bytes in feature files), and its migrations."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from store.duckdb import SCHEMA_DDL, SCHEMA_VERSION, LogStore
from store.feature_encoding import FEATURE_DTYPE, feature_bytes, features_from_bytes
from store.feature_files import file_name
from store.ingest import ingest_folder
from tests.segment_fuzz import write_segment


def _matrix(n: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _fixed(matrix: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), matrix.shape[1])


def test_feature_bytes_are_each_rows_little_endian_float32_values_and_read_back_exactly() -> None:
    matrix = _matrix(7, 5)
    matrix[0, 0], matrix[1, 1] = -0.0, np.float32(1e-45)  # sign of zero and a subnormal survive

    for feature in (_fixed(matrix), pa.array(list(matrix), pa.list_(pa.float32())),
                    pa.chunked_array([_fixed(matrix[:3]), _fixed(matrix[3:])])):
        blobs = feature_bytes(feature, 5)
        assert blobs.to_pylist() == [row.astype("<f4").tobytes() for row in matrix]
        back = features_from_bytes(blobs, 5)
        assert back.dtype == np.float32 and back.shape == (7, 5)
        assert back.tobytes() == matrix.tobytes()


def test_a_fixed_size_list_becomes_blobs_without_a_copy_and_a_slice_keeps_its_rows() -> None:
    matrix = _matrix(10, 4)
    feature = _fixed(matrix)

    blobs = feature_bytes(feature, 4)
    assert blobs.buffers()[1].address == feature.values.buffers()[1].address  # a view of the floats

    sliced = feature_bytes(feature.slice(3, 4), 4)
    np.testing.assert_array_equal(features_from_bytes(sliced, 4), matrix[3:7])


def test_features_from_bytes_reads_binary_and_large_binary_chunks_and_slices() -> None:
    matrix = _matrix(9, 3)
    blobs = [row.astype("<f4").tobytes() for row in matrix]
    for kind in (pa.binary(), pa.large_binary()):
        chunked = pa.chunked_array([pa.array(blobs[:4], kind), pa.array(blobs[4:], kind).slice(1)])
        np.testing.assert_array_equal(features_from_bytes(chunked, 3), np.concatenate([matrix[:4], matrix[5:]]))
    assert features_from_bytes(pa.array([], pa.large_binary()), 3).shape == (0, 3)


def test_feature_bytes_refuses_rows_that_do_not_hold_dim_float32_values() -> None:
    matrix = _matrix(3, 4)
    with pytest.raises(ValueError, match="4 floats per row, not 5"):
        feature_bytes(_fixed(matrix), 5)
    with pytest.raises(ValueError, match="not 4"):
        feature_bytes(pa.array([[1.0, 2.0, 3.0, 4.0], [1.0]], pa.list_(pa.float32())), 4)
    with pytest.raises(ValueError, match="NULL"):
        feature_bytes(pa.array([[1.0, 2.0], None], pa.list_(pa.float32())), 2)
    with pytest.raises(ValueError, match="NULL"):
        feature_bytes(pa.array([[1.0, None]], pa.list_(pa.float32())), 2)
    with pytest.raises(ValueError, match="float32"):
        feature_bytes(pa.array([[1.0, 2.0]], pa.list_(pa.float64())), 2)
    assert len(feature_bytes(_fixed(matrix)[:0], 5)) == 0  # no row: nothing to check the dim against


def test_features_from_bytes_refuses_blobs_of_another_length() -> None:
    blobs = pa.array([np.ones(4, "<f4").tobytes(), np.ones(3, "<f4").tobytes()], pa.binary())
    with pytest.raises(ValueError, match="4 float32 values"):
        features_from_bytes(blobs, 4)


def test_feature_dtype_is_little_endian_float32() -> None:
    assert FEATURE_DTYPE == np.dtype("<f4")


# --------------------------------------------------------------------- a version 3 file, as it was

_OLD_FEATURES_DDL = """CREATE TABLE IF NOT EXISTS features (
  request_id VARCHAR PRIMARY KEY,
  dim INTEGER NOT NULL,
  layer INTEGER NOT NULL,
  model_fingerprint VARCHAR NOT NULL,
  feature {type} NOT NULL,
  recipe VARCHAR
)"""


def _old_store(path: Path, version: int, vectors: dict[str, np.ndarray]) -> None:
    """A store as version 3 (features in `FLOAT[]`) or 4 (float32 bytes in a BLOB) created it."""
    features_ddl = _OLD_FEATURES_DDL.format(type={3: "FLOAT[]", 4: "BLOB"}[version])
    ddl = [features_ddl if "TABLE IF NOT EXISTS features" in text else text for text in SCHEMA_DDL]
    ddl = [text.replace("  client_request_id VARCHAR,\n", "") for text in ddl]  # before version 7
    assert not any("client_request_id" in text for text in ddl)
    assert ddl != list(SCHEMA_DDL)
    con = duckdb.connect(str(path))
    for text in ddl:
        con.execute(text)
    con.execute("INSERT INTO store_meta VALUES ('schema_version', ?)", [str(version)])
    for i, (request_id, vector) in enumerate(vectors.items()):
        wide = len(vector) == 6
        con.execute("INSERT INTO requests (request_id, model_fingerprint, layer, arrival_time, finish_time, "
                    "prompt_tokens, output_tokens, finish_reason, segment, ingested_at) "
                    "VALUES (?, ?, 20, ?, ?, 3, ?, 'stop', '/old.parquet', now())",
                    [request_id, "fp-wide" if wide else "fp-narrow", float(i), float(i) + 1.0, 5 + i])
        con.execute("INSERT INTO features VALUES (?, ?, 20, ?, ?, ?)",
                    [request_id, len(vector), "fp-wide" if wide else "fp-narrow",
                     vector.tolist() if version == 3 else vector.astype("<f4").tobytes(),
                     "mean@20" if wide else None])
    con.close()


def _version_3_store(path: Path) -> dict[str, np.ndarray]:
    """A version 3 store holding two feature spaces of different dims; returns each request's vector."""
    vectors = {f"a-{i}": row for i, row in enumerate(_matrix(40, 6, seed=1))}
    vectors |= {f"b-{i}": row for i, row in enumerate(_matrix(25, 3, seed=2))}
    _old_store(path, 3, vectors)
    return vectors


def test_a_version_3_store_converts_its_features_once_and_reads_back_every_float(tmp_path: Path) -> None:
    path = tmp_path / "v3.duckdb"
    vectors = _version_3_store(path)
    store = LogStore(path, busy_timeout_s=5.0)

    wide = store.training_frame(model_fingerprint="fp-wide")  # a reader migrates once, then reads
    narrow = store.training_frame(model_fingerprint="fp-narrow", recipe="last@20")

    assert store.schema_version() == SCHEMA_VERSION == 9
    assert store.shadow_rows("any")["shadow"].size == 0  # version 8's columns are there, NULL for old rows
    np.testing.assert_array_equal(wide.features, np.stack([vectors[i] for i in wide.request_ids]))
    np.testing.assert_array_equal(narrow.features, np.stack([vectors[i] for i in narrow.request_ids]))
    assert (wide.features.shape, narrow.features.shape) == ((40, 6), (25, 3))
    with store.connect(read_only=True) as con:
        columns = {name for (name,) in con.execute("SELECT column_name FROM information_schema.columns "
                                                   "WHERE table_name = 'features'").fetchall()}
        file, row = con.execute("SELECT file, file_row FROM features WHERE request_id = 'a-0'").fetchone()
        moved = con.execute("SELECT count(*) FROM requests WHERE client_request_id = request_id").fetchone()[0]
    dims = store.stored_dims()
    assert moved == len(vectors)  # the key was the client's id before version 7: it is kept as that
    assert store.recorded_lengths(["a-0", "b-3", "nobody"]) == {"a-0": (5, 0.0), "b-3": (5 + 43, 43.0)}
    assert "feature" not in columns and {"file", "file_row"} <= columns
    stored = pq.read_table(store.features_folder / file).column("feature")
    assert stored.type == pa.binary(24)  # 6 little-endian float32 values
    assert stored[row].as_py() == vectors["a-0"].astype("<f4").tobytes()
    assert dims == {("fp-wide", 20, "mean@20"): 6, ("fp-narrow", 20, "last@20"): 3}


def _version_4_store(path: Path, n: int) -> dict[str, np.ndarray]:
    """A version 4 store: `n` vectors of dim 6 and 25 of dim 3."""
    vectors = {f"a-{i:03d}": row for i, row in enumerate(_matrix(n, 6, seed=5))}
    vectors |= {f"b-{i:03d}": row for i, row in enumerate(_matrix(25, 3, seed=6))}
    _old_store(path, 4, vectors)
    return vectors


def test_a_version_4_store_moves_its_vectors_to_feature_files_page_by_page(tmp_path: Path, monkeypatch) -> None:
    """Paged by request id (pages of 16 here): every vector lands in a file once, and the store reads
    each back exactly; the database keeps only where each lies."""
    import store.duckdb as store_module

    monkeypatch.setattr(store_module, "MIGRATION_PAGE_ROWS", 16)
    path = tmp_path / "v4.duckdb"
    vectors = _version_4_store(path, n=90)
    store = LogStore(path, busy_timeout_s=5.0)

    wide = store.training_frame(model_fingerprint="fp-wide")
    narrow = store.training_frame(model_fingerprint="fp-narrow")

    assert store.schema_version() == SCHEMA_VERSION
    assert len(wide.request_ids) == 90 and len(narrow.request_ids) == 25
    for frame in (wide, narrow):
        np.testing.assert_array_equal(frame.features, np.stack([vectors[i] for i in frame.request_ids]))
    with store.connect(read_only=True) as con:
        files = dict(con.execute("SELECT dim, count(DISTINCT file) FROM features GROUP BY dim").fetchall())
        assert con.execute("SELECT count(*), count(DISTINCT request_id) FROM features").fetchone() == (115, 115)
    assert files == {6: 6, 3: 2}  # ceil(90 / 16) and ceil(25 / 16) pages
    assert sorted(path.name for path in store.features_folder.iterdir()) == sorted(
        {path.name for path in store.features_folder.glob("*.parquet")})  # no temporary file left


def test_a_missing_feature_file_is_named_when_a_frame_is_read(tmp_path: Path) -> None:
    (tmp_path / "feedback").mkdir()
    write_segment(tmp_path / "feedback" / "seg-0.parquet", 10, 4, seed=3)
    store = LogStore(tmp_path / "log.duckdb")
    ingest_folder(store, tmp_path / "feedback")
    [file] = list(store.features_folder.glob("*.parquet"))
    file.unlink()

    with pytest.raises(FileNotFoundError, match=file.name):
        store.training_frame()


def test_a_migrated_version_3_store_takes_new_segments_beside_its_old_rows(tmp_path: Path) -> None:
    path = tmp_path / "v3.duckdb"
    vectors = _version_3_store(path)
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    written = write_segment(feedback / "new.parquet", 12, 3, seed=4, model_fingerprint="fp-narrow",
                            start_time=1_000.0, finish_reasons=("stop",))
    store = LogStore(path, busy_timeout_s=5.0)

    [report] = ingest_folder(store, feedback)

    assert report.accepted == 12 and store.schema_version() == SCHEMA_VERSION
    frame = store.training_frame(model_fingerprint="fp-narrow")
    assert frame.features.shape == (37, 3)
    old = np.isin(frame.request_ids, list(vectors))
    np.testing.assert_array_equal(frame.features[old], np.stack([vectors[i] for i in frame.request_ids[old]]))
    new = written.table.to_pydict()
    expected = dict(zip(new["request_id"], np.asarray(new["feature"], dtype=np.float32)))
    np.testing.assert_array_equal(frame.features[~old], np.stack([expected[i] for i in frame.request_ids[~old]]))


def test_segment_files_hold_features_as_binary_and_ingest_reads_them_back_exactly(tmp_path: Path) -> None:
    """A version 2 segment file keeps each feature as its float32 bytes (`segment_table`); reading it gives
    the same lists (a slice too), ingest stores the same vectors, and a width that is no whole number of
    floats quarantines every row instead of failing the run."""
    import pyarrow.parquet as pq

    from leap_io.feedback_schema import feature_lists, read_segment_file, segment_table

    (tmp_path / "feedback").mkdir()
    written = write_segment(tmp_path / "feedback" / "seg-0.parquet", 40, 6, seed=3)
    table = segment_table(written.table)
    assert table.schema.field("feature").type == pa.binary(24)
    sliced = feature_lists(table.column("feature").combine_chunks().slice(5, 10))
    assert sliced.to_pylist() == written.table.column("feature").combine_chunks().slice(5, 10).to_pylist()
    pq.write_table(table, written.path)
    assert read_segment_file(written.path).column("feature").to_pylist() == \
        written.table.column("feature").to_pylist()

    store = LogStore(tmp_path / "log.duckdb")
    [report] = ingest_folder(store, tmp_path / "feedback")
    assert report.quarantined == 0 and report.accepted == 40
    frame = store.training_frame()
    expected = dict(zip(written.table.column("request_id").to_pylist(), _stack(written.table)))
    for request_id, row in zip(frame.request_ids, frame.features):
        assert np.array_equal(row, expected[request_id])

    odd = table.set_column(table.schema.get_field_index("feature"), "feature",
                           pa.array([b"\x00" * 7] * 40, pa.binary(7)))
    pq.write_table(odd, tmp_path / "feedback" / "seg-1.parquet")
    reports = [r for r in ingest_folder(store, tmp_path / "feedback") if not r.skipped]
    assert [(r.accepted, r.quarantined) for r in reports] == [(0, 40)]
    assert store.quarantine_reasons()["bad_column_type:feature"] == 40


def _stack(table: pa.Table) -> np.ndarray:
    feature = table.column("feature").combine_chunks()
    return feature.values.to_numpy().reshape(len(feature), feature.type.list_size)


def test_a_feature_file_that_cannot_be_written_fails_its_segment_alone_and_a_retry_stores_it(
        tmp_path: Path, monkeypatch) -> None:
    """The file is written on its own thread while the requests go in; its error still lands on its
    segment (recorded `failed`, nothing of it stored, no file left), the other segments are stored,
    and `retry_failed` stores the segment once the file can be written."""
    import hashlib

    import store.duckdb_writer as writer_module
    from store.ingest import STATUS_FAILED, STATUS_OK

    feedback = tmp_path / "feedback"
    feedback.mkdir()
    for index in range(3):
        write_segment(feedback / f"seg-{index}.parquet", 20, 4, seed=index, id_prefix=f"s{index}")
    broken = str((feedback / "seg-1.parquet").resolve())
    real_write = writer_module.write_feature_file
    broken_file = file_name(broken, hashlib.sha256((feedback / "seg-1.parquet").read_bytes()).hexdigest())

    def failing_write(folder: Path, name: str, blobs: pa.Array) -> None:
        if name == broken_file:
            raise OSError(28, "No space left on device")
        real_write(folder, name, blobs)

    monkeypatch.setattr(writer_module, "write_feature_file", failing_write)
    store = LogStore(tmp_path / "log.duckdb")
    reports = ingest_folder(store, feedback)

    assert [report.status for report in reports] == [STATUS_OK, STATUS_FAILED, STATUS_OK]
    assert "No space left on device" in reports[1].error
    frame = store.training_frame()
    assert not any(request_id.startswith("s1") for request_id in frame.request_ids)
    assert len(list(store.features_folder.glob("*.parquet"))) == 2
    assert not list(store.features_folder.glob(".*.tmp"))

    monkeypatch.setattr(writer_module, "write_feature_file", real_write)
    [retried] = [report for report in ingest_folder(store, feedback, retry_failed=True) if not report.skipped]
    assert retried.status == STATUS_OK and retried.accepted == reports[0].accepted
    assert store.counts()["features"] == store.counts()["requests"] == 3 * reports[0].accepted


def test_a_segment_whose_rows_are_all_stored_already_leaves_no_feature_file(tmp_path: Path) -> None:
    feedback = tmp_path / "feedback"
    feedback.mkdir()
    first = write_segment(feedback / "seg-0.parquet", 15, 4, seed=1, id_prefix="same")
    store = LogStore(tmp_path / "log.duckdb")
    ingest_folder(store, feedback)
    copy = feedback / "replica-b"
    copy.mkdir()
    (copy / "seg-0.parquet").write_bytes(first.path.read_bytes())  # the same rows under another name

    [_, again] = ingest_folder(store, feedback)

    assert again.accepted == 0 and again.duplicates == 15
    assert len(list(store.features_folder.glob("*.parquet"))) == 1
    assert store.counts()["features"] == 15
