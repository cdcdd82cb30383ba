"""Which resident requests decode this step: countdown (shortest predicted remaining first) or FCFS.

Up to R requests sit in memory but only k decode per step. Countdown decodes the k with the smallest
predicted remaining length (prediction minus tokens already generated), so short answers are not stuck
behind long ones. A prediction that is badly wrong must not starve a request forever, so each request
counts the consecutive steps it was held out, and no request is held out more than `waiting_cap` steps.

Both implement `DecodePolicy`, so the engine scheduler and the simulator can swap them freely (as vLLM
isolates its waiting-queue order behind `RequestQueue`); `make_policy` builds one from its name.
"""

from __future__ import annotations

import sys
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "POLICY_NAMES",
    "UNBOUNDED_STEPS",
    "CountdownPolicy",
    "DecodePolicy",
    "FcfsPolicy",
    "GittinsPolicy",
    "advance_held_out",
    "make_policy",
]

POLICY_NAMES = ("fcfs", "countdown", "gittins")
_NONE = np.empty(0, dtype=np.intp)
UNBOUNDED_STEPS = sys.maxsize  # a selection that only a finish or an arrival can change


@runtime_checkable
class DecodePolicy(Protocol):
    """Which of the resident decode candidates run this step.

    All arrays are aligned, one entry per candidate: `predicted_total` is the predicted total output
    length (tokens), `generated` the tokens produced so far, `held_out` the consecutive steps each has
    been left out, `arrival` the arrival time (ties), `waited` (optional, zeros when omitted) every step
    each has been resident and not decoded since it joined (held-out steps are not reset by a decode).
    `select` returns the indices of at most `k` candidates to decode, most urgent first; it must not
    modify its inputs.
    """

    k: int

    def select(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
               arrival: np.ndarray, waited: np.ndarray | None = None) -> np.ndarray: ...

    def select_steps(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
                     arrival: np.ndarray, waited: np.ndarray | None = None) -> tuple[np.ndarray, int]: ...


def advance_held_out(held_out: np.ndarray, selected_mask: np.ndarray, steps: int = 1) -> np.ndarray:
    """Held-out counters after `steps` steps with the same selection: decoded requests restart at 0,
    every other one has waited `steps` more."""
    held_out = np.asarray(held_out)
    return np.where(np.asarray(selected_mask, dtype=bool), 0, held_out + steps).astype(held_out.dtype, copy=False)


def _k_smallest(priority: np.ndarray, arrival: np.ndarray, m: int) -> np.ndarray:
    """Indices of the `m` smallest priorities, ties broken by earliest arrival, in that order.

    One O(n) partition finds the m-th value; only the requests tied at that value need a sort, so
    equal predictions (common with integer lengths) are still ordered fairly.
    """
    n = priority.shape[0]
    if m >= n:
        chosen = np.arange(n)
    else:
        threshold = np.partition(priority, m - 1)[m - 1]
        at_most = priority <= threshold
        if np.count_nonzero(at_most) == m:  # no tie straddles the boundary
            chosen = np.flatnonzero(at_most)
        else:
            below = np.flatnonzero(priority < threshold)
            tied = np.flatnonzero(priority == threshold)
            tied = tied[np.argsort(arrival[tied], kind="stable")[: m - below.shape[0]]]
            chosen = np.concatenate((below, tied))
    return chosen[np.lexsort((arrival[chosen], priority[chosen]))]


