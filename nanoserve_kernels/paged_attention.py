"""Paged decode attention: one new query token per row against that row's cached keys/values.

KV pool of one layer: `k_cache, v_cache [num_blocks, block_size, Hkv, D]`. Token t of row i
lives in block `block_tables[i, t // block_size]` at offset `t % block_size`
(slot = block * block_size + offset). Row i attends to its first `context_lens[i]` tokens;
entries of `block_tables` past a row's context are padding and hold 0, an in-range block.
Query head h reads KV head `h // (Hq // Hkv)` (grouped-query attention, GQA).
With a sliding `window` W (optional, default none) row i's query, at position
`context_lens[i] - 1`, sees only its last W tokens: positions `context_lens[i] - W ..
context_lens[i] - 1` (transformers' `sliding_window` semantics); W >= the context is no window.
The cache holds q's dtype, or float8 e4m3 (an FP8 KV cache, `nanoserve_kernels.kv_quant`) read as
`float32(entry) * k_scale` (keys) and `* v_scale` (values).

Two implementations with one signature (the CPU engine runs
`nanoserve_kernels.cpu_attention.decode_attention_cpu`, equal to the reference up to rounding):
- `paged_decode_attention_reference`: PyTorch, the oracle. It gathers every row over a
  `[B, max_ctx]` rectangle (so padding slots are real, in-range reads) and masks positions
  `>= context_lens[i]` to -inf before a float32 softmax.
- `paged_decode_attention`: Triton. One program per (row, KV head, context split) serves the
  whole group of query heads sharing that KV head, walks only its row's own tokens block by
  block through the block table, and keeps an online softmax in float32. The programs of one
  row's KV heads are launched next to each other, so programs running together read
  neighbouring bytes of each `[block_size, Hkv, D]` cache block. With more than one
  split (flash-decoding) each program covers one partition of the context and writes a
  partial output with its log-sum-exp; a second kernel combines the partitions.
  From an FP8 cache with float16/bfloat16 queries the kernel takes one of two forms
  (`fp8_form`):
  - "f16": K and V entries widened to float16 in registers (exact: every e4m3
    value is a float16), q in float16 at a power-of-two scale per query head
    (`_float16_query`: exact for bfloat16 queries), p rounded to float16 for p·v (within
    2^-11 of p; the softmax's sum l adds the unrounded p), float32 sums. V is read as 16-bit
    words, each two neighbouring entries of a token (`_widen_pairs`), and its product is
    two dots, even and odd columns.
  - "e4m3" (the default until "f16" was timed on the H200 and checked there by
    `tests/test_fp8_kv_gpu.py`, 2026-12-05: 1.69x faster at 1,024 rows): each query head split once per program into
    two e4m3 terms with their own scales (`_split_query`: about bfloat16's precision),
    q·kᵀ the two terms' products summed, the probabilities cast to e4m3 for p·v: about 1%
    of the largest value read in `tests/test_fp8_kv_gpu.py`'s peaked cases.
  Why "f16" should be faster (Triton 3.6, sm_90; counted by compiling both for the 8B heads:
  Hq 32, Hkv 8, head_dim 128, 128-token steps, and reading the SASS). On sm_90 Triton's
  dots of 16-row tiles are mma.sync, which has no FP8 form: the "e4m3" form's operands are
  widened to float16 in registers anyway, so its FP8 products save nothing and its two
  q·kᵀ terms cost a third dot. Its V operand (the p·v product reduces over tokens; V is
  contiguous along head_dim) is transposed from shared memory one byte at a time: 128
  byte loads and about 190 packing instructions a thread a step. It takes 248 registers a
  thread: 2 programs an SM, 8 warps, 2 x 32 KiB of K/V in flight; its loop runs 1,459
  instructions a warp a step, 0.18 a byte of cache (the bfloat16 kernel: 512 a 64-token
  step, 0.06 a byte, 107 registers, 4 programs an SM, 4 x 32 KiB in flight). At 256 x 1,024
  both kernels took ~4 us a loop step on the H200 (62 steps a program slot either way):
  equal steps over half the bytes, the 1.7 against 3.55 TB/s of the engine at scale.
  The "f16" form reads V's words with ldmatrix (a 16-bit transpose) and widens them with
  two byte permutes and two paired conversions (`_widen_pairs`' PTX), one dot for q·kᵀ:
  851 instructions a warp a step (0.10 a byte, 1.7x fewer), 156 registers, so 3 programs
  an SM (12 warps; 65,536 / (160 x 128)). Five stages (`F16_TILING`) put the K/V loads two
  steps ahead of their use (three and four stages pipeline only the block-table load:
  the K/V loads depend on it): 73 KiB of shared memory a program, 3 x 74 = 222 of the
  SM's 228 KiB, 3 x 2 x 32 KiB = 192 KiB in flight against the bfloat16 kernel's 128. If
  the instruction rate bound the old form, 1.7x fewer instructions a byte and 1.5x the
  warps raise it; if the bytes in flight did, they are 3x. `benchmarks/kernels.py
  --batch-scale` measures both forms side by side.
  With float32 queries, head_dim under 32 or odd, steps under 16 tokens (under 32 for
  "e4m3"), or "e4m3" under the CPU interpreter, the entries are cast to q's dtype in
  registers instead (exact). The interpreter runs the "f16" form (its float16 dots
  multiply exactly and sum in float32) with `_widen_pairs`' integer form. Either way the
  scales' multiplies are folded into the softmax scale (K) and the output's normalisation
  (V), since
  softmax(q·(s k)ᵀ c) = softmax(q·kᵀ (s c)) and Σ p (s v) = s Σ p v.
"""

