"""ray_jobs.preparation.batching: a static engine's batches of a shard's rows: bounds, every
row exactly once, determinism, longest prompts first."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.errors import InputError
from ray_jobs.preparation.batching import BatchLimits, batch_cost, cut_batches, weight


@dataclass(frozen=True)
class Row:
    position: int
    num_prompt_tokens: int
    max_tokens: int


rows_strategy = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 64)), max_size=200,
).map(lambda spec: [Row(i, n, m) for i, (n, m) in enumerate(spec)])
limits_strategy = st.builds(
    BatchLimits,
    max_rows=st.integers(1, 16),
    max_batch_tokens=st.one_of(st.none(), st.integers(1, 3000)),
)


@settings(max_examples=200, deadline=None)
@given(rows=rows_strategy, limits=limits_strategy)
def test_every_row_exactly_once_and_bounds_hold(rows, limits):
    batches = cut_batches(rows, limits)
    positions = [r.position for b in batches for r in b]
    assert sorted(positions) == list(range(len(rows)))
    for b in batches:
        assert 1 <= len(b) <= limits.max_rows
        if limits.max_batch_tokens is not None and len(b) > 1:
            assert batch_cost(b) <= limits.max_batch_tokens


@settings(max_examples=100, deadline=None)
@given(rows=rows_strategy, limits=limits_strategy)
def test_batches_are_deterministic_longest_prompts_first(rows, limits):
    def signature():
        return [tuple(r.position for r in b) for b in cut_batches(list(rows), limits)]

    assert signature() == signature()
    order = [r for b in cut_batches(rows, limits) for r in b]
    keys = [(-r.num_prompt_tokens, r.position) for r in order]
    assert keys == sorted(keys)


def test_sorting_by_length_cuts_padding():
    # Alternating short and long prompts: sorted, each batch is uniform.
    rows = [Row(i, 10 if i % 2 else 100, 8) for i in range(8)]
    batches = cut_batches(rows, BatchLimits(max_rows=4))
    assert [[r.num_prompt_tokens for r in b] for b in batches] == [[100] * 4, [10] * 4]


def test_token_bound_splits_and_single_oversized_row_stands_alone():
    rows = [Row(0, 10, 10), Row(1, 10, 10), Row(2, 10, 10), Row(3, 500, 10)]
    batches = cut_batches(rows, BatchLimits(max_rows=8, max_batch_tokens=45))
    assert [[r.position for r in b] for b in batches] == [[3], [0, 1], [2]]


@pytest.mark.parametrize("kwargs", [{"max_rows": 0}, {"max_rows": 2, "max_batch_tokens": 0},
                                    {"max_rows": True}])
def test_bad_limits_are_input_errors(kwargs):
    with pytest.raises(InputError):
        BatchLimits(**kwargs)


@dataclass(frozen=True)
class SampledRow(Row):
    n: int = 1


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 8), st.integers(1, 6)),
                     max_size=60),
       limits=limits_strategy)
def test_a_row_weighs_its_samples_in_both_bounds(rows, limits):
    rows = [SampledRow(i, p, m, n) for i, (p, m, n) in enumerate(rows)]
    batches = cut_batches(rows, limits)
    assert sorted(r.position for b in batches for r in b) == list(range(len(rows)))
    for b in batches:
        if len(b) > 1:  # a row heavier than a bound stands alone
            assert sum(weight(r) for r in b) <= limits.max_rows
            if limits.max_batch_tokens is not None:
                assert batch_cost(b) <= limits.max_batch_tokens
    assert batch_cost([SampledRow(0, 5, 4, 2)]) == 2 * (5 + 4)
