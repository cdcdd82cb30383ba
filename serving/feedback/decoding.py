"""What decided a finished request's length besides the model: the settings its feedback row records.

The row's `decoding` JSON holds the sampling settings that change a length (temperature, penalties, seed,
`ignore_eos`, `min_tokens`) and what the server itself found about where the request stopped: on the
model's own end of sequence or on a client's stop token (`stopped_on`), whether an end-of-sequence id was
biased, how many token ids the client allowed, whether the output was constrained, and which of an
`n > 1` request's samples it was. The rule that reads them is `leap_io.labels.label_problem`. Only
counts and flags are kept, never a client's lists, so a row's size does not depend on the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serving import vllm_compat

SETTING_KEYS = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "ignore_eos", "min_tokens", "seed")
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def decoding_record(request: Any, finish_reason: str, model_stop_ids: frozenset[int]) -> dict[str, object]:
    """The `decoding` settings of a finished engine request (module docstring); {} without sampling params."""
    params = vllm_compat.request_sampling_params(request)
    if params is None:
        return {}
    record: dict[str, object] = {key: getattr(params, key, None) for key in SETTING_KEYS}
    own = set(model_stop_ids)
    eos = getattr(params, "eos_token_id", None)
    if isinstance(eos, int):
        own.add(eos)
    record["stopped_on"] = _stopped_on(finish_reason, vllm_compat.stop_reason(request), own)
    record["eos_logit_bias"] = _biases_any(getattr(params, "logit_bias", None), own)
    record["allowed_token_ids"] = len(getattr(params, "allowed_token_ids", None) or ())
    constraints = getattr(params, "structured_outputs", None)
    record["structured_outputs"] = constraints is not None and any(
        getattr(constraints, name, None) for name in CONSTRAINT_FIELDS)
    index = vllm_compat.parallel_sample_index(str(request.request_id))
    record["sample_index"] = index
    return record


def _stopped_on(finish_reason: str, reason: object, own: set[int]) -> str | None:
    if finish_reason != "stop":
        return None
    if reason is None or (isinstance(reason, int) and reason in own):
        return "eos"
    return "stop_token"


def _biases_any(logit_bias: object, ids: set[int]) -> bool:
    if not isinstance(logit_bias, Mapping):
        return False
    for key in logit_bias:
        try:
            if int(key) in ids:
                return True
        except (TypeError, ValueError):
            continue
    return False
