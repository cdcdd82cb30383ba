"""The readout that serves: its version, the threads that apply and correct it.

`ReadoutService` owns the predictor thread, the RLS learner and pushes (validated, served, persisted in
`serving.readout.saved_state`). Every change of readout goes through `_publish` under one lock, which
swaps the predictor's readout and rescores every live request, so requests admitted under the old readout
are ordered by the new one from the next step. A readout reads its recipe's columns of the captured
vector and is checked against the capture before it serves. A push, restore or reset starts a new anchor
generation, and stale RLS updates or background loads of an older generation are dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from leap_core.gittins import LengthGivenPrediction
from leap_core.readout import LinearReadout
from leap_core.readout_format import to_bytes
from leap_core.rls import RLS
from leap_io.push_bundle import make_bundle, open_bundle
from serving.config import LeapConfig
from serving.readout.online_rls import OnlineLearner
from serving.readout.predictor import PredictorService, Readout
from serving.readout.push import CaptureSpace, validate_push
from serving.readout.saved_state import ReadoutState
from serving.telemetry import Telemetry
from serving.tracking import RequestTracker

logger = logging.getLogger(__name__)


class OnColumns:
    """A readout applied to its columns of a captured vector: what the predictor thread is given."""

    def __init__(self, readout: Readout, columns: np.ndarray | None) -> None:
        self.readout = readout
        self.columns = columns
        self.metadata = readout.metadata

    def predict(self, X: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(X)
        return self.readout.predict(X if self.columns is None else X.take(self.columns, axis=1))


@dataclass(frozen=True)
class _Served:
    """What serves, swapped as one reference: the readout, its columns (None: the whole vector) and the
    anchor generation it belongs to, so the engine thread never pairs a readout with another's columns."""

    readout: Readout | None = None
    columns: np.ndarray | None = None
    generation: int = 0

    def select(self, features: np.ndarray) -> np.ndarray:
        """The columns of one vector or of rows of them, C-ordered (fancy indexing would give Fortran order,
        and another BLAS path rounds float32 products differently from a row's own prediction)."""
        return features if self.columns is None else np.take(features, self.columns, axis=-1)


