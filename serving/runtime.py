"""Everything LEAP runs beside one engine's scheduler: capture receiver, predictor, RLS, feedback, admin.

The scheduler subclass stays small by delegating here: `before_schedule` chooses which resident requests
decode this step, `after_schedule` counts who actually ran, `on_finished` writes feedback and feeds RLS.
Threads: the capture receiver (features from the workers), the predictor service, the RLS learner, the
feedback writer and the admin server; the scheduler thread only reads their latest results.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from leap_core.metrics import mae, spearman
from leap_core.policy import CountdownPolicy, FcfsPolicy
from leap_core.readout import LinearReadout
from leap_core.readout_format import from_bytes
from leap_core.rls import RLS
from serving.admin import AdminServer
from serving.config import LeapConfig, channel_address, leap_config_from_vllm
from serving.feedback import FeedbackWriter
from serving.predictor import PredictorService
from leap_io.push_bundle import make_bundle
from serving.push import validate_push

logger = logging.getLogger(__name__)

_SUFFIX_LEN = 9  # vLLM appends "-" and 8 random characters to the client's request id
_DECODING_KEYS = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "ignore_eos", "seed")


def external_id(request: Any) -> str:
    extra = _extra_args(request)
    if extra.get("leap_request_id"):
        return str(extra["leap_request_id"])
    rid = request.request_id
    if len(rid) > _SUFFIX_LEN and rid[-_SUFFIX_LEN] == "-":
        return rid[:-_SUFFIX_LEN]
    return rid


def _extra_args(request: Any) -> dict:
    params = getattr(request, "sampling_params", None)
    return (getattr(params, "extra_args", None) or {}) if params is not None else {}


@dataclass
class Tracked:
    """What LEAP remembers about one resident request."""

    arrival: float
    held_out: int = 0
    first_token_time: float | None = None
    decode_seen: bool = False
    predicted_at_admission: float | None = None
    oracle: float | None = None
    client_prediction: float | None = None


@dataclass
class Counters:
    ready: int = 0
    missed: int = 0
    waited_s: float = 0.0
    max_held_out: int = 0
    finished: int = 0
    feedback_rows: int = 0
    steps: int = 0
    schedule_s: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))


class LeapRuntime:
    """LEAP's state for one engine, created by the scheduler subclass."""

    def __init__(self, vllm_config: Any, config: LeapConfig | None = None) -> None:
        self.config = config or leap_config_from_vllm(vllm_config)
        hf = vllm_config.model_config.hf_text_config
        self.dim = int(hf.hidden_size)
        self.num_layers = int(hf.num_hidden_layers)
        self.model_id, self.fingerprint = _model_identity(vllm_config)
        from serving.worker import capture_layer  # vLLM platform import stays out of module import

        self.layer = capture_layer(vllm_config, self.num_layers)
        self.max_tokens_default = int(vllm_config.model_config.max_model_len)
        self.counters = Counters()
        self.tracked: dict[str, Tracked] = {}
        self.features: dict[str, np.ndarray] = {}
        self.predictions: dict[str, float] = {}
        self.prediction_version: dict[str, str] = {}
        self._swap_lock = threading.Lock()
        self.listeners: list[Callable[[dict], None]] = []
        self.last_held: set[str] = set()
        self.last_step_shape: tuple[int, int] = (0, 0)  # (decoded requests, prefill tokens) of the last step
        self._init_metrics()

        self.readout: LinearReadout | None = None
        rls = None
        if self.config.readout_path:
            self.readout = from_bytes(Path(self.config.readout_path).read_bytes(), expect=self._expect())
            if self.config.rls_state_path and Path(self.config.rls_state_path).is_file():
                with np.load(self.config.rls_state_path) as npz:
                    rls = self._rls_from_state(self.readout, {k: npz[k] for k in npz.files})
        self.policy = self._make_policy()
        self.predictor = PredictorService(self.readout or _NoReadout(), self._on_predictions)
        if self.readout is not None:
            self.predictor.start()
        from serving.online import OnlineLearner

        self.learner = OnlineLearner(rls if self.config.rls else None, self.version, self._publish,
                                     every=self.config.rls_every)
        self.feedback = None
        if self.config.feedback_dir:
            self.feedback = FeedbackWriter(self.config.feedback_dir, self.dim, self.layer, self.model_id,
                                           self.fingerprint, max_rows=self.config.segment_max_rows,
                                           max_seconds=self.config.segment_max_seconds)
        self._receiver_stop = threading.Event()
        self._address = channel_address(vllm_config, self.config)
        self._receiver = threading.Thread(target=self._receive, name="leap-capture-receiver", daemon=True)
        self._receiver_ready = threading.Event()
        self._receiver.start()
        self._receiver_ready.wait(5)
        self.admin = None
        if self.config.admin_port is not None:
            self.admin = AdminServer(self, self.config.admin_host, self.config.admin_port, self.config.token())
            logger.info("LEAP admin API on http://%s:%d", self.admin.host, self.admin.port)
        self._readout_info.info({"version": self.version})

    # -- set-up --------------------------------------------------------------------------------
    def _expect(self) -> dict:
        expect = {"layer": self.layer, "dim": self.dim}
        if self.fingerprint:
            expect["model_fingerprint"] = self.fingerprint
        return expect

    def _make_policy(self) -> CountdownPolicy | FcfsPolicy:
        c = self.config
        if c.policy == "fcfs":
            return FcfsPolicy(k=c.decode_slots)
        return CountdownPolicy(k=c.decode_slots, waiting_cap=c.waiting_cap, aging=c.aging)

    def _rls_from_state(self, readout: LinearReadout, state: dict[str, np.ndarray]) -> RLS:
        rls = RLS.from_state_arrays(readout, state)
        if self.config.rls_forgetting != 1.0:
            rls.forgetting = self.config.rls_forgetting
        return rls

    def _init_metrics(self) -> None:
        r = self.metrics_registry = CollectorRegistry()
        self._m_predictions = Counter("leap_predictions", "Length predictions made", registry=r)
        self._m_ready = Counter("leap_prediction_ready", "Requests whose prediction was ready before decode",
                                registry=r)
        self._m_missed = Counter("leap_prediction_missed",
                                 "Requests that reached decode before their prediction", registry=r)
        self._m_finished = Counter("leap_finished_requests", "Finished requests seen", registry=r)
        self._m_rls = Gauge("leap_rls_updates", "RLS batch updates since the last anchor", registry=r)
        self._m_spearman = Gauge("leap_rolling_spearman", "Spearman of prediction vs length, last 256",
                                 registry=r)
        self._m_mae = Gauge("leap_rolling_mae", "MAE in tokens, last 256 finished requests", registry=r)
        self._m_resident = Gauge("leap_resident_requests", "Resident (running) requests", registry=r)
        self._m_decoding = Gauge("leap_decode_candidates", "Resident requests past prefill", registry=r)
        self._m_held = Gauge("leap_held_out_requests", "Requests held out this step", registry=r)
        self._m_max_held = Gauge("leap_max_steps_held_out", "Longest hold-out seen", registry=r)
        self._m_pending = Gauge("leap_predictor_queue", "Features waiting for a prediction", registry=r)
        self._readout_info = Info("leap_readout", "The readout serving now", registry=r)

    # -- the version that serves -------------------------------------------------------------------
    @property
    def version(self) -> str:
        if self.readout is None:
            return ""
        return str(self.readout.metadata.get("version", ""))

    def _publish(self, readout: LinearReadout) -> None:
        """Serve `readout` from now on and rescore the live requests from their cached features."""
        with self._swap_lock:
            self.readout = readout
            self.predictor.publish(readout)
            if not self.predictor.running:
                self.predictor.start()
            live = [rid for rid in self.features if rid in self.tracked]
            if live:
                values = readout.predict(np.stack([self.serving_slice(self.features[rid]) for rid in live]))
                version = str(readout.metadata.get("version", ""))
                for rid, value in zip(live, values):
                    self.predictions[rid] = float(value)
                    self.prediction_version[rid] = version
        self._m_rls.set(self.learner.updates if hasattr(self, "learner") else 0)
        self._readout_info.info({"version": self.version})

    # -- threads -------------------------------------------------------------------------------
    def _receive(self) -> None:
        socket = zmq.Context.instance().socket(zmq.PULL)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.bind(self._address)
        self._receiver_ready.set()
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._receiver_stop.is_set():
                if not poller.poll(100):
                    continue
                while True:
                    try:
                        rid, payload = socket.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    request_id = rid.decode()
                    feature = np.frombuffer(payload, dtype=np.float32)
                    self.features[request_id] = feature
                    if self.readout is not None:
                        self.predictor.submit(request_id, self.serving_slice(feature))
        finally:
            socket.close(linger=0)

    def serving_slice(self, feature: np.ndarray) -> np.ndarray:
        """The layer-L part of a captured vector (all of it unless every layer is captured)."""
        if feature.shape[0] == self.dim:
            return feature
        return feature[self.layer * self.dim:(self.layer + 1) * self.dim]

    def _on_predictions(self, ids, values, version, enqueued) -> None:
        predictions, versions, tracked = self.predictions, self.prediction_version, self.tracked
        for rid, value in zip(ids, values):
            predictions[rid] = float(value)
            versions[rid] = version
            entry = tracked.get(rid)
            if entry is not None and entry.predicted_at_admission is None:
                entry.predicted_at_admission = float(value)
        self._m_predictions.inc(len(ids))

    # -- scheduler hooks -----------------------------------------------------------------------
    def _track(self, request: Any) -> Tracked:
        entry = self.tracked.get(request.request_id)
        if entry is None:
            extra = _extra_args(request)
            entry = Tracked(arrival=float(request.arrival_time))
            oracle = extra.get("leap_oracle_length")
            entry.oracle = float(oracle) if oracle is not None else None
            client = extra.get("leap_predicted_length")
            entry.client_prediction = float(client) if client is not None else None
            self.tracked[request.request_id] = entry
        return entry

    def _wait_for_prediction(self, request_id: str) -> bool:
        deadline = time.perf_counter() + self.config.ready_wait_ms / 1000.0
        start = time.perf_counter()
        while request_id not in self.predictions and time.perf_counter() < deadline:
            time.sleep(0.0002)
        self.counters.waited_s += time.perf_counter() - start
        return request_id in self.predictions

    def _predicted_total(self, request: Any, entry: Tracked) -> float:
        policy = self.config.policy
        if policy == "oracle":
            if entry.oracle is not None:
                return entry.oracle
            return float(request.max_tokens)
        if policy == "client" and entry.client_prediction is not None:
            return entry.client_prediction
        value = self.predictions.get(request.request_id)
        return value if value is not None else float(request.max_tokens)

    def before_schedule(self, running: list, current_step: int) -> None:
        """Hold out all but the chosen decode candidates for the coming `schedule()` call."""
        start = time.perf_counter()
        now = time.time()
        candidates, entries = [], []
        needs_prediction = self.readout is not None
        for request in running:
            entry = self._track(request)
            if request.num_output_tokens == 0 or request.num_computed_tokens < request.num_prompt_tokens:
                continue  # still in prefill: never held
            if entry.first_token_time is None:
                entry.first_token_time = now
            if not entry.decode_seen:
                entry.decode_seen = True
                if needs_prediction:
                    if request.request_id in self.predictions:
                        self.counters.ready += 1
                        self._m_ready.inc()
                    else:
                        self.counters.missed += 1
                        self._m_missed.inc()
                        self._wait_for_prediction(request.request_id)
            candidates.append(request)
            entries.append(entry)
        n = len(candidates)
        self._m_resident.set(len(running))
        self._m_decoding.set(n)
        held = 0
        self.last_held: set[str] = set()
        if n > self.config.decode_slots:
            predicted = np.fromiter((self._predicted_total(r, e) for r, e in zip(candidates, entries)),
                                    dtype=np.float64, count=n)
            generated = np.fromiter((r.num_output_tokens for r in candidates), dtype=np.float64, count=n)
            held_out = np.fromiter((e.held_out for e in entries), dtype=np.int64, count=n)
            arrival = np.fromiter((e.arrival for e in entries), dtype=np.float64, count=n)
            chosen = np.zeros(n, dtype=bool)
            chosen[self.policy.select(predicted, generated, held_out, arrival)] = True
            hold_until = current_step + 2  # schedule() increments current_step before its check
            for request, keep in zip(candidates, chosen):
                if not keep:
                    request.next_decode_eligible_step = hold_until
                    self.last_held.add(request.request_id)
                    held += 1
        self._m_held.set(held)
        self.counters.schedule_s += time.perf_counter() - start

    def after_schedule(self, running: list, num_scheduled_tokens: dict[str, int]) -> None:
        """Count hold-outs from what the engine actually scheduled, and the step's shape."""
        decodes = sum(1 for tokens in num_scheduled_tokens.values() if tokens == 1)
        self.last_step_shape = (decodes, sum(num_scheduled_tokens.values()) - decodes)
        worst = self.counters.max_held_out
        for request in running:
            entry = self.tracked.get(request.request_id)
            if entry is None or not entry.decode_seen:
                continue
            if request.request_id in num_scheduled_tokens:
                entry.held_out = 0
            else:
                entry.held_out += 1
                if entry.held_out > worst:
                    worst = entry.held_out
        if worst != self.counters.max_held_out:
            self.counters.max_held_out = worst
            self._m_max_held.set(worst)
        self.counters.steps += 1
        self._m_pending.set(self.predictor.pending())

    def on_finished(self, request: Any) -> None:
        """Write the request's feedback row once and hand (feature, true length) to RLS."""
        rid = request.request_id
        entry = self.tracked.pop(rid, None)
        feature = self.features.pop(rid, None)
        predicted = self.predictions.pop(rid, None)
        version = self.prediction_version.pop(rid, "")
        output_tokens = int(request.num_output_tokens)
        reason = request.get_finished_reason()
        reason_name = reason.name.lower() if reason is not None else "abort"
        self.counters.finished += 1
        self._m_finished.inc()
        if entry is not None and predicted is not None and output_tokens > 0:
            self.counters.recent.append((predicted, output_tokens))
            if self.counters.finished % 16 == 0 and len(self.counters.recent) >= 16:
                pairs = np.asarray(self.counters.recent)
                self._m_spearman.set(spearman(pairs[:, 1], pairs[:, 0]))
                self._m_mae.set(mae(pairs[:, 1], pairs[:, 0]))
        if feature is not None and output_tokens > 0 and reason_name != "abort":
            self.learner.observe(self.serving_slice(feature), output_tokens)
        if feature is not None and entry is not None and (self.feedback is not None or self.listeners):
            row = self._feedback_row(request, entry, feature, output_tokens, reason_name, predicted, version)
            if self.feedback is not None:
                self.feedback.write(row)
                self.counters.feedback_rows += 1
            for listener in self.listeners:
                listener(row)

    def _feedback_row(self, request, entry: Tracked, feature, output_tokens, reason, predicted, version):
        params = request.sampling_params
        extra = _extra_args(request)
        decoding = {k: getattr(params, k, None) for k in _DECODING_KEYS} if params is not None else {}
        arrival = float(extra.get("leap_planned_arrival", entry.arrival))
        return {
            "request_id": external_id(request), "model_id": self.model_id,
            "model_fingerprint": self.fingerprint, "layer": self.layer, "policy": self.config.policy,
            "arrival_time": arrival, "first_token_time": entry.first_token_time,
            "finish_time": time.time(), "prompt_tokens": int(request.num_prompt_tokens),
            "output_tokens": output_tokens, "finish_reason": reason,
            "max_tokens": int(request.max_tokens), "decoding": json.dumps(decoding, default=str),
            "domain": extra.get("leap_domain"), "tenant": extra.get("leap_tenant"),
            "predicted_at_admission": entry.predicted_at_admission, "predicted_latest": predicted,
            "readout_version": version or self.version, "feature": feature,
        }

    def configure(self, policy: str | None = None, rls: bool | None = None) -> None:
        """Switch policy or online learning between replays on the same engine (no request in flight)."""
        if policy is not None:
            self.config.policy = policy
            self.policy = self._make_policy()
        if rls is not None:
            self.config.rls = rls
        self.counters = Counters()
        self._m_max_held.set(0)

    def serve_predictor(self, predictor: Any, version: str) -> None:
        """Serve any object with `predict(X) -> lengths` on the captured features, without RLS.

        For evaluation heads that are not linear readouts (an MLP on the hidden state); it runs on the
        same predictor thread, so its cost lands where LEAP's does.
        """
        self.learner.reanchor(None, version)
        self._publish(predictor)

    def reset_readout(self, readout: LinearReadout | None, rls_state: dict[str, np.ndarray] | None) -> None:
        """Serve `readout` (validated like a push) with its RLS anchor; None serves no readout."""
        if readout is None:
            self.readout = None
            self.learner.reanchor(None, "")
            return
        from leap_core.readout_format import to_bytes

        self.push_readout(make_bundle(to_bytes(readout), rls_state))

    # -- admin ---------------------------------------------------------------------------------
    def describe(self) -> dict:
        readout = self.readout
        meta = dict(readout.metadata) if readout is not None else {}
        return {
            "version": self.version, "policy": self.config.policy, "layer": self.layer, "dim": self.dim,
            "model_id": self.model_id, "model_fingerprint": self.fingerprint,
            "target": getattr(readout, "target", None), "max_tokens": getattr(readout, "max_tokens", None),
            "readout": {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool))},
            "rls": self.learner.stats(), "stats": self.stats(),
        }

    def push_readout(self, body: bytes) -> dict:
        """Validate and hot-swap a pushed readout; raise PushRefused and keep the old one otherwise."""
        readout, rls = validate_push(body, self._expect(), self.readout)
        if rls is not None and self.config.rls_forgetting != 1.0:
            rls.forgetting = self.config.rls_forgetting
        previous = self.version
        self.learner.reanchor(rls if self.config.rls else None, str(readout.metadata.get("version", "")))
        self._publish(readout)
        logger.info("LEAP readout %s replaced %s", self.version, previous)
        return {"version": self.version, "previous": previous, "rls": self.learner.stats()}

    def flush_feedback(self) -> dict:
        """Close the open feedback segment (as Parquet) so everything finished so far can be ingested."""
        if self.feedback is None:
            return {"flushed": False, "reason": "this process writes no feedback"}
        self.feedback.flush()
        return {"flushed": True, "rows_written": self.feedback.rows_written,
                "segments": self.feedback.segments_closed}

    def stats(self) -> dict:
        c = self.counters
        seen = c.ready + c.missed
        return {"ready_before_decode": (c.ready / seen) if seen else None, "ready": c.ready,
                "missed": c.missed, "waited_s": c.waited_s, "max_steps_held_out": c.max_held_out,
                "finished": c.finished, "feedback_rows": c.feedback_rows, "steps": c.steps,
                "schedule_overhead_s": c.schedule_s, "predicted": self.predictor.predicted,
                "resident": len(self.tracked)}

    def close(self) -> None:
        self._receiver_stop.set()
        self.predictor.stop()
        self.learner.close()
        if self.feedback is not None:
            self.feedback.close()
        if self.admin is not None:
            self.admin.close()


class _NoReadout:
    """Stands in before the first readout arrives: the predictor thread is not started then."""

    metadata: dict = {}

    def predict(self, X: np.ndarray) -> np.ndarray:
        raise RuntimeError("no readout is loaded")


def _model_identity(vllm_config: Any) -> tuple[str, str]:
    """(model id, weights fingerprint) of the served model; the fingerprint only for a local folder."""
    path = str(vllm_config.model_config.model)
    if Path(path).is_dir():
        from leap_io.model_identity import describe_model

        info = describe_model(path)
        return info.model_id, info.fingerprint
    return path, ""
