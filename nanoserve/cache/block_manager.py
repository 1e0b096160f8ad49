"""Block bookkeeping for the paged KV cache, in plain Python (no torch).

Physical KV memory is cut into blocks of `block_size` token slots. One
`BlockAllocator` hands blocks out and counts references to them; each sequence holds one
append-only `BlockTable` mapping its logical blocks to physical ones:

    sequence A table: [0, 1, 2, 6]    logical slot p -> physical slot
    sequence B table: [0, 1, 5]        table[p // block_size] * block_size + p % block_size
    sequence C table: [4]
    reference counts: 0 -> 2, 1 -> 2, 2 -> 1, 4 -> 1, 5 -> 1, 6 -> 1
    free list:        [7, 8, 9, ...]   (no hash: handed out first, oldest first)
    cached-free LRU:  [3]              (a finished row's full block that keeps its hash)

Prefix caching (see `nanoserve.cache.prefix_cache`): a full block whose tokens are written gets a
name, a hash chained over its parent's name and its token ids; the allocator indexes named
blocks, so a new row can take the blocks of a prompt prefix another row wrote (A and B share
blocks 0 and 1 above). A block whose last reference goes keeps its name and waits in the
cached-free LRU; it is evicted (its name dropped) only when no plain free block is left.

Invariants (checked by `check_integrity`):
- every block is in exactly one state: held (reference count = the number of tables that
  hold it, > 0), free (count 0, no name) or cached-free (count 0, a name);
  held + free + cached-free = total; no table holds a block twice;
- the hash index maps each name to exactly the block that carries it;
- only full, written blocks carry names, and only full blocks are shared (named ones through
  the prefix cache, or the prompt blocks of a row's n samples, `BlockTable.fork`): a
  table's partial (or not yet written) blocks are its own (count 1, no name), so a block
  is never written while shared.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from nanoserve.cache.prefix_cache import ROOT_HASH, hash_blocks
from nanoserve.errors import CacheFullError


class BlockAllocator:
    """Physical block ids with reference counts: a FIFO free list of unnamed blocks, an LRU of
    named blocks nobody holds (evicted oldest first, only when the free list is empty), and
    the index from a block's name (hash) to the block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(self._free)
        self._ref = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_of: dict[int, bytes] = {}  # named block -> its hash
        self._index: dict[bytes, int] = {}  # hash -> the named block

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: plain free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n private blocks (count 1, unnamed), or CacheFullError and nothing taken. Plain
        free blocks go first; then the least recently freed cached blocks are evicted."""
        if n > self.num_free:
            raise CacheFullError(f"KV cache needs {n} free blocks, has {self.num_free}")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
                self._free_set.discard(block)
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._index[self._hash_of.pop(block)]
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block (a table's blocks, in logical order). A block
        whose count reaches 0 goes to the free list, or, if it has a name, to the LRU's
        newest end, last block first: a block is useless without its parent, so a row's
        tail is evicted before its head. Checks everything before changing anything."""
        blocks = list(blocks)
        for block, times in Counter(blocks).items():
            if not (0 <= block < self.num_blocks) or times > self._ref[block]:
                raise RuntimeError(f"block {block} freed twice or out of range")
        released = []
        for block in blocks:
            self._ref[block] -= 1
            if self._ref[block] == 0:
                released.append(block)
        for block in released:
            if block not in self._hash_of:
                self._free.append(block)
                self._free_set.add(block)
        for block in reversed(released):
            if block in self._hash_of:
                self._evictable[block] = None

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each named block (a prefix-cache hit); a block that waited in
        the cached-free LRU leaves it."""
        for block in blocks:
            if block not in self._hash_of:
                raise RuntimeError(f"block {block} has no name: only cached blocks are shared")
        for block in blocks:
            self._ref[block] += 1
            self._evictable.pop(block, None)

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each held block, named or not (a forked sample sharing its
        prompt's full blocks). Only blocks somebody holds can be shared."""
        for block in blocks:
            if self._ref[block] < 1:
                raise RuntimeError(f"block {block} is not held: only held blocks are shared")
        for block in blocks:
            self._ref[block] += 1

    def num_free_taken_by(self, blocks: Sequence[int]) -> int:
        """How many free blocks `take(blocks)` would use up (those waiting in the LRU): what an
        admission must count next to the blocks it allocates."""
        return sum(1 for b in set(blocks) if self._ref[b] == 0)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Name a held block whose tokens are written. False (and the block stays unnamed,
        private) when another block already carries the name: the first one stays cached."""
        if self._ref[block] == 0:
            raise RuntimeError(f"block {block} is not held: only written blocks get a name")
        if block in self._hash_of:
            if self._hash_of[block] != block_hash:
                raise RuntimeError(f"block {block} is already named for other tokens")
            return True
        if block_hash in self._index:
            return False
        self._hash_of[block] = block_hash
        self._index[block_hash] = block
        return True

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block named `block_hash`, held or cached-free, or None."""
        return self._index.get(block_hash)

    def free_blocks(self) -> list[int]:
        """The plain free list (unnamed blocks), in the order `allocate` takes them."""
        return list(self._free)

    def cached_free_blocks(self) -> list[int]:
        """The named blocks nobody holds, oldest (next to be evicted) first."""
        return list(self._evictable)

    def hash_index(self) -> dict[bytes, int]:
        return dict(self._index)


