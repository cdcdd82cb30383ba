"""The columns of a feedback segment: one row per finished request, written once by the serving process.

The schema is shared by the writer (serving) and the ingest flow (flows/store.py), so it lives in one
place. The feature column is a fixed-size list of float32: the whole vector the serving engine
captured, its capture recipe (`leap_core.recipes`), so a readout may be fitted on any recipe that recipe
covers. A segment's Parquet metadata records that dim, the recipe (`leap.recipe`; segments from before
recipes have none and hold `last@<layer>`), the serving layer and the model fingerprint.
"""

import pyarrow as pa

SCHEMA_VERSION = "1"

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
            pa.field("request_id", pa.string(), nullable=False),
            pa.field("model_id", pa.string()),
            pa.field("model_fingerprint", pa.string()),
            pa.field("layer", pa.int32()),
            pa.field("policy", pa.string()),
            pa.field("arrival_time", pa.float64()),  # unix seconds, as planned by the client
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
            pa.field("feature", pa.list_(pa.float32(), dim)),
        ]
    )


COLUMNS = tuple(feedback_schema(1).names)


def parquet_options() -> dict:
    """How a segment is written to Parquet: zstd for the scalar columns, the feature column uncompressed
    and without a dictionary. Hidden states are near-random float32: zstd saved 9% of a 10,000 x 576
    segment's bytes, while decompressing them took about 40% of the CPU time reading the segment back."""
    scalars = [name for name in COLUMNS if name != "feature"]
    return {"compression": {**{name: "zstd" for name in scalars}, "feature.list.element": "none"},
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
