"""Stage preparation: static batches by token length. A worker whose engine is static cuts
its shard's rows this way (`ray_jobs.tasks.generate.GenerateTask.groups`: one window, the whole
shard); a continuous engine needs no batches (it admits rows as others finish).

Rows arrive in input order. They are taken a window at a time (`window_rows`, by default 8
batches' worth); within a window the rows that can be generated are sorted by prompt length,
longest first (ties by input position), and cut, in that order, into batches bounded by

- `batch_size` rows, and
- `max_batch_tokens` (if set): a batch's cost is `rows x max(prompt tokens + max_tokens)`,
  the padded rectangle of a static batch run to its longest possible end. It bounds both
  the prefill rectangle (rows x longest prompt) and the KV slots the batch can ever need.
  A single row costlier than the bound forms a batch of its own.
A row asking for n samples (`n`, default 1) weighs n rows in both bounds: its samples are
n rows of the engine's batch and n output rows. A row heavier than `batch_size` forms a
batch of its own.

The window's error rows form their own batches first (a worker makes them itself: they
never reach the engine). Longest first: with `--max-batch-tokens` the long rows' batches
are the small ones, and their rows start first.

Invariants: every row is in exactly one batch; batch ids count up from 0 in emission order;
the batches (ids, rows, order) are a function of the input rows and the limits only, so a
rerun of the same job rebuilds the same batches (what resuming relies on). Memory holds one
window.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from nanoserve import InputError

WINDOW_BATCHES = 8  # default window: this many full batches of rows


class BatchRow(Protocol):
    position: int
    error: str | None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    # Optional: `n`, the samples it asks for (its weight in a batch; 1 when absent).


@dataclass(frozen=True)
class BatchLimits:
    batch_size: int  # rows per batch, at most
    max_batch_tokens: int | None = None  # rows x max(prompt + max_tokens), at most; None: no bound
    window_rows: int | None = None  # rows sorted together; None: WINDOW_BATCHES x batch_size

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InputError(f"batch size must be an integer >= 1, got {self.batch_size!r}")
        if self.max_batch_tokens is not None and (
            not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < 1
        ):
            raise InputError(f"max batch tokens must be an integer >= 1, got {self.max_batch_tokens!r}")
        if self.window_rows is None:
            object.__setattr__(self, "window_rows", WINDOW_BATCHES * self.batch_size)
        if self.window_rows < 1:
            raise InputError(f"window rows must be >= 1, got {self.window_rows!r}")


@dataclass(frozen=True)
class Batch:
    batch_id: int
    rows: tuple  # of BatchRow, in the order they are generated and written

    @property
    def is_error(self) -> bool:
        """An error batch holds only rows prepared as errors; it goes to no worker."""
        return self.rows[0].error is not None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.rows)

    @property
    def padded_prompt_tokens(self) -> int:
        """The prefill rectangle: rows x longest prompt."""
        return len(self.rows) * max(r.num_prompt_tokens for r in self.rows)

    @property
    def cost(self) -> int:
        return batch_cost(self.rows)

    def digest(self) -> str:
        """A short hash of which rows the batch holds and how long they are: a rerun that
        rebuilds a different batch under the same id is detected by it."""
        h = hashlib.sha256()
        for r in self.rows:
            samples = f"x{weight(r)}" if weight(r) != 1 else ""
            h.update(f"{r.position}:{r.num_prompt_tokens}:{r.error is not None}{samples};"
                     .encode())
        return h.hexdigest()[:16]

    @property
    def num_samples(self) -> int:
        """Output rows it gives: one per sample."""
        return sum(weight(r) for r in self.rows)


def weight(row: BatchRow) -> int:
    """The samples a row asks for: its weight in a batch."""
    return getattr(row, "n", 1)


def batch_cost(rows: Iterable[BatchRow]) -> int:
    rows = list(rows)
    return sum(weight(r) for r in rows) * max(
        (r.num_prompt_tokens + r.max_tokens for r in rows), default=0)


def make_batches(rows: Iterable[BatchRow], limits: BatchLimits) -> Iterator[Batch]:
    """Group `rows` (in input order) into batches; see the module docstring."""
    next_id = 0
    window: list[BatchRow] = []
    for row in rows:
        window.append(row)
        if len(window) == limits.window_rows:
            for group in cut_window(window, limits):
                yield Batch(next_id, tuple(group))
                next_id += 1
            window = []
    for group in cut_window(window, limits):
        yield Batch(next_id, tuple(group))
        next_id += 1


def cut_window(window: list[BatchRow], limits: BatchLimits) -> list[list[BatchRow]]:
    """One window's batches: its error rows first (in input order), then the other rows
    sorted by (prompt length descending, position) and cut greedily at the bounds."""
    errors = [r for r in window if r.error is not None]
    good = sorted((r for r in window if r.error is None),
                  key=lambda r: (-r.num_prompt_tokens, r.position))
    groups: list[list[BatchRow]] = []
    current: list[BatchRow] = []
    rows = 0  # samples in `current`
    for r in errors:
        if current and rows + weight(r) > limits.batch_size:
            groups.append(current)
            current, rows = [], 0
        current.append(r)
        rows += weight(r)
    if current:
        groups.append(current)
    current, rows = [], 0
    longest = 0  # max(prompt + max_tokens) over `current`
    for r in good:
        need = r.num_prompt_tokens + r.max_tokens
        grown = max(longest, need)
        w = weight(r)
        too_many = rows + w > limits.batch_size
        too_big = limits.max_batch_tokens is not None and (rows + w) * grown > limits.max_batch_tokens
        if current and (too_many or too_big):
            groups.append(current)
            current, grown, rows = [], need, 0
        current.append(r)
        rows += w
        longest = grown
    if current:
        groups.append(current)
    return groups
