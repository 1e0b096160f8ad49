"""The CPU KV pool lies in memory the kernel zeroes page by page on first touch: allocating
it writes nothing (a 1 GiB default pool costs no time at load), yet it reads as zeros and
takes writes like any tensor."""

from __future__ import annotations

import os

import torch

from nanoserve.cache.pool import CacheShape, KVPool
from nanoserve_kernels.kv_store import store_kv_reference


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_pool_is_zero_writable_and_not_touched_until_used():
    shape = CacheShape(num_layers=4, num_kv_heads=2, head_dim=64)
    before = resident_bytes()
    pool = KVPool.for_memory(shape, 256 << 20, block_size=16, dtype=torch.float32)
    grown = resident_bytes() - before
    assert pool.num_blocks * 16 * shape.bytes_per_token(torch.float32) > 250 << 20
    assert grown < 16 << 20, grown  # the pool's pages are not written when it is made
    for t in (*pool.k, *pool.v):
        assert t.is_contiguous() and t.dtype == torch.float32
        assert t.shape == (pool.num_blocks, 16, 2, 64)
        assert not t[:: max(1, pool.num_blocks // 7)].any()
    k = torch.randn(3, 2, 64)
    v = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 17, pool.num_blocks * 16 - 1])
    store_kv_reference(k, v, pool.k[1], pool.v[1], slots)
    kf, vf = pool.flat(1)
    assert torch.equal(kf[slots], k) and torch.equal(vf[slots], v)
    assert not pool.k[0].any() and int(pool.k[1].count_nonzero()) == k.count_nonzero()


def test_empty_and_half_precision_pools():
    shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=8)
    pool = KVPool(shape, 3, 4, dtype=torch.bfloat16)
    assert pool.k[0].dtype == torch.bfloat16 and not pool.k[0].any()
    pool.v[0][2, 3] = 1.5
    assert float(pool.v[0].sum()) == 12.0
