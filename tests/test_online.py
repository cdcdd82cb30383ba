"""The RLS thread: batches of `every`, publishes tagged with their anchor generation, no feedback carried
across a reanchor, a bounded queue, and a thread that outlives a bad row or a failing publish."""

from __future__ import annotations

import threading

import numpy as np

from leap_core.readout import LinearReadout
from leap_core.rls import RLS
from serving.readout.online_rls import OnlineLearner


def _rls(seed: int = 0) -> tuple[RLS, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(200, 6))
    lengths = np.clip(np.round((10 + 3 * X[:, 0]) ** 2), 1, 512)
    readout = LinearReadout(alpha=1.0, max_tokens=512).fit(X, lengths)
    return RLS.from_readout(readout, X), X, lengths


class Published(list):
    """The readouts a learner published, with the generation each was tagged with."""

    def __init__(self) -> None:
        super().__init__()
        self.generations: list[int] = []

    def __call__(self, readout: LinearReadout, generation: int) -> None:
        self.append(readout)
        self.generations.append(generation)


def test_learns_every_batch_and_publishes_each_update():
    rls, X, lengths = _rls()
    published = Published()
    learner = OnlineLearner(rls, "v1", published, every=8)
    for row, length in zip(X[:20], lengths[:20]):
        learner.observe(row, int(length))
    assert learner.wait_idle(5)
    assert learner.updates == 2 and len(published) == 2 and learner.observed == 20
    assert published[-1].metadata["version"] == "v1+rls2"
    assert published.generations == [learner.generation] * 2
    learner.close()


def test_rows_observed_before_a_reanchor_are_not_learned_after_it():
    rls, X, lengths = _rls()
    published = Published()
    learner = OnlineLearner(None, "none", published, every=8)
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


def test_a_row_of_another_dimension_costs_that_row_and_learning_goes_on():
    rls, X, lengths = _rls()
    published = Published()
    learner = OnlineLearner(rls, "v1", published, every=8)
    for row, length in zip(X[:7], lengths[:7]):
        learner.observe(row, int(length))
    learner.observe(X[7, :5], int(lengths[7]))  # a feature of the wrong size in the middle of a batch
    for row, length in zip(X[7:16], lengths[7:16]):
        learner.observe(row, int(length))
    assert learner.wait_idle(5)
    assert learner.alive and learner.updates == 2 and learner.dropped == 1
    learner.close()


def test_a_publish_that_raises_is_counted_and_the_thread_goes_on():
    rls, X, lengths = _rls()
    calls = []

    def publish(readout: LinearReadout, generation: int) -> None:
        calls.append(readout)
        if len(calls) == 1:
            raise RuntimeError("the first publish fails")

    learner = OnlineLearner(rls, "v1", publish, every=4)
    for row, length in zip(X[:8], lengths[:8]):
        learner.observe(row, int(length))
    assert learner.wait_idle(5)
    assert learner.alive and len(calls) == 2 and learner.errors == 1
    learner.close()


def test_the_queue_is_bounded_and_counts_what_it_drops():
    rls, X, lengths = _rls()
    release = threading.Event()
    publishing = threading.Event()

    def slow_publish(readout: LinearReadout, generation: int) -> None:
        publishing.set()
        release.wait(5)

    drops = []
    learner = OnlineLearner(rls, "v1", slow_publish, every=1, max_queue=4,
                            on_drop=lambda reason, n: drops.append((reason, n)))
    learner.observe(X[0], int(lengths[0]))
    assert publishing.wait(5)  # the thread is busy publishing; the next rows wait in the queue
    accepted = [learner.observe(row, int(length)) for row, length in zip(X[1:8], lengths[1:8])]
    assert accepted == [True] * 4 + [False] * 3
    assert learner.dropped == 3 and drops == [("queue_full", 1)] * 3
    release.set()
    assert learner.wait_idle(5) and learner.updates == 5
    learner.close()


def test_flush_learns_the_partial_batch_and_the_snapshot_holds_every_observed_row():
    rls, X, lengths = _rls()
    reference, _, _ = _rls()
    published = Published()
    learner = OnlineLearner(rls, "v1", published, every=8)
    for row, length in zip(X[:13], lengths[:13]):
        learner.observe(row, int(length))
    assert learner.wait_idle(5) and learner.snapshot()["buffered"] == 5 and learner.snapshot()["rows"] == 8

    assert learner.flush()

    snapshot = learner.snapshot()
    assert (snapshot["rows"], snapshot["buffered"], learner.updates, learner.observed) == (13, 0, 2, 13)
    reference.partial_fit(X[:13], lengths[:13])  # one batch: RLS is exact whatever the batching
    np.testing.assert_allclose(snapshot["state"]["theta"], reference.theta_, rtol=0, atol=1e-9)
    assert learner.flush() and learner.updates == 2  # nothing waits: no empty update
    learner.close()
