"""The paged KV cache: one shared pool, one block table per sequence.

Oracles: plain per-row attention written out here in float64 over each row's own
slots; a per-row PagedKVCache; a dense-cache generation; and exact block ids."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.cache.block_manager import BlockAllocator, BlockTable, check_integrity
from nanoserve.cache.pool import BatchedPagedKVCache, CacheShape, KVPool, PagedKVCache
from nanoserve.errors import CacheFullError
from nanoserve.sampling.params import SamplingParams
from nanoserve.static.generate import (
    generate_batch,
    greedy_generate,
    greedy_generate_batch,
    pool_for,
)

SHAPE = CacheShape(num_layers=2, num_kv_heads=2, head_dim=8)
HQ = 6  # query heads: GQA ratio 3


def prefill(cache: BatchedPagedKVCache, lens: list[int], seed: int = 0):
    """Write random K/V for rows of the given lengths through a masked prefill on
    every layer; returns the per-row real K/V [layer][row] -> ([n, Hkv, D], [n, Hkv, D])."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lens), max(lens)
    valid = torch.arange(T)[None] < torch.tensor(lens)[:, None]
    real = []
    for layer in range(SHAPE.num_layers):
        k = torch.randn(B, T, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        v = torch.randn(B, T, SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
        cache.write(layer, k, v, valid)
        real.append([(k[i, :n], v[i, :n]) for i, n in enumerate(lens)])
    return real


def attention_oracle(q, k, v):
    """q [Hq, D], k/v [n, Hkv, D] -> [Hq, D], float64, written out longhand."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        kh, vh = k[:, h // group], v[:, h // group]  # [n, D]
        w = torch.softmax(kh @ q[h] / math.sqrt(q.shape[1]), dim=0)
        out[h] = w @ vh
    return out


def test_batched_read_equals_each_row_alone():
    pool = KVPool(SHAPE, num_blocks=20, block_size=4)
    lens = [5, 16, 1, 9]
    cache = BatchedPagedKVCache(pool, len(lens))
    real = prefill(cache, lens)
    q = torch.randn(len(lens), HQ, SHAPE.head_dim)
    for layer in range(SHAPE.num_layers):
        out = cache.paged_attention(layer, q)
        for i in range(len(lens)):
            ref = attention_oracle(q[i], *real[layer][i])
            assert torch.allclose(out[i].double(), ref, atol=1e-5)
    cache.check_integrity()


def test_batched_cache_equals_per_row_paged_caches():
    lens = [3, 8, 13]
    batched = BatchedPagedKVCache(KVPool(SHAPE, 12, 4), len(lens))
    prefill(batched, lens, seed=1)
    slots, ctx = batched.slot_mapping()
    assert ctx.tolist() == lens
    g = torch.Generator().manual_seed(1)
    T = max(lens)
    ks = [torch.randn(len(lens), T, 2, 8, generator=g) for _ in range(4)]  # k0 v0 k1 v1
    for i, n in enumerate(lens):
        single = PagedKVCache(KVPool(SHAPE, 12, 4))
        for layer in range(2):
            k, v = ks[2 * layer][i:i + 1, :n], ks[2 * layer + 1][i:i + 1, :n]
            single.write(layer, k, v, torch.ones(1, n, dtype=torch.bool))
        s_slots, _ = single.slot_mapping()
        for layer in range(2):
            kb = batched.pool.flat(layer)[0][slots[i, :n]]
            ksingle = single.pool.flat(layer)[0][s_slots[0, :n]]
            assert torch.equal(kb, ksingle)


def test_pad_slot_value_does_not_move_outputs():
    """Padding addresses slot 0, a real access in the reference: a huge value there must
    not reach any row that does not own it."""
    pool = KVPool(SHAPE, 16, 4)
    lens = [2, 11, 6]
    cache = BatchedPagedKVCache(pool, len(lens))
    prefill(cache, lens)
    owner = next(i for i, t in enumerate(cache.tables) if 0 in t.blocks)
    q = torch.randn(len(lens), HQ, SHAPE.head_dim)
    before = cache.paged_attention(0, q).clone()
    slots, _ = cache.slot_mapping()
    assert (slots == 0).sum() > 1  # padding really addresses slot 0
    pool.k[0].view(-1, 2, 8)[0] = 1e4
    pool.v[0].view(-1, 2, 8)[0] = 1e4
    after = cache.paged_attention(0, q)
    for i in range(len(lens)):
        if i != owner:
            assert torch.equal(before[i], after[i])
    assert not torch.equal(before[owner], after[owner])  # the owner does read it


def test_unmet_reservation_changes_nothing():
    pool = KVPool(SHAPE, 5, 4)
    cache = BatchedPagedKVCache(pool, 3)
    prefill(cache, [4, 4, 3])  # 3 blocks used, 2 free
    tables = [list(t.blocks) for t in cache.tables]
    free = pool.allocator.free_blocks()
    # Decode step: rows 0 and 1 need a new block each, row 2 does not: fits (2 free).
    # Then another 5 tokens for everyone cannot fit.
    k = torch.zeros(3, 5, 2, 8)
    with pytest.raises(CacheFullError):
        cache.write(0, k, k, None)
    assert [t.blocks for t in cache.tables] == tables
    assert cache.seq_lens == [4, 4, 3]
    assert pool.allocator.free_blocks() == free
    cache.check_integrity()


def test_blocks_interleave_and_return():
    pool = KVPool(SHAPE, 10, 2)
    cache = BatchedPagedKVCache(pool, 3)
    prefill(cache, [3, 2, 1])  # blocks 0,1 | 2 | 3
    assert [t.blocks for t in cache.tables] == [[0, 1], [2], [3]]
    for _ in range(2):  # decode two steps on every layer
        for layer in range(2):
            cache.write(layer, torch.ones(3, 1, 2, 8), torch.ones(3, 1, 2, 8), None)
    # Step 1: row 1's third token opens block 4 (rows 0 and 2 still have room).
    # Step 2: row 0's fifth token opens block 5, row 2's third opens block 6.
    assert [t.blocks for t in cache.tables] == [[0, 1, 5], [2, 4], [3, 6]]
    assert cache.seq_lens == [5, 4, 3] and cache.cached_tokens == 12
    # The incrementally kept device tables equal the tables rebuilt from scratch.
    assert torch.equal(cache._block_tables, cache.block_table_tensor())
    cache.free_all()
    assert sorted(pool.allocator.free_blocks()) == list(range(10))
    cache.check_integrity()


def test_guards():
    pool = KVPool(SHAPE, 8, 4)
    cache = BatchedPagedKVCache(pool, 2)
    with pytest.raises(RuntimeError, match="layer 0"):
        cache.write(1, torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 2, 8), None)
    prefill(cache, [2, 3])
    with pytest.raises(ValueError, match="empty cache"):
        cache.write(0, torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 2, 8), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no mask"):
        cache.paged_attention(0, torch.zeros(2, HQ, 8), mask=torch.ones(2, 3, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9), st.booleans()), min_size=1, max_size=60))
def test_random_grow_and_free_never_leaks(ops):
    """Random grow/free across six rows on a small pool: after every operation every
    block is free or owned once, and a refused grow changes nothing."""
    alloc = BlockAllocator(24)
    tables = [BlockTable(4) for _ in range(6)]
    for row, n, free in ops:
        if free:
            tables[row].free(alloc)
        else:
            before = (list(tables[row].blocks), tables[row].num_tokens, alloc.num_free)
            try:
                tables[row].append(n, alloc)
            except CacheFullError:
                assert (tables[row].blocks, tables[row].num_tokens, alloc.num_free) == before
        check_integrity(alloc, tables)
    for t in tables:
        t.free(alloc)
    assert alloc.num_free == 24


def test_seeded_loop_of_batches_returns_every_block(tiny_model):
    rng = random.Random(7)
    pool = KVPool(CacheShape.of(tiny_model.config), 64, 8)
    for _ in range(4):
        prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 5))]
        greedy_generate_batch(tiny_model, prompts, rng.randint(1, 12), (), pool)
        assert pool.allocator.num_free == 64


def test_batch_equals_each_prompt_alone_tiny(tiny_model):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (1, 7, 16, 17, 33, 4)]
    alone = [greedy_generate(tiny_model, p, 20) for p in prompts]
    assert greedy_generate_batch(tiny_model, prompts, 20) == alone
    pool = pool_for(tiny_model, prompts, 20, block_size=16)
    assert greedy_generate_batch(tiny_model, prompts, 20, (), pool) == alone


def test_waste_accounting_static_batch(tiny_model):
    """A finished row keeps its query, slot and block until the slowest row is done:
    the baseline continuous batching removes."""
    prompts = [[5, 6, 7], list(range(3, 13)), list(range(20, 26))]  # lengths 3, 10, 6
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 5, 9)]
    outs, stats = generate_batch(tiny_model, prompts, params)
    assert [len(o.token_ids) for o in outs] == [2, 5, 9]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert stats.prefill_slots == 3 * 10 and stats.prefill_real_tokens == 19
    assert stats.decode_row_steps == 3 * 8  # 9 tokens: 1 from the prefill, 8 decode steps
    assert stats.finished_row_steps == (9 - 2) + (9 - 5)
    assert 0 < stats.early_finish_waste < 1 and stats.padding_waste == pytest.approx(11 / 30)


def test_batch_too_big_for_pool_is_refused_before_work(tiny_model):
    pool = KVPool(CacheShape.of(tiny_model.config), 3, 4)
    with pytest.raises(CacheFullError):
        greedy_generate_batch(tiny_model, [[3] * 10, [4] * 10], 8, (), pool)
    assert pool.allocator.num_free == 3


def test_prefill_metadata_packs_right_padded_rows_once():
    from nanoserve.model.attention import AttentionMetadata

    lens = torch.tensor([3, 1, 5])
    valid = torch.arange(5)[None] < lens[:, None]
    meta = AttentionMetadata.prefill(valid)
    assert meta.cu_seqlens.tolist() == [0, 3, 4, 9] and meta.max_seqlen == 5
    # Left padding cannot be packed by offsets: no cu_seqlens, the dense path is used.
    assert AttentionMetadata.prefill(valid.flip(1)).cu_seqlens is None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_decode_reservation_equals_the_general_one(data):
    """`reserve_one_each` (a decode step's one slot per row) takes the same blocks in the
    same order, returns the same slots and leaves the same state as
    `reserve_all_or_nothing(tables, [1] * n)`, from any mix of rows at block boundaries,
    inside blocks, with spare blocks reserved ahead and with named blocks to evict; and when
    the pool is short, both raise CacheFullError and change nothing."""
    from nanoserve.cache.block_manager import (
        decode_demand,
        reserve_all_or_nothing,
        reserve_one_each,
    )

    bs = data.draw(st.sampled_from([1, 4, 16]))
    lens = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))
    spare = data.draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))
    extra = data.draw(st.integers(0, 3))

    def build():
        need = sum(-(-n // bs) + s for n, s in zip(lens, spare))
        alloc = BlockAllocator(need + extra + 2)
        named = BlockTable(bs)  # two named blocks, then freed: evictable, taken last
        named.append(2 * bs, alloc)
        for i, b in enumerate(named.blocks):
            alloc.register(b, bytes([i + 1]) * 16)
        tables = []
        for n, s in zip(lens, spare):
            t = BlockTable(bs)
            t.append(n, alloc)
            if s:  # a block reserved ahead of the tokens
                t.blocks += alloc.allocate(1)
            tables.append(t)
        named.free(alloc)
        return alloc, tables

    def state(alloc, tables):
        return ([(list(t.blocks), t.num_tokens) for t in tables], alloc.free_blocks(),
                alloc.cached_free_blocks(), alloc.hash_index())

    a1, t1 = build()
    a2, t2 = build()
    assert decode_demand(t2) == sum(t.blocks_needed(1) for t in t1)
    before = state(a1, t1)
    try:
        want = [s[0] for s in reserve_all_or_nothing(t1, [1] * len(t1), a1)]
    except CacheFullError:
        with pytest.raises(CacheFullError):
            reserve_one_each(t2, a2)
        assert state(a2, t2) == before == state(a1, t1)
        return
    assert reserve_one_each(t2, a2) == want
    assert state(a2, t2) == state(a1, t1)
    check_integrity(a2, t2)


def test_decode_reservation_refuses_a_shared_tail():
    from nanoserve.cache.block_manager import reserve_one_each

    alloc = BlockAllocator(8)
    t = BlockTable(4)
    t.append(3, alloc)
    child, pair = t.fork(alloc)
    assert pair is not None  # the partly filled tail was copied, not shared
    alloc.share(t.blocks[-1:])  # a bug's state: the tail shared
    with pytest.raises(RuntimeError, match="shared or named"):
        reserve_one_each([t], alloc)
    assert reserve_one_each([], alloc) == []


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4, 16]), st.lists(st.integers(0, 70), min_size=1, max_size=5))
def test_append_slots_are_each_positions_slot(bs, grows):
    """`append` returns, a block's run at a time, the same slots as `slot(p)` of each new
    position, over blocks taken out of order (a table grown in steps beside another)."""
    alloc = BlockAllocator(sum(-(-n // bs) + 1 for n in grows) * 2 + 2)
    t, other = BlockTable(bs), BlockTable(bs)
    for n in grows:
        start = t.num_tokens
        got = t.append(n, alloc)
        other.append(bs, alloc)  # interleaves the two tables' blocks
        assert got == [t.blocks[p // bs] * bs + p % bs for p in range(start, t.num_tokens)]
    assert t.slots() == [t.slot(p) for p in range(t.num_tokens)]


def test_registering_with_known_names_equals_hashing_them():
    """`register_full_blocks(tokens, alloc, names)` names the same blocks the same way as
    without `names`, from an empty table and after cached blocks; names too short for the
    blocks are not used."""
    from nanoserve.cache.prefix_cache import hash_blocks

    bs = 4
    tokens = list(range(100, 119))  # 4 full blocks and 3 tokens
    names = hash_blocks(tokens, bs)

    def run(given, cached=0, prefix=None):
        alloc = BlockAllocator(32)
        first = BlockTable(bs)
        first.append(len(tokens), alloc)
        first.register_full_blocks(tokens, alloc)
        hit = first.blocks[:cached]
        t = BlockTable(bs)
        t.take_cached(hit, alloc)
        t.append(len(tokens) - t.num_tokens, alloc)
        fresh = t.register_full_blocks(tokens, alloc, given)
        return fresh, t.block_hashes, alloc.hash_index()

    for cached in (0, 2):
        want = run(None, cached)
        assert want[1] == names
        assert run(names, cached) == want
        assert run(names[:2], cached) == want  # too short: hashed instead
