"""The checks a feedback segment's rows pass before they are stored, and why a row is quarantined.

`JudgedSegment` conforms a segment to the feedback schema and judges every row with Arrow / numpy kernels,
without a row loop: accepted, or quarantined with the first reason it fails. The one check that needs the
store (a dim conflicting with the stored feature space) runs later on the writing connection
(`judge_against_store`). Every finish reason the serving side writes is stored, but only
`TRAINING_FINISH_REASONS` are labels; a segment whose capture recipe does not parse or cannot fit its
dim is quarantined whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from leap_core.recipes import Recipe, RecipeError
from leap_io.feedback_schema import (
    META_DIM,
    META_LAYER,
    META_MODEL_FINGERPRINT,
    META_MODEL_ID,
    META_RECIPE,
    NOT_TRAINING_FINISH_REASONS,
    TRAINING_FINISH_REASONS,
    feature_lists,
    feedback_schema,
)
from leap_io.jsonable import dumps
from store.protocol import SpaceKey
from store.row_masks import rows_where, true_rows
from store.sql import REQUIRED_COLUMNS, SCALAR_COLUMNS

FINISH_REASONS = TRAINING_FINISH_REASONS + NOT_TRAINING_FINISH_REASONS
"""Every finish reason a row may carry; any other is quarantined."""

REASON_MISSING_ID = "missing_request_id"
REASON_MISSING_SEGMENT_DIM = "missing_segment_dim"
REASON_FEATURE_WRONG_DIM = "feature_wrong_dim"
REASON_FEATURE_DIM_CONFLICT = "feature_dim_conflicts_store"
REASON_FEATURE_NOT_FINITE = "feature_not_finite"
REASON_INVALID_PROMPT_TOKENS = "invalid_prompt_tokens"
REASON_INVALID_OUTPUT_TOKENS = "invalid_output_tokens"
REASON_ZERO_OUTPUT_TOKENS = "zero_output_tokens"
REASON_NON_FINITE_TIME = "non_finite_time"
REASON_FINISH_BEFORE_ARRIVAL = "finish_before_arrival"
REASON_UNKNOWN_FINISH_REASON = "unknown_finish_reason"
REASON_UNPARSABLE_RECIPE = "unparsable_recipe"
REASON_RECIPE_WRONG_DIM = "recipe_does_not_fit_dim"
REASON_NUL_IN_TEXT = "nul_in_text"


def null_field_reason(column: str) -> str:
    return f"null_field:{column}"


def missing_column_reason(column: str) -> str:
    return f"missing_column:{column}"


def bad_column_type_reason(column: str) -> str:
    return f"bad_column_type:{column}"


def bad_metadata_reason(column: str) -> str:
    """A row needed the segment metadata's value for `column`, and that value does not fit the column."""
    return f"bad_metadata:{column}"


_TOKEN_COLUMNS = ("prompt_tokens", "output_tokens")
_TIME_COLUMNS = ("arrival_time", "first_token_time", "finish_time")
# Columns a row may leave null because the segment's metadata says the same thing for every row.
_METADATA_FALLBACK = {
    "model_id": (META_MODEL_ID, str),
    "model_fingerprint": (META_MODEL_FINGERPRINT, str),
    "layer": (META_LAYER, int),
}
_INT32_MAX = np.iinfo(np.int32).max
_SCHEMA = feedback_schema(1)


class _Verdicts:
    """The first failing reason of each row, as a rank into `reasons` (0: passing).

    A row's reason is the earliest check, in the order the checks were made, that it fails. A check
    that needs the store runs later, on the writing thread, but keeps its place in that order
    through a rank reserved when it would have run.
    """

    def __init__(self, n: int) -> None:
        self.codes = np.zeros(n, dtype=np.int32)
        self.reasons: list[str | None] = [None]

    def reserve(self) -> int:
        self.reasons.append(None)
        return len(self.reasons) - 1

    def flag(self, failing: np.ndarray | bool, reason: str, rank: int | None = None) -> None:
        if rank is None:
            rank = self.reserve()
        self.reasons[rank] = reason
        codes = self.codes
        codes[((codes == 0) | (codes > rank)) & failing] = rank

    @property
    def passing(self) -> np.ndarray:
        return self.codes == 0

    def reason_of(self, rows: np.ndarray) -> list[str]:
        return np.array(self.reasons, dtype=object)[self.codes[rows]].tolist()


