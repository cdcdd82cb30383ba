"""Which finished requests' lengths are training labels: the one rule the serving process's RLS and the fits use.

A length trains only when the model chose where to stop, or ran into the whole budget M the readout is
fitted for. Otherwise it says what the client asked for, not how long the answer is, and a client could
use it to teach the readout that everything is short:
- cut short by abort, error or repetition, or capped by the client's `max_tokens` below M;
- `ignore_eos` or `min_tokens` set, or served under a policy that uses client-given lengths;
- stopped on the client's stop token or stop string rather than the model's own end of sequence;
- the end of sequence biased (`logit_bias` on an end-of-sequence id), the vocabulary narrowed
  (`allowed_token_ids`) or the output constrained (structured or guided decoding);
- a second or later sample of a request with `n > 1` (one prompt counts once: its first sample).
The serving process decides each of these from the engine's own request (`serving.feedback.decoding`)
and records them in the row's `decoding` JSON, so the fit applies the same rule to stored rows. Such rows
are kept in the store as data; they never reach RLS, a fit or a quality figure as lengths.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from leap_io.feedback_schema import TRAINING_FINISH_REASONS

CLIENT_LENGTH_POLICIES = ("client", "oracle")
FORCED_LENGTH_PROBLEMS = ("client_cap", "ignore_eos", "min_tokens")
"""The problems of a length the request forced; a replay of recorded true lengths forces them on purpose
(`LeapConfig.rls_learns_forced_lengths`)."""
CLIENT_STOPS = ("stop_token", "stop_string")
"""`decoding["stopped_on"]` values that mean the client's stop ended the answer (the model's own is "eos")."""
BENDING_SETTINGS = ("eos_logit_bias", "allowed_token_ids", "structured_outputs")
"""`decoding` keys that, when true or non-zero, bend where the model stops whatever it finished on."""
LABEL_PROBLEMS = ("client_cap", "ignore_eos", "min_tokens", "client_stop", *BENDING_SETTINGS, "parallel_sample",
                  *(f"policy_{p}" for p in CLIENT_LENGTH_POLICIES))
"""The reasons besides a finish reason that keep a row's length out of training."""


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def label_problem(finish_reason: object, max_tokens: int | None, max_length: int, *, policy: object = None,
                  decoding: Mapping[str, object] | None = None) -> str | None:
    """None when the finished request's length is a training label; else why not (module docstring).

    `decoding` is the row's recorded settings (`decoding_settings`); a value of the wrong type counts as
    unset, so a row written before a key existed keeps its old verdict."""
    decoding = decoding or {}
    if finish_reason not in TRAINING_FINISH_REASONS:
        return str(finish_reason)
    if policy in CLIENT_LENGTH_POLICIES:
        return f"policy_{policy}"
    if decoding.get("ignore_eos") is True:
        return "ignore_eos"
    if _positive_int(decoding.get("min_tokens")):
        return "min_tokens"
    if finish_reason == "stop" and decoding.get("stopped_on") in CLIENT_STOPS:
        return "client_stop"
    for setting in BENDING_SETTINGS:
        value = decoding.get(setting)
        if value is True or _positive_int(value):
            return setting
    if _positive_int(decoding.get("sample_index")):
        return "parallel_sample"
    if finish_reason == "length" and max_tokens and 0 < int(max_tokens) < int(max_length):
        return "client_cap"
    return None


def decoding_settings(decoding: object) -> Mapping[str, object]:
    """The recorded sampling settings (a feedback row's `decoding` JSON); {} when absent or unreadable."""
    if not isinstance(decoding, str) or not decoding:
        return {}
    try:
        parsed = json.loads(decoding)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def label_problems(finish_reason: np.ndarray, max_tokens: np.ndarray | None, max_length: int,
                   policy: np.ndarray | None = None, decoding: np.ndarray | None = None) -> np.ndarray:
    """`label_problem` of each row of a frame's columns: an object array, None where the length trains.

    Each distinct `decoding` text is parsed once (a store holds few of them).
    """
    n = len(finish_reason)
    parsed = {text: decoding_settings(text) for text in set(decoding.tolist())} if decoding is not None else {}
    out = np.empty(n, dtype=object)
    for i in range(n):
        settings = parsed.get(decoding[i], {}) if decoding is not None else {}
        out[i] = label_problem(finish_reason[i], None if max_tokens is None else int(max_tokens[i]), max_length,
                               policy=None if policy is None else policy[i], decoding=settings)
    return out


def label_mask(columns: Mapping[str, np.ndarray], max_length: int) -> np.ndarray:
    """Which rows of stored columns (`finish_reason`, `max_tokens`, `policy`, `decoding`) have a length that
    is a label (`label_problems`), as a bool array; a row that recorded no `max_tokens` had the whole M."""
    max_tokens = np.asarray(columns["max_tokens"], dtype=np.float64)
    max_tokens = np.where(np.isfinite(max_tokens), max_tokens, max_length)
    problems = label_problems(columns["finish_reason"], max_tokens, max_length, columns["policy"], columns["decoding"])
    return np.asarray([problem is None for problem in problems], dtype=bool)
