"""Everything LEAP runs beside one engine's scheduler, composed from parts that each own one thing.

`LeapRuntime` wires the per-request state (`serving.tracking`), the serving readout and its threads
(`serving.readout.service`, `serving.readout.sources`, `CaptureSpace` in `serving.readout.push`), the
captured features (`serving.capture.receiver`), feedback rows (`serving.feedback.recorder`), the decode
choice (`serving.decode_steps`) and telemetry (`serving.telemetry`). It holds the three scheduler hooks:
`before_schedule` chooses who decodes, `after_schedule` counts who ran, `on_finished` writes feedback and
feeds RLS. The engine thread never blocks on another thread except in one bounded place (`DecodeSteps`).
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_io.push_bundle import make_bundle
from leap_io.redact import redact_url
from serving import vllm_compat
from serving.capture.receiver import CaptureReceiver
from serving.config import LeapConfig, channel_address, leap_config_from_vllm
from serving.decode_steps import DecodeSteps
from serving.fcfs_fallback import FcfsFallback
from serving.feedback.finished import FinishedRequests
from serving.feedback.recorder import FeedbackRecorder
from serving.readout.push import CaptureSpace
from serving.readout.service import ReadoutService
from serving.readout.shadow import ShadowReadout
from serving.readout.sources import ReadoutSources, RegistrySourceFactory
from serving.supervise import RateLimitedLog, SupervisedThread
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker

logger = logging.getLogger(__name__)

_hook_warnings = RateLimitedLog(logger)
IDLE_SETTLE_EVERY_S = 0.5  # how often rows waiting for a late feature are settled while no step runs


def _engine_hook(method):
    """A scheduler hook that never raises into vLLM: a LEAP bug costs one step's ordering or one
    request's feedback row (counted as `leap:thread_errors_total{thread="scheduler"}`), not engine-core."""

    @functools.wraps(method)
    def hook(self, *args, **kwargs):
        try:
            with self._engine_lock:
                return method(self, *args, **kwargs)
        except Exception:
            self.telemetry.thread_error("scheduler")
            _hook_warnings.warning(method.__name__, "LEAP %s failed; the engine goes on", method.__name__,
                                   exc_info=True)
            return None

    return hook


