"""The per-request extras LEAP reads (`vllm_xargs` of the OpenAI API, `SamplingParams.extra_args`).

Anything a client sends is hostile until validated. One pydantic model says what each `leap_*` key may
hold; `parse_leap_extras` never raises: it returns the valid values and, for every bad key, a reason, so
the API front end can refuse the request with HTTP 400 and engine-core can ignore the key with a counter
and a warning. Keys that do not start with `leap_` belong to other plugins and are left alone.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

PREFIX = "leap_"
_MAX_LENGTH = 1 << 24  # an output length beyond any context window
_Text = Annotated[str, Field(min_length=1, max_length=256)]


class LeapExtras(BaseModel):
    """The validated `leap_*` extras of one request; a missing or refused key is None."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    leap_request_id: _Text | None = None
    leap_oracle_length: float | None = Field(None, ge=0, le=_MAX_LENGTH)
    leap_predicted_length: float | None = Field(None, ge=0, le=_MAX_LENGTH)
    leap_planned_arrival: float | None = Field(None, ge=0, le=1e11)
    leap_domain: _Text | None = None
    leap_tenant: _Text | None = None

    @field_validator("leap_oracle_length", "leap_predicted_length", "leap_planned_arrival", mode="before")
    @classmethod
    def _real_number(cls, value):
        # bool is an int to Python and "nan"/"inf" parse as floats: none of them is a length or a time
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        if not math.isfinite(float(value)):
            raise ValueError("must be finite")
        return value

    @field_validator("leap_request_id", "leap_domain", "leap_tenant", mode="before")
    @classmethod
    def _text(cls, value):
        if not isinstance(value, str):
            raise ValueError("must be a string")
        return value


KNOWN_KEYS = frozenset(LeapExtras.model_fields)
EMPTY = LeapExtras()


def parse_leap_extras(extra: object) -> tuple[LeapExtras, dict[str, str]]:
    """(the valid `leap_*` values, {bad key: reason}); never raises, whatever `extra` is."""
    if extra is None:
        return EMPTY, {}
    if not isinstance(extra, dict):
        return EMPTY, {"vllm_xargs": f"must be an object, not {type(extra).__name__}"}
    ours = {key: value for key, value in extra.items() if isinstance(key, str) and key.startswith(PREFIX)}
    if not ours:
        return EMPTY, {}
    errors: dict[str, str] = {}
    for key in ours:
        if key not in KNOWN_KEYS:
            errors[key] = f"unknown LEAP extra (known: {', '.join(sorted(KNOWN_KEYS))})"
    good = {key: value for key, value in ours.items() if key in KNOWN_KEYS}
    try:
        return LeapExtras(**good), errors
    except ValidationError as exc:
        for error in exc.errors():
            key = str(error["loc"][0]) if error.get("loc") else "vllm_xargs"
            errors[key] = error["msg"]
        valid = {key: value for key, value in good.items() if key not in errors}
        return LeapExtras(**valid), errors