class CountdownPolicy:
    """Decode the k requests with the smallest predicted remaining length; never hold one out past the cap.

    Parameters
    ----------
    k : decode slots per step.
    waiting_cap : the most consecutive steps a resident request may be held out.
    aging : exponential aging rate as in TIE: priority = remaining * exp(-aging * held_out). 0 is plain
        countdown.
    wait_aging : aging by wait over predicted remaining length, as in HRRN (highest response ratio next):
        priority = remaining * exp(-wait_aging * waited / remaining), where `waited` counts every step the
        request has been resident and not decoded. A request predicted long ages slowly and one predicted
        short quickly, each in proportion to the service it still needs; unlike `aging`, a forced decode does
        not reset it. 0 ignores waits.

    Starvation guard: a request held out `waiting_cap` steps is forced in. Forcing only those could
    still overshoot the cap when more than k reach it in the same step (a burst admitted together and
    predicted long), so the guard looks ahead like earliest-deadline-first: if more requests will hit
    the cap within e steps than e steps of slots can serve, the most held-out ones are forced in now.
    This keeps held_out <= waiting_cap as long as at most k * (waiting_cap + 1) requests are resident
    and new ones join with held_out 0.
    Forced requests go first (most held out, then earliest arrival); the other slots go by priority.
    """

    def __init__(self, k: int = 64, waiting_cap: int = 128, aging: float = 0.0, wait_aging: float = 0.0) -> None:
        self.k = k
        self.waiting_cap = waiting_cap
        self.aging = aging
        self.wait_aging = wait_aging

    def _forced(self, held_out: np.ndarray, arrival: np.ndarray) -> np.ndarray:
        """The requests that must decode now so no one later exceeds the cap, most held out first."""
        n = held_out.shape[0]
        slack = self.waiting_cap - held_out  # steps a request may still wait
        if n <= self.k * int(slack.min()):
            return _NONE  # fast path: even all of them could be served before the first deadline
        # Only requests due within n/k steps can outnumber the slots before their deadline.
        urgent = np.flatnonzero(slack <= min(n // self.k + 1, self.waiting_cap))
        urgent_slack = slack[urgent]
        order = np.lexsort((arrival[urgent], urgent_slack))
        # If the m most urgent are all due within s steps, more than k * s of them must start now.
        due = np.maximum(urgent_slack[order], 0)
        need = min(int((np.arange(1, due.shape[0] + 1) - self.k * due).max()), self.k)
        return urgent[order[:need]] if need > 0 else _NONE

    def _rank(self, predicted_total: np.ndarray, generated: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        """The un-aged priority, smaller first: the predicted remaining length."""
        return remaining

    def _priority(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
                  waited: np.ndarray | None) -> np.ndarray:
        """Smaller decodes first: `_rank` (the predicted remaining length, at least 1), aged when `aging` or
        `wait_aging` > 0."""
        remaining = np.maximum(predicted_total - generated, 1.0)
        rank = self._rank(predicted_total, generated, remaining)
        if not (self.aging or (self.wait_aging and waited is not None)):
            return rank
        exponent = self.aging * np.asarray(held_out, dtype=np.float64)
        if self.wait_aging and waited is not None:
            exponent = exponent + self.wait_aging * np.asarray(waited, dtype=np.float64) / remaining
        return rank * np.exp(-exponent)

    @property
    def _steady(self) -> bool:
        """Whether the chosen requests' priorities keep their order while they decode (remaining only
        shrinks for them; held-out requests' priorities do not move unless aging moves them)."""
        return not (self.aging or self.wait_aging)

    def _select(self, predicted_total, generated, held_out, arrival, waited=None) -> tuple[np.ndarray, int]:
        """The selection and how many of its first entries were forced in by the cap."""
        n = held_out.shape[0]
        if n == 0:
            return _NONE, 0
        priority = self._priority(np.asarray(predicted_total, dtype=np.float64), generated, held_out, waited)
        if n <= self.k:
            return np.lexsort((arrival, priority)), 0
        forced = self._forced(held_out, arrival)
        num_forced = forced.shape[0]
        if num_forced == 0:
            return _k_smallest(priority, arrival, self.k), 0
        if num_forced == self.k:
            return forced, num_forced
        priority[forced] = np.inf  # a fresh array: remaining was computed above
        return np.concatenate((forced, _k_smallest(priority, arrival, self.k - num_forced))), num_forced

    def select(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
               arrival: np.ndarray, waited: np.ndarray | None = None) -> np.ndarray:
        """Indices (into the given arrays) of at most k requests to decode this step, most urgent first."""
        held_out = np.asarray(held_out, dtype=np.int64)
        return self._select(predicted_total, generated, held_out, np.asarray(arrival), waited)[0]

    def select_steps(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
                     arrival: np.ndarray, waited: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """`select`, plus for how many consecutive steps (this one included) the same requests stay chosen.

        Valid while only the chosen requests advance and none finishes or joins: their remaining
        length only shrinks, so without aging the order changes only when the cap forces someone in.
        A simulator uses it to jump over steady stretches in one move.
        """
        held_out = np.asarray(held_out, dtype=np.int64)
        arrival = np.asarray(arrival)
        chosen, num_forced = self._select(predicted_total, generated, held_out, arrival, waited)
        n = held_out.shape[0]
        if n <= self.k:
            return chosen, UNBOUNDED_STEPS
        if num_forced or not self._steady or n > self.k * self.waiting_cap:
            return chosen, 1
        waiting = np.ones(n, dtype=bool)
        waiting[chosen] = False
        # After j more steps a waiting request has slack s - j. The cap first forces someone in at the
        # smallest j where, for some e, k * e + 1 waiting requests have slack <= e + j.
        slack = np.sort(self.waiting_cap - held_out[waiting])
        e = np.arange(0, slack.shape[0], self.k)
        return chosen, max(int((slack[e] - e // self.k).min()), 1)


class GittinsPolicy(CountdownPolicy):
    """Countdown's slots, waiting cap and wait aging, ranked by the Gittins index of the remaining length
    under the predictor's error distribution (`leap_core.gittins.LengthGivenPrediction`): the largest
    expected weight completed per token of service first. `distribution` maps (predicted total, generated)
    to the index."""

    def __init__(self, distribution, k: int = 64, waiting_cap: int = 128, wait_aging: float = 0.0) -> None:
        super().__init__(k=k, waiting_cap=waiting_cap, wait_aging=wait_aging)
        self.distribution = distribution

    def _rank(self, predicted_total: np.ndarray, generated: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        return 1.0 / self.distribution.index(predicted_total, generated)

    @property
    def _steady(self) -> bool:
        return False  # an index can rise or fall as a request outlives samples


class FcfsPolicy:
    """Decode the k earliest arrivals among the resident requests (the engine's default order)."""

    def __init__(self, k: int = 64) -> None:
        self.k = k

    def select(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
               arrival: np.ndarray, waited: np.ndarray | None = None) -> np.ndarray:
        """Indices of the at most k earliest arrivals, earliest first; the other inputs are ignored."""
        arrival = np.asarray(arrival, dtype=np.float64)
        n = arrival.shape[0]
        if n <= self.k:
            return np.argsort(arrival, kind="stable")
        chosen = np.argpartition(arrival, self.k - 1)[: self.k]
        threshold = arrival[chosen].max()
        chosen = np.concatenate((np.flatnonzero(arrival < threshold), np.flatnonzero(arrival == threshold)))
        return chosen[np.lexsort((chosen, arrival[chosen]))][: self.k]

    def select_steps(self, predicted_total: np.ndarray, generated: np.ndarray, held_out: np.ndarray,
                     arrival: np.ndarray, waited: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """`select`, plus for how many steps it holds: until a request finishes or joins."""
        return self.select(predicted_total, generated, held_out, arrival), UNBOUNDED_STEPS


def make_policy(name: str, k: int = 64, waiting_cap: int = 128, aging: float = 0.0,
                distribution=None, wait_aging: float = 0.0) -> DecodePolicy:
    """The policy called `name` ("fcfs", "countdown", or "gittins" with the predictor's `distribution`).
    The oracle is countdown fed the true lengths."""
    if name == "countdown":
        return CountdownPolicy(k=k, waiting_cap=waiting_cap, aging=aging, wait_aging=wait_aging)
    if name == "fcfs":
        return FcfsPolicy(k=k)
    if name == "gittins":
        if distribution is None:
            raise ValueError("the gittins policy needs the predictor's length distribution")
        return GittinsPolicy(distribution, k=k, waiting_cap=waiting_cap, wait_aging=wait_aging)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICY_NAMES}")
