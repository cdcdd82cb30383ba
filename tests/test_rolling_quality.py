"""One rolling window of prediction quality (serving/rolling_quality.py) behind every live figure.

The per-domain figures (`DomainQuality`), the live ranking the FCFS fallback watches (`FeedbackRecorder`)
and the shadow's paired figures (`ShadowReadout`) each kept their own deque and computed their own
figures; they now share `RollingQuality`. The references below are those three computations as they were,
so the figures are shown the same, bit for bit, on the same inputs.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from leap_core.metrics import mae, spearman
from serving.feedback.recorder import ALL, DomainQuality
from serving.feedback.tenant_share import capped_weights
from serving.readout.shadow import FIGURES_EVERY, ShadowReadout
from serving.rolling_quality import RollingQuality
from serving.telemetry import Telemetry


def _stream(seed: int, n: int):
    rng = np.random.default_rng(seed)
    true = rng.integers(1, 400, n)  # integer lengths: ties, as real lengths have
    predicted = true * rng.lognormal(0.0, 0.5, n)
    other = predicted + rng.normal(0.0, 30.0, n)
    tenants = rng.choice(["a", "b", "c", None], n, p=[0.7, 0.15, 0.1, 0.05])
    return true, predicted, other, [None if t is None else str(t) for t in tenants]


# -- the computations as they were -------------------------------------------------------------------
def _old_domain_figures(rows, max_share):
    values = np.asarray([row[:3] for row in rows], dtype=np.float64)
    weight = capped_weights([row[3] for row in rows], max_share)
    true = values[:, 2]
    return {"spearman": spearman(true, values[:, 0]) if len(values) > 1 else float("nan"),
            "mae": float(weight @ np.abs(true - values[:, 0])),
            "anchor_mae": float(weight @ np.abs(true - values[:, 1])), "rows": len(values)}


def _old_ranking(recent):
    pairs = np.asarray(recent)
    return spearman(pairs[:, 1], pairs[:, 0]), mae(pairs[:, 1], pairs[:, 0])


def _old_shadow(pairs):
    pairs = np.asarray(pairs, dtype=np.float64)
    truth = pairs[:, 2]
    return {(name, figure): fn(truth, pairs[:, index]) for index, name in ((0, "served"), (1, "shadow"))
            for figure, fn in (("spearman", spearman), ("mae", mae))}


def _same(a: float, b: float) -> bool:
    return (np.isnan(a) and np.isnan(b)) or a == b


# -- the window --------------------------------------------------------------------------------------
def test_the_window_keeps_the_last_rows_and_their_figures():
    window = RollingQuality(4, readouts=2)
    assert len(window) == 0 and len(window.snapshot()) == 0 and np.isnan(window.snapshot().spearman())
    for i in range(6):
        window.add(10 * (i + 1), 10 * (i + 1) + 1, 5.0, tenant=f"t{i % 2}")
    rows = window.snapshot()
    assert len(rows) == 4 and rows.true.tolist() == [30.0, 40.0, 50.0, 60.0]
    assert rows.predicted.shape == (4, 2) and rows.tenants == ("t0", "t1", "t0", "t1")
    assert rows.spearman(0) == pytest.approx(1.0) and rows.mae(0) == 1.0 and rows.mae(1) == 40.0
    assert np.isnan(rows.spearman(1))  # a constant prediction ranks nothing
    window.add(1.0, 2.0, 3.0)
    assert len(rows) == 4  # a snapshot is a copy
    window.clear()
    assert len(window) == 0
    with pytest.raises(ValueError):
        window.add(1.0, 2.0)  # two readouts: two predictions per row
    with pytest.raises(ValueError):
        RollingQuality(0)


def test_tenant_weights_are_the_capped_ones():
    window = RollingQuality(8)
    for true, tenant in ((10, "a"), (20, "a"), (30, "a"), (40, "b")):
        window.add(true, true + 8 * (tenant == "a"), tenant=tenant)
    rows = window.snapshot()
    weight = rows.tenant_weights(0.5)
    assert weight.tolist() == capped_weights(["a", "a", "a", "b"], 0.5).tolist()
    assert rows.mae(0, weight) == pytest.approx(4.0) and rows.mae(0) == pytest.approx(6.0)


# -- the same figures as before ----------------------------------------------------------------------
@pytest.mark.parametrize("max_share", [None, 0.4])
def test_domain_figures_are_unchanged(max_share):
    true, predicted, anchor, tenants = _stream(1, 700)
    quality = DomainQuality(Telemetry(), window=256, tenant_max_share=max_share)
    kept: dict[str, deque] = {}
    for i in range(len(true)):
        domain = ("chat", "code", None)[i % 3]
        quality.add(predicted[i], anchor[i], int(true[i]), domain, 0, tenants[i])
        row = (float(predicted[i]), float(anchor[i]), float(true[i]), tenants[i])
        for name in (ALL, domain):
            if name is not None:
                kept.setdefault(name, deque(maxlen=256)).append(row)
        if i in (0, 1, 17, 255, 256, 699):
            for name, rows in kept.items():
                figures, old = quality.figures(name), _old_domain_figures(rows, max_share)
                assert figures["rows"] == old["rows"]
                assert all(_same(figures[key], old[key]) for key in ("spearman", "mae", "anchor_mae")), (i, name)


def test_the_live_ranking_is_unchanged():
    true, predicted, _, _ = _stream(2, 600)
    window, recent = RollingQuality(256), deque(maxlen=256)
    for i in range(len(true)):
        window.add(int(true[i]), predicted[i])
        recent.append((predicted[i], int(true[i])))
        if len(recent) >= 16 and i % 16 == 0:
            rows = window.snapshot()
            ranking, error = _old_ranking(recent)
            assert (rows.spearman(), rows.mae(), len(rows)) == (ranking, error, len(recent))


def test_the_shadow_figures_are_unchanged():
    true, served, shadowed, _ = _stream(3, 300)
    telemetry = Telemetry()
    shadow = ShadowReadout({}, None, telemetry, window=100)
    pairs = deque(maxlen=100)
    for i in range(len(true)):
        shadow.observe(served[i], shadowed[i], int(true[i]))
        pairs.append((served[i], shadowed[i], int(true[i])))
        if (i + 1) % FIGURES_EVERY == 0:
            for (name, figure), value in _old_shadow(pairs).items():
                got = telemetry.registry.get_sample_value("leap:shadow_figure", {"readout": name, "figure": figure})
                assert got == value, (i, name, figure)
    assert telemetry.registry.get_sample_value("leap:shadow_rows") == 100
