"""Prefix caching's block bookkeeping (plain Python): block names, lookup, reference counts,
the cached-free LRU and the hash index, with exact block ids; and random admit / grow /
finish / preempt sequences held to a model of what each KV slot holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.cache.block_manager import BlockAllocator, BlockTable, check_integrity
from nanoserve.cache.prefix_cache import (
    ROOT_HASH,
    blocks_to_admit,
    hash_block,
    hash_blocks,
    lookup,
    max_cached_blocks,
)
from nanoserve.errors import CacheFullError


def written_row(alloc: BlockAllocator, tokens: list[int], block_size: int) -> BlockTable:
    """A row that prefilled `tokens` from scratch and named its full blocks."""
    table = BlockTable(block_size)
    table.append(len(tokens), alloc)
    table.register_full_blocks(tokens, alloc)
    return table


# --- block names ------------------------------------------------------------------------------


def test_block_names_chain_over_the_parent():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ha, hb = hash_blocks(a + b + [9], 4)
    assert ha == hash_block(ROOT_HASH, a) and hb == hash_block(ha, b)
    assert hash_blocks(b + a, 4)[1] != ha  # same tokens at another position: another block
    assert hash_block(ROOT_HASH, [1, 2, 3, 5]) != ha
    assert hash_block(ROOT_HASH, [2**40, -1]) != hash_block(ROOT_HASH, [0, -1])  # any int64
    assert hash_blocks(a + b, 4, max_blocks=1) == [ha]
    assert [max_cached_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


# --- lookup, with exact block ids -------------------------------------------------------------


def test_a_hit_takes_the_cached_run_and_prefills_the_rest():
    alloc = BlockAllocator(6)
    prompt = list(range(10))  # blocks 0, 1 full; block 2 holds 2 tokens
    a = written_row(alloc, prompt, 4)
    assert a.blocks == [0, 1, 2] and alloc.hash_index() == dict(zip(hash_blocks(prompt, 4), [0, 1]))
    assert lookup(alloc, prompt, 4) == [0, 1]
    assert lookup(alloc, prompt[:8] + [99, 98, 97], 4) == [0, 1]
    assert lookup(alloc, prompt[:4] + [0, 0, 0, 0, 1], 4) == [0]
    hit = lookup(alloc, prompt[:8] + [50, 51], 4)
    b = BlockTable(4)
    b.take_cached(hit, alloc)
    assert (b.num_tokens, alloc.ref_count(0), alloc.ref_count(1)) == (8, 2, 2)
    assert b.append(2, alloc) == [12, 13]  # the new tokens go to a block of its own: block 3
    assert b.blocks == [0, 1, 3]
    check_integrity(alloc, [a, b])
    a.free(alloc)  # blocks 0 and 1 stay held by b; a's partial block 2 is plainly free
    assert alloc.ref_count(0) == 1 and alloc.cached_free_blocks() == []
    assert alloc.free_blocks() == [4, 5, 2]
    check_integrity(alloc, [b])
    b.free(alloc)
    assert alloc.cached_free_blocks() == [1, 0] and alloc.num_free == 6
    check_integrity(alloc, [])


def test_a_miss_and_equal_tokens_at_another_position():
    alloc = BlockAllocator(8)
    prompt = [10, 11, 12, 13, 20, 21, 22, 23, 30]
    row = written_row(alloc, prompt, 4)
    assert lookup(alloc, [1, 2, 3, 4, 5], 4) == []  # nothing in common
    assert lookup(alloc, [20, 21, 22, 23, 30], 4) == []  # block 1's tokens, but at block 0
    assert lookup(alloc, [9, 9, 9, 9] + prompt[:4] + [30], 4) == []  # block 0's tokens at 1
    assert lookup(alloc, prompt[:4] + [9, 9, 9, 9, 9], 4) == [0]  # the parent alone matches
    check_integrity(alloc, [row])


def test_a_prompt_that_ends_on_a_block_boundary_prefills_its_last_block():
    alloc = BlockAllocator(6)
    prompt = list(range(100, 108))  # exactly two blocks
    a = written_row(alloc, prompt, 4)
    assert a.blocks == [0, 1] and len(alloc.hash_index()) == 2
    assert lookup(alloc, prompt, 4) == [0]  # the last block is prefilled: logits to sample from
    assert lookup(alloc, prompt[:4], 4) == []  # a one-block prompt takes nothing
    assert lookup(alloc, prompt + [7], 4) == [0, 1]
    b = BlockTable(4)
    b.take_cached(lookup(alloc, prompt, 4), alloc)
    assert b.append(4, alloc) == [8, 9, 10, 11]  # its own block 2, not the shared block 1
    # block 2 holds block 1's tokens too, but the name stays with block 1: b's copy is private
    assert b.register_full_blocks(prompt, alloc) == 1
    assert alloc.block_hash(2) is None and b.block_hashes == a.block_hashes
    check_integrity(alloc, [a, b])
    b.append(1, alloc)  # b's next token chains from its own names
    b.register_full_blocks(prompt + [5], alloc)
    a.free(alloc)
    b.free(alloc)
    assert alloc.cached_free_blocks() == [1, 0] and alloc.free_blocks() == [4, 5, 2, 3]
    check_integrity(alloc, [])


def test_eviction_takes_plain_free_blocks_first_then_the_oldest_cached():
    alloc = BlockAllocator(5)
    a = written_row(alloc, [1, 2, 3, 4, 5, 6], 2)  # blocks 0, 1, 2, all full and named
    a.free(alloc)
    # the row's tail is the oldest: evicted first (a block is useless without its parent)
    assert alloc.cached_free_blocks() == [2, 1, 0] and alloc.free_blocks() == [3, 4]
    assert alloc.num_free == 5 and alloc.num_cached_free == 3
    # a hit moves its blocks out of the LRU; freed again they are the newest
    b = BlockTable(2)
    hit = lookup(alloc, [1, 2, 3, 4, 9], 2)
    assert hit == [0, 1] and alloc.num_free_taken_by(hit) == 2
    b.take_cached(hit, alloc)
    assert alloc.cached_free_blocks() == [2] and alloc.num_free == 3
    b.free(alloc)
    assert alloc.cached_free_blocks() == [2, 1, 0]
    assert alloc.allocate(2) == [3, 4]  # plain free blocks first, the cache untouched
    assert len(alloc.hash_index()) == 3
    assert alloc.allocate(1) == [2]  # then the least recently used cached block
    assert alloc.block_hash(2) is None and len(alloc.hash_index()) == 2
    assert lookup(alloc, [1, 2, 3, 4, 5, 6, 7], 2) == [0, 1]  # its name is gone
    assert alloc.allocate(2) == [1, 0]
    assert lookup(alloc, [1, 2, 3], 2) == [] and alloc.hash_index() == {}
    with pytest.raises(CacheFullError):
        alloc.allocate(1)


def test_frees_are_checked_before_anything_changes():
    alloc = BlockAllocator(4)
    a = written_row(alloc, [1, 2, 3, 4], 2)
    b = BlockTable(2)
    b.take_cached([0], alloc)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free([0, 0, 0])  # held twice, freed three times
    assert alloc.ref_count(0) == 2
    with pytest.raises(RuntimeError, match="no name"):
        BlockTable(2).take_cached([2], alloc)  # block 2 is plainly free: never shared
    with pytest.raises(RuntimeError, match="empty table"):
        b.take_cached([0], alloc)
    check_integrity(alloc, [a, b])


def test_a_shared_or_named_block_is_never_written():
    alloc = BlockAllocator(4)
    a = written_row(alloc, [1, 2, 3, 4], 2)
    b = BlockTable(2)
    b.take_cached([0, 1], alloc)
    b.num_tokens = 3  # a bug that would append into shared block 1
    b.block_hashes.pop()
    with pytest.raises(RuntimeError, match="written while shared"):
        b.append(1, alloc)
    with pytest.raises(AssertionError, match="shared or named"):
        check_integrity(alloc, [a, b])
    a.free(alloc)
    a.blocks, a.num_tokens = [1], 1  # a private table over a block that is named
    alloc._ref[1] = 1  # (what a broken take would leave)
    with pytest.raises(RuntimeError, match="written while shared or named"):
        a.append(1, alloc)


def test_integrity_check_catches_each_broken_invariant():
    def fresh():
        alloc = BlockAllocator(6)
        rows = [written_row(alloc, [1, 2, 3, 4, 5], 2)]
        rows.append(BlockTable(2))
        rows[1].take_cached([0, 1], alloc)
        rows[0].free(alloc)
        rows[0] = written_row(alloc, [7, 8, 9], 2)
        check_integrity(alloc, rows)
        return alloc, rows

    alloc, rows = fresh()
    alloc._ref[0] += 1
    with pytest.raises(AssertionError, match="reference count"):
        check_integrity(alloc, rows)
    alloc, rows = fresh()
    rows[1].free(alloc)
    alloc._evictable.pop(alloc.cached_free_blocks()[0])  # a cached block lost
    with pytest.raises(AssertionError, match="leak"):
        check_integrity(alloc, rows)
    alloc, rows = fresh()
    alloc._index[b"x" * 32] = 5  # the index names a block that does not carry the name
    with pytest.raises(AssertionError, match="hash index"):
        check_integrity(alloc, rows)
    alloc, rows = fresh()
    rows[1].free(alloc)
    block = alloc.cached_free_blocks()[0]
    del alloc._evictable[block]
    alloc._free.append(block)  # a named block on the plain free list
    alloc._free_set.add(block)
    with pytest.raises(AssertionError, match="named block on the free list"):
        check_integrity(alloc, rows)
    alloc, rows = fresh()
    rows[1].block_hashes.reverse()
    with pytest.raises(AssertionError, match="expects another name"):
        check_integrity(alloc, rows)


# --- random sequences against a model of the KV contents ---------------------------------------

BLOCK_SIZE = 3
NUM_BLOCKS = 8
NUM_ROWS = 4
# Prompts are one of a few shared heads plus a short tail, over a small vocabulary, so hits,
# partial hits, duplicates and evictions all happen.
HEADS = [[], [1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 1, 2, 3, 8, 8, 8, 9]]


class Pool:
    """The allocator plus a model of what each slot holds: the slot of position p of a row
    holds `tuple(tokens[:p + 1])`, everything its keys and values depend on."""

    def __init__(self) -> None:
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.contents: dict[int, list] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.running: dict[int, tuple[BlockTable, list[int]]] = {}
        self.waiting: dict[int, list[int]] = {}  # preempted rows: their tokens so far
        self.named: dict[bytes, tuple] = {}  # a name -> the prefix its block must hold
        self.cached_tokens = 0

    def write(self, table: BlockTable, tokens: list[int], start: int) -> None:
        for p in range(start, table.num_tokens):
            block = table.blocks[p // BLOCK_SIZE]
            assert self.alloc.ref_count(block) == 1 and self.alloc.block_hash(block) is None
            self.contents[block][p % BLOCK_SIZE] = tuple(tokens[: p + 1])
        table.register_full_blocks(tokens, self.alloc)
        for i, name in enumerate(table.block_hashes):
            self.named.setdefault(name, tuple(tokens[: (i + 1) * BLOCK_SIZE]))

    def admit(self, row: int, head: int, tail: int) -> None:
        if row in self.running:
            return
        tokens = self.waiting.pop(row, None) or HEADS[head] + [10 + row, tail][: 1 + tail % 2]
        table = BlockTable(BLOCK_SIZE)
        hit = lookup(self.alloc, tokens, BLOCK_SIZE)
        assert len(hit) <= max_cached_blocks(len(tokens), BLOCK_SIZE)
        if blocks_to_admit(self.alloc, hit, len(tokens), BLOCK_SIZE) > self.alloc.num_free:
            # all or nothing: the row waits, and nothing changed
            self.waiting[row] = tokens
            return
        table.take_cached(hit, self.alloc)
        self.cached_tokens += table.num_tokens
        table.append(len(tokens) - table.num_tokens, self.alloc)  # fits: blocks_to_admit
        self.write(table, tokens, len(hit) * BLOCK_SIZE)
        self.running[row] = (table, tokens)

    def grow(self, row: int, n: int) -> None:
        if row not in self.running:
            return
        table, tokens = self.running[row]
        before = (list(table.blocks), table.num_tokens, self.alloc.num_free)
        try:
            table.append(n, self.alloc)
        except CacheFullError:
            assert (table.blocks, table.num_tokens, self.alloc.num_free) == before
            return
        tokens.extend((7 * len(tokens) + row) % 5 for _ in range(n))
        self.write(table, tokens, before[1])

    def release(self, row: int, preempt: bool) -> None:
        if row not in self.running:
            return
        table, tokens = self.running.pop(row)
        table.free(self.alloc)
        if preempt:
            self.waiting[row] = tokens

    def check(self) -> None:
        tables = [t for t, _ in self.running.values()]
        check_integrity(self.alloc, tables)
        for table, tokens in self.running.values():  # every row reads exactly its own past
            for p in range(table.num_tokens):
                held = self.contents[table.blocks[p // BLOCK_SIZE]][p % BLOCK_SIZE]
                assert held == tuple(tokens[: p + 1])
        for name, block in self.alloc.hash_index().items():  # every cached block is right
            assert tuple(self.contents[block][-1]) == self.named[name]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "grow", "grow", "finish", "preempt"]),
        st.integers(0, NUM_ROWS - 1),
        st.integers(0, len(HEADS) - 1),
        st.integers(0, 4),
    ),
    min_size=1,
    max_size=60,
)


def run_ops(ops) -> Pool:
    pool = Pool()
    for kind, row, a, b in ops:
        if kind == "admit":
            pool.admit(row, a, b)
        elif kind == "grow":
            pool.grow(row, b)
        else:
            pool.release(row, preempt=kind == "preempt")
        pool.check()
    for row in list(pool.running):
        pool.release(row, preempt=False)
    pool.check()
    assert pool.alloc.num_free == NUM_BLOCKS  # every block returned
    assert all(pool.alloc.ref_count(b) == 0 for b in range(NUM_BLOCKS))
    return pool


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_admit_grow_finish_preempt_keeps_every_invariant(ops):
    run_ops(ops)


def test_a_fixed_sequence_hits_the_cache_and_evicts():
    """The random test's model, on one sequence that surely shares, preempts and evicts."""
    ops = [("admit", 0, 3, 0), ("admit", 1, 3, 1), ("grow", 0, 0, 4), ("preempt", 1, 0, 0),
           ("admit", 2, 2, 0), ("grow", 2, 0, 4), ("grow", 2, 0, 4), ("admit", 1, 0, 0),
           ("finish", 0, 0, 0), ("admit", 3, 1, 3), ("grow", 3, 0, 4), ("grow", 1, 0, 4),
           ("admit", 0, 3, 2)]  # fmt: skip
    pool = run_ops(ops)
    assert pool.cached_tokens >= 3 * BLOCK_SIZE
    assert pool.alloc.num_cached_free > 0


