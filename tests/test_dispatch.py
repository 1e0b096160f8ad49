"""Which worker a span (a shard, or a half of one) goes to (`WorkerPool.pick`): the least
loaded, and among equally loaded ones the worker whose last span began with the same tokens
(prefix affinity)."""

from __future__ import annotations

import pytest

from nanoserve.errors import NanoserveError
from ray_jobs.dispatch.pool import WorkerPool, WorkerSlot
from ray_jobs.report.timeline import Timeline

A, B = (1, 2, 3), (4, 5, 6)


def pool_of(loads, prefixes):
    pool = WorkerPool(None, {}, 1.0, Timeline(0.0))
    for load, prefix in zip(loads, prefixes):
        pool.workers.append(WorkerSlot(None, {}, in_flight=load, last_prefix=prefix,
                                       max_spans=2))
    return pool


def test_equal_loads_prefer_the_worker_that_last_ran_the_prefix():
    pool = pool_of([1, 1, 1], [A, B, A])
    assert pool.pick(False, B) == 1
    assert pool.pick(False, A) == 0
    assert pool.pick(False, (9,)) == 0  # nobody has it: lowest index
    assert pool.pick(False, ()) == 0


def test_affinity_never_outweighs_load_or_limits():
    pool = pool_of([1, 0], [A, B])
    assert pool.pick(False, A) == 1  # the idle worker, though worker 0 ran A
    pool = pool_of([2, 1], [A, B])
    assert pool.pick(False, A) == 1  # worker 0 is full
    assert pool.pick(True, A) is None  # alone: only an idle worker
    pool.workers[1].alive = False
    assert pool.pick(False, A) is None
    pool.workers[0].alive = False
    with pytest.raises(NanoserveError, match="no worker is left"):
        pool.pick(False, A)


def test_a_worker_takes_spans_until_its_rows_reach_its_limit():
    pool = pool_of([3, 3], [A, B])
    for w in pool.workers:
        w.max_spans, w.max_rows_held = 10, 100
    pool.workers[0].rows_in_flight = 100  # its engine's share is held
    pool.workers[1].rows_in_flight = 99
    assert pool.pick(False, A) == 1
    pool.workers[1].rows_in_flight = 100
    assert pool.pick(False, A) is None


@pytest.mark.parametrize("shard, held", [(4, 24), (5, 25)])
def test_a_worker_is_fed_up_to_three_times_its_engine_rows(shard, held):
    """The pool's own limits for an engine that runs 8 rows at once: the driver's loop (pick,
    then count the span in flight) sends whole shards until the worker holds 3 x 8 = 24
    rows, the last shard allowed to cross that line, none after it."""
    from ray_jobs.dispatch.pool import hold_limits
    from ray_jobs.workers.options import JobOptions

    spans, rows = hold_limits({"scheduler": "continuous", "max_rows": 8},
                              JobOptions(batch_size=shard))
    pool = WorkerPool(None, {}, 1.0, Timeline(0.0))
    pool.workers.append(WorkerSlot(None, {}, max_spans=spans, max_rows_held=rows))
    sent = 0
    while pool.pick(False) is not None:
        pool.workers[0].in_flight += 1
        pool.workers[0].rows_in_flight += shard
        sent += 1
        assert sent <= 100
    assert pool.workers[0].rows_in_flight == held
    pool.workers[0].in_flight -= 1  # one shard answered: room for one more
    pool.workers[0].rows_in_flight -= shard
    assert pool.pick(False) == 0
