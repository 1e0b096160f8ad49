"""Causal attention over packed ragged prompts (prefill).

The B prompts of a batch are packed along one token axis: prompt b owns tokens
`cu_seqlens[b] : cu_seqlens[b + 1]` of `q [N, Hq, D]`, `k, v [N, Hkv, D]`. Token i of a prompt
attends to tokens 0..i of the same prompt only; with a sliding `window` W (optional, default
none) to tokens i-W+1..i only (transformers' `sliding_window`; W >= the prompt is no window).
Query head h reads KV head `h // (Hq // Hkv)`.

Two implementations with one signature:
- `prefill_attention_reference`: PyTorch, the oracle (float32 math, one prompt at a time).
- `prefill_attention`: Triton flash-attention forward. One program per (query block, query
  head, prompt) walks the prompt's key blocks up to its diagonal with a float32 online softmax.

A work table (`prefill_work`) lists the (prompt, query block) pairs instead: the grid is then
(table size, query heads) whatever the prompts' lengths, so a CUDA graph captured at one
table size serves every packing of that many tokens (entries with prompt -1 do nothing).
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve_kernels._triton import HAS_TRITON, interpret_requested, next_power_of_2, tl, triton
from nanoserve_kernels.kv_args import check_window
from nanoserve_kernels.online_softmax import online_softmax_step

# Decided when this module is imported, like Triton's own choice in `@triton.jit` below.
INTERPRETED = HAS_TRITON and interpret_requested()

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (*_KERNEL_DTYPES, torch.float64)  # float64: the reference only
_LOG2E = 1.4426950408889634
PREFILL_BLOCK_M = 64  # queries per program (the default; a work table is built for it)


def prefill_work_size(num_tokens: int, max_prompts: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Entries a work table needs for any packing of `num_tokens` tokens into at most
    `max_prompts` prompts: each prompt's blocks are ceil(length / block_m)."""
    return num_tokens // block_m + min(max_prompts, num_tokens) + 1