from __future__ import annotations

import functools

import torch

from nanoserve_kernels._triton import HAS_TRITON, interpret_requested, next_power_of_2, tl, triton
from nanoserve_kernels.kv_args import check_context_lens, check_decode_args, check_window
from nanoserve_kernels.kv_quant import dequantize_reference, is_fp8
from nanoserve_kernels.online_softmax import (
    online_softmax_probs,
    online_softmax_step,
    online_softmax_update,
)

# Decided when this module is imported, like Triton's own choice in `@triton.jit` below.
INTERPRETED = HAS_TRITON and interpret_requested()

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_F16_QUERY_DTYPES = (torch.float16, torch.bfloat16)  # exact in float16 at a power-of-two scale
_LOG2E = 1.4426950408889634
# How the decode kernel multiplies an FP8 cache's entries (module docstring): "f16" widens
# them to float16 (the default), "e4m3" splits q into two e4m3 terms (the earlier form).
FP8_FORMS = ("f16", "e4m3")
DEFAULT_FP8_FORM = "f16"  # the engine's form (`backend.fp8_decode_form` may override it)
# The "f16" form's tiling on CUDA (see `default_tiling`): tokens a step, warps, stages.
F16_TILING = (128, 4, 5)

# Split heuristics: aim for this many programs per SM, never split below this many tokens.
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
# Program order of the decode grid (see `paged_decode_attention`'s `heads_fastest`): KV heads
# of a row side by side measured 1-4% faster than rows side by side on an H200.
_HEADS_FASTEST = True


