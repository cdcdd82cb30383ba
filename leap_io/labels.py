"""Which finished requests' lengths are training labels: the one rule the serving process's RLS and the fits use.

A length trains only when the model chose where to stop, or ran into the whole budget M the readout is
fitted for. Otherwise (cut short by abort, error or repetition; capped by the client's `max_tokens`;
`ignore_eos` or `min_tokens` set; served under a policy that uses client-given lengths) it says what the
client asked for, not how long the answer is, and a client could use it to teach the readout that
everything is short. Such rows are kept in the store as data; they never reach RLS or a fit as lengths.
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
LABEL_PROBLEMS = ("client_cap", "ignore_eos", "min_tokens", *(f"policy_{p}" for p in CLIENT_LENGTH_POLICIES))
"""The reasons besides a finish reason that keep a row's length out of training."""


def label_problem(finish_reason: object, max_tokens: int | None, max_length: int, *, policy: object = None,
                  ignore_eos: object = False, min_tokens: object = 0) -> str | None:
    """None when the finished request's length is a training label; else why not (module docstring)."""
    if finish_reason not in TRAINING_FINISH_REASONS:
        return str(finish_reason)
    if policy in CLIENT_LENGTH_POLICIES:
        return f"policy_{policy}"
    if ignore_eos is True:
        return "ignore_eos"
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 0:
        return "min_tokens"
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
                               policy=None if policy is None else policy[i], ignore_eos=settings.get("ignore_eos"),
                               min_tokens=settings.get("min_tokens", 0))
    return out


def label_mask(columns: Mapping[str, np.ndarray], max_length: int) -> np.ndarray:
    """Which rows of stored columns (`finish_reason`, `max_tokens`, `policy`, `decoding`) have a length that
    is a label (`label_problems`), as a bool array; a row that recorded no `max_tokens` had the whole M."""
    max_tokens = np.asarray(columns["max_tokens"], dtype=np.float64)
    max_tokens = np.where(np.isfinite(max_tokens), max_tokens, max_length)
    problems = label_problems(columns["finish_reason"], max_tokens, max_length, columns["policy"], columns["decoding"])
    return np.asarray([problem is None for problem in problems], dtype=bool)
