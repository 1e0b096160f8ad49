"""Paged prefill attention: the new tokens of each row against that row's whole context, read
through its block table (prefill after a prefix-cache hit, or a chunk of a long prompt).

Row b brings `q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b]` new tokens, packed along the
token axis of `q [N_new, Hq, D]`. Its context, `context_lens[b]` tokens (cached + new), lives
in the layer's pool `k_cache, v_cache [num_blocks, block_size, Hkv, D]`: token t in block
`block_tables[b, t // block_size]` at offset `t % block_size`. The caller has already stored
the new tokens' keys and values there (`nanoserve_kernels.kv_store`). With `cached = context_lens[b] -
q_len`, new token j sits at absolute position `cached + j` and attends to context tokens
`0 .. cached + j` (causal), or with a sliding `window` W only `cached + j - W + 1 .. cached + j`
(transformers' `sliding_window`, as `nanoserve_kernels.prefill_attention`). Query head h reads KV head `h // (Hq // Hkv)` (GQA). The cache
holds q's dtype, or float8 e4m3 read as `float32(entry) * k_scale` / `* v_scale` (an FP8 KV
cache, `nanoserve_kernels.kv_quant`; the kernel folds the scales as `nanoserve_kernels.paged_attention` does).

    row b's context:  [ cached tokens (shared blocks) | new tokens 0 .. q_len-1 ]
    new token j sees: [ 0 ...................................... cached + j ]

Two implementations with one signature:
- `paged_prefill_attention_reference`: PyTorch, the oracle. One row at a time, it gathers the
  row's context through its block table and masks keys after each query's position before a
  float32 softmax.
- `paged_prefill_attention`: Triton. One program per (block of new tokens, KV head, row) serves
  those tokens for all the query heads sharing that KV head (tokens x heads are the rows of
  one tile, as in the paged decode kernel), walks the row's context block by block up to the
  tile's last position, and keeps an online softmax in float32 (`nanoserve_kernels.online_softmax`).
  A work table (`nanoserve_kernels.prefill_attention.prefill_work`) may list the (row, block) pairs
  instead, so the grid depends on the table's size alone (a captured prefill).
With no cached tokens (context_lens == q_len) both equal `nanoserve_kernels.prefill_attention` over the
same tokens.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, interpret_requested, next_power_of_2, tl, triton
from nanoserve_kernels.kv_args import check_paged_prefill_args, check_window
from nanoserve_kernels.kv_quant import dequantize_reference, is_fp8
from nanoserve_kernels.online_softmax import online_softmax_step
from nanoserve_kernels.prefill_attention import check_prompt_lengths, check_work, prefill_program

# Decided when this module is imported, like Triton's own choice in `@triton.jit` below.
INTERPRETED = HAS_TRITON and interpret_requested()

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


def check_row_lengths(n: int, block_tables: torch.Tensor, block_size: int,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      max_seqlen_q: int) -> tuple[list[int], list[int]]:
    """(new tokens, context tokens) of each row, checked: cu_seqlens_q rises from 0 to n,
    no row longer than max_seqlen_q, each context holds its new tokens and fits its blocks
    (ValueError otherwise)."""
    q_lens = check_prompt_lengths(cu_seqlens_q, n, max_seqlen_q, "_q")
    ctx_lens = context_lens.tolist()
    capacity = block_tables.shape[1] * block_size
    for q_len, ctx in zip(q_lens, ctx_lens):
        if ctx < q_len or ctx > capacity:
            raise ValueError(
                f"context_lens must hold a row's new tokens and fit its {block_tables.shape[1]} "
                f"blocks of {block_size}: got {ctx} for {q_len} new tokens"
            )
    return q_lens, ctx_lens


def paged_prefill_attention_reference(
    q: torch.Tensor,  # [N, Hq, D] the new tokens of every row, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padding entries 0
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: 0, q_len_0, q_len_0 + q_len_1, ..., N
    context_lens: torch.Tensor,  # [B] int32: cached + new tokens of each row
    max_seqlen_q: int,  # >= every q_len
    scale: float,
    *,
    k_scale: float = 1.0,  # FP8 caches: a key is float32(entry) * k_scale
    v_scale: float = 1.0,
    window: int | None = None,  # sliding window: keys p - window + 1 .. p only
) -> torch.Tensor:  # [N, Hq, D], dtype of q
    """PyTorch oracle for `paged_prefill_attention`; also checks the lengths' values."""
    check_paged_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                             k_scale, v_scale)
    window = check_window(window)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    bounds = cu_seqlens_q.tolist()
    q_lens, ctx_lens = check_row_lengths(q.shape[0], block_tables, block_size, cu_seqlens_q,
                                         context_lens, max_seqlen_q)
    group = q.shape[1] // num_kv_heads
    math_dtype = torch.promote_types(q.dtype, torch.float32)  # float32 (float64 stays)
    out = torch.empty_like(q)
    for row, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n, ctx = end - start, ctx_lens[row]
        if n == 0:
            continue
        pos = torch.arange(ctx, device=q.device)  # [T] context positions
        blocks = block_tables[row].long()[pos // block_size]  # [T]
        k = dequantize_reference(k_cache[blocks, pos % block_size], k_scale, math_dtype)
        v = dequantize_reference(v_cache[blocks, pos % block_size], v_scale, math_dtype)  # [T, Hkv, D]
        qg = q[start:end].to(math_dtype).reshape(n, num_kv_heads, group, head_dim)  # [n,Hkv,G,D]
        scores = torch.einsum("nkgd,tkd->kgnt", qg, k) * scale  # [Hkv, G, n, T]
        query_pos = (ctx - n) + torch.arange(n, device=q.device)  # [n] absolute positions
        hidden = (pos[None, :] > query_pos[:, None]) | (pos[None, :] <= query_pos[:, None] - window)
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)  # [Hkv,G,n,T]
        o = torch.einsum("kgnt,tkd->nkgd", probs, v)  # [n, Hkv, G, D]
        out[start:end] = o.reshape(n, num_kv_heads * group, head_dim).to(q.dtype)
    return out


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [N, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks]
    cu_seqlens_q_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B]
    out_ptr,  # [N, Hq, D]
    work_ptr,  # [2, P] int32 (WORK): each program's row (-1: none) and block of new tokens
    work_size,  # P
    qk_scale,  # softmax scale * log2(e) (* k_scale: FP8 caches)
    v_scale,  # FP8 caches: the values' scale, applied to the output; else 1.0
    window,  # sliding window (NO_WINDOW: none): the query at p sees keys p-window+1..p
    stride_qn,
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
    stride_on,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,  # block_size of the cache
    BLOCK_M: tl.constexpr,  # new tokens per program; the tile has BLOCK_M * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # context tokens per loop step
    DOT_FP32: tl.constexpr,  # compute dots in float32 (fp32 inputs, CPU interpreter)
    KV_FP8: tl.constexpr,  # the cache is float8 e4m3
    WORK: tl.constexpr,  # grid (P, Hkv) over a work table, else (blocks, Hkv, B)
):
    kv_head = tl.program_id(1)
    row, m_block = prefill_program(work_ptr, work_size, WORK)
    if row < 0:
        return
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    context_len = tl.load(context_lens_ptr + row)
    cached = context_len - q_len

    r = tl.arange(0, BLOCK_M * GROUP_PAD)  # tile rows: token-major, then the group's heads
    tok = m0 + r // GROUP_PAD  # [ROWS] index among the row's new tokens
    g = r % GROUP_PAD
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    r_mask = (tok < q_len) & (g < GROUP)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q_off = q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # [ROWS, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)
    query_pos = cached + tok  # [ROWS] absolute positions

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_btb
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    hi = tl.minimum(context_len, cached + m0 + BLOCK_M)  # causal: nothing past the last query
    lo = tl.maximum(cached + m0 - window + 1, 0)  # window: nothing before the first query's
    lo = (lo // BLOCK_N) * BLOCK_N
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        t_mask = t < hi
        block = tl.load(bt_row + (t // PAGE) * stride_btn, mask=t_mask, other=0).to(tl.int64)
        offset = t % PAGE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_ptrs = k_head + block[:, None] * stride_kb + offset[:, None] * stride_ko
        v_ptrs = v_head + block[:, None] * stride_vb + offset[:, None] * stride_vo
        k = tl.load(k_ptrs + d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(v_ptrs + d[None, :] * stride_vd, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        if KV_FP8:  # exact casts; the scales are in qk_scale and v_scale
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        visible = (t[None, :] <= query_pos[:, None]) & t_mask[None, :]  # [ROWS, BLOCK_N]
        visible = visible & (t[None, :] > query_pos[:, None] - window)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, qk_scale, m_i, l_i, acc, DOT_FP32)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # every query sees itself
    o_off = q_rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(
        out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :]
    )


def default_block_m(group: int) -> int:
    """New tokens per program: a tile of about 64 rows (tokens x the group's query heads), and
    never fewer than 16 tokens."""
    return max(16, 64 // next_power_of_2(group))


def paged_prefill_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32: cached + new tokens
    max_seqlen_q: int,  # >= every q_len
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    work: torch.Tensor | None = None,  # [2, P] int32 (`prefill_work` for block_m)
    window: int | None = None,  # sliding window (the reference's meaning)
) -> torch.Tensor:  # [N, Hq, D], dtype of q
    """Triton paged prefill attention; same contract as `paged_prefill_attention_reference`.

    Values are not checked on the device (no synchronization): rows with more than
    `max_seqlen_q` new tokens are computed only up to `max_seqlen_q`, and a context longer
    than the row's blocks reads whatever its padding entries point to. `block_m` (new tokens
    per program), `block_n` (context tokens per step), `num_warps` and `num_stages` are
    tuning knobs. `work`: a work table built for this block_m
    (`nanoserve_kernels.prefill_attention.prefill_work`; default block_m: `default_block_m(group)`),
    the grid then (P, Hkv) whatever the rows' lengths (max_seqlen_q unused).
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_prefill_attention needs Triton; use the reference instead")
    check_paged_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                             k_scale, v_scale)
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {_KERNEL_DTYPES}, got {q.dtype}")
    window = check_window(window)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    batch = cu_seqlens_q.shape[0] - 1
    if work is not None:
        check_work(work, q)
        if num_tokens == 0 or batch == 0 or work.shape[1] == 0:
            return out
    elif num_tokens == 0 or batch == 0 or max_seqlen_q <= 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_m = block_m or default_block_m(group)
    block_n = block_n or 64
    d_pad = next_power_of_2(head_dim)
    launch = {"num_warps": num_warps or (8 if block_m * group_pad * d_pad > 64 * 128 else 4)}
    if num_stages is not None:
        launch["num_stages"] = num_stages
    if work is not None:
        grid = (work.shape[1], num_kv_heads)
    else:
        grid = (-(-int(max_seqlen_q) // block_m), num_kv_heads, batch)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        cu_seqlens_q if work is None else work,
        0 if work is None else work.shape[1],
        float(scale) * _LOG2E * float(k_scale),
        float(v_scale),
        window,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=INTERPRETED or q.dtype == torch.float32,
        KV_FP8=is_fp8(k_cache.dtype),
        WORK=work is not None,
        **launch,
    )
    return out


__all__ = [
    "default_block_m",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
]