# --- the bookkeeping and the paged prefill together ---------------------------------------------


def test_rows_sharing_cached_blocks_attend_like_dense_prefill():
    """Rows admitted through `lookup` / `take_cached`, whose new tokens' K/V are stored at the
    slots `append` gave them, get from the paged prefill reference exactly what dense causal
    attention over their whole prompt gives; corrupting one cached block breaks the rows that
    share it and only those. K/V at position p depend on every token up to p, as a model's do,
    so a block shared on equal tokens after another parent would show."""
    import torch
    import torch.nn.functional as F

    from nanoserve_kernels.kv_store import store_kv_reference
    from nanoserve_kernels.paged_prefill import paged_prefill_attention_reference

    bs, hkv, group, dim = 4, 2, 2, 8
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn((3, 50, hkv, dim), dtype=torch.float64, generator=gen)  # q, k, v tables

    def dense(tokens):  # [3, T, H, D]: a running mix of every token so far
        out, state = [], torch.zeros((3, hkv, dim), dtype=torch.float64)
        for t in tokens:
            state = 0.7 * state + emb[:, t]
            out.append(state.clone())
        return torch.stack(out, dim=1)

    alloc = BlockAllocator(16)
    k_cache = torch.zeros((16, bs, hkv, dim), dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)

    def prefill(prompts):
        tables, q_new, hits = [], [], []
        for tokens in prompts:
            table = BlockTable(bs)
            table.take_cached(lookup(alloc, tokens, bs), alloc)
            cached = table.num_tokens
            slots = table.append(len(tokens) - cached, alloc)
            qkv = dense(tokens)
            store_kv_reference(qkv[1, cached:], qkv[2, cached:], k_cache, v_cache,
                               torch.tensor(slots))  # fmt: skip
            q_new.append(qkv[0, cached:].repeat_interleave(group, dim=1))
            tables.append(table)
            hits.append(cached)
        for table, tokens in zip(tables, prompts):  # named after the step that wrote them
            table.register_full_blocks(tokens, alloc)
        width = max(len(t.blocks) for t in tables)
        block_tables = torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t in tables],
                                    dtype=torch.int32)  # fmt: skip
        new = [len(p) - c for p, c in zip(prompts, hits)]
        cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int32)
        args = (torch.cat(q_new), k_cache, v_cache, block_tables, cu, lens, max(new), 0.3)
        return tables, hits, cu, args

    def expected(tokens, cached):
        qkv = dense(tokens)
        q = qkv[0].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in qkv[1:])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return out.transpose(0, 1)[cached:]

    head = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    first, _, _, _ = prefill([head + [11]])
    prompts = [
        head + [12, 13],  # shares two blocks
        head[:8],  # ends on a block boundary: takes one block, prefills the second
        [1, 2, 3, 4, 9, 9, 9, 9, 9],  # shares one block
        [0, 2, 3, 4, 5, 6, 7, 8, 9],  # the same blocks' tokens after another first token: a miss
        [40, 41, 42, 43] + head[4:8],  # block 1's tokens after another parent: a miss
        head[4:8] + [9],  # block 1's tokens at position 0: a miss
    ]
    tables, hits, cu, args = prefill(prompts)
    assert hits == [8, 4, 4, 0, 0, 0]
    out = paged_prefill_attention_reference(*args)
    bounds = cu.tolist()
    for i, tokens in enumerate(prompts):
        torch.testing.assert_close(out[bounds[i] : bounds[i + 1]], expected(tokens, hits[i]))
    check_integrity(alloc, first + tables)

    k_cache[first[0].blocks[0]] += 0.5  # corrupt the shared first block
    bad = paged_prefill_attention_reference(*args)
    for i in range(len(prompts)):
        rows = slice(bounds[i], bounds[i + 1])
        assert torch.equal(bad[rows], out[rows]) == (hits[i] == 0)
