"""Decode-state rows: ids that name the prompt and the generated count, and the per-prompt index."""

import numpy as np

from study_harness.corpus import Corpus
from study_harness.decode_states import checkpoint_matrix, decode_states_key, row_id, split_ids


def _rows(ids):
    n = len(ids)
    empty = np.array(["x"] * n, dtype=object)
    return Corpus(np.array(ids, dtype=object), empty, empty, empty, np.zeros(n, int), np.ones(n, int),
                  np.array(["stop"] * n, dtype=object), np.zeros((n, 2), np.float32), 3, 64)


def test_row_ids_round_trip_even_when_a_prompt_id_holds_the_separator():
    ids = [row_id("sharegpt-1", 0), row_id("odd@id", 32)]
    owners, generated = split_ids(ids)
    assert owners.tolist() == ["sharegpt-1", "odd@id"] and generated.tolist() == [0, 32]


def test_checkpoint_matrix_places_each_row_and_marks_missing_ones():
    rows = _rows([row_id("b", 16), row_id("a", 0), row_id("b", 0), row_id("a", 32), row_id("c", 16)])
    index, has_prefill = checkpoint_matrix(rows, ["a", "b", "c"], checkpoints=(16, 32))
    assert index.tolist() == [[1, -1, 3], [2, 0, -1], [-1, 4, -1]]
    assert has_prefill.tolist() == [True, True, False]


def test_the_key_changes_with_the_checkpoints_and_names_a_decode_corpus():
    a = decode_states_key("fp", 22, 1024, {"temperature": 0.0})
    assert a.startswith("D22-M1024-")
    assert a != decode_states_key("fp", 22, 1024, {"temperature": 0.0}, checkpoints=(16, 64))