class LeapRuntime:
    """LEAP's state for one engine, created by the scheduler subclass.

    `registry_source` opens the registry whose champion serves at start when nothing else does
    (`serving.readout.sources`); None: the installed `leap.readout_sources` entry point.
    """

    def __init__(self, vllm_config: Any, config: LeapConfig | None = None,
                 registry_source: RegistrySourceFactory | None = None) -> None:
        self.config = config or leap_config_from_vllm(vllm_config)
        self.dim, self.num_layers, model, self.max_tokens_default = vllm_compat.served_model_shape(vllm_config)
        self.model_id, self.fingerprint = _model_identity(model)
        # imported here: serving.worker imports vLLM's platform, which module import must not
        from serving.worker import capture_layer, readout_side_recipe, serving_recipe

        self.recipe = serving_recipe(vllm_config, self.num_layers)
        self.layer = capture_layer(vllm_config, self.num_layers)
        self.capture = CaptureSpace(self.recipe, self.dim, self.num_layers,
                                    default=readout_side_recipe(self.config, self.num_layers))

        self._engine_lock = threading.RLock()  # the scheduler hooks and the idle settle, one at a time
        self.telemetry = Telemetry()
        self.metrics_registry = self.telemetry.registry
        self.tracker = RequestTracker(self.telemetry, finished_memory=self.config.finished_memory,
                                      orphan_ttl_s=self.config.orphan_ttl_s)
        self.readouts = ReadoutService(self.config, self._expect(), self.tracker, self.telemetry, self.capture)
        self.fallback = FcfsFallback(self.telemetry, self.config.fcfs_below_spearman, self.config.fcfs_min_rows)
        if self.readouts.state is not None and (left_on := self.readouts.state.kill_switch()) is not None:
            self.fallback.engage(f"kept across a restart: {left_on}")
        self.shadow = ShadowReadout(self._expect(), self.capture, self.telemetry)
        self.recorder = FeedbackRecorder(self._feedback_writer(), self.model_id, self.fingerprint, self.layer,
                                         self.telemetry, anchor=self.readouts.anchor_prediction,
                                         tenant_max_share=self.config.rls_tenant_max_share, fallback=self.fallback,
                                         shadow=self.shadow)
        self.finished = FinishedRequests(self.config, self.tracker, self.readouts, self.recorder, self.telemetry,
                                         vllm_compat.model_stop_ids(vllm_config))
        self.steps = DecodeSteps(self.config, self.tracker, self.telemetry, self.readouts, self.fallback)
        self.readouts.start()
        self.sources = ReadoutSources(self.readouts, self.telemetry, self.model_id, self.layer,
                                      registry_source).start()
        self.champion_watch = None  # the published champion beside the served version, for /metrics
        if self.config.champion_url:
            from serving.readout.champion_watch import ChampionWatch

            self.champion_watch = ChampionWatch(self.config.champion_url, self.sources.model_name,
                                                lambda: self.readouts.version, self.telemetry,
                                                self.config.champion_public_key).start()
        # an idle engine runs no step, so the rows of its last requests are settled here while it idles
        self._idle_settle = SupervisedThread("leap-idle-settle", self._settle_while_idle,
                                             on_error=lambda _exc: self.telemetry.thread_error("idle_settle"))
        self._idle_settle.start()
        self.receiver = CaptureReceiver(channel_address(vllm_config, self.config), (self.recipe.dim(self.dim),),
                                        self._on_feature, self.telemetry,
                                        deliver_batch=self._on_features_in_step).start()
        self.admin = None
        if self.config.admin_port is not None:
            from serving.admin.api import AdminRefusalCollector, AdminServer

            self.admin = AdminServer(self, self.config.admin_host, self.config.admin_port, self.config.token())
            self.metrics_registry.register(AdminRefusalCollector(self.admin))
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
        self.shipper = None  # serving.feedback.shipper.FeedbackShipper when feedback_url is set
        if not self.config.feedback_dir:
            # segments are written locally first (the crash-safe spool), then shipped: no folder, no feedback.
            # Not an error: engines that write none (the gate's, a replay's) read the fleet's LEAP_FEEDBACK_URL too
            if self.config.feedback_url:
                logger.warning("LEAP writes no feedback: feedback_url %s is set but feedback_dir "
                               "(LEAP_FEEDBACK_DIR) is not, and segments are spooled there before shipping",
                               redact_url(self.config.feedback_url))
            return None
        from serving.feedback.segments import default_replica_id
        from serving.feedback.writer import FeedbackCollector, FeedbackWriter

        # rows keep the whole captured vector, so the fit flow may choose any recipe the capture covers
        writer = FeedbackWriter(self.config.feedback_dir, self.feature_dim, self.layer, self.model_id,
                                self.fingerprint, recipe=str(self.recipe), max_rows=self.config.segment_max_rows,
                                max_seconds=self.config.segment_max_seconds,
                                # the admin port tells replicas on one host apart
                                replica_id=default_replica_id(self.config.admin_port or None))
        self.metrics_registry.register(FeedbackCollector(writer))
        self.telemetry.watch_thread("feedback", lambda: bool(self.recorder.writer_health().get("alive")))
        from serving.feedback.shipper import start_shipper

        self.shipper = start_shipper(self.config, writer, self.telemetry)
        return writer

    def _on_feature(self, request_id: str, feature: np.ndarray) -> None:
        """The receiver thread's hand-off: keep the feature and queue it for a prediction."""
        if self.tracker.add_feature(request_id, feature):
            self.readouts.submit(request_id, feature)

    def _on_features_in_step(self, request_ids: list[str], features: list[np.ndarray]) -> None:
        """A worker in this process hands over a step's features: keep them and predict them now."""
        kept = [(rid, f) for rid, f in zip(request_ids, features) if self.tracker.add_feature(rid, f)]
        if kept:
            self.readouts.predict_in_step([rid for rid, _ in kept], [f for _, f in kept])

    # -- scheduler hooks -----------------------------------------------------------------------
    @_engine_hook
    def before_schedule(self, running: list, current_step: int) -> None:
        """Hold out all but the chosen decode candidates for the coming `schedule()` call."""
        self.steps.choose(running, current_step)

    @_engine_hook
    def after_schedule(self, running: list, num_scheduled_tokens: dict[str, int]) -> None:
        """Count hold-outs from what the engine actually scheduled, write the feedback rows whose late
        features arrived, and prune the per-request state."""
        self.steps.count(running, num_scheduled_tokens)
        self.finished.settle()
        self.steps.tidy()

    def _settle_while_idle(self) -> None:
        while not self._idle_settle.stopping.wait(IDLE_SETTLE_EVERY_S):
            self.settle_idle()

    @_engine_hook
    def settle_idle(self) -> None:
        """Write the feedback rows whose late feature arrived or whose wait is over, between engine steps."""
        self.finished.settle()

    @_engine_hook
    def on_finished(self, request: Any) -> None:
        """Forget the request, write its feedback row once and hand (feature, true length) to RLS."""
        self.finished.finish(request)

    # -- control, between replays and from the admin API ----------------------------------------
    def configure(self, policy: str | None = None, rls: bool | None = None, decode_slots: int | None = None,
                  waiting_cap: int | None = None, order: str | None = None) -> None:
        """Switch policy, decode order, online learning or the decode shape between replays (no request
        in flight)."""
        if policy is not None:
            self.config.policy = policy  # validated: an unknown name raises and changes nothing
        if order is not None:
            self.config.order = order
        if decode_slots is not None:
            self.config.decode_slots = decode_slots
        if waiting_cap is not None:
            self.config.waiting_cap = waiting_cap
        if rls is not None:
            self.config.rls = rls
        self.fallback.release()  # a replay's policy is the one it asks for
        self.steps.reset()

    def serve_predictor(self, predictor: Any, version: str) -> None:
        """Serve any object with `predict(X) -> lengths` on the captured features, without RLS.

        For evaluation heads that are not linear readouts (an MLP on the hidden state), under the "leap"
        policy; it runs on the same predictor thread, so its cost lands where LEAP's does. `version` names
        the head in the feedback rows.
        """
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

    def hold_shadow(self, body: bytes) -> dict:
        """Hold a pushed readout in shadow (POST /leap/shadow): predicted beside the serving one, never
        scheduling; an empty body lets it go. PushRefused as for a push."""
        return self.shadow.hold(body)

    def set_fcfs(self, on: bool, reason: str = "") -> dict:
        """The kill switch (POST /leap/fcfs): order decodes FCFS from the next step, or by the policy again;
        kept in `state_dir`, when there is one, so a restart keeps it."""
        state = self.fallback.engage(reason) if on else self.fallback.release()
        if self.readouts.state is not None:
            try:
                self.readouts.state.save_kill_switch(on, reason)
                state["kept_across_restart"] = True
            except OSError as exc:  # switched all the same; the answer says a restart would lose it
                logger.error("LEAP: the kill switch could not be kept in %s: %s", self.readouts.state.folder, exc)
                state["kept_across_restart"] = False
        return state

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
        readout = self.readouts.readout
        meta = dict(getattr(readout, "metadata", {}) or {})
        return {
            "version": self.readouts.version, "policy": self.config.policy, "layer": self.layer, "dim": self.dim,
            "recipe": str(self.recipe), "feature_dim": self.feature_dim, "readout_recipe": self.readouts.recipe,
            "model_id": self.model_id, "model_fingerprint": self.fingerprint,
            "target": getattr(readout, "target", None), "max_tokens": getattr(readout, "max_tokens", None),
            "readout": {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))},
            **self.readouts.describe(), **self.sources.describe(), "rls": self.readouts.learner.stats(),
            "shadow": self.shadow.describe(), "stats": self.stats(), "healthy": self.health()["healthy"],
            "decode_order": self.steps.describe_order(),
        }

    def health(self) -> dict:
        """Liveness of every LEAP thread, and what LEAP dropped; `healthy` is False if a thread is down.

        The predictor and RLS threads run from start to close, readout or not; the feedback writer is
        judged by its own `healthy()`.
        """
        feedback = self.recorder.writer_health()
        threads = {"receiver": self.receiver.stats(), "predictor": self.readouts.predictor.stats(),
                   "rls": self.readouts.learner.health(), "feedback": feedback,
                   "idle_settle": self._idle_settle.stats()}
        healthy = (threads["receiver"]["alive"] and threads["predictor"]["alive"] and threads["rls"]["alive"]
                   and threads["idle_settle"]["alive"]
                   and (not feedback["enabled"] or feedback["healthy"]))
        if self.shipper is not None:
            threads["feedback_shipper"] = self.shipper.stats()
            healthy = healthy and threads["feedback_shipper"]["healthy"]
        counters = {**self.telemetry.snapshot(), "state": self.tracker.sizes()}
        readout = {"version": self.readouts.version, "source": self.readouts.source,
                   "recipe": self.readouts.recipe, "capture_recipe": str(self.recipe), "layer": self.layer}
        return {"healthy": bool(healthy), "readout": readout, "threads": threads, "counters": counters,
                "fcfs_fallback": self.fallback.state(), "decode_order": self.steps.describe_order(),
                "shadow": self.shadow.describe()}

    def stats(self) -> dict:
        c = self.steps.counters
        seen = c.ready + c.missed
        return {"ready_before_decode": (c.ready / seen) if seen else None, "ready": c.ready,
                "missed": c.missed, "waited_s": c.waited_s, "max_steps_held_out": c.max_held_out,
                "finished": self.recorder.finished, "feedback_rows": self.recorder.rows, "steps": c.steps,
                "schedule_overhead_s": c.schedule_s, "predicted": self.readouts.predictor.predicted,
                "resident": len(self.tracker.tracked), "recipe": str(self.recipe),
                "held_steps": c.held_steps, "held": c.held, "decode_slots": self.steps.describe_slots(),
                "readout_recipe": self.readouts.recipe}

    def close(self) -> None:
        """Stop taking pushes first, then features, then predictions and learning; feedback last."""
        if self.admin is not None:
            self.admin.close()
        if self.champion_watch is not None:
            self.champion_watch.close()
        self._idle_settle.stop()
        self.receiver.close()
        self.finished.settle(final=True)
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
