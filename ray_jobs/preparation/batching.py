"""Stage preparation: a static engine's batches of a shard's rows, by token length. A worker
whose engine is static cuts the rows of a shard that reach its engine this way
(`ray_jobs.tasks.generate.GenerateTask.batches`); a continuous engine takes them as one batch
(it admits rows as others finish), and so do the prefill-only tasks' engines (they pack
rows by tokens themselves).

The rows are sorted by prompt length, longest first (ties by input position), and cut, in
that order, into batches bounded by

- `max_rows` samples (the engine's running rows), and
- `max_batch_tokens` (if set): a batch's cost is `rows x max(prompt tokens + max_tokens)`,
  the padded rectangle of a static batch run to its longest possible end. It bounds both
  the prefill rectangle (rows x longest prompt) and the KV slots the batch can ever need.
  A single row costlier than the bound forms a batch of its own.
A row asking for n samples (`n`, default 1) weighs n rows in both bounds: its samples are
n rows of the engine's batch and n output rows. A row heavier than `max_rows` forms a batch
of its own. Longest first: with `--max-batch-tokens` the long rows' batches are the small
ones, and their rows start first.

Invariants: every row is in exactly one batch; the batches are a function of the rows and
the limits only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from nanoserve import InputError


class BatchRow(Protocol):
    position: int

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    # Optional: `n`, the samples it asks for (its weight in a batch; 1 when absent).


@dataclass(frozen=True)
class BatchLimits:
    max_rows: int  # samples per batch, at most
    max_batch_tokens: int | None = None  # rows x max(prompt + max_tokens), at most; None: no bound

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_batch_tokens"):
            value = getattr(self, name)
            if (value is not None or name == "max_rows") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")


def weight(row: BatchRow) -> int:
    """The samples a row asks for: its weight in a batch."""
    return getattr(row, "n", 1)


def batch_cost(rows: Iterable[BatchRow]) -> int:
    rows = list(rows)
    return sum(weight(r) for r in rows) * max(
        (r.num_prompt_tokens + r.max_tokens for r in rows), default=0)


def cut_batches(rows: list[BatchRow], limits: BatchLimits) -> list[list[BatchRow]]:
    """`rows`' batches: sorted by (prompt length descending, position) and cut greedily at
    the bounds (see the module docstring)."""
    batches: list[list[BatchRow]] = []
    current: list[BatchRow] = []
    samples = 0  # in `current`
    longest = 0  # max(prompt + max_tokens) over `current`
    for r in sorted(rows, key=lambda r: (-r.num_prompt_tokens, r.position)):
        need = r.num_prompt_tokens + r.max_tokens
        grown = max(longest, need)
        w = weight(r)
        too_many = samples + w > limits.max_rows
        too_big = (limits.max_batch_tokens is not None
                   and (samples + w) * grown > limits.max_batch_tokens)
        if current and (too_many or too_big):
            batches.append(current)
            current, grown, samples = [], need, 0
        current.append(r)
        samples += w
        longest = grown
    if current:
        batches.append(current)
    return batches