def _segment_recipe(metadata: Mapping[bytes, bytes]) -> tuple[str | None, str | None]:
    """(canonical recipe, None), (None, None) when the segment records none, or (None, why) when the
    recorded one does not parse."""
    raw = metadata.get(META_RECIPE)
    if raw is None:
        return None, None
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None, f"the recipe {raw[:200]!r} is not UTF-8"
    if not text.strip():
        return None, None  # an empty value says no more than a missing one
    try:
        return str(Recipe.parse(text)), None
    except ValueError as error:  # RecipeError
        return None, str(error)[:500]


def _fits_dim(recipe: str, dim: int) -> bool:
    """Whether some hidden size makes `recipe`'s vector `dim` floats long."""
    try:
        Recipe.parse(recipe).hidden_for(dim)
        return True
    except RecipeError:
        return False


def _metadata_value(metadata: dict[bytes, bytes], key: bytes, kind: type) -> Any:
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        return kind(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None


class JudgedSegment:
    """One segment's rows conformed to the feedback schema and judged row by row, without row loops.

    Everything here depends on the segment alone; `judge_against_store` adds the one check that
    needs the store (a dim that conflicts with the dim already stored for the same feature space).
    `dim` is the segment's feature dim (None: its metadata records none), `recipe` its capture recipe
    (None: it records none, i.e. `last@<layer>`).
    """

    def __init__(self, raw: pa.Table) -> None:
        self.raw = raw
        self.n = raw.num_rows
        metadata = raw.schema.metadata or {}
        self.dim = _metadata_value(metadata, META_DIM, int)
        self.recipe, self.recipe_error = _segment_recipe(metadata)
        self.verdicts = _Verdicts(self.n)
        self.columns: dict[str, pa.Array] = {}
        column_problems: list[str] = []
        self._row_problems: list[tuple[np.ndarray, str]] = []  # rows a column problem touches
        for name in SCALAR_COLUMNS:
            self.columns[name] = self._conform(name, metadata, column_problems)
        # a row without a client id (written before the key was the server's own) is known by its key
        self.columns["client_request_id"] = pc.coalesce(self.columns["client_request_id"], self.columns["request_id"])
        self.feature = self._conform_feature(column_problems)
        self._dim_conflict_rank: int | None = None
        self._judge(column_problems)

    def _conform(self, name: str, metadata: dict[bytes, bytes], problems: list[str]) -> pa.Array:
        target = _SCHEMA.field(name).type
        fallback = None
        if name in _METADATA_FALLBACK:
            key, kind = _METADATA_FALLBACK[name]
            fallback = _metadata_value(metadata, key, kind)
        if name not in self.raw.column_names:
            if name in REQUIRED_COLUMNS and fallback is None:
                problems.append(missing_column_reason(name))
            column = pa.nulls(self.n, target)
        else:
            column = self.raw.column(name).combine_chunks()
            try:
                if name in _TOKEN_COLUMNS:
                    # Checked as float64 first: a writer may have stored NaN or fractional counts.
                    column = pc.cast(column, pa.float64())
                elif column.type != target:
                    column = pc.cast(column, target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                problems.append(bad_column_type_reason(name))
                column = pa.nulls(self.n, pa.float64() if name in _TOKEN_COLUMNS else target)
        if fallback is not None and column.null_count:
            try:
                value = pa.scalar(fallback, column.type)
            except (pa.ArrowException, OverflowError, TypeError, ValueError):
                # e.g. a layer above int32: the rows that needed it fail, the others stand
                self._row_problems.append((true_rows(column.is_null()), bad_metadata_reason(name)))
            else:
                column = pc.fill_null(column, value)
        return column

    def _conform_feature(self, problems: list[str]) -> pa.Array:
        list_type = pa.list_(pa.float32())
        if "feature" not in self.raw.column_names:
            problems.append(missing_column_reason("feature"))
            return pa.nulls(self.n, list_type)
        feature = self.raw.column("feature").combine_chunks()
        if pa.types.is_fixed_size_binary(feature.type):  # a version 2 file: the floats' bytes (`segment_table`)
            try:
                return feature_lists(feature)
            except ValueError:
                problems.append(bad_column_type_reason("feature"))
                return pa.nulls(self.n, list_type)
        if pa.types.is_fixed_size_list(feature.type):
            target = pa.list_(pa.float32(), feature.type.list_size)
        elif pa.types.is_list(feature.type) or pa.types.is_large_list(feature.type):
            target = list_type
        else:
            problems.append(bad_column_type_reason("feature"))
            return pa.nulls(self.n, list_type)
        if feature.type.value_type == pa.float32():
            return feature  # a Parquet round trip renames the list's child field; no copy for that
        try:
            return pc.cast(feature, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            problems.append(bad_column_type_reason("feature"))
            return pa.nulls(self.n, list_type)

    def _judge(self, column_problems: list[str]) -> None:
        flag, columns = self.verdicts.flag, self.columns
        for problem in column_problems:
            flag(True, problem)
        for rows, problem in self._row_problems:
            flag(rows, problem)
        flag(self.recipe_error is not None, REASON_UNPARSABLE_RECIPE)

        ids = columns["request_id"]
        flag(true_rows(pc.or_kleene(ids.is_null(), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(ids)), 0))),
             REASON_MISSING_ID)
        for name in SCALAR_COLUMNS:
            if name in REQUIRED_COLUMNS and name != "request_id":
                flag(true_rows(columns[name].is_null()), null_field_reason(name))
        flag(true_rows(self.feature.is_null()), null_field_reason("feature"))

        self._judge_features()

        for name, reason in zip(_TOKEN_COLUMNS, (REASON_INVALID_PROMPT_TOKENS, REASON_INVALID_OUTPUT_TOKENS)):
            counts = columns[name].to_numpy(zero_copy_only=False)
            with np.errstate(invalid="ignore"):
                valid = np.isfinite(counts) & (counts >= 0) & (counts <= _INT32_MAX) & (counts == np.floor(counts))
            flag(~valid & ~true_rows(columns[name].is_null()), reason)
            columns[name] = pa.array(np.where(valid, counts, 0).astype(np.int32), mask=~valid)
        flag(true_rows(pc.equal(columns["output_tokens"], 0)), REASON_ZERO_OUTPUT_TOKENS)

        times = {name: columns[name].to_numpy(zero_copy_only=False) for name in _TIME_COLUMNS}
        for name in _TIME_COLUMNS:
            flag(~np.isfinite(times[name]) & ~true_rows(columns[name].is_null()), REASON_NON_FINITE_TIME)
        flag(true_rows(pc.less(columns["finish_time"], columns["arrival_time"])), REASON_FINISH_BEFORE_ARRIVAL)
        known = pc.is_in(columns["finish_reason"], value_set=pa.array(FINISH_REASONS))
        flag(~true_rows(known), REASON_UNKNOWN_FINISH_REASON)
        # PostgreSQL text cannot hold NUL, which would fail the whole segment's COPY there: one store
        # rule for both, the row is quarantined with its reason
        for name in SCALAR_COLUMNS:
            if pa.types.is_string(columns[name].type):
                flag(true_rows(pc.match_substring(columns[name], "\x00")), REASON_NUL_IN_TEXT)

    def _judge_features(self) -> None:
        flag = self.verdicts.flag
        if self.dim is None:
            flag(True, REASON_MISSING_SEGMENT_DIM)
            return
        flag(self.recipe is not None and not _fits_dim(self.recipe, self.dim), REASON_RECIPE_WRONG_DIM)
        feature = self.feature
        if pa.types.is_fixed_size_list(feature.type) and feature.type.list_size == self.dim:
            wrong_dim = true_rows(feature.is_null())  # null rows already failed; every other row has dim floats
        else:
            wrong_dim = pc.fill_null(pc.list_value_length(feature), -1).to_numpy(zero_copy_only=False) != self.dim
        flag(wrong_dim, REASON_FEATURE_WRONG_DIM)
        self._dim_conflict_rank = self.verdicts.reserve()
        flag(self._rows_with_non_finite_values(), REASON_FEATURE_NOT_FINITE)

    def _rows_with_non_finite_values(self) -> np.ndarray:
        feature = self.feature
        if pa.types.is_fixed_size_list(feature.type):
            size = feature.type.list_size
            values = feature.values.slice(feature.offset * size, self.n * size)
            matrix = values.to_numpy(zero_copy_only=False).reshape(self.n, size)
            return ~np.isfinite(matrix).all(axis=1)
        flat = pc.list_flatten(feature).to_numpy(zero_copy_only=False)
        parents = pc.list_parent_indices(feature).to_numpy(zero_copy_only=False)
        bad = np.zeros(self.n, dtype=bool)
        bad[parents[~np.isfinite(flat)]] = True
        return bad

    def feature_spaces(self) -> tuple[np.ndarray, list[tuple[str | None, int | None, str | None]]]:
        """Each row's feature space as a code into the list of distinct (fingerprint, layer, recipe)
        triples; the recipe is the segment's, else `last@<layer>` as `store.sql.RECIPE_SQL` reads it."""
        fingerprints = pc.dictionary_encode(self.columns["model_fingerprint"])
        layers = pc.dictionary_encode(self.columns["layer"])
        # Codes shifted by one so that null (-1) is a code too, then one integer per pair.
        fp_codes = pc.fill_null(fingerprints.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        layer_codes = pc.fill_null(layers.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        width = len(layers.dictionary) + 1
        pairs, codes = np.unique(fp_codes * width + layer_codes, return_inverse=True)
        fp_values = [None, *fingerprints.dictionary.to_pylist()]
        layer_values = [None, *layers.dictionary.to_pylist()]
        named = [(fp_values[pair // width], layer_values[pair % width]) for pair in pairs.tolist()]
        return codes.reshape(-1), [(fingerprint, layer, self._space_recipe(layer)) for fingerprint, layer in named]

    def _space_recipe(self, layer: int | None) -> str | None:
        if self.recipe is not None:
            return self.recipe
        return None if layer is None else str(Recipe.last(int(layer)))

    def judge_against_store(self, stored_dims: Mapping[SpaceKey, int]) -> None:
        """Fail the rows whose feature space is already stored with another dim."""
        if self._dim_conflict_rank is None or not stored_dims:
            return
        codes, pairs = self.feature_spaces()
        clashing = [index for index, pair in enumerate(pairs)
                    if stored_dims.get(pair) not in (None, self.dim)]
        if clashing:
            self.verdicts.flag(np.isin(codes, clashing), REASON_FEATURE_DIM_CONFLICT, rank=self._dim_conflict_rank)

    def first_occurrences(self) -> np.ndarray:
        """Passing rows that are the first passing row with their request id (first wins)."""
        passing = np.flatnonzero(self.verdicts.passing)
        mask = np.zeros(self.n, dtype=bool)
        if passing.size == 0:
            return mask
        ids = pc.dictionary_encode(self.columns["request_id"].take(passing)).indices
        _, first = np.unique(ids.to_numpy(zero_copy_only=False), return_index=True)
        mask[passing[first]] = True
        return mask

    def quarantine_rows(self, segment: str) -> pa.Table:
        rows = np.flatnonzero(~self.verdicts.passing)
        ids = self.columns["request_id"].take(rows)
        return pa.table(
            {
                "segment": pa.array([segment] * len(rows), pa.string()),
                "row_index": pa.array(rows, pa.int64()),
                # an id with NUL cannot be text in PostgreSQL; `raw` keeps it, escaped
                "request_id": pc.replace_substring(
                    pc.if_else(pc.equal(ids, ""), pa.scalar(None, pa.string()), ids), "\x00", "\ufffd"),
                "reason": pa.array(self.verdicts.reason_of(rows), pa.string()),
                # Only failing rows get here, kept whole (features too) for whoever looks into them.
                "raw": pa.array([quarantine_json(row) for row in self.raw.take(rows).to_pylist()], pa.string()),
            }
        )

    def accepted_rows(self, accepted: np.ndarray) -> pa.Table:
        return rows_where(pa.table({**self.columns, "feature": self.feature}), accepted)

    def dims_by_space(self, accepted: np.ndarray) -> dict[SpaceKey, int]:
        """The dim this segment stores for each feature space among the accepted rows."""
        if not accepted.any():
            return {}
        codes, pairs = self.feature_spaces()
        return {pairs[code]: int(self.dim) for code in np.unique(codes[accepted])}


def quarantine_json(row: dict[str, Any]) -> str:
    """A quarantined row (or a segment's quarantine detail) as the `raw` JSON that keeps it whole."""
    return dumps(row, nonfinite="string", default=str)  # "nan", "inf": strict JSON has no spelling for them
