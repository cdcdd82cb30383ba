"""When a request finishes: when its feedback row can be written, and whether its true length may teach RLS.

A prefilled request's feature was captured, but a worker in another process sends it over ZeroMQ and it
can land after the finish: then the row waits for it, up to `LATE_FEATURE_S`, and is written when the
feature arrives (settled every step, and every half second while the engine idles) or without it once the wait is over (counted as
`feature_never_arrived`). Only lengths that say how long the answer really was teach RLS
(`leap_io.labels`: not aborted, not capped below the readout's budget or otherwise steered by the
client, decided from the engine's own request by `serving.feedback.decoding`), and only they count in the
quality figures; the others are counted as dropped `rls_row`s by reason, and so are the rows of a tenant past its
share of what RLS learns (`serving.feedback.tenant_share`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leap_io.labels import FORCED_LENGTH_PROBLEMS, LABEL_PROBLEMS, label_problem
from serving import vllm_compat
from serving.config import LeapConfig
from serving.feedback.decoding import decoding_record
from serving.feedback.recorder import FeedbackRecorder
from serving.feedback.tenant_share import TenantShare
from serving.readout.service import ReadoutService
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker

LATE_FEATURE_S = 5.0  # how long a finished request's row waits for a feature still on its way


class FinishedRequests:
    """Writes the feedback row of every finished request once, and feeds RLS from those that train it."""

    def __init__(self, config: LeapConfig, tracker: RequestTracker, readouts: ReadoutService,
                 recorder: FeedbackRecorder, telemetry: Telemetry, model_stop_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        self._model_stop_ids = model_stop_ids
        self._tracker = tracker
        self._readouts = readouts
        self._recorder = recorder
        self._telemetry = telemetry
        self._late_rows: dict[str, tuple] = {}  # finished, waiting for their feature (engine thread only)
        self._tenants = TenantShare(config.rls_tenant_max_share, config.rls_tenant_window)

    def finish(self, request: Any) -> None:
        """Forget the request, write its feedback row once and hand (feature, true length) to RLS."""
        prefilled = request.num_output_tokens > 0
        entry, feature, predicted, version, awaiting = self._tracker.finish(
            request.request_id, LATE_FEATURE_S if prefilled else None)
        if entry is None and (feature is not None or prefilled):
            entry = self._tracker.entry_of_unseen(request)  # finished in the step that prefilled it
        context = (request, entry, predicted, version or self._readouts.version, self.config.policy)
        if awaiting:
            self._late_rows[request.request_id] = context
            return
        self._write(context, feature)

    def settle(self, final: bool = False) -> None:
        """Write the rows whose late feature arrived, or whose wait is over (every row left, when `final`)."""
        for request_id, feature in self._tracker.settle(final):
            self._write(self._late_rows.pop(request_id), feature)

    def _write(self, context: tuple, feature: np.ndarray | None) -> None:
        request, entry, predicted, version, policy = context
        output_tokens = int(request.num_output_tokens)
        reason = vllm_compat.finish_reason(request)
        decoding = decoding_record(request, reason, self._model_stop_ids)
        problem = label_problem(reason, int(request.max_tokens), int(getattr(self._readouts.readout, "max_tokens", 0) or 0),
                                policy=policy, decoding=decoding)
        labelled = problem is None or (problem in FORCED_LENGTH_PROBLEMS and self.config.rls_learns_forced_lengths)
        if feature is not None and output_tokens > 0:
            if labelled:
                if self._tenants.admit(entry.extras.leap_tenant if entry is not None else None):
                    self._readouts.observe(feature, output_tokens)
                else:
                    self._telemetry.drop("rls_row", "tenant_share")
            elif problem in LABEL_PROBLEMS:
                self._telemetry.drop("rls_row", problem)
        if feature is None and output_tokens > 0:
            self._telemetry.drop("feedback_row", "feature_never_arrived")
        self._recorder.record(request, entry, feature, predicted, version, policy, decoding, labelled)
