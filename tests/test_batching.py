"""ray_jobs.preparation.batching: bounds, every row exactly once, determinism, length bucketing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.errors import InputError
from ray_jobs.preparation.batching import BatchLimits, batch_cost, make_batches


@dataclass(frozen=True)
class Row:
    position: int
    num_prompt_tokens: int
    max_tokens: int
    error: str | None = None


rows_strategy = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 64), st.booleans()), max_size=200,
).map(lambda spec: [Row(i, 0, 0, "bad") if err else Row(i, n, m)  # error rows hold no tokens
                        for i, (n, m, err) in enumerate(spec)])
limits_strategy = st.builds(
    BatchLimits,
    batch_size=st.integers(1, 16),
    max_batch_tokens=st.one_of(st.none(), st.integers(1, 3000)),
    window_rows=st.one_of(st.none(), st.integers(1, 64)),
)


@settings(max_examples=200, deadline=None)
@given(rows=rows_strategy, limits=limits_strategy)
def test_every_row_exactly_once_and_bounds_hold(rows, limits):
    batches = list(make_batches(iter(rows), limits))
    positions = [r.position for b in batches for r in b.rows]
    assert sorted(positions) == list(range(len(rows)))
    assert [b.batch_id for b in batches] == list(range(len(batches)))
    for b in batches:
        assert 1 <= len(b.rows) <= limits.batch_size
        assert len({r.error is None for r in b.rows}) == 1  # error rows never mix with others
        if limits.max_batch_tokens is not None and len(b.rows) > 1 and not b.is_error:
            assert batch_cost(b.rows) <= limits.max_batch_tokens


@settings(max_examples=100, deadline=None)
@given(rows=rows_strategy, limits=limits_strategy)
def test_batches_are_deterministic(rows, limits):
    def signature():
        return [(b.batch_id, tuple(r.position for r in b.rows), b.digest())
                for b in make_batches(iter(rows), limits)]

    assert signature() == signature()


@settings(max_examples=100, deadline=None)
@given(rows=rows_strategy, limits=limits_strategy)
def test_batches_stay_within_their_window_longest_prompts_first(rows, limits):
    w = limits.window_rows
    flat = []
    for b in make_batches(iter(rows), limits):
        windows = {r.position // w for r in b.rows}
        assert len(windows) == 1  # a batch never spans two windows
        if not b.is_error:
            flat.append((windows.pop(), b.rows))
    for window in {k for k, _ in flat}:
        order = [r for k, rs in flat if k == window for r in rs]
        keys = [(-r.num_prompt_tokens, r.position) for r in order]
        assert keys == sorted(keys)


def test_sorting_by_length_cuts_padding():
    # Alternating short and long prompts: sorted within the window, each batch is uniform.
    rows = [Row(i, 10 if i % 2 else 100, 8) for i in range(8)]
    batches = list(make_batches(rows, BatchLimits(batch_size=4)))
    assert [[r.num_prompt_tokens for r in b.rows] for b in batches] == [[100] * 4, [10] * 4]
    assert sum(b.padded_prompt_tokens for b in batches) == sum(r.num_prompt_tokens for r in rows)


def test_token_bound_splits_and_single_oversized_row_stands_alone():
    rows = [Row(0, 10, 10), Row(1, 10, 10), Row(2, 10, 10), Row(3, 500, 10)]
    batches = list(make_batches(rows, BatchLimits(batch_size=8, max_batch_tokens=45)))
    assert [[r.position for r in b.rows] for b in batches] == [[3], [0, 1], [2]]


def test_error_rows_form_their_own_batches_first_in_each_window():
    rows = [Row(0, 5, 4), Row(1, 0, 0, "empty"), Row(2, 3, 4), Row(3, 0, 0, "bad")]
    batches = list(make_batches(rows, BatchLimits(batch_size=2, window_rows=4)))
    assert [(b.is_error, [r.position for r in b.rows]) for b in batches] == [
        (True, [1, 3]), (False, [0, 2])]


def test_digest_tells_different_batches_apart():
    a = list(make_batches([Row(0, 5, 4), Row(1, 6, 4)], BatchLimits(batch_size=2)))[0]
    b = list(make_batches([Row(0, 5, 4), Row(1, 7, 4)], BatchLimits(batch_size=2)))[0]
    assert a.digest() != b.digest()


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": 2, "max_batch_tokens": 0},
                                    {"batch_size": 2, "window_rows": 0}])
def test_bad_limits_are_input_errors(kwargs):
    with pytest.raises(InputError):
        BatchLimits(**kwargs)


def test_batching_streams_one_window_at_a_time():
    pulled = []

    def rows():
        for i in range(10_000):
            pulled.append(i)
            yield Row(i, 1 + i % 7, 4)

    batches = make_batches(rows(), BatchLimits(batch_size=4, window_rows=32))
    first = next(batches)
    assert len(pulled) == 32  # one window read, not the input
    assert len(first.rows) == 4


@dataclass(frozen=True)
class SampledRow(Row):
    n: int = 1


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 8), st.integers(1, 6)),
                     max_size=60),
       limits=limits_strategy)
def test_a_row_weighs_its_samples_in_both_bounds(rows, limits):
    rows = [SampledRow(i, p, m, None, n) for i, (p, m, n) in enumerate(rows)]
    batches = list(make_batches(iter(rows), limits))
    assert sorted(r.position for b in batches for r in b.rows) == list(range(len(rows)))
    for b in batches:
        assert b.num_samples == sum(r.n for r in b.rows)
        if len(b.rows) > 1:  # a row heavier than a bound stands alone
            assert b.num_samples <= limits.batch_size
            if limits.max_batch_tokens is not None:
                assert batch_cost(b.rows) <= limits.max_batch_tokens


def test_samples_enter_the_digest():
    one = list(make_batches([SampledRow(0, 5, 4, None, 1)], BatchLimits(batch_size=4)))[0]
    two = list(make_batches([SampledRow(0, 5, 4, None, 2)], BatchLimits(batch_size=4)))[0]
    plain = list(make_batches([Row(0, 5, 4)], BatchLimits(batch_size=4)))[0]
    assert one.digest() == plain.digest() != two.digest()  # n = 1 keeps earlier digests
    assert batch_cost(two.rows) == 2 * (5 + 4)
