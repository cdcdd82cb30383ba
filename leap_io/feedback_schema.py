"""The columns of a feedback segment: one row per finished request, written once by the serving process.

The schema is shared by the writer (serving) and the ingest flow (`store.ingest`), so it lives in one
place. The feature column holds the whole vector of the replica's capture recipe (`leap_core.recipes`),
so a readout may be fitted on any recipe it covers; the segment's Parquet metadata records the recipe,
layer and model fingerprint. `request_id` is made by the serving process, never by a client, so no client
can make another request's row look like a duplicate; the client's id is kept in `client_request_id`.
File versions and old-segment handling: docs/architecture.md.
"""

import pyarrow as pa

SCHEMA_VERSION = "2"
"""Version 2 segment files hold the feature column as fixed-size binary (`segment_table`); version 1 files
held the fixed-size list itself. Ingest reads both."""

# Keys stored in each segment's Parquet key-value metadata (bytes -> bytes).
META_SCHEMA_VERSION = b"leap.schema_version"
META_DIM = b"leap.dim"
META_LAYER = b"leap.layer"
META_MODEL_ID = b"leap.model_id"
META_MODEL_FINGERPRINT = b"leap.model_fingerprint"
META_REPLICA_ID = b"leap.replica_id"  # the serving replica whose writer made the segment (optional)
META_RECIPE = b"leap.recipe"  # the capture recipe the feature column holds (optional: else last@<layer>)


def feedback_schema(dim: int) -> pa.Schema:
    """Arrow schema of a feedback segment whose features have `dim` floats."""
    return pa.schema(
        [
            pa.field("request_id", pa.string(), nullable=False),  # the serving process's key (ROW_ID below)
            pa.field("client_request_id", pa.string()),  # the client's id (leap_request_id, X-Request-Id): data
            pa.field("model_id", pa.string()),
            pa.field("model_fingerprint", pa.string()),
            pa.field("layer", pa.int32()),
            pa.field("policy", pa.string()),
            pa.field("arrival_time", pa.float64()),  # unix seconds, when the server received the request
            pa.field("first_token_time", pa.float64()),
            pa.field("finish_time", pa.float64()),
            pa.field("prompt_tokens", pa.int32()),
            pa.field("output_tokens", pa.int32()),
            pa.field("finish_reason", pa.string()),  # "stop", "length", "abort", "error", "repetition"
            pa.field("max_tokens", pa.int32()),
            pa.field("decoding", pa.string()),  # JSON of the sampling parameters that change length
            pa.field("domain", pa.string()),
            pa.field("tenant", pa.string()),
            pa.field("predicted_at_admission", pa.float32()),
            pa.field("predicted_latest", pa.float32()),
            pa.field("readout_version", pa.string()),
            pa.field("shadow_predicted", pa.float32()),  # a readout held in shadow, same vector (serving.readout.shadow)
            pa.field("shadow_version", pa.string()),
            pa.field("client_arrival_time", pa.float64()),  # the client's own planned arrival (an extra): data
            pa.field("feature", pa.list_(pa.float32(), dim)),
        ]
    )


COLUMNS = tuple(feedback_schema(1).names)

CLIENT_ID_MAX_CHARS = 256
"""How much of a client's request id a row keeps."""


def segment_table(table: pa.Table) -> pa.Table:
    """`table` as a segment file holds it: the feature column (a fixed-size list of float32, the writer's
    form) as fixed-size binary, each row its `dim` little-endian float32 values, a view of the same buffer.
    Parquet stores a list with a repetition level per float, which reading back decoded value by value
    (25 ms per 10,000 x 576 rows against 3 ms for the binary column)."""
    index = table.schema.get_field_index("feature")
    feature = table.column(index).combine_chunks()
    if not pa.types.is_fixed_size_list(feature.type) or feature.type.value_type != pa.float32():
        raise TypeError(f"the feature column must be a fixed-size list of float32, not {feature.type}")
    if feature.null_count:
        raise ValueError("a segment holds no NULL feature")
    dim, n = feature.type.list_size, len(feature)
    values = feature.values.slice(feature.offset * dim, n * dim)
    floats = values.to_numpy(zero_copy_only=False).astype("<f4", copy=False)
    binary = pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * dim), n, [None, pa.py_buffer(floats)]) \
        if dim else pa.array([b""] * n, pa.binary(0))
    field = pa.field("feature", binary.type, nullable=table.schema.field(index).nullable)
    return table.set_column(index, field, binary)


def feature_lists(feature: pa.Array) -> pa.Array:
    """A segment file's binary feature column as fixed-size lists of float32 (a view; NULL rows stay
    NULL). ValueError when its width is not a whole number of float32 values."""
    width = feature.type.byte_width
    if width % 4:
        raise ValueError(f"a binary feature of {width} bytes is not a whole number of float32 values")
    dim, n = width // 4, len(feature)
    values = pa.Array.from_buffers(pa.float32(), n * dim, [None, feature.buffers()[1]], offset=feature.offset * dim)
    mask = feature.is_null() if feature.null_count else None
    return pa.FixedSizeListArray.from_arrays(values, dim, mask=mask)


def read_segment_file(source) -> pa.Table:
    """A segment file (a path or a buffer) as a table whose feature column is fixed-size lists of float32,
    whichever version wrote it."""
    import pyarrow.parquet as pq

    table = pq.read_table(source)
    index = table.schema.get_field_index("feature")
    if index >= 0 and pa.types.is_fixed_size_binary(table.schema.field(index).type):
        lists = feature_lists(table.column(index).combine_chunks())
        table = table.set_column(index, pa.field("feature", lists.type), lists)
    return table


def parquet_options() -> dict:
    """How a segment table (`segment_table`) is written to Parquet: zstd for the scalar columns, the
    feature column uncompressed and without a dictionary. Hidden states are near-random float32: zstd saved 9% of a 10,000 x 576
    segment's bytes, while decompressing them took about 40% of the CPU time reading the segment back."""
    scalars = [name for name in COLUMNS if name != "feature"]
    return {"compression": {**{name: "zstd" for name in scalars}, "feature": "none"},
            "use_dictionary": scalars}


def segment_metadata(dim: int, layer: int, model_id: str, fingerprint: str,
                     replica_id: str | None = None, recipe: str | None = None) -> dict[bytes, bytes]:
    metadata = {META_SCHEMA_VERSION: SCHEMA_VERSION.encode(), META_DIM: str(dim).encode(),
                META_LAYER: str(layer).encode(), META_MODEL_ID: model_id.encode(),
                META_MODEL_FINGERPRINT: fingerprint.encode()}
    if replica_id:
        metadata[META_REPLICA_ID] = replica_id.encode()
    if recipe:
        metadata[META_RECIPE] = recipe.encode()
    return metadata


# A stopped request's length is its true length and a capped one is censored at M, which the sqrt target
# clips to anyway; an aborted, failed or looping request says nothing about how long the answer would be.
# The one rule for what trains: the ingest flow and the serving process's RLS both use it.
TRAINING_FINISH_REASONS = ("stop", "length")
NOT_TRAINING_FINISH_REASONS = ("abort", "error", "repetition")
