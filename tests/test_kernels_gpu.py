"""Kernels on a CUDA device: the Triton kernels against their PyTorch references in bfloat16
(plus float16 and float32), with larger shapes than the CPU interpreter allows.

Skipped cleanly where Triton or a CUDA device is missing. Tolerances, kernel vs reference
(the reference computes in float32 from the same low-precision inputs, then rounds):
- float32: atol 1e-4, rtol 1e-4 (dots in IEEE float32);
- float16: atol 2e-3, rtol 2e-3;
- bfloat16: atol 2e-2, rtol 2e-2 (the kernels round the softmax weights to bfloat16 before
  the weights x values product, as flash attention does; bfloat16 keeps 8 mantissa bits).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nanoserve_kernels import decode_attention, paged_prefill_attention, use_triton  # noqa: E402
from nanoserve_kernels.kv_store import store_kv, store_kv_reference  # noqa: E402
from nanoserve_kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
)
from nanoserve_kernels.paged_prefill import (  # noqa: E402
    paged_prefill_attention as paged_prefill_kernel,
)
from nanoserve_kernels.paged_prefill import (  # noqa: E402
    paged_prefill_attention_reference,
)
from nanoserve_kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_reference,
    prefill_work,
    prefill_work_size,
)

DEVICE = "cuda"
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def make_decode_case(*, seed, context_lens, num_kv_heads, group, head_dim, block_size, dtype):
    """Random paged cache on the GPU; rows own disjoint shuffled blocks numbered from 1, block
    0 is only padding. Returns the tensors and a [num_blocks, block_size] mask of real slots."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    blocks_per_row = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max(blocks_per_row) + 1
    num_blocks = 1 + sum(blocks_per_row) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((batch, num_kv_heads * group, head_dim), generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros((batch, max_blocks), dtype=torch.int32)
    real = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    for row, (n, nb) in enumerate(zip(context_lens, blocks_per_row)):
        mine, order = order[:nb], order[nb:]
        tables[row, :nb] = torch.tensor(mine, dtype=torch.int32)
        for t in range(n):
            real[mine[t // block_size], t % block_size] = True
    lens = torch.tensor(context_lens, dtype=torch.int32)
    tensors = [x.to(DEVICE) for x in (q, k_cache, v_cache, tables, lens)]
    return tensors, real.to(DEVICE)


def ragged_lengths(seed, count, block_size, longest):
    gen = torch.Generator().manual_seed(seed)
    fixed = [1, block_size, 2 * block_size, longest]
    rand = torch.randint(2, longest, (count - len(fixed),), generator=gen).tolist()
    return fixed + rand


DECODE_CASES = [  # (query heads per KV head, head_dim, block_size)
    (1, 64, 16),
    (3, 128, 32),
    (4, 64, 16),
    (8, 128, 16),
    (4, 128, 32),
    (8, 64, 32),
]


@pytest.mark.parametrize("group,head_dim,block_size", DECODE_CASES)
def test_decode_kernel_matches_reference_bf16(group, head_dim, block_size):
    lens = ragged_lengths(group + head_dim, 24, block_size, longest=2000)
    (q, k_cache, v_cache, tables, ctx), real = make_decode_case(
        seed=group * 7 + head_dim, context_lens=lens, num_kv_heads=4, group=group,
        head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, ctx, scale)
    for splits in (None, 1, 5):  # heuristic, one program per (row, KV head), split-K
        for even in (False, True):  # partitions sized for the bound, or per row
            out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale,
                                         num_splits=splits, even_splits=even)
            assert out.dtype == torch.bfloat16 and out.shape == q.shape
            assert_close(out, expected, torch.bfloat16)
    for splits in (1, 5):  # both launch orders of the programs
        for heads_fastest in (False, True):
            out = paged_decode_attention(
                q, k_cache, v_cache, tables, ctx, scale, num_splits=splits,
                heads_fastest=heads_fastest,
            )  # fmt: skip
            assert_close(out, expected, torch.bfloat16)
    # padding block 0, spare blocks and tails of partly filled blocks are never read
    k_bad = k_cache.masked_fill(~real[:, :, None, None], 1e4)
    v_bad = v_cache.masked_fill(~real[:, :, None, None], 1e4)
    for splits in (1, 5):
        clean = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=splits)
        dirty = paged_decode_attention(q, k_bad, v_bad, tables, ctx, scale, num_splits=splits)
        assert torch.equal(clean, dirty)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_kernel_matches_reference_other_dtypes(dtype):
    lens = ragged_lengths(3, 12, 16, longest=700)
    (q, k_cache, v_cache, tables, ctx), _ = make_decode_case(
        seed=3, context_lens=lens, num_kv_heads=2, group=4, head_dim=64, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, ctx, 0.125)
    for splits in (1, 4):
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, num_splits=splits)
        assert_close(out, expected, dtype)