class BlockTable:
    """The blocks of one sequence in logical order; grows by `append`, empties by `free`.

    `block_hashes[i]` names logical block i, for the leading full blocks whose tokens are
    known (taken from the cache or registered); a registered block whose name another block
    already carries keeps its name here (its children chain from it) but stays private."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.num_tokens = 0  # token slots reserved and written (or being written this step)
        self.block_hashes: list[bytes] = []

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Free blocks that `append(num_new_tokens)` takes: never negative (a table may hold
        blocks reserved ahead of its tokens, which must not lower a batch's demand)."""
        total = self.num_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(self.blocks))

    def append(self, num_new_tokens: int, allocator: BlockAllocator) -> list[int]:
        """Reserve room for `num_new_tokens` more tokens (all or nothing) and return
        the physical slots they occupy, in order."""
        if num_new_tokens > 0 and self.num_tokens % self.block_size:
            tail = self.blocks[self.num_tokens // self.block_size]
            if allocator.ref_count(tail) != 1 or allocator.block_hash(tail) is not None:
                raise RuntimeError(f"block {tail} would be written while shared or named")
        need = self.blocks_needed(num_new_tokens)
        if need > 0:
            self.blocks.extend(allocator.allocate(need))
        start = self.num_tokens
        self.num_tokens += num_new_tokens
        return self._slots_between(start, self.num_tokens)

    def _slots_between(self, start: int, end: int) -> list[int]:
        """The physical slots of positions start..end-1, `[self.slot(p) for p in
        range(start, end)]`, built a block's run at a time (a prefill's thousands of
        tokens are a few hundred ranges)."""
        bs, out = self.block_size, []
        p = start
        while p < end:
            i, off = divmod(p, bs)
            n = min(end - p, bs - off)
            base = self.blocks[i] * bs + off
            out.extend(range(base, base + n))
            p += n
        return out

    def take_cached(self, blocks: Sequence[int], allocator: BlockAllocator) -> None:
        """Start an empty table from cached blocks (`prefix_cache.lookup`'s answer): one more
        reference each, and their tokens count as written."""
        if self.blocks:
            raise RuntimeError("only an empty table starts from cached blocks")
        allocator.take(blocks)
        self.blocks = list(blocks)
        self.num_tokens = len(blocks) * self.block_size
        self.block_hashes = [allocator.block_hash(b) for b in blocks]  # type: ignore[misc]

    def fork(self, allocator: BlockAllocator) -> tuple[BlockTable, tuple[int, int] | None]:
        """A new table holding the same tokens (another sample of the same prompt): the full
        blocks are shared (one more reference each), and a partly filled last block, which
        both tables will write, is copied into a fresh block. Returns the new table and the
        (source, destination) block whose K/V the caller must copy, if any. Raises
        CacheFullError, changing nothing, when no block is free for the copy."""
        full = self.num_tokens // self.block_size
        tail = len(self.blocks) > full
        fresh = allocator.allocate(1) if tail else []
        allocator.share(self.blocks[:full])
        child = BlockTable(self.block_size)
        child.blocks = self.blocks[:full] + fresh
        child.num_tokens = self.num_tokens
        child.block_hashes = list(self.block_hashes[:full])
        return child, ((self.blocks[full], fresh[0]) if tail else None)

    def register_full_blocks(self, token_ids: Sequence[int], allocator: BlockAllocator,
                             names: Sequence[bytes] | None = None) -> int:
        """Name the full blocks written since the last call; `token_ids` are the sequence's
        tokens from position 0 (prompt, then generated). Call after the step that wrote them.
        names: `hash_blocks(token_ids, block_size)` when the caller has it already (used
        where it covers the blocks, not recomputed). Returns how many blocks got a name
        here."""
        num_full = min(self.num_tokens, len(token_ids)) // self.block_size
        start = len(self.block_hashes)
        if num_full <= start:
            return 0
        if names is not None and len(names) >= num_full:
            fresh = names[start:num_full]
        else:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            new = token_ids[start * self.block_size : num_full * self.block_size]
            fresh = hash_blocks(new, self.block_size, parent)
        for i, name in enumerate(fresh, start):
            self.block_hashes.append(name)
            allocator.register(self.blocks[i], name)
        return max(0, num_full - start)

    def slot(self, position: int) -> int:
        return (
            self.blocks[position // self.block_size] * self.block_size + position % self.block_size
        )

    def slots(self) -> list[int]:
        return self._slots_between(0, self.num_tokens)

    def free(self, allocator: BlockAllocator) -> None:
        allocator.free(self.blocks)
        self.blocks = []
        self.num_tokens = 0
        self.block_hashes = []


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


def decode_demand(tables: list[BlockTable]) -> int:
    """Free blocks a decode step of these tables takes, `sum(t.blocks_needed(1))`, in one
    pass (a table needs a block when its tokens fill every block it holds)."""
    return sum(1 for t in tables if len(t.blocks) <= t.num_tokens // t.block_size)


def reserve_one_each(tables: list[BlockTable], allocator: BlockAllocator) -> list[int]:
    """A decode step's reservation: one token slot for every table, all or nothing; the same
    as `[s[0] for s in reserve_all_or_nothing(tables, [1] * len(tables), allocator)]` (the
    same blocks, taken in the same order, the same checks), as one loop over the rows: it
    runs for every row of every step. The tables share `allocator`'s block size."""
    if not tables:
        return []
    bs = tables[0].block_size
    demand = decode_demand(tables)
    if demand > allocator.num_free:
        raise CacheFullError(
            f"KV cache needs {demand} free blocks for this step, has {allocator.num_free}"
        )
    fresh = iter(allocator.allocate(demand))
    ref, named = allocator._ref, allocator._hash_of
    slots = []
    for t in tables:
        n = t.num_tokens
        i = n // bs
        off = n - i * bs
        blocks = t.blocks
        if i == len(blocks):
            blocks.append(next(fresh))
        elif off and (ref[blocks[i]] != 1 or blocks[i] in named):
            raise RuntimeError(f"block {blocks[i]} would be written while shared or named")
        slots.append(blocks[i] * bs + off)
        t.num_tokens = n + 1
    return slots


def check_integrity(allocator: BlockAllocator, tables: Iterable[BlockTable]) -> None:
    """Raise AssertionError unless the invariants in this module's docstring hold for the
    allocator and the tables holding its blocks (all of them)."""
    tables = list(tables)
    held = Counter(b for t in tables for b in t.blocks)
    free, cached = allocator.free_blocks(), allocator.cached_free_blocks()
    free_set, cached_set = set(free), set(cached)
    if len(free_set) != len(free):
        raise AssertionError("a block is on the free list twice")
    if free_set & cached_set:
        raise AssertionError(
            f"blocks both free and cached-free: {sorted(free_set & cached_set)[:8]}"
        )
    idle = free_set | cached_set
    for block in range(allocator.num_blocks):
        ref, holders = allocator.ref_count(block), held.get(block, 0)
        named = allocator.block_hash(block) is not None
        if ref != holders:
            raise AssertionError(f"block {block}: reference count {ref}, held by {holders} tables")
        if (ref > 0) == (block in idle):
            state = "held and free" if ref > 0 else "neither held nor free (a leak)"
            raise AssertionError(f"block {block} is {state}")
        if block in free_set and named or block in cached_set and not named:
            raise AssertionError(f"block {block}: a named block on the free list or the reverse")
    if len(held) + len(idle) != allocator.num_blocks:
        raise AssertionError(
            f"leak: {len(held)} held + {len(idle)} free != {allocator.num_blocks} total"
        )
    index = allocator.hash_index()
    named_blocks = [b for b in range(allocator.num_blocks) if allocator.block_hash(b) is not None]
    if len(named_blocks) != len(index) or any(
        allocator.block_hash(b) != h for h, b in index.items()
    ):
        raise AssertionError("the hash index and the blocks' names disagree")
    for t in tables:
        if len(set(t.blocks)) != len(t.blocks):
            raise AssertionError("a table holds a block twice")
        if len(t.blocks) * t.block_size < t.num_tokens:
            raise AssertionError("a table holds more tokens than its blocks have room for")
        num_full = t.num_tokens // t.block_size
        if len(t.block_hashes) > num_full:
            raise AssertionError("a table names a block that is not full")
        for i, block in enumerate(t.blocks):
            name = allocator.block_hash(block)
            if i >= num_full and (name is not None or allocator.ref_count(block) != 1):
                raise AssertionError(f"block {block}, partial or unwritten, is shared or named")
            if name is not None and (i >= len(t.block_hashes) or t.block_hashes[i] != name):
                raise AssertionError(f"block {block} sits where the table expects another name")
