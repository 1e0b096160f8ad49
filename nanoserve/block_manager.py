"""Block bookkeeping for the paged KV cache, in plain Python (no torch).

Physical KV memory is cut into blocks of `block_size` token slots. One
`BlockAllocator` hands blocks out of a free list; each sequence owns one append-only
`BlockTable` mapping its logical blocks to physical ones:

    sequence A table: [0, 1, 2, 6]    logical slot p -> physical slot
    sequence B table: [3, 5]           table[p // block_size] * block_size + p % block_size
    sequence C table: [4]
    free list:        [7, 8, 9, ...]

Invariants (checked by `check_integrity`): every block is either free or owned by
exactly one table, never both, never twice; free + owned = total.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from nanoserve.errors import CacheFullError


class BlockAllocator:
    """Free list of physical block ids, handed out in FIFO order."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n blocks, or CacheFullError and nothing taken."""
        if n > len(self._free):
            raise CacheFullError(f"KV cache needs {n} free blocks, has {len(self._free)}")
        out = [self._free.popleft() for _ in range(n)]
        self._free_set.difference_update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b in self._free_set or not (0 <= b < self.num_blocks):
                raise RuntimeError(f"block {b} freed twice or out of range")
            self._free.append(b)
            self._free_set.add(b)

    def free_blocks(self) -> list[int]:
        return list(self._free)


class BlockTable:
    """The blocks of one sequence in logical order; grows by `append`, empties by `free`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.num_tokens = 0  # token slots reserved and written (or being written this step)

    def blocks_needed(self, num_new_tokens: int) -> int:
        total = self.num_tokens + num_new_tokens
        return -(-total // self.block_size) - len(self.blocks)

    def append(self, num_new_tokens: int, allocator: BlockAllocator) -> list[int]:
        """Reserve room for `num_new_tokens` more tokens (all or nothing) and return
        the physical slots they occupy, in order."""
        need = self.blocks_needed(num_new_tokens)
        if need > 0:
            self.blocks.extend(allocator.allocate(need))
        start = self.num_tokens
        self.num_tokens += num_new_tokens
        return [self.slot(p) for p in range(start, self.num_tokens)]

    def slot(self, position: int) -> int:
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self) -> list[int]:
        return [self.slot(p) for p in range(self.num_tokens)]

    def free(self, allocator: BlockAllocator) -> None:
        allocator.free(self.blocks)
        self.blocks = []
        self.num_tokens = 0


def reserve_all_or_nothing(
    tables: list[BlockTable], num_new_tokens: list[int], allocator: BlockAllocator
) -> list[list[int]]:
    """Grow every table by its row's count, or raise CacheFullError with every table
    and the free list untouched: the whole batch's demand is checked first."""
    demand = sum(t.blocks_needed(n) for t, n in zip(tables, num_new_tokens))
    if demand > allocator.num_free:
        raise CacheFullError(
            f"KV cache needs {demand} free blocks for this step, has {allocator.num_free}"
        )
    return [t.append(n, allocator) for t, n in zip(tables, num_new_tokens)]


def check_integrity(allocator: BlockAllocator, tables: Iterable[BlockTable]) -> None:
    """Raise AssertionError unless every block is free or owned by exactly one table."""
    owned: list[int] = [b for t in tables for b in t.blocks]
    free = allocator.free_blocks()
    owned_set, free_set = set(owned), set(free)
    if len(owned_set) != len(owned):
        raise AssertionError("a block is owned twice")
    if len(free_set) != len(free):
        raise AssertionError("a block is on the free list twice")
    if owned_set & free_set:
        raise AssertionError(f"blocks both free and owned: {sorted(owned_set & free_set)[:8]}")
    if len(owned) + len(free) != allocator.num_blocks:
        raise AssertionError(
            f"leak: {len(owned)} owned + {len(free)} free != {allocator.num_blocks} total"
        )
    for t in tables:
        if len(t.blocks) * t.block_size < t.num_tokens:
            raise AssertionError("a table holds more tokens than its blocks have room for")
