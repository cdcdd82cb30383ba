"""The feedback row of a finished request, built for the writer and in-process listeners, and the quality
figures computed from those rows.

One row per finished request that was resident and had its feature captured: the whole captured vector,
what the engine measured, what LEAP predicted (and a shadow readout, while one is held) and the client's
validated extras; a bad extra is absent, never a reason to lose the row. The row's times are the
server's: a client's planned arrival is kept only as `client_arrival_time`. Its key is the process's own
(`RowIds`). `DomainQuality` keeps the rolling per-domain figures the drift watch reads, afresh at every
anchor and tenant-weighted so no tenant alone can push them (docs/serving.md, "Drift watch"). A listener
that raises is counted and the others still get the row.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from leap_io.feedback_schema import CLIENT_ID_MAX_CHARS
from serving import vllm_compat
from serving.fcfs_fallback import FcfsFallback
from serving.readout.shadow import ShadowReadout
from serving.rolling_quality import QUALITY_WINDOW, QualityRows, RollingQuality
from serving.supervise import RateLimitedLog
from serving.telemetry import Telemetry
from serving.tracking import Tracked

logger = logging.getLogger(__name__)

MAX_DOMAINS = 32
ALL = "all"

Anchor = Callable[[np.ndarray | None], "tuple[float | None, int]"]
"""anchor(feature) -> (the anchor readout's prediction, None when no anchor serves or `feature` is None;
the current anchor generation)."""


class DomainQuality:
    """Rolling prediction quality by domain since the current anchor, a Prometheus collector.

    Each domain's window (a `serving.rolling_quality.RollingQuality` of two readouts, the served and
    the anchor) holds the last `window` (true length, predicted, anchor-predicted, tenant) rows of its
    domain; the engine thread only appends, and the figures are computed when /metrics is scraped
    (`leap:rolling_spearman`, `leap:rolling_mae_tokens`, `leap:anchor_mae_tokens`,
    `leap:rolling_requests`, by `domain`, and `leap:anchor_generation`). When the anchor generation
    (`generation()`, read at every scrape and row) moves on, every window is emptied at once, so a
    scrape just after a push never reports the previous readout's figures. At most `max_domains`
    domains besides "all" are kept; a row of another domain is counted in "all" and dropped from its
    own (`leap:dropped_total{what="quality_row", reason="domain_cap"}`).
    """

    def __init__(self, telemetry: Telemetry, generation: Callable[[], int] | None = None,
                 window: int = QUALITY_WINDOW, max_domains: int = MAX_DOMAINS,
                 tenant_max_share: float | None = None) -> None:
        self._telemetry = telemetry
        self._generation_now = generation
        self.window, self.max_domains, self.tenant_max_share = window, max_domains, tenant_max_share
        self.generation = 0
        self._rows: dict[str, RollingQuality] = {}
        self._lock = threading.Lock()
        telemetry.registry.register(self)

    def add(self, predicted: float, anchor: float, output_tokens: int, domain: str | None, generation: int,
            tenant: str | None = None) -> None:
        row = (output_tokens, predicted, anchor, tenant)
        with self._lock:
            if generation != self.generation:
                self._reset(generation)
            self._append(ALL, row)
            if domain is None or domain == ALL:
                return
            if domain not in self._rows and len(self._rows) > self.max_domains:  # "all" is one of them
                self._telemetry.drop("quality_row", "domain_cap")
                return
            self._append(domain, row)

    def figures(self, domain: str = ALL) -> dict | None:
        """The domain's spearman, mae, anchor_mae and rows now (None when it has no rows)."""
        return self._snapshot()[1].get(domain)

    def domains(self) -> list[str]:
        return list(self._snapshot()[1])

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        generation, figures = self._snapshot()
        families = {
            "spearman": GaugeMetricFamily("leap:rolling_spearman", "Spearman of prediction vs length by "
                                          "domain, last 256 since the anchor", labels=["domain"]),
            "mae": GaugeMetricFamily("leap:rolling_mae_tokens", "MAE in tokens of the serving (online-corrected) "
                                     "readout by domain, last 256 since the anchor", labels=["domain"]),
            "anchor_mae": GaugeMetricFamily("leap:anchor_mae_tokens", "MAE in tokens of the anchor readout (as "
                                            "pushed, before online correction) on the same requests",
                                            labels=["domain"]),
            "rows": GaugeMetricFamily("leap:rolling_requests", "Finished requests the domain's figures are "
                                      "over", labels=["domain"]),
        }
        for domain, values in sorted(figures.items()):
            for key, family in families.items():
                family.add_metric([domain], values[key])
        yield from families.values()
        yield GaugeMetricFamily("leap:anchor_generation", "Pushes, restores and resets served so far (the "
                                "per-domain figures start afresh at each)", value=generation)

    def _snapshot(self) -> tuple[int, dict[str, dict]]:
        with self._lock:
            if self._generation_now is not None:
                current = self._generation_now()
                if current != self.generation:
                    self._reset(current)
            generation = self.generation
            copies = {domain: rows.snapshot() for domain, rows in self._rows.items()}
        return generation, {domain: self._figures(rows) for domain, rows in copies.items()}

    def _figures(self, rows: QualityRows) -> dict:
        weight = rows.tenant_weights(self.tenant_max_share)
        return {"spearman": rows.spearman(0), "mae": rows.mae(0, weight), "anchor_mae": rows.mae(1, weight),
                "rows": len(rows)}

    def _reset(self, generation: int) -> None:
        self.generation = generation
        self._rows.clear()

    def _append(self, domain: str, row: tuple[float, float, float, str | None]) -> None:
        rows = self._rows.get(domain)
        if rows is None:
            rows = self._rows[domain] = RollingQuality(self.window, readouts=2)
        true, predicted, anchor, tenant = row
        rows.add(true, predicted, anchor, tenant=tenant)


