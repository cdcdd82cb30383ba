"""The RLS thread: batches of `every`, publishes, and no feedback carried across a reanchor."""

from __future__ import annotations

import numpy as np

from leap_core.readout import LinearReadout
from leap_core.rls import RLS
from serving.online import OnlineLearner


def _rls(seed: int = 0) -> tuple[RLS, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(200, 6))
    lengths = np.clip(np.round((10 + 3 * X[:, 0]) ** 2), 1, 512)
    readout = LinearReadout(alpha=1.0, max_tokens=512).fit(X, lengths)
    return RLS.from_readout(readout, X), X, lengths


def test_learns_every_batch_and_publishes_each_update():
    rls, X, lengths = _rls()
    published = []
    learner = OnlineLearner(rls, "v1", published.append, every=8)
    for row, length in zip(X[:20], lengths[:20]):
        learner.observe(row, int(length))
    assert learner.wait_idle(5)
    assert learner.updates == 2 and len(published) == 2 and learner.observed == 20
    assert published[-1].metadata["version"] == "v1+rls2"
    learner.close()


def test_rows_observed_before_a_reanchor_are_not_learned_after_it():
    rls, X, lengths = _rls()
    published = []
    learner = OnlineLearner(None, "none", published.append, every=8)
    for row, length in zip(X[:5], lengths[:5]):  # buffered under no readout
        learner.observe(row, int(length))
    assert learner.wait_idle(5)
    learner.reanchor(rls, "v2")
    for row, length in zip(X[5:8], lengths[5:8]):  # only 3 rows since the reanchor: no batch yet
        learner.observe(row, int(length))
    assert learner.wait_idle(5)
    assert learner.updates == 0 and not published
    expected = _rls()[0].partial_fit(X[5:13], lengths[5:13]).readout()
    for row, length in zip(X[8:13], lengths[8:13]):
        learner.observe(row, int(length))
    assert learner.wait_idle(5) and learner.updates == 1
    np.testing.assert_allclose(published[0].theta_, expected.theta_, rtol=1e-9, atol=1e-9)
    learner.close()