def prefill_work(lengths: list[int], size: int, block_m: int = PREFILL_BLOCK_M) -> np.ndarray:
    """[2, size] int32: row 0 the prompt, row 1 the query block (of block_m queries) of each
    program, the blocks furthest along their prompt first (they see the most keys, so they
    start first and the programs end together); entries past the work hold prompt -1.
    (The paged prefill kernel takes the same table, built for its own block_m.)"""
    lens = np.asarray(lengths, dtype=np.int64)
    blocks = -(-lens // block_m)  # [B]
    total = int(blocks.sum())
    if total > size:
        raise ValueError(f"{total} query blocks do not fit a work table of {size}")
    prompt = np.repeat(np.arange(len(lens)), blocks)  # [total]
    block = np.arange(total) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    order = np.argsort(-block, kind="stable")
    out = np.full((2, size), -1, dtype=np.int32)
    out[0, :total], out[1, :total] = prompt[order], block[order]
    return out


def check_work(work: torch.Tensor, q: torch.Tensor) -> None:
    """A work table must be a contiguous [2, P] int32 tensor on q's device (ValueError)."""
    if work.dim() != 2 or work.shape[0] != 2 or work.dtype != torch.int32 \
            or not work.is_contiguous() or work.device != q.device:
        raise ValueError("work must be a contiguous [2, P] int32 tensor on q's device")


def check_prefill_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> None:
    """Shape, dtype and device checks shared by the kernel and the reference (no device sync)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q must be [N, Hq, D] and k, v [N, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in tokens/head_dim")
    if k.shape[1] == 0 or num_q_heads % k.shape[1] != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({k.shape[1]})"
        )
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k and v must share one of {_FLOAT_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor [B + 1], got {cu_seqlens.dtype} "
            f"of shape {tuple(cu_seqlens.shape)}"
        )
    devices = {t.device for t in (q, k, v, cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def check_prompt_lengths(cu_seqlens: torch.Tensor, n: int, max_seqlen: int,
                         suffix: str = "") -> list[int]:
    """Each packed prompt's length, checked: cu_seqlens rises from 0 to n, none longer than
    max_seqlen (ValueError otherwise). suffix: the arguments' names' ending in the messages
    ("_q": cu_seqlens_q, max_seqlen_q)."""
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != n or any(x < 0 for x in lengths):
        raise ValueError(f"cu_seqlens{suffix} must rise from 0 to N={n} without decreasing, "
                         f"got {bounds}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen{suffix}={max_seqlen} is below the longest prompt "
                         f"({max(lengths)})")
    return lengths


def prefill_attention_reference(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32: 0, len_0, len_0 + len_1, ..., N
    max_seqlen: int,  # >= every prompt length
    scale: float,
    *,
    window: int | None = None,  # sliding window: keys i-window+1..i only
) -> torch.Tensor:  # [N, Hq, D], dtype of q
    """PyTorch oracle for `prefill_attention`; also checks `cu_seqlens` and `max_seqlen`."""
    check_prefill_args(q, k, v, cu_seqlens)
    window = check_window(window)
    bounds = cu_seqlens.tolist()
    check_prompt_lengths(cu_seqlens, q.shape[0], max_seqlen)
    group = q.shape[1] // k.shape[1]
    math_dtype = torch.promote_types(q.dtype, torch.float32)  # float32 (float64 stays)
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        length = end - start
        qs = q[start:end].to(math_dtype).transpose(0, 1)  # [Hq, L, D]
        ks = k[start:end].to(math_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[start:end].to(math_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale  # [Hq, L, L]
        pos = torch.arange(length, device=q.device)
        hidden = (pos[None, :] > pos[:, None]) | (pos[None, :] <= pos[:, None] - window)  # [L, L]
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)  # [L, Hq, D]
    return out


@triton.jit
def prefill_program(work_ptr, work_size, WORK: tl.constexpr):
    """(row, block of queries) of this program: from the work table with WORK (row -1:
    none), else from the grid (blocks, heads, rows). Shared by both prefill kernels."""
    if WORK:
        row = tl.load(work_ptr + tl.program_id(0))
        m_block = tl.load(work_ptr + work_size + tl.program_id(0))
    else:
        row = tl.program_id(2)
        m_block = tl.program_id(0)
    return row, m_block


@triton.jit
def _prefill_kernel(
    q_ptr,  # [N, Hq, D]
    k_ptr,  # [N, Hkv, D]
    v_ptr,  # [N, Hkv, D]
    out_ptr,  # [N, Hq, D]
    cu_seqlens_ptr,  # [B + 1] int32
    work_ptr,  # [2, P] int32 (WORK): each program's prompt (-1: none) and query block
    work_size,  # P
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (NO_WINDOW: none): query m sees keys m-window+1..m
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_on,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    DOT_FP32: tl.constexpr,  # compute dots in float32 (fp32 inputs, CPU interpreter)
    WORK: tl.constexpr,  # grid (P, Hq) over a work table, else (query blocks, Hq, B)
):
    head = tl.program_id(1)
    seq, m_block = prefill_program(work_ptr, work_size, WORK)
    if seq < 0:
        return
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    m0 = m_block * BLOCK_M
    if m0 >= seq_len:
        return
    kv_head = head // GROUP
    m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions in the prompt
    d = tl.arange(0, D_PAD)
    m_mask = m < seq_len
    d_mask = d < HEAD_DIM
    rows = (seq_start + m).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + head * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    hi = tl.minimum(seq_len, m0 + BLOCK_M)  # causal: no key beyond the block's last query
    lo = tl.maximum(m0 - window + 1, 0)  # window: no key before the block's first query's
    lo = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        cols = (seq_start + n).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = k_ptr + cols[:, None] * stride_kn + kv_head * stride_kh + d[None, :] * stride_kd
        v_ptrs = v_ptr + cols[:, None] * stride_vn + kv_head * stride_vh + d[None, :] * stride_vd
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        visible = (n[None, :] <= m[:, None]) & n_mask[None, :]  # [BLOCK_M, BLOCK_N]
        visible = visible & (n[None, :] > m[:, None] - window)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, qk_scale, m_i, l_i, acc, DOT_FP32)

    # every real query sees at least itself (l_i > 0); rows past the prompt, which are not
    # stored, may see nothing under a window
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_on + head * stride_oh + d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,  # >= every prompt length
    scale: float,
    *,
    window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    work: torch.Tensor | None = None,  # [2, P] int32, from `prefill_work` (then max_seqlen unused)
) -> torch.Tensor:  # [N, Hq, D], dtype of q
    """Triton causal ragged prefill attention; same contract as `prefill_attention_reference`.

    `cu_seqlens` values are not checked on the device (no synchronization): prompts longer
    than `max_seqlen` are computed only up to `max_seqlen` queries (with a work table: its
    blocks only). `window`: a sliding window (the reference's meaning). `block_m`, `block_n`
    and `num_warps` are tuning knobs; with a work table, block_m is PREFILL_BLOCK_M.
    """
    if not HAS_TRITON:
        raise RuntimeError("prefill_attention needs Triton; use the reference instead")
    check_prefill_args(q, k, v, cu_seqlens)
    window = check_window(window)
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes {_KERNEL_DTYPES}, got {q.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens.shape[0] - 1
    if work is not None:
        if block_m not in (None, PREFILL_BLOCK_M):
            raise ValueError(f"a work table is built for block_m={PREFILL_BLOCK_M}")
        check_work(work, q)
        if num_tokens == 0 or num_seqs == 0 or work.shape[1] == 0:
            return out
        block_m = PREFILL_BLOCK_M
        grid = (work.shape[1], num_q_heads)
    else:
        if num_tokens == 0 or num_seqs == 0 or max_seqlen <= 0:
            return out
        block_m = block_m or PREFILL_BLOCK_M
        grid = (-(-int(max_seqlen) // block_m), num_q_heads, num_seqs)
    block_n = block_n or 64
    _prefill_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        cu_seqlens if work is None else work,
        0 if work is None else work.shape[1],
        float(scale) * _LOG2E,
        window,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        GROUP=num_q_heads // k.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=INTERPRETED or q.dtype == torch.float32,
        WORK=work is not None,
        num_warps=num_warps or 4,
    )
    return out


__all__ = ["PREFILL_BLOCK_M", "check_prefill_args", "check_work", "prefill_attention",
           "prefill_attention_reference", "prefill_work", "prefill_work_size"]
