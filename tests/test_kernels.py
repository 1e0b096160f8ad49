"""Kernels (CPU): the PyTorch references against independent math, and the Triton kernels
against the references under Triton's CPU interpreter.

How the interpreter tests run. Triton reads `TRITON_INTERPRET` when it is imported (its own
`tl.max`/`tl.sum` are `@triton.jit` functions) and when each kernel is decorated, so one
process cannot hold interpreted and compiled kernels side by side, and setting the variable
here would leak into every test module collected after this one. Instead,
`test_kernels_under_the_triton_interpreter` starts a child pytest on this file with
`TRITON_INTERPRET=1 NANOSERVE_TRITON_INTERPRET=1` set from the start and `-k test_interp_`;
in the parent those `test_interp_*` tests skip (one grouped SKIPPED line), in the child they
run. So a plain `pytest` (or `pytest tests/test_kernels.py`) runs everything; CI needs no
extra invocation or environment. To run or debug the interpreter tests directly:
`TRITON_INTERPRET=1 NANOSERVE_TRITON_INTERPRET=1 pytest tests/test_kernels.py -k test_interp_`.

Interpreter runs are slow per program (~0.4 ms plus numpy per op), so the shapes are small and
the programs few. The same checks in bfloat16 on the GPU are in `test_kernels_gpu.py`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted, run_interpreted

from nanoserve_kernels.kv_store import store_kv_reference
from nanoserve_kernels.paged_attention import paged_decode_attention_reference
from nanoserve_kernels.paged_prefill import paged_prefill_attention_reference
from nanoserve_kernels.prefill_attention import prefill_attention_reference

REPO_ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {  # (atol, rtol) of a kernel against the reference, by input dtype
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
}


# --- helpers ---------------------------------------------------------------------------------


def make_decode_case(
    *,
    seed: int,
    context_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    spare_blocks: int = 3,
):
    """A random paged cache. Rows own disjoint, shuffled blocks numbered from 1; block 0 is
    never anyone's: it is the padding entry of every block table. Returns the tensors and the
    set of (block, offset) slots that hold real context."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    blocks_per_row = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max(blocks_per_row) + 1  # one padding column even for the longest row
    num_blocks = 1 + sum(blocks_per_row) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((batch, num_kv_heads * group, head_dim), generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros((batch, max_blocks), dtype=torch.int32)
    used = set()
    for row, (n, nb) in enumerate(zip(context_lens, blocks_per_row)):
        mine, order = order[:nb], order[nb:]
        block_tables[row, :nb] = torch.tensor(mine, dtype=torch.int32)
        used.update((mine[t // block_size], t % block_size) for t in range(n))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    tensors = [x.to(device) for x in (q, k_cache, v_cache, block_tables, lens)]
    return tensors, used


def poison_unused(
    cache: torch.Tensor, used: set[tuple[int, int]], value: float = 1e4
) -> torch.Tensor:
    """A copy of `cache` with `value` in every slot that is not real context (block 0, spare
    blocks, the tails of partly filled blocks)."""
    poisoned = cache.clone()
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for block, offset in used:
        keep[block, offset] = True
    poisoned[~keep.to(cache.device)] = value
    return poisoned


def make_prefill_case(*, seed, lengths, num_kv_heads, group, head_dim, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn((n, num_kv_heads * group, head_dim), generator=gen).to(dtype)
    k = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(device) for x in (q, k, v, cu)]


def make_paged_prefill_case(
    *, seed, cached_lens, new_lens, num_kv_heads, group, head_dim, block_size, dtype,
    device="cpu",
):  # fmt: skip
    """Rows with `cached_lens[i]` tokens already in the pool and `new_lens[i]` new ones (their
    K/V stored too, as the caller of the kernel does). Each row's whole context is drawn dense
    first (`q_full`, `k_full`, `v_full`, one [ctx, H, D] tensor per row), then scattered into
    disjoint shuffled blocks numbered from 1 (block 0 is padding only). Returns the kernel's
    arguments, the dense tensors, and the set of (block, offset) slots holding context."""
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    blocks_per_row = [math.ceil(n / block_size) for n in ctx_lens]
    num_blocks = 1 + sum(blocks_per_row) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros((len(ctx_lens), max(blocks_per_row) + 1), dtype=torch.int32)
    q_full, k_full, v_full, used = [], [], [], set()
    for row, (ctx, nb) in enumerate(zip(ctx_lens, blocks_per_row)):
        mine, order = order[:nb], order[nb:]
        tables[row, :nb] = torch.tensor(mine, dtype=torch.int32)
        q_full.append(torch.randn((ctx, num_kv_heads * group, head_dim), generator=gen).to(dtype))
        k_full.append(torch.randn((ctx, num_kv_heads, head_dim), generator=gen).to(dtype))
        v_full.append(torch.randn((ctx, num_kv_heads, head_dim), generator=gen).to(dtype))
        for t in range(ctx):
            k_cache[mine[t // block_size], t % block_size] = k_full[row][t]
            v_cache[mine[t // block_size], t % block_size] = v_full[row][t]
            used.add((mine[t // block_size], t % block_size))
    q = torch.cat([qf[c:] for qf, c in zip(q_full, cached_lens)])  # [N_new, Hq, D]
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    args = [x.to(device) for x in (q, k_cache, v_cache, tables, cu, lens)]
    return args, (q_full, k_full, v_full), used


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# --- the references against independent math --------------------------------------------------


@pytest.mark.parametrize("group", [1, 3])
def test_decode_reference_matches_dense_sdpa_per_row(group):
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=1, context_lens=[1, 16, 23, 48], num_kv_heads=2, group=group, head_dim=32,
        block_size=16, dtype=torch.float64,
    )  # fmt: skip
    scale = 0.3
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    for row, n in enumerate(lens.tolist()):
        slots = [(int(tables[row, t // 16]), t % 16) for t in range(n)]
        k = torch.stack([k_cache[b, o] for b, o in slots])  # [n, Hkv, D]
        v = torch.stack([v_cache[b, o] for b, o in slots])
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row][:, None, :], k, v, scale=scale)
        torch.testing.assert_close(out[row], expected[:, 0, :])


def test_decode_reference_refuses_empty_rows_and_short_tables():
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=2, context_lens=[5, 9], num_kv_heads=1, group=2, head_dim=16, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="context_lens >= 1"):
        paged_decode_attention_reference(
            q, k_cache, v_cache, tables, torch.tensor([5, 0], dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="blocks"):
        too_long = torch.tensor([5, 16 * tables.shape[1] + 1], dtype=torch.int32)
        paged_decode_attention_reference(q, k_cache, v_cache, tables, too_long, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        two_kv_heads = k_cache.expand(-1, -1, 2, -1)
        q3 = torch.zeros((2, 3, 16))
        paged_decode_attention_reference(q3, two_kv_heads, two_kv_heads, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_reference(q, k_cache, v_cache, tables.float(), lens, 1.0)


def test_decode_reference_ignores_padding_and_unused_slots():
    (q, k_cache, v_cache, tables, lens), used = make_decode_case(
        seed=3, context_lens=[1, 16, 20], num_kv_heads=2, group=4, head_dim=16, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    before = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.25)
    after = paged_decode_attention_reference(
        q, poison_unused(k_cache, used), poison_unused(v_cache, used), tables, lens, 0.25
    )
    torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_reference_matches_causal_sdpa_per_prompt(group):
    lengths = [1, 7, 0, 20]
    q, k, v, cu = make_prefill_case(
        seed=4, lengths=lengths, num_kv_heads=2, group=group, head_dim=16, dtype=torch.float64
    )
    out = prefill_attention_reference(q, k, v, cu, max(lengths), 0.2)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        ks = k[a:b].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(group, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), ks, vs, is_causal=True, scale=0.2
        )
        torch.testing.assert_close(out[a:b], expected.transpose(0, 1))


def test_prefill_reference_checks_cu_seqlens():
    q, k, v, cu = make_prefill_case(
        seed=5, lengths=[3, 4], num_kv_heads=1, group=1, head_dim=8, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="max_seqlen"):
        prefill_attention_reference(q, k, v, cu, 3, 1.0)
    with pytest.raises(ValueError, match="rise from 0"):
        prefill_attention_reference(q, k, v, torch.tensor([0, 3, 6], dtype=torch.int32), 4, 1.0)
    with pytest.raises(ValueError, match="int32"):
        prefill_attention_reference(q, k, v, cu.long(), 4, 1.0)


# a row of one new token, one that starts on a block boundary, one with nothing cached, one
# with no new token, and ragged ones
PAGED_PREFILL_ROWS = ([5, 16, 0, 9, 13, 32], [1, 7, 20, 0, 3, 16])


@pytest.mark.parametrize("group", [1, 3])
def test_paged_prefill_reference_matches_dense_causal_attention(group):
    """The independent oracle: each row's new tokens, attending through the pool, equal the
    tail of plain causal attention (SDPA) over the row's whole dense context."""
    cached, new = PAGED_PREFILL_ROWS
    (q, k_cache, v_cache, tables, cu, lens), (q_full, k_full, v_full), _ = (
        make_paged_prefill_case(
            seed=21, cached_lens=cached, new_lens=new, num_kv_heads=2, group=group,
            head_dim=16, block_size=8, dtype=torch.float64,
        )
    )  # fmt: skip
    out = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu, lens, max(new), 0.3)
    for row, (c, start, end) in enumerate(zip(cached, cu[:-1].tolist(), cu[1:].tolist())):
        if start == end:
            continue
        ks = k_full[row].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        vs = v_full[row].repeat_interleave(group, dim=1).transpose(0, 1)
        dense = F.scaled_dot_product_attention(
            q_full[row].transpose(0, 1), ks, vs, is_causal=True, scale=0.3
        ).transpose(0, 1)  # [ctx, Hq, D]
        torch.testing.assert_close(out[start:end], dense[c:])


def test_paged_prefill_reference_without_cache_equals_prefill():
    new = [1, 9, 16, 30]
    (q, k_cache, v_cache, tables, cu, lens), (_, k_full, v_full), _ = make_paged_prefill_case(
        seed=22, cached_lens=[0] * 4, new_lens=new, num_kv_heads=2, group=2, head_dim=16,
        block_size=8, dtype=torch.float32,
    )  # fmt: skip
    out = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu, lens, 30, 0.25)
    expected = prefill_attention_reference(q, torch.cat(k_full), torch.cat(v_full), cu, 30, 0.25)
    torch.testing.assert_close(out, expected)


def test_paged_prefill_reference_ignores_padding_and_unused_slots():
    cached, new = PAGED_PREFILL_ROWS
    (q, k_cache, v_cache, tables, cu, lens), _, used = make_paged_prefill_case(
        seed=23, cached_lens=cached, new_lens=new, num_kv_heads=1, group=4, head_dim=16,
        block_size=8, dtype=torch.float32,
    )  # fmt: skip
    before = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu, lens, 20, 0.25)
    k_bad, v_bad = poison_unused(k_cache, used), poison_unused(v_cache, used)
    after = paged_prefill_attention_reference(q, k_bad, v_bad, tables, cu, lens, 20, 0.25)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    # and a cached block's contents do count: corrupt one and the rows reading it change
    k_bad = k_cache.clone()
    k_bad[int(tables[1, 0])] += 1.0
    after = paged_prefill_attention_reference(q, k_bad, v_cache, tables, cu, lens, 20, 0.25)
    changed = (after - before).abs().amax(dim=(1, 2)) > 0  # [N_new]
    assert changed[cu[1] : cu[2]].all() and not changed[: cu[1]].any()
    assert not changed[cu[2] :].any()


def test_paged_prefill_dispatch_on_cpu_equals_the_reference(monkeypatch):
    import nanoserve_kernels as kernels

    monkeypatch.delenv("NANOSERVE_TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, _, _ = make_paged_prefill_case(
        seed=25, cached_lens=[9, 0], new_lens=[3, 4], num_kv_heads=1, group=2, head_dim=8,
        block_size=4, dtype=torch.float32,
    )  # fmt: skip
    # the CPU's fused path (nanoserve_kernels.cpu_attention), equal to the reference up to rounding
    for window in (None, 2, 5):
        torch.testing.assert_close(
            kernels.paged_prefill_attention(*args, 4, 0.5, window=window),
            paged_prefill_attention_reference(*args, 4, 0.5, window=window),
            atol=2e-6,
            rtol=2e-6,
        )


def test_paged_prefill_reference_checks_lengths():
    (q, k_cache, v_cache, tables, cu, lens), _, _ = make_paged_prefill_case(
        seed=24, cached_lens=[3, 0], new_lens=[2, 5], num_kv_heads=1, group=2, head_dim=8,
        block_size=4, dtype=torch.float32,
    )  # fmt: skip
    args = (q, k_cache, v_cache, tables, cu)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_prefill_attention_reference(*args, lens, 4, 1.0)
    with pytest.raises(ValueError, match="new tokens"):
        paged_prefill_attention_reference(*args, torch.tensor([5, 4], dtype=torch.int32), 5, 1.0)
    with pytest.raises(ValueError, match="blocks"):
        too_long = torch.tensor([5, 4 * tables.shape[1] + 1], dtype=torch.int32)
        paged_prefill_attention_reference(*args, too_long, 5, 1.0)
    with pytest.raises(ValueError, match="rise from 0"):
        bad_cu = torch.tensor([0, 3, 6], dtype=torch.int32)
        paged_prefill_attention_reference(q, k_cache, v_cache, tables, bad_cu, lens, 5, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu.long(), lens, 5, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        q3 = torch.zeros((7, 3, 8))
        two = k_cache.expand(-1, -1, 2, -1)
        paged_prefill_attention_reference(q3, two, two, tables, cu, lens, 5, 1.0)


def _sliding_allowed(length: int, window: int) -> torch.Tensor:
    """[L, L] bool from transformers' own mask function: query i may attend key j."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    allow = sliding_window_causal_mask_function(window)
    pos = torch.arange(length)
    return allow(torch.tensor(0), torch.tensor(0), pos[:, None], pos[None, :]).expand(length, length)


@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_decode_reference_window_matches_transformers_mask(window):
    """Row of length n: its query (position n - 1) sees exactly the keys transformers'
    sliding-window mask allows; a window longer than the context equals no window."""
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=21, context_lens=[1, 5, 17, 40], num_kv_heads=2, group=3, head_dim=16,
        block_size=16, dtype=torch.float64,
    )  # fmt: skip
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.3, window=window)
    for row, n in enumerate(lens.tolist()):
        seen = _sliding_allowed(n, window)[n - 1]  # [n]
        slots = [(int(tables[row, t // 16]), t % 16) for t in range(n) if seen[t]]
        k = torch.stack([k_cache[b, o] for b, o in slots]).repeat_interleave(3, 1).transpose(0, 1)
        v = torch.stack([v_cache[b, o] for b, o in slots]).repeat_interleave(3, 1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row][:, None, :], k, v, scale=0.3)
        torch.testing.assert_close(out[row], expected[:, 0, :])
    if window >= 40:
        no_window = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.3)
        torch.testing.assert_close(out, no_window, atol=0, rtol=0)


@pytest.mark.parametrize("window", [1, 4, 9, 64])
def test_prefill_reference_window_matches_transformers_mask(window):
    lengths = [1, 7, 0, 20]
    q, k, v, cu = make_prefill_case(
        seed=22, lengths=lengths, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float64
    )
    out = prefill_attention_reference(q, k, v, cu, max(lengths), 0.2, window=window)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        ks = k[a:b].repeat_interleave(2, dim=1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(2, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), ks, vs, attn_mask=_sliding_allowed(b - a, window), scale=0.2
        )
        torch.testing.assert_close(out[a:b], expected.transpose(0, 1))
    if window >= max(lengths):
        no_window = prefill_attention_reference(q, k, v, cu, max(lengths), 0.2)
        torch.testing.assert_close(out, no_window, atol=0, rtol=0)


@pytest.mark.parametrize("window", [1, 6, 1000])
def test_paged_prefill_reference_window_matches_transformers_mask(window):
    """A cache hit's prefill under a sliding window: each row's new tokens, attending through
    the pool, equal the tail of SDPA over the row's whole dense context under transformers'
    own sliding-window mask (a window longer than every context equals no window)."""
    cached, new = PAGED_PREFILL_ROWS
    (q, k_cache, v_cache, tables, cu, lens), (q_full, k_full, v_full), _ = (
        make_paged_prefill_case(
            seed=26, cached_lens=cached, new_lens=new, num_kv_heads=2, group=2,
            head_dim=16, block_size=8, dtype=torch.float64,
        )
    )  # fmt: skip
    args = (q, k_cache, v_cache, tables, cu, lens, max(new), 0.3)
    out = paged_prefill_attention_reference(*args, window=window)
    for row, (c, start, end) in enumerate(zip(cached, cu[:-1].tolist(), cu[1:].tolist())):
        if start == end:
            continue
        ks = k_full[row].repeat_interleave(2, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        vs = v_full[row].repeat_interleave(2, dim=1).transpose(0, 1)
        dense = F.scaled_dot_product_attention(
            q_full[row].transpose(0, 1), ks, vs, attn_mask=_sliding_allowed(c + end - start, window),
            scale=0.3,
        ).transpose(0, 1)  # [ctx, Hq, D]
        torch.testing.assert_close(out[start:end], dense[c:])
    no_window = paged_prefill_attention_reference(*args)
    if window >= max(c + n for c, n in zip(cached, new)):
        torch.testing.assert_close(out, no_window, atol=0, rtol=0)
    else:
        assert not torch.equal(out, no_window)


def test_window_must_be_positive():
    q, k, v, cu = make_prefill_case(
        seed=5, lengths=[3], num_kv_heads=1, group=1, head_dim=8, dtype=torch.float32
    )
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            prefill_attention_reference(q, k, v, cu, 3, 1.0, window=bad)


def test_store_kv_reference_writes_each_slot_and_skips_negative_ones():
    gen = torch.Generator().manual_seed(6)
    k = torch.randn((5, 2, 8), generator=gen)
    v = torch.randn((5, 2, 8), generator=gen)
    k_cache = torch.zeros((4, 4, 2, 8))
    v_cache = torch.zeros((4, 4, 2, 8))
    slots = torch.tensor([0, 5, -1, 15, 9], dtype=torch.int64)
    store_kv_reference(k, v, k_cache, v_cache, slots)
    for n, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], k[n])
            assert torch.equal(v_cache[slot // 4, slot % 4], v[n])
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 4  # token 2 was not stored
    with pytest.raises(ValueError, match="outside the pool"):
        store_kv_reference(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 16]))
    with pytest.raises(ValueError, match="int64"):
        store_kv_reference(k, v, k_cache, v_cache, slots.int())


# --- the backend switch ---------------------------------------------------------------------


def test_backend_uses_references_on_cpu_by_default(monkeypatch):
    import nanoserve_kernels as kernels

    monkeypatch.delenv("NANOSERVE_TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.use_triton("cpu")
    assert not kernels.use_triton(torch.device("meta"))
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=7, context_lens=[3, 17], num_kv_heads=1, group=3, head_dim=16, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    # the CPU's fused path (nanoserve_kernels.cpu_attention), equal to the reference up to rounding
    torch.testing.assert_close(
        kernels.decode_attention(q, k_cache, v_cache, tables, lens, 0.5),
        paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.5),
        atol=2e-6,
        rtol=2e-6,
    )


_INTERPRETER_SWITCH_SCRIPT = """
import torch, nanoserve_kernels as kernels
from nanoserve_kernels.paged_attention import paged_decode_attention_reference
assert kernels.use_triton("cpu"), "NANOSERVE_TRITON_INTERPRET=1 did not select the kernels"
g = torch.Generator().manual_seed(0)
kc, vc = torch.randn(4, 16, 2, 64, generator=g), torch.randn(4, 16, 2, 64, generator=g)
q = torch.randn(2, 4, 64, generator=g)
tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
lens = torch.tensor([20, 9], dtype=torch.int32)
out = kernels.decode_attention(q, kc, vc, tables, lens, 0.125)
ref = paged_decode_attention_reference(q, kc, vc, tables, lens, 0.125)
torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
print("triton-interpreter-ok")
"""


def test_nanoserve_triton_interpret_switches_cpu_to_the_kernels():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NANOSERVE_TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SWITCH_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton-interpreter-ok" in result.stdout


# --- our kernels package beside transformers' `kernels` dependency ---------------------------


def test_transformers_runs_beside_our_kernels_package():
    """transformers (from 5.25) depends on a distribution named `kernels` and imports it when
    it is installed. Ours is `nanoserve_kernels`, so the name `kernels` is never ours (it is
    that distribution, or nothing) and transformers' Llama builds and runs."""
    import importlib.util

    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("kernels")
    ours = Path(__file__).resolve().parents[1]
    assert spec is None or Path(spec.origin or "").resolve().parent.parent != ours
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 64)
    assert torch.isfinite(logits).all()


# --- the Triton kernels under the CPU interpreter --------------------------------------------


def test_kernels_under_the_triton_interpreter():
    """Runs this file's `test_interp_*` tests in a child pytest with `TRITON_INTERPRET=1`
    set from the start (Triton reads it when it is imported); see the module docstring."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    if interpreted():
        pytest.skip("already inside the interpreter run")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def interp():
    """The kernel modules, defined for the interpreter (only inside the child run)."""
    if not interpreted():
        pytest.skip("run by test_kernels_under_the_triton_interpreter in a child process")
    from nanoserve_kernels import kv_store, paged_attention, paged_prefill

    return {
        "paged_attention": paged_attention,
        "paged_prefill": paged_prefill,
        "prefill_attention": sys.modules["nanoserve_kernels.prefill_attention"],
        "kv_store": kv_store,
    }


def test_interp_backend_selects_the_kernels(interp):
    import nanoserve_kernels as kernels

    assert kernels.use_triton("cpu")
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=8, context_lens=[20, 9], num_kv_heads=2, group=2, head_dim=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    out = kernels.decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert_close(out, expected, torch.float32)


# (query heads per KV head, head_dim, block_size, dtype): every value of each axis appears in
# both float32 and float16.
DECODE_CASES = [
    (1, 64, 16, torch.float32),
    (3, 128, 32, torch.float16),
    (4, 64, 32, torch.float16),
    (8, 128, 16, torch.float32),
    (3, 64, 16, torch.float32),
    (8, 64, 32, torch.float16),
    (1, 128, 32, torch.float16),
    (4, 128, 16, torch.float32),
]


@pytest.mark.parametrize("group,head_dim,block_size,dtype", DECODE_CASES)
def test_interp_decode_kernel_matches_reference(interp, group, head_dim, block_size, dtype):
    paged = interp["paged_attention"]
    seed = group * 1000 + head_dim + block_size
    rand_len = int(
        torch.randint(2, 4 * block_size, (1,), generator=torch.Generator().manual_seed(seed))
    )
    # ragged: one token, exact multiples of the block size, and one random length
    context_lens = [1, block_size, 2 * block_size, rand_len]
    (q, k_cache, v_cache, tables, lens), used = make_decode_case(
        seed=seed, context_lens=context_lens, num_kv_heads=2, group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    # one program per (row, KV head) over the whole context, and the split-K path
    for splits in (None, 3):
        out = paged.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, num_splits=splits
        )
        assert out.shape == q.shape and out.dtype == dtype
        assert_close(out, expected, dtype)
    # the other launch order of the programs (KV heads of a row side by side, or rows)
    out = paged.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale, num_splits=2,
        heads_fastest=not paged._HEADS_FASTEST,
    )  # fmt: skip
    assert_close(out, expected, dtype)
    # padding (block 0), spare blocks and the tails of partly filled blocks are never read
    k_bad, v_bad = poison_unused(k_cache, used), poison_unused(v_cache, used)
    for splits in (1, 2):
        clean = paged.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, num_splits=splits
        )
        dirty = paged.paged_decode_attention(
            q, k_bad, v_bad, tables, lens, scale, num_splits=splits
        )
        torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


def test_interp_decode_kernel_split_k_many_partitions(interp):
    """More partitions than some rows have tokens: empty partitions must not count."""
    paged = interp["paged_attention"]
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=11, context_lens=[1, 70, 200], num_kv_heads=1, group=4, head_dim=64,
        block_size=16, dtype=torch.float32,
    )  # fmt: skip
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
    for splits, block_n in ((4, 16), (8, 16), (2, 128)):
        for even in (False, True):  # partitions sized for the bound, or per row
            out = paged.paged_decode_attention(
                q, k_cache, v_cache, tables, lens, 0.125, num_splits=splits, block_n=block_n,
                even_splits=even,
            )  # fmt: skip
            assert_close(out, expected, torch.float32)
    # a host-side bound on the context that is too small still covers every token
    out = paged.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.125, num_splits=4, max_context_len=64, block_n=16
    )
    assert_close(out, expected, torch.float32)


def test_interp_decode_kernel_reads_strided_queries(interp):
    """q as a view into a wider projection output (non-contiguous rows)."""
    paged = interp["paged_attention"]
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=12, context_lens=[5, 33], num_kv_heads=2, group=2, head_dim=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    wide = torch.zeros((2, 4 + 4, 64))
    wide[:, :4] = q
    q_view = wide[:, :4]
    assert not q_view.is_contiguous()
    out = paged.paged_decode_attention(q_view, k_cache, v_cache, tables, lens, 0.125)
    assert_close(
        out,
        paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125),
        torch.float32,
    )


# (query heads per KV head, head_dim, dtype, block_m, block_n)
PREFILL_CASES = [
    (1, 64, torch.float32, None, None),
    (3, 128, torch.float16, None, None),
    (4, 64, torch.float16, 16, 32),
    (8, 128, torch.float32, 32, 16),
]


@pytest.mark.parametrize("group,head_dim,dtype,block_m,block_n", PREFILL_CASES)
def test_interp_prefill_kernel_matches_reference(interp, group, head_dim, dtype, block_m, block_n):
    prefill = interp["prefill_attention"]
    seed = group * 100 + head_dim
    rand_len = int(torch.randint(2, 130, (1,), generator=torch.Generator().manual_seed(seed)))
    lengths = [1, 64, 0, rand_len, 32]  # one token, tile multiples, an empty prompt
    q, k, v, cu = make_prefill_case(
        seed=seed, lengths=lengths, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype
    )
    scale = 1.0 / math.sqrt(head_dim)
    expected = prefill_attention_reference(q, k, v, cu, max(lengths), scale)
    out = prefill.prefill_attention(
        q, k, v, cu, max(lengths), scale, block_m=block_m, block_n=block_n
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype)


def test_prefill_work_lists_each_query_block_once_furthest_first():
    from nanoserve_kernels.prefill_attention import PREFILL_BLOCK_M, prefill_work, prefill_work_size

    lengths = [1, 0, 2 * PREFILL_BLOCK_M, 3 * PREFILL_BLOCK_M + 5, 7]
    size = prefill_work_size(sum(lengths), len(lengths))
    work = prefill_work(lengths, size)
    assert work.shape == (2, size) and work.dtype == np.int32
    real = [(int(p), int(b)) for p, b in zip(*work) if p >= 0]
    expected = {(p, b) for p, n in enumerate(lengths) for b in range(-(-n // PREFILL_BLOCK_M))}
    assert sorted(real) == sorted(expected) and len(real) == len(expected)
    assert [b for _, b in real] == sorted((b for _, b in real), reverse=True)
    assert (work[:, len(real):] == -1).all()
    # any packing of N tokens into at most R prompts fits the size made for (N, R)
    for lens in ([1] * 9, [64] * 3 + [1] * 6, [65, 63, 1, 0]):
        prefill_work(lens, prefill_work_size(sum(lens), len(lens)))
    with pytest.raises(ValueError, match="do not fit"):
        prefill_work([PREFILL_BLOCK_M + 1] * 3, 5)
    from nanoserve_kernels.prefill_attention import check_work

    q = torch.zeros(4, 2, 8)
    check_work(torch.from_numpy(work), q)
    for bad in (torch.from_numpy(work).long(), torch.from_numpy(work)[:, ::2],
                torch.zeros(3, 4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="contiguous \\[2, P\\] int32"):
            check_work(bad, q)


@pytest.mark.parametrize("group,dtype,window", [(1, torch.float32, None), (4, torch.float16, None),
                                                (2, torch.float32, 37)])
def test_interp_prefill_kernel_over_a_work_table_equals_its_grid(interp, group, dtype, window):
    """The same blocks with the same tiles: the output equals the usual grid's bit for bit,
    spare entries (prompt -1) and empty prompts included, and the reference's within
    tolerance."""
    prefill = interp["prefill_attention"]
    lengths = [1, 64, 0, 131, 32, 70]
    q, k, v, cu = make_prefill_case(seed=7 + group, lengths=lengths, num_kv_heads=2,
                                    group=group, head_dim=64, dtype=dtype)
    size = prefill.prefill_work_size(sum(lengths), len(lengths) + 3)
    work = torch.from_numpy(prefill.prefill_work(lengths, size))
    out = prefill.prefill_attention(q, k, v, cu, 1, 0.125, window=window, work=work)
    plain = prefill.prefill_attention(q, k, v, cu, max(lengths), 0.125, window=window)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    expected = prefill_attention_reference(q, k, v, cu, max(lengths), 0.125, window=window)
    assert_close(out, expected, dtype)
    with pytest.raises(ValueError, match="block_m"):
        prefill.prefill_attention(q, k, v, cu, 1, 0.125, work=work, block_m=16)


def _poison_outside_window(cache, tables, lens, window, block_size):
    """A copy of `cache` with NaN in each row's real slots that lie before its window: a
    kernel that loads one of them (even to mask it afterwards) returns NaN."""
    poisoned = cache.clone()
    for row, n in enumerate(lens.tolist()):
        for t in range(max(0, n - window)):
            poisoned[int(tables[row, t // block_size]), t % block_size] = float("nan")
    return poisoned


@pytest.mark.parametrize("window", [1, 5, 37, 10_000])
def test_interp_decode_kernel_window_matches_reference(interp, window):
    """Windows of one token, inside a block, across blocks, and longer than every context;
    one program per row and split-K (partitions over the window only); tokens before the
    window are never loaded."""
    paged = interp["paged_attention"]
    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=31 + window, context_lens=[1, 6, 40, 77], num_kv_heads=2, group=4, head_dim=64,
        block_size=16, dtype=torch.float32,
    )  # fmt: skip
    expected = paged_decode_attention_reference(
        q, k_cache, v_cache, tables, lens, 0.125, window=window
    )
    k_bad = _poison_outside_window(k_cache, tables, lens, window, 16)
    v_bad = _poison_outside_window(v_cache, tables, lens, window, 16)
    for splits, block_n, even in ((1, 16, False), (3, 16, False), (3, 16, True),
                                  (None, None, False)):  # the last: compared below
        out = paged.paged_decode_attention(
            q, k_bad, v_bad, tables, lens, 0.125, window=window, num_splits=splits,
            block_n=block_n, even_splits=even,
        )  # fmt: skip
        assert_close(out, expected, torch.float32)
    if window >= 77:
        plain = paged.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
        torch.testing.assert_close(out, plain, atol=0, rtol=0)


@pytest.mark.parametrize("window,block_m,block_n", [(1, 16, 16), (5, 16, 32), (23, 32, 16),
                                                    (500, None, None)])
def test_interp_prefill_kernel_window_matches_reference(interp, window, block_m, block_n):
    prefill = interp["prefill_attention"]
    lengths = [1, 64, 0, 45, 9]
    q, k, v, cu = make_prefill_case(
        seed=40 + window, lengths=lengths, num_kv_heads=2, group=2, head_dim=64,
        dtype=torch.float32,
    )  # fmt: skip
    expected = prefill_attention_reference(q, k, v, cu, max(lengths), 0.125, window=window)
    out = prefill.prefill_attention(
        q, k, v, cu, max(lengths), 0.125, window=window, block_m=block_m, block_n=block_n
    )
    assert_close(out, expected, torch.float32)
    if window >= max(lengths):
        plain = prefill.prefill_attention(q, k, v, cu, max(lengths), 0.125)
        torch.testing.assert_close(out, plain, atol=0, rtol=0)


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,src_dtype,cache_dtype",
    [
        (2, 64, 16, torch.float32, torch.float32),
        (3, 128, 32, torch.float16, torch.float16),
        (1, 64, 32, torch.float32, torch.float16),
    ],
)
def test_interp_store_kv_kernel_matches_reference(
    interp, num_kv_heads, head_dim, block_size, src_dtype, cache_dtype
):
    kv = interp["kv_store"]
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim + block_size)
    num_tokens, num_blocks = 24, 5
    # k and v as views into one wider projection output: strided rows
    qkv = torch.randn((num_tokens, (2 + 2 * num_kv_heads) * head_dim), generator=gen).to(src_dtype)
    k = qkv[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (2 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # a padding token: not stored
    caches = [
        torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=gen).to(cache_dtype)
        for _ in range(2)
    ]
    expected = [c.clone() for c in caches]
    store_kv_reference(k, v, *expected, slots)
    kv.store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0])
    assert torch.equal(caches[1], expected[1])


# --- fused RMSNorm and SwiGLU gate ------------------------------------------------------------


def test_rms_norm_reference_is_transformers_order():
    """The reference rounds like transformers' LlamaRMSNorm: normalised in float32, cast to
    the input's dtype, then scaled by the weight in that dtype."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from nanoserve_kernels.rmsnorm import rms_norm_reference

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
        hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
        hf.weight.data = (torch.randn(96, generator=g) + 1).to(dtype)
        assert torch.equal(rms_norm_reference(x, hf.weight.data, 1e-5), hf(x))


def test_interp_rms_norm_and_silu_and_mul_match_references(interp):
    from nanoserve_kernels.activation import silu_and_mul, silu_and_mul_reference
    from nanoserve_kernels.rmsnorm import rms_norm, rms_norm_reference

    g = torch.Generator().manual_seed(4)
    for d in (64, 96):  # a power of two and not
        x = torch.randn(7, d, generator=g) * 2
        w = torch.randn(d, generator=g)
        assert_close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), torch.float32)
        gu = torch.randn(3, 2, 2 * d, generator=g)
        assert_close(silu_and_mul(gu), silu_and_mul_reference(gu), torch.float32)
# (query heads per KV head, head_dim, block_size, dtype, block_m, block_n): every value of each
# axis appears in both float32 and float16; block_n below, equal to and above the block size.
PAGED_PREFILL_CASES = [
    (1, 64, 16, torch.float32, None, None),
    (3, 128, 16, torch.float16, None, None),
    (4, 64, 32, torch.float16, 16, 16),
    (8, 128, 32, torch.float32, 16, 32),
    (2, 64, 16, torch.float32, 32, 16),
]


@pytest.mark.parametrize("group,head_dim,block_size,dtype,block_m,block_n", PAGED_PREFILL_CASES)
def test_interp_paged_prefill_kernel_matches_reference(
    interp, group, head_dim, block_size, dtype, block_m, block_n
):
    paged_prefill = interp["paged_prefill"]
    seed = group * 100 + head_dim + block_size
    # nothing cached, a block-boundary start, one new token, no new token, ragged rows
    cached = [0, block_size, 37, 5, 2 * block_size + 3]
    new = [40, 17, 1, 0, 33]
    (q, k_cache, v_cache, tables, cu, lens), _, used = make_paged_prefill_case(
        seed=seed, cached_lens=cached, new_lens=new, num_kv_heads=2, group=group,
        head_dim=head_dim, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    args = (q, k_cache, v_cache, tables, cu, lens, max(new), scale)
    expected = paged_prefill_attention_reference(*args)
    out = paged_prefill.paged_prefill_attention(*args, block_m=block_m, block_n=block_n)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected, dtype)
    # padding (block 0), spare blocks and the tails of partly filled blocks are never read
    k_bad, v_bad = poison_unused(k_cache, used), poison_unused(v_cache, used)
    dirty = paged_prefill.paged_prefill_attention(
        q, k_bad, v_bad, tables, cu, lens, max(new), scale, block_m=block_m, block_n=block_n
    )
    torch.testing.assert_close(dirty, out, atol=0, rtol=0)
    if block_m is None and dtype == torch.float32:  # over a work table: the same bits
        from nanoserve_kernels.prefill_attention import prefill_work, prefill_work_size

        bm = paged_prefill.default_block_m(group)
        work = torch.from_numpy(prefill_work(new, prefill_work_size(sum(new), 8, bm), bm))
        tabled = paged_prefill.paged_prefill_attention(
            q, k_bad, v_bad, tables, cu, lens, 1, scale, block_n=block_n, work=work)
        torch.testing.assert_close(tabled, out, atol=0, rtol=0)
    # a sliding window (shorter than a block, and spanning several): the reference's keys only
    window = (5, 2 * block_size + 7)[group % 2]
    got = paged_prefill.paged_prefill_attention(*args, block_m=block_m, block_n=block_n,
                                                window=window)
    assert_close(got, paged_prefill_attention_reference(*args, window=window), dtype)


def test_interp_paged_prefill_dispatch_and_strided_queries(interp):
    """The backend's switch picks the kernel under the interpreter; q may be a view into a
    wider projection output."""
    import nanoserve_kernels as kernels

    (q, k_cache, v_cache, tables, cu, lens), _, _ = make_paged_prefill_case(
        seed=31, cached_lens=[20, 0], new_lens=[12, 5], num_kv_heads=2, group=2, head_dim=64,
        block_size=16, dtype=torch.float32,
    )  # fmt: skip
    wide = torch.zeros((q.shape[0], 2 * q.shape[1], 64))
    wide[:, : q.shape[1]] = q
    q_view = wide[:, : q.shape[1]]
    assert not q_view.is_contiguous()
    expected = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu, lens, 12, 0.125)
    out = kernels.paged_prefill_attention(q_view, k_cache, v_cache, tables, cu, lens, 12, 0.125)
    assert kernels.use_triton("cpu")
    assert_close(out, expected, torch.float32)


def test_rotary_and_add_rms_norm_references_are_the_plain_forms():
    """The references equal transformers' rotary (`apply_rotary_pos_emb`) and a plain add
    followed by the norm, in float32 and bfloat16."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from nanoserve_kernels.rmsnorm import add_rms_norm_reference, rms_norm_reference
    from nanoserve_kernels.rotary import rotary_reference

    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 5, 3, 16, generator=g).to(dtype)  # [B, T, H, D]
        freqs = torch.randn(1, 5, 8, generator=g)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        want, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
        got = rotary_reference(q[0], cos[0], sin[0])
        assert torch.equal(got, want.transpose(1, 2)[0])
        x, r = torch.randn(4, 32, generator=g).to(dtype), torch.randn(4, 32, generator=g).to(dtype)
        w = torch.randn(32, generator=g).to(dtype)
        h, y = add_rms_norm_reference(x, r, w, 1e-6)
        assert torch.equal(h, x + r) and torch.equal(y, rms_norm_reference(x + r, w, 1e-6))


def test_interp_rotary_and_add_rms_norm_match_references(interp):
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_reference
    from nanoserve_kernels.rotary import rotary, rotary_reference

    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(6, 7, 32, generator=g)  # [N, H + 2 Hkv, D]: rotate a strided slice
    cos, sin = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    x = qkv[:, :5]  # float32: the kernel's single rounding equals the reference's
    assert_close(rotary(x, cos, sin), rotary_reference(x, cos, sin), torch.float32)
    a, r, w = (torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g),
               torch.randn(96, generator=g))
    for got, want in zip(add_rms_norm(a, r, w, 1e-5), add_rms_norm_reference(a, r, w, 1e-5)):
        assert_close(got, want, torch.float32)


def test_fp8_output_references_are_the_plain_forms_quantized():
    from nanoserve_kernels.activation import silu_and_mul_fp8_reference, silu_and_mul_reference
    from nanoserve_kernels.fp8_quant import quantize_rows_reference
    from nanoserve_kernels.rmsnorm import (
        add_rms_norm_fp8_reference,
        add_rms_norm_reference,
        rms_norm_fp8_reference,
        rms_norm_reference,
    )

    g = torch.Generator().manual_seed(8)
    x, r, w = (torch.randn(2, 3, 96, generator=g), torch.randn(2, 3, 96, generator=g),
               torch.randn(96, generator=g))
    h, y = add_rms_norm_reference(x, r, w, 1e-5)
    for got, want in zip(add_rms_norm_fp8_reference(x, r, w, 1e-5, 0.5),
                         (h, *quantize_rows_reference(y.reshape(6, 96), 0.5))):
        assert torch.equal(got.float(), want.float())
    q, s = rms_norm_fp8_reference(x, w, 1e-5)
    want_q, want_s = quantize_rows_reference(rms_norm_reference(x, w, 1e-5).reshape(6, 96))
    assert q.shape == (6, 96) and s.shape == (6, 1)
    assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s)
    gu = torch.randn(5, 192, generator=g)
    q, s = silu_and_mul_fp8_reference(gu)
    want_q, want_s = quantize_rows_reference(silu_and_mul_reference(gu))
    assert torch.equal(q.float(), want_q.float()) and torch.equal(s, want_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_fp8_output_kernels_equal_the_kernels_unfused(interp, dtype):
    """Each fused kernel quantizes exactly what the unfused pair (the plain kernel, then
    `quantize_rows`) quantizes: equal codes and scales, with and without an amax cap;
    rows of 96 (not a power of two) and gate/up rows of 2 x 1,300 (two blocks, one partial);
    silu-and-mul's FP8 form in both its forms (one program a row, and blocks of a row)."""
    from nanoserve_kernels.activation import silu_and_mul, silu_and_mul_fp8
    from nanoserve_kernels.fp8_quant import quantize_rows
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8

    def same(a, b):
        return all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))

    g = torch.Generator().manual_seed(9)
    x, r = (torch.randn(2, 3, 96, generator=g).to(dtype) * 3 for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype)
    gu = (torch.randn(4, 2600, generator=g) * 2).to(dtype)
    wide = (torch.randn(2, 2 * 16400, generator=g) * 2).to(dtype)  # past one pass: two
    for ub in (None, 0.5):
        for form in ("row", "split"):
            assert same(silu_and_mul_fp8(wide, ub, form=form),
                        quantize_rows(silu_and_mul(wide), ub))
            assert same(silu_and_mul_fp8(gu, ub, form=form), quantize_rows(silu_and_mul(gu), ub))
        assert same(rms_norm_fp8(x, w, 1e-5, ub),
                    quantize_rows(rms_norm(x, w, 1e-5).reshape(6, 96), ub))
        h, y = add_rms_norm(x, r, w, 1e-5)
        assert same(add_rms_norm_fp8(x, r, w, 1e-5, ub), (h, *quantize_rows(y.reshape(6, 96), ub)))
    q, s = rms_norm_fp8(x, w, 1e-5)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (6, 1)


def _scaled_case(g, m, n, dtype):
    """An FP8 GEMM's raw output [m, n] (sums of e4m3 products: hundreds) and its scales."""
    raw = (torch.randn(m, n, generator=g) * 300).to(dtype)
    row_scale = torch.rand(m, 1, generator=g) / 100 + 1e-3
    col_scale = torch.rand(1, n, generator=g) / 100 + 1e-3
    return raw, (row_scale, col_scale)


def test_scaled_references_read_x_as_scale_rows_gives_it():
    """The residual adds and silu-and-mul's FP8 form given x raw with its scales compute what
    they compute on `scale_rows_reference` of it; which is the products in float32, in order."""
    from nanoserve_kernels.activation import silu_and_mul_fp8_reference
    from nanoserve_kernels.rmsnorm import add_rms_norm_fp8_reference, add_rms_norm_reference
    from nanoserve_kernels.scaled_rows import scale_rows_reference

    g = torch.Generator().manual_seed(10)
    for dtype in (torch.float32, torch.bfloat16):
        raw, scales = _scaled_case(g, 6, 96, dtype)
        y = scale_rows_reference(raw, *scales, dtype)
        assert y.dtype == dtype
        assert torch.equal(y, ((raw.float() * scales[0]) * scales[1]).to(dtype))
        r, w = torch.randn(2, 3, 96, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
        x = raw.view(2, 3, 96)
        for got, want in zip(add_rms_norm_reference(x, r, w, 1e-5, scales),
                             add_rms_norm_reference(y.view(2, 3, 96), r, w, 1e-5)):
            assert torch.equal(got, want)
        for got, want in zip(add_rms_norm_fp8_reference(x, r, w, 1e-5, 0.5, scales),
                             add_rms_norm_fp8_reference(y.view(2, 3, 96), r, w, 1e-5, 0.5)):
            assert torch.equal(got.float(), want.float())
        gu, gu_scales = _scaled_case(g, 4, 192, dtype)
        gu_y = scale_rows_reference(gu, *gu_scales, dtype)
        for got, want in zip(silu_and_mul_fp8_reference(gu, None, gu_scales),
                             silu_and_mul_fp8_reference(gu_y)):
            assert torch.equal(got.float(), want.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_scaled_kernels_equal_scale_rows_then_the_plain_kernels(interp, dtype):
    """`scale_rows` equals its reference (bit for bit in float32); the residual adds and
    silu-and-mul's FP8 form applying x's scales as they read it equal `scale_rows` then the
    kernel on its output (rows of 96, not a power of two; gate/up rows of 2 x 1,300, one
    pass, and of 2 x 16,400, wider than one pass holds: a pass for the maximum, one to
    quantize)."""
    from nanoserve_kernels.activation import silu_and_mul_fp8
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8
    from nanoserve_kernels.scaled_rows import scale_rows, scale_rows_reference

    def same(a, b):
        return all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))

    g = torch.Generator().manual_seed(11)
    raw, scales = _scaled_case(g, 6, 96, dtype)
    y = scale_rows(raw, *scales, dtype)
    if dtype == torch.float32:
        assert torch.equal(y, scale_rows_reference(raw, *scales, dtype))
    else:  # the interpreter's cast to bfloat16 may round the other way: one ulp
        torch.testing.assert_close(y, scale_rows_reference(raw, *scales, dtype),
                                   rtol=2 ** -7, atol=0)
    r, w = torch.randn(6, 96, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    assert same(add_rms_norm(raw, r, w, 1e-5, scales), add_rms_norm(y, r, w, 1e-5))
    for ub in (None, 0.5):
        assert same(add_rms_norm_fp8(raw, r, w, 1e-5, ub, scales),
                    add_rms_norm_fp8(y, r, w, 1e-5, ub))
    for inner in (1300, 16400):
        gu, gu_scales = _scaled_case(g, 2, 2 * inner, dtype)
        for form in ("row", "split"):
            assert same(silu_and_mul_fp8(gu, None, gu_scales, form=form),
                        silu_and_mul_fp8(scale_rows(gu, *gu_scales, dtype), form="row"))
    with pytest.raises(ValueError, match="row_scale"):
        scale_rows(raw, scales[0].t(), scales[1], dtype)


def _rotary_store_case(g, n=6, hq=4, hkv=2, d=32, num_blocks=5, block=4):
    qkv = torch.randn(n, hq + 2 * hkv + 1, d, generator=g)[:, :hq + 2 * hkv]  # strided rows
    cos, sin = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    shape = (num_blocks, block, hkv, d)
    slots = torch.tensor([3, -1, 17, 0, 9, -1], dtype=torch.int64)[:n]
    return qkv, cos, sin, torch.zeros(shape), torch.zeros(shape), slots


def test_rotary_store_reference_is_rotary_then_store():
    from nanoserve_kernels.rotary import rotary_reference
    from nanoserve_kernels.rotary_store import rotary_store_reference

    g = torch.Generator().manual_seed(3)
    qkv, cos, sin, kc, vc, slots = _rotary_store_case(g)
    q = rotary_store_reference(qkv, cos, sin, kc, vc, slots, 4)
    assert torch.equal(q, rotary_reference(qkv[:, :4], cos, sin))
    k_want, v_want = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv_reference(rotary_reference(qkv[:, 4:6], cos, sin), qkv[:, 6:], k_want, v_want,
                       slots)
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)
    stored = (kc.view(-1, 2 * 32) != 0).any(1)  # per slot
    assert stored.nonzero().flatten().tolist() == [0, 3, 9, 17]  # slot -1: nothing stored


def test_interp_rotary_store_matches_reference(interp):
    from nanoserve_kernels.rotary_store import rotary_store, rotary_store_reference

    g = torch.Generator().manual_seed(5)
    qkv, cos, sin, kc, vc, slots = _rotary_store_case(g)
    kc2, vc2 = kc.clone(), vc.clone()
    want = rotary_store_reference(qkv, cos, sin, kc, vc, slots, 4)
    got = rotary_store(qkv, cos, sin, kc2, vc2, slots, 4)
    assert_close(got, want, torch.float32)
    assert_close(kc2, kc, torch.float32)
    assert torch.equal(vc2, vc)


def _argmax_cases(g):
    V = 9000  # three chunks, the last partial
    x = torch.randn(7, V, generator=g)
    x[1, 5000] = x[1, 100] = x[1].max() + 1  # a tie across chunks: the first index
    x[2, 8999] = x[2].max() + 1  # in the partial last chunk
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 6000] = float("nan")  # NaN beats every number
    x[4, 7] = float("inf")
    x[5, 4200] = x[5, 4100] = float("nan")  # the first NaN
    x[6, 4095:4097] = x[6].max() + 1  # a tie across a chunk boundary
    return x


def test_argmax_scatter_reference_rules():
    from nanoserve_kernels.argmax import argmax_scatter_reference

    x = _argmax_cases(torch.Generator().manual_seed(0))
    last = torch.full((10,), -1, dtype=torch.int64)
    slots = torch.tensor([9, 0, 3, 4, 5, 6, 1])
    tokens = argmax_scatter_reference(x, slots, last)
    assert tokens[1:].tolist() == [100, 8999, 0, 6000, 4100, 4095]
    assert last[slots].tolist() == tokens.tolist() and last[[2, 7, 8]].tolist() == [-1] * 3


def test_interp_argmax_scatter_matches_reference(interp):
    from nanoserve_kernels.argmax import argmax_scatter, argmax_scatter_reference

    x = _argmax_cases(torch.Generator().manual_seed(0))
    slots = torch.tensor([9, 0, 3, 4, 5, 6, 1])
    last, want_last = (torch.full((10,), -1, dtype=torch.int64) for _ in range(2))
    want = argmax_scatter_reference(x, slots, want_last)
    got = argmax_scatter(x, slots, last)
    assert torch.equal(got, want) and torch.equal(last, want_last)
    for dtype in (torch.bfloat16, torch.float16):  # half-width logits, ties made by rounding
        xh = x.to(dtype)
        assert torch.equal(argmax_scatter(xh, slots, last),
                           argmax_scatter_reference(xh, slots, want_last))


def _masked_argmax_cases(g):
    """Rows of _argmax_cases under bitmasks with one word more than V needs (its bits set:
    they must be ignored): random bits; none (-1); one token, in the partial last chunk;
    the row's NaN and maximum disallowed; a NaN allowed (it wins); every word set."""
    x = _argmax_cases(g)
    b, V = x.shape
    words = -(-V // 32) + 1
    bm = torch.randint(-(2**31), 2**31 - 1, (b, words), generator=g, dtype=torch.int32)
    bm[:, -1] = -1
    bm[0, :-1] = 0  # nothing allowed
    bm[2, :-1] = 0
    bm[2, 8990 // 32] = 1 << (8990 % 32)  # only token 8990
    bm[4, 6000 // 32] &= ~(1 << (6000 % 32))  # its NaN disallowed: the +inf at 7 wins if allowed
    bm[4, 0] |= 1 << 7
    bm[5, 4100 // 32] |= 1 << (4100 % 32)  # its first NaN allowed
    bm[6, :-1] = -1  # every token: the unmasked argmax
    return x, bm


def test_masked_argmax_reference_rules():
    from nanoserve_kernels.argmax import masked_argmax_reference

    x, bm = _masked_argmax_cases(torch.Generator().manual_seed(0))
    tokens = masked_argmax_reference(x, bm)
    assert tokens[[0, 2, 4, 5, 6]].tolist() == [-1, 8990, 7, 4100, 4095]
    bits = ((bm[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :9000]
    assert tokens[3] == bits[3].nonzero()[0]  # all -inf: the first allowed token
    allowed = bits[1].bool()  # random bits: the largest allowed logit
    assert allowed[tokens[1]] and tokens[1] == torch.where(allowed, x[1], float("-inf")).argmax()


def test_interp_masked_argmax_matches_reference(interp):
    from nanoserve_kernels.argmax import masked_argmax, masked_argmax_reference

    x, bm = _masked_argmax_cases(torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        assert torch.equal(masked_argmax(xd, bm), masked_argmax_reference(xd, bm))
    with pytest.raises(ValueError, match="bitmask must be int32"):
        masked_argmax(x, bm[:, :200])


# --- logprobs of a step's tokens (nanoserve_kernels/logprobs.py) ----------------------------------------


def _logprob_cases(g, dtype):
    """7 rows over V = 9000 (three chunks, the last partial), as a strided view; tokens
    chosen among the best, the worst and in between; large values at chunk edges."""
    wide = torch.randn(7, 9100, generator=g) * 3
    x = wide[:, :9000]
    x[1, 4095:4097] = 20.0 + torch.tensor([0.5, 0.25])  # across a chunk boundary
    x[2, 8990:9000] = 15.0 + torch.arange(10.0)  # the best all in the partial chunk
    x[3, :40] = 12.0 + torch.arange(40.0) / 8  # the best all in the first chunk
    x = x.to(dtype)
    tokens = torch.tensor([0, 4096, 8999, 5, int(x[4].argmin()), int(x[5].argmax()), 8191])
    return x, tokens


def _assert_same_logprob_rows(got, want, x, k):
    """Equal up to rounding; among equal top values any order (each id must carry the
    value it is listed with, and the ids must be distinct)."""
    assert got.shape == want.shape == (x.shape[0], 2 + 2 * k)
    torch.testing.assert_close(got[:, 0], want[:, 0], atol=2e-5, rtol=1e-5)
    assert torch.equal(got[:, 1], want[:, 1])  # ranks
    if k:
        torch.testing.assert_close(got[:, 2 + k:], want[:, 2 + k:], atol=2e-5, rtol=1e-5)
        lp = torch.log_softmax(x.float(), dim=-1)
        ids = got[:, 2:2 + k].long()
        torch.testing.assert_close(lp.gather(1, ids), got[:, 2 + k:], atol=2e-5, rtol=1e-5)
        assert all(len(set(r)) == k for r in ids.tolist())


def test_logprob_rows_reference_rules():
    from nanoserve_kernels.logprobs import logprob_rows_reference

    x, tokens = _logprob_cases(torch.Generator().manual_seed(3), torch.float32)
    out = logprob_rows_reference(x, tokens, 3)
    lp = torch.log_softmax(x, dim=-1)
    assert torch.equal(out[:, 0], lp.gather(1, tokens[:, None])[:, 0])
    assert out[1, 1] == 2 and out[1, 2:4].tolist() == [4095.0, 4096.0]  # the second best
    assert out[2, 1] == 1 and out[2, 2:5].tolist() == [8999.0, 8998.0, 8997.0]
    assert out[4, 1] == x.shape[1]  # the worst token ranks last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_logprob_rows_matches_reference(interp, dtype):
    from nanoserve_kernels.logprobs import logprob_rows, logprob_rows_reference

    x, tokens = _logprob_cases(torch.Generator().manual_seed(3), dtype)
    for k in (0, 1, 5, 20):
        _assert_same_logprob_rows(logprob_rows(x, tokens, k),
                                  logprob_rows_reference(x, tokens, k), x, k)
    assert logprob_rows(x[:0], tokens[:0], 5).shape == (0, 12)
    with pytest.raises(ValueError, match="k must be"):
        logprob_rows(x, tokens, 21)


# --- FP8 KV cache: float8 e4m3 pools with per-layer scales (nanoserve_kernels/kv_quant.py) ---------------
# The interpreter loads float8 exactly, but its own float32 -> float8 cast rounds wrongly; the
# kernels round to the e4m3 grid themselves before casting (see nanoserve_kernels/kv_quant.py), so the
# stores below are held to torch's conversion bit for bit. Attention over an FP8 pool is held
# to the reference over the same pool within the float tolerances above: the kernels' casts
# from e4m3 are exact and folding the scales into the softmax scale and the output only
# reorders float32 roundings.

FP8_SCALES = [(1.0, 1.0), (0.37, 2.5)]  # (k_scale, v_scale): unit, and neither a power of two


def _fp8_pool(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """A float cache quantized into an FP8 one (values up to 6x past 448 * scale: clamped)."""
    from nanoserve_kernels.kv_quant import quantize_reference

    return quantize_reference(cache * 150.0 * scale, scale)


def _assert_close_fp8(actual, expected, dtype, v_cache: torch.Tensor, v_scale: float) -> None:
    """The float tolerances, the absolute one scaled by the largest value read (outputs are
    averages of values up to 448 * v_scale: float32's rounding of such sums is absolute)."""
    atol, rtol = TOLERANCE[dtype]
    biggest = float(v_cache.float().abs().max()) * v_scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * biggest, rtol=rtol)


def _fp8_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (+0 and -0 alike: the kernels' rounding gives +0 where torch keeps -0)."""
    return a.dtype == b.dtype == torch.float8_e4m3fn and torch.equal(a.float(), b.float())


def test_interp_fp8_store_rounds_every_code_and_tie_as_torch(interp):
    """The store kernel's quantization against torch's float32 -> e4m3 conversion on every
    finite code, every halfway point between neighbours (ties to even), values past 448
    (clamped), subnormals and random values."""
    kv = interp["kv_store"]
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[~codes.isnan()].sort().values  # 254 finite values, -448 .. 448
    ties = (codes[1:] + codes[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([codes, ties, torch.randn(1000, generator=g) * 50,
                   torch.randn(500, generator=g) * 1e-2, torch.tensor([1e4, -1e4, 1e-30])])
    x = torch.cat([x, torch.zeros(2048 - x.numel())]).view(32, 1, 64)  # [N, Hkv, D]
    slots = torch.arange(32, dtype=torch.int64)
    for scale in (1.0, 0.37, 4.0):
        caches = [torch.zeros((2, 16, 1, 64), dtype=torch.float8_e4m3fn) for _ in range(2)]
        expected = [c.clone() for c in caches]
        store_kv_reference(x, x, *expected, slots, k_scale=scale, v_scale=scale)
        kv.store_kv(x, x, *caches, slots, k_scale=scale, v_scale=scale)
        assert _fp8_equal(caches[0], expected[0]) and _fp8_equal(caches[1], expected[1])


@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
def test_interp_fp8_store_kv_kernel_matches_reference(interp, src_dtype, k_scale, v_scale):
    kv = interp["kv_store"]
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_blocks, block_size, hkv, d = 20, 4, 8, 2, 64
    k = (torch.randn((num_tokens, hkv, d), generator=gen) * 200).to(src_dtype)  # some clamp
    v = (torch.randn((num_tokens, hkv, d), generator=gen) * 0.01).to(src_dtype)  # subnormals
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1
    shape = (num_blocks, block_size, hkv, d)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(2)]
    expected = [c.clone() for c in caches]
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    store_kv_reference(k, v, *expected, slots, **scales)
    kv.store_kv(k, v, *caches, slots, **scales)
    assert _fp8_equal(caches[0], expected[0]) and _fp8_equal(caches[1], expected[1])


def test_interp_fp8_rotary_store_matches_reference(interp):
    from nanoserve_kernels.rotary_store import rotary_store, rotary_store_reference

    g = torch.Generator().manual_seed(5)
    qkv, cos, sin, kc, vc, slots = _rotary_store_case(g)
    qkv = qkv * 30
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    kc2, vc2 = kc.clone(), vc.clone()
    scales = {"k_scale": 0.37, "v_scale": 2.5}
    want = rotary_store_reference(qkv, cos, sin, kc, vc, slots, 4, **scales)
    got = rotary_store(qkv, cos, sin, kc2, vc2, slots, 4, **scales)
    assert_close(got, want, torch.float32)
    assert _fp8_equal(kc2, kc) and _fp8_equal(vc2, vc)
    assert kc.float().abs().max() > 0  # something was stored


@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize("group,head_dim,block_size,dtype", [
    (1, 64, 16, torch.float32), (4, 128, 32, torch.float16), (3, 64, 16, torch.float16),
])  # fmt: skip
def test_interp_fp8_decode_kernel_matches_reference(
    interp, group, head_dim, block_size, dtype, k_scale, v_scale
):
    paged = interp["paged_attention"]
    (q, k_cache, v_cache, tables, lens), used = make_decode_case(
        seed=group + head_dim, context_lens=[1, block_size, 3 * block_size - 5], num_kv_heads=2,
        group=group, head_dim=head_dim, block_size=block_size, dtype=torch.float32,
    )  # fmt: skip
    q = (q / 40).to(dtype)  # scores of a few units over keys up to 448 * k_scale
    k8, v8 = _fp8_pool(k_cache, k_scale), _fp8_pool(v_cache, v_scale)
    scale, scales = 1.0 / math.sqrt(head_dim), {"k_scale": k_scale, "v_scale": v_scale}
    expected = paged_decode_attention_reference(q, k8, v8, tables, lens, scale, **scales)
    for splits in (None, 3):  # one program per (row, KV head), and the split-K path
        out = paged.paged_decode_attention(q, k8, v8, tables, lens, scale, num_splits=splits,
                                           **scales)
        assert out.dtype == dtype
        _assert_close_fp8(out, expected, dtype, v8, v_scale)
    # padding, spare blocks and partly filled blocks' tails are never read
    k_bad, v_bad = (poison_unused(c.float(), used, 448.0).to(c.dtype) for c in (k8, v8))
    dirty = paged.paged_decode_attention(q, k_bad, v_bad, tables, lens, scale, **scales)
    clean = paged.paged_decode_attention(q, k8, v8, tables, lens, scale, **scales)
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim,block_size", [(4, 128, 16), (3, 64, 32)])
def test_interp_fp8_decode_f16_form_matches_reference(interp, group, head_dim, block_size, dtype):
    """The decode kernel's "f16" form over an FP8 pool (`fp8_form="f16"`: entries widened to
    float16, V read as 16-bit words, q in float16 at a power-of-two scale; here with
    `_widen_pairs`' integer form) against the reference: splits, a window, steps of 16-128
    tokens, and bfloat16 queries of 2^-30 and 2^20 (the softmax scale compensating) that
    float16 would flush to zero or overflow without the scale. The output is in q's dtype: the
    float16 tolerance, relative 2^-7 for bfloat16 (its rounding is 2^-9)."""
    paged = interp["paged_attention"]
    assert paged.uses_f16_form(dtype, torch.float8_e4m3fn, head_dim, 16, "f16")
    (q, k_cache, v_cache, tables, lens), used = make_decode_case(
        seed=7 * group + head_dim, context_lens=[1, 17, 2 * block_size, 5 * block_size - 3],
        num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32,
    )  # fmt: skip
    k8, v8 = _fp8_pool(k_cache, 0.37), _fp8_pool(v_cache, 2.5)
    scales = {"k_scale": 0.37, "v_scale": 2.5}
    atol, rtol = TOLERANCE[torch.float16] if dtype == torch.float16 else (2e-3, 2**-7)
    biggest = float(v8.float().abs().max()) * 2.5
    sizes = (1.0, 2.0**-30, 2.0**20) if dtype == torch.bfloat16 else (1.0, 2.0**-8, 2.0**8)
    for q_size in sizes:
        qs = (q / 40 * q_size).to(dtype)
        scale = 1.0 / math.sqrt(head_dim) / q_size
        for kwargs in ({}, {"num_splits": 3, "block_n": 16}, {"window": 9, "block_n": 32},
                       {"num_splits": 2, "even_splits": True, "block_n": 128}):
            expected = paged_decode_attention_reference(
                qs, k8, v8, tables, lens, scale, window=kwargs.get("window"), **scales)
            out = paged.paged_decode_attention(qs, k8, v8, tables, lens, scale, **kwargs,
                                               fp8_form="f16", **scales)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), expected.float(), atol=atol * biggest,
                                       rtol=rtol, msg=lambda m, kw=kwargs: f"{kw}: {m}")
    # padding, spare blocks and partly filled blocks' tails are never read
    k_bad, v_bad = (poison_unused(c.float(), used, 448.0).to(c.dtype) for c in (k8, v8))
    qs = (q / 40).to(dtype)
    dirty = paged.paged_decode_attention(qs, k_bad, v_bad, tables, lens, 0.1, **scales)
    clean = paged.paged_decode_attention(qs, k8, v8, tables, lens, 0.1, **scales)
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize("group,head_dim,block_size,dtype", [
    (1, 64, 16, torch.float32), (4, 64, 32, torch.float16),
])  # fmt: skip
def test_interp_fp8_paged_prefill_kernel_matches_reference(
    interp, group, head_dim, block_size, dtype, k_scale, v_scale
):
    paged_prefill = interp["paged_prefill"]
    cached, new = [0, block_size, 5], [20, 9, 1]
    (q, k_cache, v_cache, tables, cu, lens), _, used = make_paged_prefill_case(
        seed=group * 10 + block_size, cached_lens=cached, new_lens=new, num_kv_heads=2,
        group=group, head_dim=head_dim, block_size=block_size, dtype=torch.float32,
    )  # fmt: skip
    q = (q / 40).to(dtype)
    k8, v8 = _fp8_pool(k_cache, k_scale), _fp8_pool(v_cache, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    args = (q, k8, v8, tables, cu, lens, max(new), 1.0 / math.sqrt(head_dim))
    expected = paged_prefill_attention_reference(*args, **scales)
    out = paged_prefill.paged_prefill_attention(*args, block_m=16, block_n=16, **scales)
    assert out.dtype == dtype
    _assert_close_fp8(out, expected, dtype, v8, v_scale)
    k_bad, v_bad = (poison_unused(c.float(), used, 448.0).to(c.dtype) for c in (k8, v8))
    dirty = paged_prefill.paged_prefill_attention(q, k_bad, v_bad, *args[3:], block_m=16,
                                                  block_n=16, **scales)
    torch.testing.assert_close(dirty, out, atol=0, rtol=0)


def test_interp_fp8_backend_dispatches_the_kernels(interp):
    import nanoserve_kernels.backend as backend

    (q, k_cache, v_cache, tables, lens), _ = make_decode_case(
        seed=9, context_lens=[7, 30], num_kv_heads=2, group=2, head_dim=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip
    k8, v8 = _fp8_pool(k_cache, 0.5), _fp8_pool(v_cache, 2.0)
    scales = {"k_scale": 0.5, "v_scale": 2.0}
    out = backend.decode_attention(q / 40, k8, v8, tables, lens, 0.125, **scales)
    want = paged_decode_attention_reference(q / 40, k8, v8, tables, lens, 0.125, **scales)
    assert backend.use_triton("cpu")
    _assert_close_fp8(out, want, torch.float32, v8, 2.0)