def paged_decode_attention_reference(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    *,
    window: int | None = None,  # sliding window: the last `window` tokens only
    k_scale: float = 1.0,  # FP8 caches: a key is float32(entry) * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, Hq, D], dtype of q
    """PyTorch oracle for `paged_decode_attention` (float32 math, reads the whole rectangle)."""
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    window = check_window(window)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return torch.empty_like(q)
    lens, max_ctx = check_context_lens(context_lens, block_tables, block_size)
    pos = torch.arange(max_ctx, device=q.device)  # [T]
    blocks = block_tables.long()[:, pos // block_size]  # [B, T]; padding entries are block 0
    offsets = (pos % block_size).expand(batch, max_ctx)  # [B, T]
    math_dtype = torch.promote_types(q.dtype, torch.float32)  # float32 (float64 stays)
    k = dequantize_reference(k_cache[blocks, offsets], k_scale, math_dtype)  # [B, T, Hkv, D]
    v = dequantize_reference(v_cache[blocks, offsets], v_scale, math_dtype)  # [B, T, Hkv, D]
    group = num_q_heads // num_kv_heads
    # GQA: query head h = kv_head * group + j uses KV head h // group = kv_head; viewing the
    # queries as [B, Hkv, group, D] equals repeating each KV head `group` times.
    qg = q.to(math_dtype).reshape(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    pad = pos[None, :] >= lens[:, None]  # [B, T]
    pad = pad | (pos[None, :] < lens[:, None] - window)  # outside the sliding window
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G, T]
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


@triton.jit
def _row_partition(span, partition_size, num_splits, BLOCK_N: tl.constexpr,
                   EVEN_SPLITS: tl.constexpr):
    """Tokens per partition of a row whose window holds `span` tokens: fixed, or (even
    splits) the span cut into num_splits parts rounded up to BLOCK_N, at least
    partition_size. Both kernels of a split call derive it the same way."""
    if EVEN_SPLITS:
        part = (span + num_splits - 1) // num_splits
        part = ((part + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        return tl.maximum(part, partition_size)
    return partition_size


@triton.jit
def _split_query(q):
    """q [M, D] -> two e4m3 terms with per-row scales, q ≈ hi * s_hi + lo * s_lo: hi is q
    rounded to e4m3 at s_hi = a row's largest |q| / 448, lo the remainder rounded the same
    way, so the sum keeps about 7 significant bits (bfloat16's 8) where one e4m3 term
    keeps 4. Returns (hi, s_hi [M], lo, s_lo [M]); an all-zero row gets scales 1."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    s_hi = tl.where(amax > 0.0, amax / 448.0, 1.0)
    hi = (qf / s_hi[:, None]).to(tl.float8e4nv)
    rest = qf - hi.to(tl.float32) * s_hi[:, None]
    r_max = tl.max(tl.abs(rest), 1)
    s_lo = tl.where(r_max > 0.0, r_max / 448.0, 1.0)
    lo = (rest / s_lo[:, None]).to(tl.float8e4nv)
    return hi, s_hi, lo, s_lo


@triton.jit
def _float16_query(q):
    """q [M, D] -> (q16 [M, D] float16, s [M]) with q = q16 * s: s a power of two that puts
    a row's largest |q| in [2^14, 2^15), so that every bfloat16 or float16 entry down to
    2^-28 of it is a float16 normal and converts exactly. An all-zero row gets s = 1."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax))
    e = tl.minimum(tl.maximum(e - 14, -126), 127)
    s = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e
    s = tl.where(amax > 0.0, s, 1.0)
    return (qf / s[:, None]).to(tl.float16), s


@triton.jit
def _widen_pairs(w, PTX: tl.constexpr):
    """w: 16-bit words, each two neighbouring e4m3 entries of a token's value (low byte: the
    even column) -> (even, odd) as float16, exactly. PTX: two byte permutes and two paired
    conversions per two words, in whatever layout w is in (the compiler's own lowering of
    the integer form takes about twice the instructions); the interpreter runs the form
    below it, the same function."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 e, o; .reg .b16 e16, o16, x; prmt.b32 e, $2, 0, 0x20; "
            "prmt.b32 o, $2, 0, 0x31; mov.b32 {e16, x}, e; mov.b32 {o16, x}, o; "
            "cvt.rn.f16x2.e4m3x2 $0, e16; cvt.rn.f16x2.e4m3x2 $1, o16; }",
            "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    even = w.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    odd = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D] (KV_F16: 16-bit words [..., D / 2])
    block_tables_ptr,  # [B, max_blocks]
    context_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D] (one split) or partial outputs [B, Hq, S, D] float32
    lse_ptr,  # [B, Hq, S] float32 log2-sum-exp of each partition (unused with one split)
    qk_scale,  # softmax scale * log2(e) (* k_scale: FP8 caches)
    v_scale,  # FP8 caches: the values' scale, applied to the output; else 1.0
    window,  # sliding window (NO_WINDOW: none); splits cover positions from max(0, len - window)
    partition_size,  # tokens per split, a multiple of BLOCK_N (EVEN_SPLITS: the least)
    num_splits,  # the last split also takes any tokens beyond num_splits * partition_size
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a tl.dot-able power of two (>= 16)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,  # block_size of the cache
    BLOCK_N: tl.constexpr,  # tokens per loop step
    SPLIT: tl.constexpr,  # write partial outputs + lse instead of the final output
    DOT_FP32: tl.constexpr,  # compute dots in float32 (fp32 inputs, CPU interpreter)
    HEADS_FASTEST: tl.constexpr,  # grid (Hkv, B, S) instead of (B, Hkv, S)
    EVEN_SPLITS: tl.constexpr,  # each row's own span cut into num_splits equal partitions
    KV_FP8: tl.constexpr,  # the cache is float8 e4m3
    FP8_PRODUCTS: tl.constexpr,  # KV_FP8, not DOT_FP32, D_PAD and BLOCK_N >= 32: e4m3 dots
    KV_F16: tl.constexpr,  # KV_FP8, float16/bfloat16 q: entries widened to float16, V as words
    PTX: tl.constexpr,  # compiled for a GPU (not the interpreter): `_widen_pairs`' PTX form
):
    if HEADS_FASTEST:  # the KV heads of one row run side by side and read adjacent bytes
        kv_head = tl.program_id(0)
        row = tl.program_id(1)
    else:
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + row)
    lo = tl.maximum(context_len - window, 0)  # first position inside the window
    part = _row_partition(context_len - lo, partition_size, num_splits, BLOCK_N, EVEN_SPLITS)
    start = lo + split * part
    end = tl.minimum(start + part, context_len)
    end = tl.where(split == num_splits - 1, context_len, end)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g  # [GROUP_PAD] query heads of this KV head
    row64 = row.to(tl.int64)
    q_ptrs = q_ptr + row64 * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)
    if FP8_PRODUCTS:  # q in two e4m3 terms, each query head with its own scales
        q_hi, s_hi, q_lo, s_lo = _split_query(q)
        s_hi = s_hi[:, None] * qk_scale  # [GROUP_PAD, 1]
        s_lo = s_lo[:, None] * qk_scale

    if KV_F16:  # q exactly in float16, at a power-of-two scale per query head
        q, s_q = _float16_query(q)
        s_q = s_q[:, None] * qk_scale  # [GROUP_PAD, 1]
        w = tl.arange(0, D_PAD // 2)  # V's 16-bit words: columns 2w (low byte) and 2w + 1
        acc_even = tl.zeros([GROUP_PAD, D_PAD // 2], dtype=tl.float32)
        acc_odd = tl.zeros([GROUP_PAD, D_PAD // 2], dtype=tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + row64 * stride_btb
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        t_mask = t < end
        block = tl.load(bt_row + (t // PAGE) * stride_btn, mask=t_mask, other=0).to(tl.int64)
        offset = t % PAGE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_ptrs = k_head + block[:, None] * stride_kb + offset[:, None] * stride_ko
        v_ptrs = v_head + block[:, None] * stride_vb + offset[:, None] * stride_vo
        k = tl.load(k_ptrs + d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        if KV_F16:  # both products in float16 over exactly widened entries, float32 sums
            s = tl.dot(q, tl.trans(k.to(tl.float16))) * s_q  # [GROUP_PAD, BLOCK_N]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_i, l_i, alpha, p = online_softmax_probs(s, m_i, l_i)
            # V as words [BLOCK_N, D_PAD / 2]: the p·v operand's transpose moves 16-bit
            # words (ldmatrix) instead of single bytes
            vw_mask = t_mask[:, None] & (w < HEAD_DIM // 2)[None, :]
            v_words = tl.load(v_ptrs + w[None, :] * stride_vd, mask=vw_mask, other=0)
            v_even, v_odd = _widen_pairs(v_words, PTX)
            p = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd)
        else:
            v = tl.load(v_ptrs + d[None, :] * stride_vd, mask=kv_mask, other=0.0)  # [N, D_PAD]
            if KV_FP8 and not FP8_PRODUCTS:  # exact casts; the scales: in qk_scale, v_scale
                k = k.to(q_ptr.dtype.element_ty)
                v = v.to(q_ptr.dtype.element_ty)
            if FP8_PRODUCTS:  # e4m3 operands, float32 sums (module docstring)
                k_t = tl.trans(k)
                s = tl.dot(q_hi, k_t) * s_hi + tl.dot(q_lo, k_t) * s_lo  # [GROUP_PAD, N]
                s = tl.where(t_mask[None, :], s, float("-inf"))
                m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, DOT_FP32)
            else:
                m_i, l_i, acc = online_softmax_step(q, k, v, t_mask[None, :], qk_scale, m_i,
                                                    l_i, acc, DOT_FP32)
    if KV_F16:  # columns 2w and 2w + 1 side by side again
        acc = tl.reshape(tl.join(acc_even, acc_odd), [GROUP_PAD, D_PAD])
    has_tokens = l_i > 0.0  # False only for an empty partition (or a row of length 0)
    out = acc / tl.where(has_tokens, l_i, 1.0)[:, None] * v_scale
    out_mask = g_mask[:, None] & d_mask[None, :]
    out_ptrs = out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
    if SPLIT:
        tl.store(out_ptrs + split * stride_os, out, mask=out_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row64 * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    part_ptr,  # [B, Hq, S, D] float32 partial outputs
    lse_ptr,  # [B, Hq, S] float32 log2-sum-exp of each partition
    context_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D]
    window,
    num_splits,
    partition_size,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    row64 = row.to(tl.int64)
    context_len = tl.load(context_lens_ptr + row)
    span = context_len - tl.maximum(context_len - window, 0)  # tokens inside the window
    part = _row_partition(span, partition_size, num_splits, BLOCK_N, EVEN_SPLITS)
    used = tl.minimum((span + part - 1) // part, num_splits)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < used
    d_mask = d < HEAD_DIM
    lse = tl.load(
        lse_ptr + row64 * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no partition used: a row of length 0
    w = tl.exp2(lse - m)  # [S_PAD], 0 for unused partitions
    part_ptrs = (
        part_ptr + row64 * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :]
    )
    part = tl.load(part_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [S_PAD, D_PAD]
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [D_PAD]
    out_ptrs = out_ptr + row64 * stride_ob + head * stride_oh + d * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """How many partitions to cut each row's context into.

    One program per (row, KV head) is enough when those programs already fill the GPU; with
    fewer, long contexts are split so that about `_PROGRAMS_PER_SM` programs run per SM, never
    into partitions shorter than `_MIN_TOKENS_PER_SPLIT` tokens. On the CPU interpreter: 1.
    """
    if device.type != "cuda":
        return 1
    programs = max(1, batch * num_kv_heads)
    target = _PROGRAMS_PER_SM * _num_sms(device.index if device.index is not None else 0)
    if programs * 2 >= target:
        return 1
    by_fill = _cdiv(target, programs)
    by_length = max(1, max_context_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_fill, by_length, _MAX_SPLITS))


def default_tiling(programs: int, head_dim: int, device: torch.device,
                   fp8_products: bool = False, kv_f16: bool = False
                   ) -> tuple[int, int | None, int]:
    """(tokens per loop step, software-pipelining depth, warps) on CUDA.

    A bfloat16/float16 cache, as measured best on an H200 with `benchmarks/kernels.py
    --sweep`: two stages (three hold more shared memory per program and leave fewer
    programs per SM), 4 warps, and 128-token steps when fewer than 8 programs per SM
    (head_dim <= 64), else 64. The "e4m3" form of an FP8 cache (`fp8_products`): 128-token
    steps (1.10-1.41x faster than 64-token steps at head_dim 128), two stages. The "f16"
    form (`kv_f16`): `F16_TILING`, reasoned in the module docstring. Off CUDA: 64 tokens,
    Triton's default stages, 4 warps."""
    if device.type != "cuda":
        return 64, None, 4
    if kv_f16:
        return F16_TILING[0], F16_TILING[2], F16_TILING[1]
    few = programs < 8 * _num_sms(device.index if device.index is not None else 0)
    return (128 if fp8_products or (few and head_dim <= 64) else 64), 2, 4


def uses_f16_form(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                  block_n: int, fp8_form: str) -> bool:
    """Whether the decode kernel runs the "f16" form: an FP8 cache read by float16/bfloat16
    queries, an even head_dim padding to >= 32 (V's words: >= 16 a dot's side) and steps of
    >= 16 tokens."""
    return (is_fp8(cache_dtype) and fp8_form == "f16" and q_dtype in _F16_QUERY_DTYPES
            and head_dim % 2 == 0 and next_power_of_2(head_dim) >= 32 and block_n >= 16)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    *,
    window: int | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_fastest: bool | None = None,
    even_splits: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_form: str = DEFAULT_FP8_FORM,
) -> torch.Tensor:  # [B, Hq, D], dtype of q
    """Triton paged decode attention; same contract as `paged_decode_attention_reference`.

    `window`: a sliding window (the reference's meaning); the splits then cover only the
    window's tokens.
    Keyword-only extras, none needed for correctness:
    - `max_context_len`: an upper bound on `context_lens` known on the host (default:
      `block_tables.shape[1] * block_size`), used only to choose the number of splits; the
      kernel never reads it from the device, so a call does not synchronize.
    - `num_splits`: force this many context partitions (1 = no second kernel).
    - `block_n`, `num_warps`, `num_stages`: tokens per loop step, warps per program and
      software-pipelining depth (tuning; defaults from `default_tiling`).
    - `heads_fastest`: launch order of the programs. True: the KV heads of one row are
      neighbouring programs, so programs running together read neighbouring bytes of each
      cache block ([block_size, Hkv, D] is contiguous); False: the rows of one KV head are.
      Default `_HEADS_FASTEST`.
    - `even_splits`: cut each row's own context into `num_splits` equal partitions (of at
      least `_MIN_TOKENS_PER_SPLIT` tokens), instead of partitions sized for
      `max_context_len`: a short row's programs are short, a long row's are not longer
      than the rest, whatever the lengths a captured step meets.
    - `fp8_form`: how an FP8 cache's entries meet the queries (`FP8_FORMS`, module
      docstring): "f16" (the default, `DEFAULT_FP8_FORM`) or "e4m3".
      Where a form does not apply (float32 queries, head_dim under 32, the interpreter for
      "e4m3") the entries are cast to q's dtype instead.
    Values are not checked on the device: a row with `context_lens[i] == 0` yields zeros,
    and a length beyond the row's blocks reads whatever its padding blocks hold.
    """
    if fp8_form not in FP8_FORMS:
        raise ValueError(f"fp8_form must be one of {FP8_FORMS}, got {fp8_form!r}")
    if not HAS_TRITON:
        raise RuntimeError("paged_decode_attention needs Triton; use the reference instead")
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    window = check_window(window)
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {_KERNEL_DTYPES}, got {q.dtype}")
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    capacity = block_tables.shape[1] * block_size
    max_ctx = capacity if max_context_len is None else max(1, min(int(max_context_len), capacity))
    max_ctx = min(max_ctx, window)  # the most tokens one row attends to
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_ctx, q.device)
    dot_fp32 = INTERPRETED or q.dtype == torch.float32
    # FP8 tensor-core products need both reduction sides (head_dim, tokens a step) >= 32
    fp8_products = (is_fp8(k_cache.dtype) and fp8_form == "e4m3" and not dot_fp32
                    and next_power_of_2(head_dim) >= 32)
    kv_f16 = (uses_f16_form(q.dtype, k_cache.dtype, head_dim, block_n or 16, fp8_form)
              and v_cache.stride(-1) == 1
              and all(x % 2 == 0 for x in (*v_cache.stride()[:-1], v_cache.storage_offset())))
    default_block_n, default_stages, default_warps = default_tiling(
        batch * num_kv_heads * num_splits, head_dim, q.device, fp8_products, kv_f16
    )
    block_n = block_n or default_block_n
    fp8_products = fp8_products and block_n >= 32
    num_stages = num_stages or default_stages
    num_warps = num_warps or default_warps
    if even_splits:  # `partition`: the least partition, each row computes its own
        partition = _cdiv(_MIN_TOKENS_PER_SPLIT, block_n) * block_n
        num_splits = max(1, min(int(num_splits), _cdiv(max_ctx, partition)))
    else:
        num_splits = max(1, min(int(num_splits), _cdiv(max_ctx, block_n)))
        partition = _cdiv(_cdiv(max_ctx, num_splits), block_n) * block_n  # of BLOCK_N
        num_splits = _cdiv(max_ctx, partition)
    d_pad = next_power_of_2(head_dim)
    launch = {"num_warps": num_warps}
    if num_stages is not None:
        launch["num_stages"] = num_stages

    if num_splits == 1:
        target, lse = out, out  # lse unused
        t_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        l_strides = (0, 0)
    else:
        target = torch.empty(
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        t_strides = target.stride()
        l_strides = (lse.stride(0), lse.stride(1))

    if heads_fastest is None:
        heads_fastest = _HEADS_FASTEST
    grid = (num_kv_heads, batch, num_splits) if heads_fastest else (batch, num_kv_heads, num_splits)
    # the "f16" form reads V as 16-bit words: two neighbouring entries of a token each
    v_arg = v_cache.view(torch.uint16) if kv_f16 else v_cache
    _paged_decode_kernel[grid](
        q,
        k_cache,
        v_arg,
        block_tables,
        context_lens,
        target,
        lse,
        float(scale) * _LOG2E * float(k_scale),
        float(v_scale),
        window,
        partition,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        *v_arg.stride(),
        *block_tables.stride(),
        *t_strides,
        *l_strides,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=block_size,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        DOT_FP32=dot_fp32,
        HEADS_FASTEST=bool(heads_fastest),
        EVEN_SPLITS=bool(even_splits),
        KV_FP8=is_fp8(k_cache.dtype),
        FP8_PRODUCTS=fp8_products,
        KV_F16=kv_f16,
        PTX=not INTERPRETED,
        **launch,
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_q_heads)](
            target,
            lse,
            context_lens,
            out,
            window,
            num_splits,
            partition,
            target.stride(0),
            target.stride(1),
            target.stride(2),
            lse.stride(0),
            lse.stride(1),
            *out.stride(),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            S_PAD=next_power_of_2(num_splits),
            BLOCK_N=block_n,
            EVEN_SPLITS=bool(even_splits),
            num_warps=4 if d_pad * next_power_of_2(num_splits) >= 2048 else 1,
        )
    return out


__all__ = [
    "FP8_FORMS",
    "F16_TILING",
    "choose_num_splits",
    "default_tiling",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "uses_f16_form",
]