def client_id(text: str) -> str:
    """A client's request id as a row keeps it: at most CLIENT_ID_MAX_CHARS, NUL (which no store's text
    holds) replaced."""
    return text[:CLIENT_ID_MAX_CHARS].replace("\x00", "\ufffd")


class RowIds:
    """The serving process's row keys: `<token>-<n>`, a random 64-bit token drawn once per process and a
    counter, so two processes (replicas, restarts) never make the same key and no client chooses one."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.token}-{next(self._counter)}"


class FeedbackRecorder:
    """Builds each finished request's row and hands it to the feedback writer and the listeners.

    `writer` is a `serving.feedback.writer.FeedbackWriter` or None (no feedback written, listeners only).
    `anchor` gives the anchor readout's prediction of a feature (`ReadoutService.anchor_prediction`);
    without it, or while no anchor serves, the served prediction stands for the anchor's.
    """

    def __init__(self, writer: Any, model_id: str, fingerprint: str, layer: int, telemetry: Telemetry,
                 anchor: Anchor | None = None, tenant_max_share: float | None = None,
                 fallback: FcfsFallback | None = None, shadow: ShadowReadout | None = None) -> None:
        self.writer = writer
        self.model_id, self.fingerprint, self.layer = model_id, fingerprint, layer
        self.listeners: list[Callable[[dict], None]] = []
        self._telemetry = telemetry
        self._warn = RateLimitedLog(logger)
        self.rows = 0
        self.finished = 0
        self.row_ids = RowIds()
        self.recent = RollingQuality(QUALITY_WINDOW)  # the live ranking the FCFS fallback watches
        self.anchor = anchor
        self.fallback = fallback
        self.shadow = shadow
        self._recent_generation = 0
        self.quality = DomainQuality(telemetry, None if anchor is None else lambda: anchor(None)[1],
                                     tenant_max_share=tenant_max_share)

    def record(self, request: Any, entry: Tracked | None, feature: np.ndarray | None, predicted: float | None,
               version: str, policy: str, decoding: dict, labelled: bool) -> dict | None:
        """Account for one finished request; its row when one was written or listened to. `decoding` is
        what the row records of its settings (`serving.feedback.decoding`); the quality figures count the
        request only when its length is a label (`labelled`, `leap_io.labels`)."""
        output_tokens = int(request.num_output_tokens)
        self.finished += 1
        self._telemetry.finished.inc()
        if entry is not None and predicted is not None and output_tokens > 0 and labelled:
            admitted = entry.predicted_at_admission
            self._telemetry.finished_lengths(predicted if admitted is None else admitted, output_tokens)
            self._quality(predicted, output_tokens)
            self._domain_quality(predicted, output_tokens, feature, entry.extras.leap_domain, entry.extras.leap_tenant)
        shadow: tuple[float | None, str | None] = (None, None)
        if self.shadow is not None and entry is not None:
            shadow = self.shadow.predict(feature)
            if labelled:
                self.shadow.observe(entry.predicted_at_admission, shadow[0], output_tokens)
        if feature is None or entry is None or (self.writer is None and not self.listeners):
            return None
        row = self.row(request, entry, feature, predicted, version, policy, decoding)
        row["shadow_predicted"], row["shadow_version"] = shadow
        if self.writer is not None and self.writer.write(row) is not False:  # the writer counts its drops
            self.rows += 1
        for listener in list(self.listeners):
            try:
                listener(row)
            except Exception:
                self._telemetry.thread_error("listener")
                self._warn.warning("listener", "LEAP feedback listener %r failed", listener, exc_info=True)
        return row

    def row(self, request: Any, entry: Tracked, feature: np.ndarray, predicted: float | None, version: str,
            policy: str, decoding: dict) -> dict:
        extras = entry.extras
        return {
            "request_id": self.row_ids.next(),
            "client_request_id": client_id(extras.leap_request_id or vllm_compat.external_request_id(request.request_id)),
            "model_id": self.model_id, "model_fingerprint": self.fingerprint, "layer": self.layer,
            "policy": policy, "arrival_time": float(entry.arrival),
            "client_arrival_time": extras.leap_planned_arrival, "first_token_time": entry.first_token_time,
            "finish_time": time.time(), "prompt_tokens": int(request.num_prompt_tokens),
            "output_tokens": int(request.num_output_tokens), "finish_reason": vllm_compat.finish_reason(request),
            "max_tokens": int(request.max_tokens), "decoding": json.dumps(decoding, default=str),
            "domain": extras.leap_domain, "tenant": extras.leap_tenant,
            "predicted_at_admission": entry.predicted_at_admission, "predicted_latest": predicted,
            "readout_version": version, "shadow_predicted": None, "shadow_version": None, "feature": feature,
        }

    def _quality(self, predicted: float, output_tokens: int) -> None:
        generation = self.anchor(None)[1] if self.anchor is not None else 0
        if generation != self._recent_generation:  # a new readout: its ranking is judged afresh
            self._recent_generation = generation
            self.recent.clear()
            if self.fallback is not None:
                self.fallback.new_anchor()
        self.recent.add(output_tokens, predicted)
        if self.fallback is not None and self.finished % 16 == 0 and len(self.recent) >= 16:
            rows = self.recent.snapshot()
            self.fallback.observe(rows.spearman(), len(rows))

    def _domain_quality(self, predicted: float, output_tokens: int, feature: np.ndarray | None,
                        domain: str | None, tenant: str | None) -> None:
        anchored, generation = None, self.quality.generation
        if self.anchor is not None:
            if feature is None:  # the anchor's prediction is unknown: the comparison needs both
                self._telemetry.drop("quality_row", "no_feature")
                return
            try:
                anchored, generation = self.anchor(feature)
            except Exception:
                self._telemetry.drop("quality_row", "anchor_error")
                self._warn.warning("anchor", "LEAP: the anchor readout could not predict", exc_info=True)
                return
        self.quality.add(predicted, predicted if anchored is None else anchored, output_tokens, domain, generation,
                         tenant)

    # -- the writer --------------------------------------------------------------------------------
    def flush(self) -> dict:
        """Close the open segment so everything finished so far can be ingested (raises if it cannot)."""
        if self.writer is None:
            return {"flushed": False, "reason": "this process writes no feedback"}
        stats = self.writer.flush()
        return {"flushed": True, "rows_written": self.writer.rows_written,
                "segments": getattr(self.writer, "segments_closed", None),
                **(stats if isinstance(stats, dict) else {})}

    def writer_health(self) -> dict:
        """The writer thread's report (`FeedbackWriter.stats()` and `healthy()` where it has them)."""
        if self.writer is None:
            return {"alive": None, "enabled": False}
        stats = getattr(self.writer, "stats", None)
        report = dict(stats()) if callable(stats) else {"rows_written": getattr(self.writer, "rows_written", None),
                                                        "alive": None}
        healthy = getattr(self.writer, "healthy", None)
        report["healthy"] = bool(healthy()) if callable(healthy) else report.get("alive") is not False
        report["enabled"] = True
        return report

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
