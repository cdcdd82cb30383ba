"""Everything LEAP runs beside one engine's scheduler, composed from parts that each own one thing.

- `RequestTracker` (serving/tracking.py): per-request state (entries, features, predictions), pruned;
- `ReadoutService` (serving/readout_service.py): the serving readout, the predictor and RLS threads,
  pushes, persistence and the restore at start;
- `CaptureReceiver` (serving/receiver.py): captured features from the workers, validated;
- a `CaptureSpace` (serving/push.py): what a captured vector holds (the engine's capture recipe), which
  every readout is checked against and reads its own recipe's columns of;
- `FeedbackRecorder` (serving/recorder.py): one row per finished request for the writer and listeners;
- a `leap_core.policy.DecodePolicy`: which decode candidates run this step;
- `Telemetry` (serving/telemetry.py): the Prometheus registry and the drop / error counts;
- a `Refresher` (serving/refresh.py), only when refresh is configured and its readout fits: decode
  states at the `refresh_at` checkpoints -> refreshed predicted totals.

`LeapRuntime` wires them and holds the three scheduler hooks: `before_schedule` chooses which resident
requests decode this step, `after_schedule` counts who actually ran, `on_finished` writes feedback and
feeds RLS. The engine thread never blocks on another thread except in one bounded place: a step whose
new decode candidates have no prediction yet waits for them once, up to `ready_wait_ms` for all of them
together, and a request still without one is ordered by its max_tokens.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leap_core.policy import DecodePolicy, make_policy
from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_io.feedback_schema import TRAINING_FINISH_REASONS
from leap_io.push_bundle import make_bundle
from serving import vllm_compat
from serving.config import (
    LeapConfig,
    channel_address,
    leap_config_from_vllm,
    register_predictor_policy,
)
from serving.online import OnlineLearner
from serving.predictor import PredictorService
from serving.push import CaptureSpace
from serving.readout_service import ReadoutService
from serving.receiver import CaptureReceiver
from serving.recorder import FeedbackRecorder
from serving.refresh import Refresher, RefreshReadoutError, load_refresh_readout, refresh_columns
from serving.supervise import RateLimitedLog
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker, Tracked

logger = logging.getLogger(__name__)

EXPIRE_EVERY_S = 1.0
LATE_FEATURE_S = 5.0  # how long a finished request's row waits for a feature still on its way
_hook_warnings = RateLimitedLog(logger)


def _engine_hook(method):
    """A scheduler hook that never raises into vLLM: a LEAP bug costs one step's ordering or one
    request's feedback row (counted as `leap_thread_errors_total{thread="scheduler"}`), not engine-core."""

    @functools.wraps(method)
    def hook(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - nothing LEAP does may take engine-core down
            self.telemetry.thread_error("scheduler")
            _hook_warnings.warning(method.__name__, "LEAP %s failed; the engine goes on", method.__name__,
                                   exc_info=True)
            return None

    return hook


@dataclass
class Counters:
    """The scheduler-side counts `stats()` reports (reset by `configure` between replays)."""

    ready: int = 0
    missed: int = 0
    waited_s: float = 0.0
    max_held_out: int = 0
    steps: int = 0
    schedule_s: float = 0.0
    refreshed: int = 0


class LeapRuntime:
    """LEAP's state for one engine, created by the scheduler subclass."""

    def __init__(self, vllm_config: Any, config: LeapConfig | None = None) -> None:
        self.config = config or leap_config_from_vllm(vllm_config)
        self.dim, self.num_layers, model, self.max_tokens_default = vllm_compat.served_model_shape(vllm_config)
        self.model_id, self.fingerprint = _model_identity(model)
        # imported here: serving.worker imports vLLM's platform, which module import must not
        from serving.worker import capture_layer, readout_side_recipe, serving_recipe

        self.recipe = serving_recipe(vllm_config, self.num_layers)
        self.layer = capture_layer(vllm_config, self.num_layers)
        self.capture = CaptureSpace(self.recipe, self.dim, self.num_layers,
                                    default=readout_side_recipe(self.config, self.num_layers))
        self.counters = Counters()
        self.last_held: set[str] = set()
        self.last_step_shape: tuple[int, int] = (0, 0)  # (decoded requests, prefill tokens) of the last step
        self._next_expiry = 0.0
        self._late_rows: dict[str, tuple] = {}  # finished, waiting for their feature (engine thread only)

        self.telemetry = Telemetry()
        self.metrics_registry = self.telemetry.registry
        self.tracker = RequestTracker(self.telemetry, finished_memory=self.config.finished_memory,
                                      orphan_ttl_s=self.config.orphan_ttl_s)
        self.readouts = ReadoutService(self.config, self._expect(), self.tracker, self.telemetry,
                                       self.capture, model_id=self.model_id, layer=self.layer)
        self.recorder = FeedbackRecorder(self._feedback_writer(), self.model_id, self.fingerprint, self.layer,
                                         self.telemetry, anchor=self.readouts.anchor_prediction)
        self.policy: DecodePolicy = self._make_policy()
        self.refresh_error: str | None = None
        self.refresher: Refresher | None = self._make_refresher()
        self.readouts.start()
        # prefill vectors hold the recipe; refresh rows the last-token state of each captured layer
        sizes = (self.recipe.dim(self.dim), len(self.recipe.layers) * self.dim)
        self.receiver = CaptureReceiver(channel_address(vllm_config, self.config), sizes, self._on_feature,
                                        self.telemetry, deliver_batch=self._on_features_in_step,
                                        deliver_refresh=self._on_refresh).start()
        self.admin = None
        if self.config.admin_port is not None:
            from serving.admin import AdminServer

            self.admin = AdminServer(self, self.config.admin_host, self.config.admin_port, self.config.token())
            logger.info("LEAP admin API on http://%s:%d", self.admin.host, self.admin.port)

    # -- set-up --------------------------------------------------------------------------------
    def _expect(self) -> dict:
        """What a readout file must record as given: the served model's fingerprint (its recipe and dim
        are checked against the capture, `CaptureSpace.check`)."""
        return {"model_fingerprint": self.fingerprint} if self.fingerprint else {}

    @property
    def feature_dim(self) -> int:
        """The size of a captured vector, and so of the widest readout this engine can serve."""
        return self.capture.dim

    def _feedback_writer(self) -> Any:
        self.shipper = None  # serving.shipper.FeedbackShipper when feedback_url is set
        if not self.config.feedback_dir:
            # segments are written locally first (the crash-safe spool), then shipped: no folder, no feedback.
            # Not an error: engines that write none (the gate's, a replay's) read the fleet's LEAP_FEEDBACK_URL too
            if self.config.feedback_url:
                logger.warning("LEAP writes no feedback: feedback_url %s is set but feedback_dir "
                               "(LEAP_FEEDBACK_DIR) is not, and segments are spooled there before shipping",
                               self.config.feedback_url)
            return None
        from serving import feedback

        # rows keep the whole captured vector, so the fit flow may choose any recipe the capture covers
        writer = feedback.FeedbackWriter(self.config.feedback_dir, self.feature_dim, self.layer, self.model_id,
                                         self.fingerprint, recipe=str(self.recipe),
                                         max_rows=self.config.segment_max_rows,
                                         max_seconds=self.config.segment_max_seconds,
                                         # the admin port tells replicas on one host apart
                                         replica_id=feedback.default_replica_id(self.config.admin_port or None))
        self.metrics_registry.register(feedback.FeedbackCollector(writer))
        self.telemetry.watch_thread("feedback", lambda: bool(self.recorder.writer_health().get("alive")))
        from serving.shipper import start_shipper

        self.shipper = start_shipper(self.config, writer, self.telemetry)
        return writer

    def _make_policy(self) -> DecodePolicy:
        c = self.config
        return make_policy(c.decode_order, k=c.decode_slots, waiting_cap=c.waiting_cap, aging=c.aging)

    def _make_refresher(self) -> Refresher | None:
        """The refresh readout when both refresh settings are given and it fits; else None (logged why)."""
        c = self.config
        if not c.refresh_configured:
            if c.refresh_at or c.refresh_readout_path:
                self.refresh_error = "refresh needs both refresh_at and refresh_readout_path"
                logger.warning("LEAP refresh is off: %s", self.refresh_error)
            return None
        try:
            readout = load_refresh_readout(c.refresh_readout_path, self._expect(), self.capture)
        except RefreshReadoutError as exc:
            self.refresh_error = str(exc)
            logger.error("LEAP refresh is off, decodes keep the countdown: %s", exc)
            return None
        refresher = Refresher(readout, c.refresh_at, refresh_columns(readout, self.capture))
        logger.info("LEAP refreshes remaining lengths at %s generated tokens with readout %s",
                    list(refresher.checkpoints), refresher.version)
        return refresher

    # -- the parts, under the names other code uses ---------------------------------------------
    @property
    def readout(self) -> Any:
        return self.readouts.readout

    @property
    def version(self) -> str:
        return self.readouts.version

    @property
    def predictor(self) -> PredictorService:
        return self.readouts.predictor

    @property
    def learner(self) -> OnlineLearner:
        return self.readouts.learner

    @property
    def feedback(self) -> Any:
        """The `serving.feedback.FeedbackWriter`, or None when no feedback folder is configured."""
        return self.recorder.writer

    @property
    def listeners(self) -> list[Callable[[dict], None]]:
        return self.recorder.listeners

    @property
    def tracked(self) -> dict[str, Tracked]:
        return self.tracker.tracked

    @property
    def features(self) -> dict[str, np.ndarray]:
        return self.tracker.features

    @property
    def predictions(self) -> dict[str, float]:
        return self.tracker.predictions

    def _on_feature(self, request_id: str, feature: np.ndarray) -> None:
        """The receiver thread's hand-off: keep the feature and queue it for a prediction."""
        if self.tracker.add_feature(request_id, feature):
            self.readouts.submit(request_id, feature)

    def _on_features_in_step(self, request_ids: list[str], features: list[np.ndarray]) -> None:
        """A worker in this process hands over a step's features: keep them and predict them now."""
        kept = [(rid, f) for rid, f in zip(request_ids, features) if self.tracker.add_feature(rid, f)]
        if kept:
            self.readouts.predict_in_step([rid for rid, _ in kept], [f for _, f in kept])

    def _on_refresh(self, request_ids: list[str], generated: np.ndarray, states: list[np.ndarray]) -> None:
        """Decode states at a checkpoint (in the step, or from the receiver thread): refresh their totals."""
        refresher = self.refresher
        if refresher is None:  # the worker captured them, but this runtime refused the refresh readout
            self.telemetry.drop("refresh", "refresh_off", len(request_ids))
            return
        totals = refresher.predicted_totals(generated, np.stack(states))
        applied = self.tracker.refresh(request_ids, generated, totals)
        self.counters.refreshed += applied
        self.telemetry.refreshes.inc(applied)

    # -- scheduler hooks -----------------------------------------------------------------------
    def _predicted_total(self, request: Any, entry: Tracked, source: str) -> float:
        """The total length a request is ordered by: the latest refresh, where LEAP's own prediction is used."""
        if source == "oracle":
            value = entry.oracle
        elif source == "client" and entry.client_prediction is not None:
            value = entry.client_prediction
        elif entry.refreshed_total is not None:
            value = entry.refreshed_total
        else:
            value = self.tracker.predictions.get(request.request_id)
        return value if value is not None else float(request.max_tokens)

    @_engine_hook
    def before_schedule(self, running: list, current_step: int) -> None:
        """Hold out all but the chosen decode candidates for the coming `schedule()` call."""
        start = time.perf_counter()
        now = time.time()
        track, predictions = self.tracker.track, self.tracker.predictions
        candidates, entries, missing = [], [], []
        source = self.config.length_source
        needs_prediction = self.readout is not None and source in ("predicted", "client")
        for request in running:
            entry = track(request)
            if not vllm_compat.past_prefill(request):
                continue  # still in prefill: never held
            if not entry.decode_seen:
                entry.decode_seen = True
                entry.first_token_time = now
                if needs_prediction:
                    if request.request_id in predictions:
                        self.counters.ready += 1
                    else:
                        missing.append(request.request_id)
            candidates.append(request)
            entries.append(entry)
        if missing:
            self._wait_for_predictions(missing)
        n = len(candidates)
        self.telemetry.resident.set(len(running))
        self.telemetry.decoding.set(n)
        self.last_held = set()
        if n > self.config.decode_slots:
            predicted = np.fromiter((self._predicted_total(r, e, source) for r, e in zip(candidates, entries)),
                                    dtype=np.float64, count=n)
            generated = np.fromiter((r.num_output_tokens for r in candidates), dtype=np.float64, count=n)
            held_out = np.fromiter((e.held_out for e in entries), dtype=np.int64, count=n)
            arrival = np.fromiter((e.arrival for e in entries), dtype=np.float64, count=n)
            chosen = np.zeros(n, dtype=bool)
            chosen[self.policy.select(predicted, generated, held_out, arrival)] = True
            for request, keep in zip(candidates, chosen):
                if not keep:
                    vllm_compat.hold_out_next_step(request, current_step)
                    self.last_held.add(request.request_id)
        self.telemetry.held.set(len(self.last_held))
        self.counters.schedule_s += time.perf_counter() - start

    def _wait_for_predictions(self, missing: list[str]) -> None:
        """One bounded wait for all of this step's new decode candidates that have no prediction yet."""
        self.counters.missed += len(missing)
        self.telemetry.missed.inc(len(missing))
        timeout = self.config.ready_wait_ms / 1000.0
        if timeout <= 0 or not self.predictor.running:
            return
        start = time.perf_counter()
        self.tracker.wait_for(missing, timeout)
        waited = time.perf_counter() - start
        self.counters.waited_s += waited
        self.telemetry.wait_seconds.inc(waited)

    @_engine_hook
    def after_schedule(self, running: list, num_scheduled_tokens: dict[str, int]) -> None:
        """Count hold-outs from what the engine actually scheduled, and the step's shape."""
        decodes = sum(1 for tokens in num_scheduled_tokens.values() if tokens == 1)
        self.last_step_shape = (decodes, sum(num_scheduled_tokens.values()) - decodes)
        worst = self.counters.max_held_out
        tracked = self.tracker.tracked
        for request in running:
            entry = tracked.get(request.request_id)
            if entry is None or not entry.decode_seen:
                continue
            if request.request_id in num_scheduled_tokens:
                entry.held_out = 0
            else:
                entry.held_out += 1
                worst = max(worst, entry.held_out)
        if worst != self.counters.max_held_out:
            self.counters.max_held_out = worst
            self.telemetry.max_held.set(worst)
        self.counters.steps += 1
        self._settle_late_rows()
        self.telemetry.pending.set(self.predictor.pending())
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRE_EVERY_S
            self.tracker.expire()
            for kind, size in self.tracker.sizes().items():
                self.telemetry.tracked.labels(kind=kind).set(size)

    @_engine_hook
    def on_finished(self, request: Any) -> None:
        """Forget the request, write its feedback row once and hand (feature, true length) to RLS."""
        prefilled = request.num_output_tokens > 0
        # a prefilled request's feature was captured, but a worker in another process sends it over
        # ZeroMQ and it can land after the finish: then the row waits for it (settled every step)
        entry, feature, predicted, version, awaiting = self.tracker.finish(
            request.request_id, LATE_FEATURE_S if prefilled else None)
        if entry is None and (feature is not None or prefilled):
            entry = self.tracker.entry_of_unseen(request)  # finished in the step that prefilled it
        context = (request, entry, predicted, version or self.version, self.config.policy)
        if awaiting:
            self._late_rows[request.request_id] = context
            return
        self._finish_row(context, feature)

    def _finish_row(self, context: tuple, feature: np.ndarray | None) -> None:
        request, entry, predicted, version, policy = context
        output_tokens = int(request.num_output_tokens)
        if feature is not None and output_tokens > 0 and vllm_compat.finish_reason(request) in TRAINING_FINISH_REASONS:
            self.readouts.observe(feature, output_tokens)
        if feature is None and output_tokens > 0:
            self.telemetry.drop("feedback_row", "feature_never_arrived")
        self.recorder.record(request, entry, feature, predicted, version, policy)

    def _settle_late_rows(self, final: bool = False) -> None:
        for request_id, feature in self.tracker.settle(final):
            self._finish_row(self._late_rows.pop(request_id), feature)

    # -- control, between replays and from the admin API ----------------------------------------
    def configure(self, policy: str | None = None, rls: bool | None = None, decode_slots: int | None = None,
                  waiting_cap: int | None = None) -> None:
        """Switch policy, online learning or the decode shape between replays (no request in flight)."""
        if policy is not None:
            self.config.policy = policy  # validated: an unknown name raises and changes nothing
        if decode_slots is not None:
            self.config.decode_slots = decode_slots
        if waiting_cap is not None:
            self.config.waiting_cap = waiting_cap
        self.policy = self._make_policy()
        if rls is not None:
            self.config.rls = rls
        self.counters = Counters()
        self.telemetry.max_held.set(0)

    def serve_predictor(self, predictor: Any, version: str) -> None:
        """Serve any object with `predict(X) -> lengths` on the captured features, without RLS.

        For evaluation heads that are not linear readouts (an MLP on the hidden state); it runs on the
        same predictor thread, so its cost lands where LEAP's does. `version` also becomes a policy
        name (`configure(policy=version)`), so feedback rows say which head ordered the requests.
        """
        register_predictor_policy(version)
        self.readouts.serve_predictor(predictor, version)

    def reset_readout(self, readout: LinearReadout | None, rls_state: dict[str, np.ndarray] | None) -> None:
        """Serve `readout` (validated like a push) with its RLS anchor; None serves no readout."""
        if readout is None:
            self.readouts.clear()
            return
        self.push_readout(make_bundle(to_bytes(readout), rls_state))

    def push_readout(self, body: bytes) -> dict:
        """Validate and hot-swap a pushed readout; raise PushRefused and keep the old one otherwise."""
        return self.readouts.push(body)

    def rls_state(self) -> tuple[bytes, dict]:
        """The RLS state learned since the last anchor, as a bundle, and what it is (GET /leap/rls)."""
        return self.readouts.rls_bundle()

    def flush_feedback(self) -> dict:
        """Close the open feedback segment (as Parquet) so everything finished so far can be ingested
        (shipped to the bucket first, when feedback_url is set)."""
        report = self.recorder.flush()
        if self.shipper is not None:
            report["shipper"] = self.shipper.ship(deadline_s=30.0)
        return report

    # -- reporting -----------------------------------------------------------------------------
    def describe(self) -> dict:
        readout = self.readout
        meta = dict(getattr(readout, "metadata", {}) or {})
        return {
            "version": self.version, "policy": self.config.policy, "layer": self.layer, "dim": self.dim,
            "recipe": str(self.recipe), "feature_dim": self.feature_dim, "readout_recipe": self.readouts.recipe,
            "model_id": self.model_id, "model_fingerprint": self.fingerprint,
            "target": getattr(readout, "target", None), "max_tokens": getattr(readout, "max_tokens", None),
            "readout": {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))},
            **self.readouts.describe(), "rls": self.learner.stats(), "refresh": self.describe_refresh(),
            "stats": self.stats(), "healthy": self.health()["healthy"],
        }

    def describe_refresh(self) -> dict:
        """Whether refresh serves, at which generated counts, with which readout, or why it does not."""
        refresher = self.refresher
        return {"active": refresher is not None, "at": list(self.config.refresh_at),
                "version": refresher.version if refresher is not None else None, "error": self.refresh_error,
                "refreshed": self.counters.refreshed}

    def health(self) -> dict:
        """Liveness of every LEAP thread, and what LEAP dropped; `healthy` is False if a thread is down.

        The predictor and RLS threads run from start to close, readout or not; the feedback writer is
        judged by its own `healthy()`.
        """
        feedback = self.recorder.writer_health()
        threads = {"receiver": self.receiver.stats(), "predictor": self.predictor.stats(),
                   "rls": self.learner.health(), "feedback": feedback}
        healthy = (threads["receiver"]["alive"] and threads["predictor"]["alive"] and threads["rls"]["alive"]
                   and (not feedback["enabled"] or feedback["healthy"]))
        if self.shipper is not None:
            threads["feedback_shipper"] = self.shipper.stats()
            healthy = healthy and threads["feedback_shipper"]["healthy"]
        counters = {**self.telemetry.snapshot(), "state": self.tracker.sizes()}
        return {"healthy": bool(healthy), "threads": threads, "counters": counters}

    def stats(self) -> dict:
        c = self.counters
        seen = c.ready + c.missed
        return {"ready_before_decode": (c.ready / seen) if seen else None, "ready": c.ready,
                "missed": c.missed, "waited_s": c.waited_s, "max_steps_held_out": c.max_held_out,
                "finished": self.recorder.finished, "feedback_rows": self.recorder.rows, "steps": c.steps,
                "schedule_overhead_s": c.schedule_s, "predicted": self.predictor.predicted,
                "refreshed": c.refreshed, "resident": len(self.tracker.tracked), "recipe": str(self.recipe),
                "readout_recipe": self.readouts.recipe}

    def close(self) -> None:
        """Stop taking pushes first, then features, then predictions and learning; feedback last."""
        if self.admin is not None:
            self.admin.close()
        self.receiver.close()
        self._settle_late_rows(final=True)
        self.readouts.close()
        self.recorder.close()
        if self.shipper is not None:
            self.shipper.close()


def _model_identity(model: str) -> tuple[str, str]:
    """(model id, weights fingerprint) of the served model; the fingerprint only for a local folder."""
    if Path(model).is_dir():
        from leap_io.model_identity import describe_model

        info = describe_model(model)
        return info.model_id, info.fingerprint
    return model, ""