class ReadoutService:
    """The serving readout of one runtime, its predictor thread and its RLS learner.

    Parameters
    ----------
    config : the runtime's settings (read live: `configure` may switch RLS between replays).
    expect : metadata a readout must record as given to serve here (the model fingerprint).
    tracker : the per-request state predictions are stored in and live features read from.
    telemetry : counts and the readout info metric.
    capture : what the captured vectors hold; None applies every readout to the whole vector unchecked.
    """

    def __init__(self, config: LeapConfig, expect: dict, tracker: RequestTracker, telemetry: Telemetry,
                 capture: CaptureSpace | None = None) -> None:
        self.config = config
        self.expect = dict(expect)
        self._tracker = tracker
        self._telemetry = telemetry
        self.capture = capture
        self._lock = threading.RLock()
        self._push_lock = threading.Lock()  # one push at a time: validate, serve, persist
        self._served = _Served()
        self._anchor = _Served()  # the readout as last pushed (restored, loaded), before RLS corrects it
        self.source = "none"
        self._generation = 0
        self.persisted_at: float | None = None
        self.state = ReadoutState(config.state_dir) if config.state_dir else None
        self.predictor = PredictorService(None, self._on_predictions, max_pending=config.queue_max,
                                          on_drop=lambda reason, n: telemetry.drop("prediction", reason, n))
        telemetry.watch_thread("predictor", lambda: self.predictor.running)
        self.learner = OnlineLearner(None, "", self.publish_learned, every=config.rls_every,
                                     max_queue=config.queue_max,
                                     on_drop=lambda reason, n: telemetry.drop("rls_row", reason, n),
                                     on_error=lambda: telemetry.thread_error("rls"))
        telemetry.watch_thread("rls", lambda: self.learner.alive)
        telemetry.set_readout("", "none")

    # -- what serves -------------------------------------------------------------------------------
    @property
    def readout(self) -> Readout | None:
        return self._served.readout

    @property
    def length_distribution(self) -> LengthGivenPrediction | None:
        """The serving readout's distribution of true length given its prediction, which the Gittins order
        ranks by (None: no readout serves, or it carries none; readouts RLS corrects keep their anchor's)."""
        return getattr(self._served.readout, "length_distribution_", None)

    @property
    def recipe(self) -> str | None:
        """The recipe the serving readout reads (None while none serves, or without a capture space)."""
        readout = self.readout
        if readout is None or self.capture is None:
            return None
        return str(self.capture.recipe_of(readout.metadata, strict=False))

    @property
    def version(self) -> str:
        readout = self.readout
        return "" if readout is None else str(readout.metadata.get("version", ""))

    @property
    def generation(self) -> int:
        """The anchor generation: a push, a restore or a reset moves it on."""
        return self._generation

    def start(self) -> ReadoutService:
        """Start the predictor thread (what serves first is `serving.readout.sources`' choice)."""
        self.predictor.start()
        return self

    # -- changing what serves ----------------------------------------------------------------------
    def check(self, bundle: bytes) -> tuple[LinearReadout, RLS | None]:
        """The readout and RLS anchor of a bundle from a start-up source, validated exactly as a push
        (PushRefused when it must not serve here); no serving readout to be newer than."""
        return validate_push(bundle, self.expect, None, self.capture)

    def push(self, body: bytes) -> dict:
        """Validate and hot-swap a pushed readout (PushRefused keeps the old one), then persist it.

        Pushes are serialized: each is validated against the readout the one before it left serving,
        and the state saved is the last one served (two at once never let the older one win)."""
        with self._push_lock:
            readout, rls = validate_push(body, self.expect, self.readout, self.capture)
            previous = self.version
            with self._lock:
                self.serve(readout, rls, "push")
                version = self.version
            persisted = self.persist(body, version)
        logger.info("LEAP readout %s replaced %s", version, previous)
        return {"version": version, "previous": previous, "rls": self.learner.stats(), "persisted": persisted}

    def persist(self, body: bytes, version: str, sequence: int | None = None) -> bool:
        """Keep the bundle as this replica's state (a restart serves it again), with the champion
        publication it belongs to (`sequence`, else the one the bundle carries); False when not kept."""
        if self.state is None:
            return False
        try:
            bundle = open_bundle(body)
            self.state.save(bundle.readout_bytes, bundle.state, version,
                            sequence if sequence is not None else bundle.sequence)
        except Exception:
            self._telemetry.drop("state", "write_error")
            logger.exception("LEAP could not persist readout %s to %s; it serves, but a restart will not "
                             "restore it", version, self.state.folder)
            return False
        self.persisted_at = time.time()
        return True

    def clear(self) -> None:
        """Serve no readout (and learn nothing) until the next push."""
        with self._lock:
            self._generation = self.learner.reanchor(None, "")
            self.source = "none"
            self._anchor = _Served(None, None, self._generation)
            self._publish(None)

    def serve_predictor(self, predictor: Readout, version: str) -> None:
        """Serve any object with `predict(X) -> lengths` on the captured features, without RLS."""
        with self._lock:
            self._generation = self.learner.reanchor(None, version)
            self.source = "push"
            self._anchor = _Served(None, None, self._generation)
            self._publish(predictor)

    def serve(self, readout: LinearReadout, rls: RLS | None, source: str) -> None:
        """Serve a validated readout as the new anchor (RLS learns from `rls`, when it learns here)."""
        with self._lock:
            if rls is not None and self.config.rls_forgetting != 1.0:
                rls.forgetting = self.config.rls_forgetting
            version = str(readout.metadata.get("version", ""))
            self._generation = self.learner.reanchor(rls if self.config.rls else None, version)
            self.source = source
            self._publish(readout)
            self._anchor = self._served

    def serve_unless_moved_on(self, readout: LinearReadout, rls: RLS | None, source: str,
                              generation: int) -> bool:
        """`serve` a readout loaded in the background unless a push, restore or reset moved the anchor
        generation on since `generation` was read (then that one wins, and False)."""
        with self._lock:
            if generation != self._generation:
                return False
            self.serve(readout, rls, source)
            return True

    def publish_learned(self, readout: LinearReadout, generation: int) -> None:
        """The learner's publish: served only if no push, restore or reset happened since it was learned."""
        with self._lock:
            if generation != self._generation:
                self._telemetry.drop("readout", "stale_generation")
                return
            self._publish(readout)

    def _columns(self, readout: Readout | None) -> np.ndarray | None:
        """The readout's columns of a captured vector; None when it reads the whole vector as it comes
        (then nothing is copied, and predictions are computed exactly as on the vector itself)."""
        if readout is None or self.capture is None:
            return None
        columns = self.capture.columns(readout.metadata)
        if columns.size == self.capture.dim and np.array_equal(columns, np.arange(columns.size)):
            return None
        return columns

    def _publish(self, readout: Readout | None) -> None:
        """Serve `readout` from now on and rescore the live requests from their cached features."""
        with self._lock:
            served = _Served(readout, self._columns(readout), self._generation)
            self._served = served
            self.predictor.publish(None if readout is None else OnColumns(readout, served.columns))
            self._telemetry.set_readout(self.version, self.source)
            self._telemetry.rls_updates.set(self.learner.updates)
            if readout is None:
                return
            ids, features = self._tracker.live_features()
            if not ids:
                return
            try:
                values = np.asarray(readout.predict(served.select(np.stack(features))), dtype=np.float64)
            except Exception:
                self._telemetry.drop("prediction", "rescore_error", len(ids))
                logger.exception("LEAP: rescoring %d live requests with %s failed; they keep their predictions",
                                 len(ids), self.version)
                return
            self._tracker.add_predictions(ids, values.reshape(-1), self.version)

    # -- the threads' inputs -----------------------------------------------------------------------
    def submit(self, request_id: str, feature: np.ndarray) -> None:
        """Queue a captured feature for prediction (nothing to do while no readout serves)."""
        if self.readout is not None:
            self.predictor.submit(request_id, feature)  # the published readout takes its columns

    def predict_in_step(self, request_ids: list[str], features: list[np.ndarray]) -> None:
        """Predict a step's features on the calling (engine) thread when the readout is linear.

        One [n, d] x [d] product costs microseconds, less than the hand-off to the predictor thread,
        and makes the prediction ready before the request's first decode. Other predictors (an
        evaluation MLP) keep running on the predictor thread, where their cost is measured.
        """
        served = self._served
        readout = served.readout
        if readout is None:
            return
        if not isinstance(readout, LinearReadout):
            for request_id, feature in zip(request_ids, features):
                self.predictor.submit(request_id, feature)
            return
        try:
            values = np.asarray(readout.predict(served.select(np.stack(features))), dtype=np.float64)
        except Exception:  # a bad batch falls back to the predictor thread, which retries row by row
            logger.warning("LEAP: in-step prediction failed; the predictor thread takes the batch", exc_info=True)
            for request_id, feature in zip(request_ids, features):
                self.predictor.submit(request_id, feature)
            return
        self._tracker.add_predictions(request_ids, values.reshape(-1), str(readout.metadata.get("version", "")))

    def anchor_prediction(self, feature: np.ndarray | None) -> tuple[float | None, int]:
        """The anchor readout's prediction of one captured vector (None while no anchor serves: no
        readout, or a predictor without RLS, which is then its own anchor; and for `feature` None)
        and the anchor's generation, which a push, restore or reset moves on."""
        anchor = self._anchor
        if feature is None or anchor.readout is None:
            return None, anchor.generation
        value = np.asarray(anchor.readout.predict(anchor.select(np.asarray(feature))[None, :]), dtype=np.float64)
        return float(value.reshape(-1)[0]), anchor.generation

    def observe(self, feature: np.ndarray, output_tokens: int) -> None:
        """Hand a finished request's columns to RLS, when it learns, tagged with the anchor they belong to."""
        served = self._served
        if not self.learner.active or served.readout is None:
            return
        try:
            row = served.select(feature)
        except IndexError:  # the receiver checks sizes; this only keeps the feedback row if one slips through
            self._telemetry.drop("rls_row", "wrong_dim")
            return
        self.learner.observe(row, output_tokens, served.generation)

    def _on_predictions(self, ids: Sequence[str], values: np.ndarray, version: str, enqueued: np.ndarray) -> None:
        if version != self.version:  # predicted by a readout replaced meanwhile; the publish rescored them
            self._telemetry.drop("prediction", "superseded", len(ids))
            return
        self._tracker.add_predictions(ids, values, version)

    # -- reporting ---------------------------------------------------------------------------------
    def rls_bundle(self) -> tuple[bytes, dict]:
        """What RLS learned here since the last anchor, as a push bundle (the anchor readout and the
        state arrays), with `base_version` (the anchor's readout version), `rows` folded since it,
        `updates`, `generation`, `buffered` (rows not in the state yet), `flushed` and `serving` (the
        version serving now). Rows waiting for a full RLS batch are learned first (`flushed`), so the
        state holds every row observed before the call. The fleet merge reads it (`flows.fleet`).
        LookupError when nothing learns."""
        flushed = self.learner.flush() if self.learner.active else False  # the partial batch joins the state
        snapshot = self.learner.snapshot()
        if snapshot is None:
            reason = ("no readout serves" if self.readout is None
                      else "online learning is off, or the serving readout came without RLS state")
            raise LookupError(f"this replica holds no RLS state: {reason}")
        info = {key: snapshot[key] for key in ("base_version", "rows", "updates", "generation", "buffered")}
        return (make_bundle(to_bytes(snapshot["readout"]), snapshot["state"]),
                {**info, "flushed": flushed, "serving": self.version})

    def describe(self) -> dict:
        return {"version": self.version, "source": self.source, "generation": self._generation,
                "persisted_at": self.persisted_at}

    def close(self) -> None:
        self.predictor.stop()
        self.learner.close()