def test_decode_heuristic_splits_small_batch_long_context():
    """Batch 2 x 8 KV heads cannot fill the GPU: the default call takes the split-K path."""
    lens = [8000, 5]
    (q, k_cache, v_cache, tables, ctx), _ = make_decode_case(
        seed=5, context_lens=lens, num_kv_heads=8, group=4, head_dim=64, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, ctx, 0.125)
    assert_close(
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125), expected, torch.bfloat16
    )
    assert use_triton(q.device)
    assert_close(
        decode_attention(q, k_cache, v_cache, tables, ctx, 0.125), expected, torch.bfloat16
    )


@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 128), (4, 64), (8, 128)])
def test_prefill_kernel_matches_reference_bf16(group, head_dim):
    gen = torch.Generator().manual_seed(group + head_dim)
    lengths = [1, 64, 128, 0, 1000, *torch.randint(2, 600, (5,), generator=gen).tolist()]
    n = sum(lengths)
    q = torch.randn((n, 4 * group, head_dim), generator=gen).to(torch.bfloat16).to(DEVICE)
    k = torch.randn((n, 4, head_dim), generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn((n, 4, head_dim), generator=gen).to(torch.bfloat16).to(DEVICE)
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    scale = 1.0 / math.sqrt(head_dim)
    expected = prefill_attention_reference(q, k, v, cu, max(lengths), scale)
    out = prefill_attention(q, k, v, cu, max(lengths), scale)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, torch.bfloat16)
    # over a work table (the captured prefill's grid), spare entries included: the same bits
    size = prefill_work_size(n, len(lengths) + 4)
    work = torch.from_numpy(prefill_work(lengths, size)).to(DEVICE)
    torch.testing.assert_close(prefill_attention(q, k, v, cu, 1, scale, work=work), out,
                               atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_kernel_matches_reference_other_dtypes(dtype):
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 63, 65, 300]
    n = sum(lengths)
    q, k, v = (torch.randn((n, h, 64), generator=gen).to(dtype).to(DEVICE) for h in (8, 2, 2))
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    expected = prefill_attention_reference(q, k, v, cu, 300, 0.125)
    assert_close(prefill_attention(q, k, v, cu, 300, 0.125), expected, dtype)


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(8, 64, 16), (3, 128, 32)])
def test_store_kv_kernel_matches_reference(num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_tokens, num_blocks = 3000, 400
    qkv = torch.randn((num_tokens, (4 + 2 * num_kv_heads) * head_dim), generator=gen)
    qkv = qkv.to(torch.bfloat16).to(DEVICE)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding tokens: not stored
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv_reference(k, v, *expected, slots)
    store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0])
    assert torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_silu_and_mul_kernels_match_references(dtype):
    from nanoserve_kernels.activation import silu_and_mul, silu_and_mul_reference
    from nanoserve_kernels.rmsnorm import rms_norm, rms_norm_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    for d in (576, 2048):
        x = (torch.randn(300, d, generator=g, device="cuda") * 2).to(dtype)
        w = (torch.randn(d, generator=g, device="cuda") + 1).to(dtype)
        torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5),
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
        gu = torch.randn(300, 2 * d, generator=g, device="cuda").to(dtype)
        torch.testing.assert_close(silu_and_mul(gu), silu_and_mul_reference(gu),
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
def make_paged_prefill_case(*, seed, cached_lens, new_lens, num_kv_heads, group, head_dim,
                            block_size, dtype):  # fmt: skip
    """Rows with `cached_lens[i]` tokens in the pool plus `new_lens[i]` new ones (stored too),
    in disjoint shuffled blocks numbered from 1 (block 0 is padding only). Returns the kernel's
    arguments and a [num_blocks, block_size] mask of the slots holding context."""
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    (_, k_cache, v_cache, tables, ctx), real = make_decode_case(
        seed=seed, context_lens=ctx_lens, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, block_size=block_size, dtype=dtype,
    )  # fmt: skip
    q = torch.randn((sum(new_lens), num_kv_heads * group, head_dim), generator=gen)
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    return [q.to(dtype).to(DEVICE), k_cache, v_cache, tables, cu.to(DEVICE), ctx], real


def paged_prefill_rows(seed, count):
    """(cached, new) lengths: a long shared-prefix-like context, nothing cached, one new token,
    no new token, block-boundary starts, and random rows."""
    gen = torch.Generator().manual_seed(seed)
    rand_cached = torch.randint(0, 2000, (count - 6,), generator=gen).tolist()
    rand_new = torch.randint(1, 400, (count - 6,), generator=gen).tolist()
    return [1000, 0, 1500, 64, 16, 0, *rand_cached], [200, 600, 1, 0, 100, 1, *rand_new]


PAGED_PREFILL_CASES = [  # (query heads per KV head, head_dim, block_size)
    (1, 64, 16),
    (3, 128, 32),
    (4, 64, 16),
    (8, 128, 16),
    (8, 64, 32),
]


@pytest.mark.parametrize("group,head_dim,block_size", PAGED_PREFILL_CASES)
def test_paged_prefill_kernel_matches_reference_bf16(group, head_dim, block_size):
    cached, new = paged_prefill_rows(group + head_dim, 16)
    args, real = make_paged_prefill_case(
        seed=group * 11 + head_dim, cached_lens=cached, new_lens=new, num_kv_heads=4,
        group=group, head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
    )  # fmt: skip
    q, k_cache, v_cache, tables, cu, ctx = args
    scale = 1.0 / math.sqrt(head_dim)
    expected = paged_prefill_attention_reference(*args, max(new), scale)
    big_m = max(16, 128 // (1 << (group - 1).bit_length()))  # a tile of 128 rows
    for block_m, block_n in ((None, None), (16, 32), (big_m, 64)):
        out = paged_prefill_kernel(*args, max(new), scale, block_m=block_m, block_n=block_n)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        assert_close(out, expected, torch.bfloat16)
    for window in (7, 3 * block_size + 5):  # a sliding window: the reference's keys only
        want = paged_prefill_attention_reference(*args, max(new), scale, window=window)
        for block_m, block_n in ((None, None), (16, 32)):
            got = paged_prefill_kernel(*args, max(new), scale, block_m=block_m,
                                       block_n=block_n, window=window)
            assert_close(got, want, torch.bfloat16)
    # padding block 0, spare blocks and tails of partly filled blocks are never read
    k_bad = k_cache.masked_fill(~real[:, :, None, None], 1e4)
    v_bad = v_cache.masked_fill(~real[:, :, None, None], 1e4)
    clean = paged_prefill_kernel(*args, max(new), scale)
    dirty = paged_prefill_kernel(q, k_bad, v_bad, tables, cu, ctx, max(new), scale)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_prefill_kernel_matches_reference_other_dtypes(dtype):
    cached, new = paged_prefill_rows(5, 10)
    args, _ = make_paged_prefill_case(
        seed=5, cached_lens=cached, new_lens=new, num_kv_heads=2, group=4, head_dim=64,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    expected = paged_prefill_attention_reference(*args, max(new), 0.125)
    assert_close(paged_prefill_kernel(*args, max(new), 0.125), expected, dtype)
    assert use_triton(args[0].device)
    assert_close(paged_prefill_attention(*args, max(new), 0.125), expected, dtype)


def test_paged_prefill_kernel_without_cache_equals_prefill_kernel():
    """Nothing cached: the paged prefill over the pool equals the ragged prefill kernel over
    the same packed keys and values."""
    new = [1, 64, 300, 17]
    args, _ = make_paged_prefill_case(
        seed=9, cached_lens=[0] * 4, new_lens=new, num_kv_heads=2, group=4, head_dim=64,
        block_size=16, dtype=torch.bfloat16,
    )  # fmt: skip
    q, k_cache, v_cache, tables, cu, ctx = args
    k = torch.cat([k_cache[tables[i].long(), :][: -(-n // 16)].flatten(0, 1)[:n]
                   for i, n in enumerate(new)])  # fmt: skip
    v = torch.cat([v_cache[tables[i].long(), :][: -(-n // 16)].flatten(0, 1)[:n]
                   for i, n in enumerate(new)])  # fmt: skip
    expected = prefill_attention(q, k, v, cu, max(new), 0.125)
    assert_close(paged_prefill_kernel(*args, max(new), 0.125), expected, torch.bfloat16)


# --- sliding window ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 100, 4096, 1_000_000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_window_matches_reference(window, dtype):
    """Windows of one token, shorter than most rows, Mistral v0.1's 4096 (some rows longer,
    some shorter), longer than every row (equals no window); one program per (row, KV head),
    split-K over the window, the heuristic; tokens before a row's window are never loaded
    (NaN there would reach the output)."""
    lens = [1, 99, 100, 101, 4095, 4097, 9000, *ragged_lengths(window, 13, 16, longest=6000)]
    (q, k_cache, v_cache, tables, ctx), real = make_decode_case(
        seed=window % 1000, context_lens=lens, num_kv_heads=4, group=4, head_dim=128,
        block_size=16, dtype=dtype,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(128)
    expected = paged_decode_attention_reference(
        q, k_cache, v_cache, tables, ctx, scale, window=window
    )
    before = torch.zeros_like(real)  # real slots before their row's window
    for row, n in enumerate(lens):
        for t in range(max(0, n - window)):
            before[int(tables[row, t // 16]), t % 16] = True
    k_bad = k_cache.masked_fill(before[:, :, None, None], float("nan"))
    v_bad = v_cache.masked_fill(before[:, :, None, None], float("nan"))
    for splits, even in ((None, False), (1, False), (5, False), (5, True)):
        out = paged_decode_attention(
            q, k_bad, v_bad, tables, ctx, scale, window=window, num_splits=splits,
            even_splits=even,
        )
        assert_close(out, expected, dtype)
    if window >= max(lens):
        plain = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits=5)
        windowed = paged_decode_attention(
            q, k_cache, v_cache, tables, ctx, scale, window=window, num_splits=5
        )
        assert torch.equal(plain, windowed)
    assert_close(
        decode_attention(q, k_cache, v_cache, tables, ctx, scale, window=window), expected, dtype
    )


@pytest.mark.parametrize("window", [1, 37, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_kernel_window_matches_reference(window, dtype):
    gen = torch.Generator().manual_seed(window)
    lengths = [1, 64, 128, 0, 1000, 5000, *torch.randint(2, 600, (5,), generator=gen).tolist()]
    n = sum(lengths)
    q = torch.randn((n, 16, 128), generator=gen).to(dtype).to(DEVICE)
    k = torch.randn((n, 4, 128), generator=gen).to(dtype).to(DEVICE)
    v = torch.randn((n, 4, 128), generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    scale = 1.0 / math.sqrt(128)
    expected = prefill_attention_reference(q, k, v, cu, max(lengths), scale, window=window)
    for block_m, block_n in ((None, None), (32, 16)):
        out = prefill_attention(
            q, k, v, cu, max(lengths), scale, window=window, block_m=block_m, block_n=block_n
        )
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_and_add_rms_norm_kernels_match_references(dtype):
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_reference
    from nanoserve_kernels.rotary import rotary, rotary_reference

    g = torch.Generator(device="cuda").manual_seed(8)
    for heads, d in ((40, 64), (12, 128)):  # the fused q|k heads of the 1B shape; 128-wide
        qkv = torch.randn(300, heads + 8, d, generator=g, device="cuda").to(dtype)
        cos = torch.randn(300, d, generator=g, device="cuda").to(dtype)
        sin = torch.randn(300, d, generator=g, device="cuda").to(dtype)
        x = qkv[:, :heads]
        # bf16: the kernel rounds once, the reference after each product too (one ulp apart;
        # |out| < 8 here, where a bf16 ulp is at most 2**-5)
        torch.testing.assert_close(rotary(x, cos, sin), rotary_reference(x, cos, sin),
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=2**-5 if dtype == torch.bfloat16 else 1e-5)
    x, r = (torch.randn(300, 2048, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = torch.randn(2048, generator=g, device="cuda").to(dtype)
    for got, want in zip(add_rms_norm(x, r, w, 1e-5), add_rms_norm_reference(x, r, w, 1e-5)):
        torch.testing.assert_close(got, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_store_equals_the_rotary_and_store_kernels(dtype):
    """The fused kernel rounds where the two kernels it replaces round: bit for bit in
    bf16; in float32 within the FMA contractions each compiled kernel may choose."""
    from nanoserve_kernels.rotary import rotary
    from nanoserve_kernels.rotary_store import rotary_store

    g = torch.Generator(device="cuda").manual_seed(9)
    for hq, hkv, d in ((32, 8, 64), (12, 2, 128)):
        n, num_blocks, block = 300, 40, 16
        qkv = torch.randn(n, hq + 2 * hkv, d, generator=g, device="cuda").to(dtype)
        cos = torch.randn(n, d, generator=g, device="cuda").to(dtype)
        sin = torch.randn(n, d, generator=g, device="cuda").to(dtype)
        slots = torch.randperm(num_blocks * block, generator=g, device="cuda")[:n]
        slots[::7] = -1
        shape = (num_blocks, block, hkv, d)
        kc, vc = (torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(2))
        kc2, vc2 = kc.clone(), vc.clone()
        q = rotary_store(qkv, cos, sin, kc, vc, slots, hq)
        qk = rotary(qkv[:, :hq + hkv], cos, sin)
        store_kv(qk[:, hq:], qkv[:, hq + hkv:], kc2, vc2, slots)
        if dtype == torch.float32:  # the compilers may contract other products into FMAs
            torch.testing.assert_close(q, qk[:, :hq], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(kc, kc2, rtol=1e-6, atol=1e-6)
        else:  # rounding to 16 bits hides that: bit for bit
            assert torch.equal(q, qk[:, :hq]) and torch.equal(kc, kc2)
        assert torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_scatter_equals_torch_argmax(dtype):
    from nanoserve_kernels.argmax import argmax_scatter

    g = torch.Generator(device="cuda").manual_seed(10)
    for b, V in ((1, 128256), (7, 9000), (256, 128256), (33, 32000)):
        x = torch.randn(b, V, generator=g, device="cuda").to(dtype)
        if b > 1:
            x[1, V // 2] = x[1, 3] = x[1].max() + 1  # a tie: the first index
            x[-1] = float("-inf")
        slots = torch.randperm(b + 5, device="cuda")[:b]
        last = torch.full((b + 5,), -1, dtype=torch.int64, device="cuda")
        tokens = argmax_scatter(x, slots, last)
        want = torch.argmax(x, dim=-1)
        assert torch.equal(tokens, want)
        assert torch.equal(last[slots], want)
        assert int((last >= 0).sum()) == b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_argmax_equals_reference(dtype):
    """The engine's shapes (up to 256 rows over real vocabularies): random bitmasks, sparse
    ones (a few allowed tokens, as inside a JSON string's end), a row allowing nothing (-1)
    and one allowing everything, against the torch reference on the same device."""
    from nanoserve_kernels.argmax import masked_argmax, masked_argmax_reference

    g = torch.Generator(device="cuda").manual_seed(12)
    for b, V in ((1, 49152), (7, 9000), (256, 49152), (64, 128256)):
        words = -(-V // 32)
        x = torch.randn(b, V, generator=g, device="cuda").to(dtype)
        bm = torch.randint(-(2**31), 2**31 - 1, (b, words), generator=g, device="cuda",
                           dtype=torch.int32)
        bm[::3] &= torch.randint(0, 2, (words,), generator=g, device="cuda",
                                 dtype=torch.int32) << 5  # sparse: one bit in some words
        if b > 1:
            bm[0] = 0
            bm[-1] = -1
        got = masked_argmax(x, bm)
        assert torch.equal(got, masked_argmax_reference(x, bm))
        if b > 1:
            assert got[0] == -1 and got[-1] == torch.argmax(x[-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprob_rows_kernel_equals_reference(dtype):
    """The engine's shapes: up to 256 rows over real vocabularies, k from 0 to 20; each
    token's logprob and rank, and the top k (any order among equal values: bf16 logits
    tie often), against log_softmax, gather and topk."""
    from nanoserve_kernels.logprobs import logprob_rows, logprob_rows_reference

    g = torch.Generator(device="cuda").manual_seed(11)
    for m, V in ((1, 128256), (256, 128256), (256, 49152), (13, 32000)):
        x = (torch.randn(m, V, generator=g, device="cuda") * 4).to(dtype)
        tokens = torch.randint(0, V, (m,), generator=g, device="cuda")
        tokens[0] = int(x[0].argmax())
        for k in (0, 5, 20):
            got, want = logprob_rows(x, tokens, k), logprob_rows_reference(x, tokens, k)
            torch.testing.assert_close(got[:, 0], want[:, 0], atol=1e-4, rtol=1e-5)
            assert torch.equal(got[:, 1], want[:, 1])
            if k:
                torch.testing.assert_close(got[:, 2 + k:], want[:, 2 + k:], atol=1e-4,
                                           rtol=1e-5)
                lp = torch.log_softmax(x.float(), dim=-1)
                ids = got[:, 2:2 + k].long()
                torch.testing.assert_close(lp.gather(1, ids), got[:, 2 + k:], atol=1e-4,
                                           rtol=1e-5)
                assert all(len(set(r)) == k for r in ids.tolist())
