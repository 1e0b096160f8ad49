"""Attention on the CPU: the references' results in few, large PyTorch operations.

On the CPU each PyTorch operation carries a fixed cost (dispatch, and a parallel region
over the intra-op threads that waits for every thread: on a busy machine, milliseconds),
so what decides the CPU engine's speed is the number of operations per layer, not their
arithmetic. The references (the oracles for the Triton kernels) loop over rows and spell
out the softmax; the functions here give the same result through one
`scaled_dot_product_attention` call per layer over all rows (PyTorch's fused CPU kernel;
grouped-query attention through `enable_gqa`, float32 softmax inside for every dtype):

- `decode_attention_cpu`: one query per row over its paged context (`paged_decode_attention
  _reference`'s arguments): the context's keys and values gathered through the block
  tables into a `[B, max_ctx]` rectangle, positions past a row's context (or outside its
  sliding window) masked;
- `prefill_attention_cpu`: causal attention within each packed prompt (`prefill_attention
  _reference`'s arguments): the prompts padded into a `[B, max_len]` rectangle, a causal
  mask that also hides the padding keys;
- `paged_prefill_attention_cpu`: each row's new tokens over its whole paged context, cached
  tokens included (`paged_prefill_attention_reference`'s arguments).

Rows of very different lengths waste work in a padded rectangle; the prefills fall back to
one call per row when the rectangle would hold more than `MAX_PADDING` times the real
(query, key) pairs. Padding query rows always see at least one key, so nothing is NaN.
The argument checks are the references' own (same errors for the same bad input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve_kernels.kv_args import (
    check_context_lens,
    check_decode_args,
    check_paged_prefill_args,
    check_window,
)
from nanoserve_kernels.kv_quant import is_fp8
from nanoserve_kernels.paged_prefill import check_row_lengths
from nanoserve_kernels.prefill_attention import check_prefill_args, check_prompt_lengths

MAX_PADDING = 4  # padded (query, key) pairs per real pair above which rows run one by one


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
          scale: float) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], allowed [B, Lq, Lk] bool -> [B, Lq, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None],
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])  # [B, Hq, Lq, D]
    return out.transpose(1, 2)


def _packed_index(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of each packed token: [N] each."""
    lens = torch.tensor(lengths, device=device)
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    return row, torch.arange(int(lens.sum()), device=device) - starts[row]


def _padded(x: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, batch: int,
            width: int) -> torch.Tensor:
    """Packed [N, H, D] -> [batch, width, H, D], zeros in the padding."""
    out = x.new_zeros(batch, width, *x.shape[1:])
    out[row, pos] = x
    return out


def _context_slots(block_tables: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """[B, width] pool slot of each row's context position (padding blocks give slots of
    block 0: real, in-range reads that the masks hide)."""
    pos = torch.arange(width, device=block_tables.device)
    return block_tables.long()[:, pos // block_size] * block_size + pos % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], slots [B, T] -> [B, T, Hkv, D] in `dtype`
    (an FP8 pool's entries times its scale, as the references read them)."""
    flat = cache.reshape(-1, *cache.shape[2:])
    out = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[2:])
    if is_fp8(cache.dtype):
        return out.to(dtype) * scale
    return out


def decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    *,
    window: int | None = None,  # sliding window: the last `window` tokens only
    k_scale: float = 1.0,  # an FP8 pool's per-layer scales (nanoserve_kernels.kv_quant)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, Hq, D], dtype of q
    """`paged_decode_attention_reference`'s result through one fused attention call."""
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    window = check_window(window)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    block_size = k_cache.shape[1]
    lens, max_ctx = check_context_lens(context_lens, block_tables, block_size)
    slots = _context_slots(block_tables, block_size, max_ctx)  # [B, T]
    pos = torch.arange(max_ctx, device=q.device)
    allowed = (pos[None, :] < lens[:, None]) & (pos[None, :] >= lens[:, None] - window)
    out = _sdpa(q[:, None], _gather(k_cache, slots, k_scale, q.dtype),
                _gather(v_cache, slots, v_scale, q.dtype), allowed[:, None, :],
                scale)  # [B, 1, Hq, D]
    return out[:, 0]


def prefill_attention_cpu(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    scale: float,
    *,
    window: int | None = None,  # sliding window: keys i-window+1..i only
) -> torch.Tensor:  # [N, Hq, D], dtype of q
    """`prefill_attention_reference`'s result: the prompts padded into one rectangle, or one
    call per prompt when padding would dominate."""
    check_prefill_args(q, k, v, cu_seqlens)
    window = check_window(window)
    lengths = check_prompt_lengths(cu_seqlens, q.shape[0], max_seqlen)
    if not any(lengths):
        return torch.empty_like(q)
    width = max(lengths)
    if len(lengths) * width * width > MAX_PADDING * sum(n * n for n in lengths):
        out = torch.empty_like(q)
        start = 0
        for n in lengths:
            if n:
                s = slice(start, start + n)
                out[s] = prefill_attention_cpu(q[s], k[s], v[s], cu_seqlens.new_tensor([0, n]),
                                               n, scale, window=window)
            start += n
        return out
    row, pos = _packed_index(lengths, q.device)
    batch = len(lengths)
    p = torch.arange(width, device=q.device)
    causal = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - window)  # [Lq, Lk]
    allowed = causal[None] & (p[None, None, :] < torch.tensor(lengths, device=q.device)[:, None, None])
    out = _sdpa(_padded(q, row, pos, batch, width), _padded(k, row, pos, batch, width),
                _padded(v, row, pos, batch, width), allowed | (p[:, None] == p[None, :]), scale)
    return out[row, pos]


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [N, Hq, D] the new tokens of every row, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], new tokens already stored
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32: cached + new tokens
    max_seqlen_q: int,
    scale: float,
    k_scale: float = 1.0,  # an FP8 pool's per-layer scales (nanoserve_kernels.kv_quant)
    v_scale: float = 1.0,
    window: int | None = None,  # sliding window: keys p - window + 1 .. p only
) -> torch.Tensor:  # [N, Hq, D]
    """`paged_prefill_attention_reference`'s result: new token i of a row with n new tokens
    and a context of c sees context positions 0 .. c - n + i (with a window W, from
    c - n + i - W + 1)."""
    check_paged_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                             k_scale, v_scale)
    window = check_window(window)
    block_size = k_cache.shape[1]
    lengths, ctx = check_row_lengths(q.shape[0], block_tables, block_size, cu_seqlens_q,
                                     context_lens, max_seqlen_q)
    if not any(lengths):
        return torch.empty_like(q)
    width, ctx_width = max(lengths), max(ctx)
    if len(lengths) * width * ctx_width > MAX_PADDING * sum(n * c for n, c in zip(lengths, ctx)):
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(lengths):
            if n:
                s = slice(start, start + n)
                out[s] = paged_prefill_attention_cpu(
                    q[s], k_cache, v_cache, block_tables[i:i + 1], cu_seqlens_q.new_tensor([0, n]),
                    context_lens[i:i + 1], n, scale, k_scale, v_scale, window)
            start += n
        return out
    row, pos = _packed_index(lengths, q.device)
    slots = _context_slots(block_tables, block_size, ctx_width)  # [B, T]
    c = torch.tensor(ctx, device=q.device)[:, None, None]
    n = torch.tensor(lengths, device=q.device)[:, None, None]
    qi = torch.arange(width, device=q.device)[None, :, None]
    kj = torch.arange(ctx_width, device=q.device)[None, None, :]
    last = c - n + torch.minimum(qi, n - 1)  # a query's position (padding queries: the last's)
    allowed = ((kj <= last) & (kj > last - window)) | (kj == last.clamp(min=0))  # itself, at least
    out = _sdpa(_padded(q, row, pos, len(lengths), width),
                _gather(k_cache, slots, k_scale, q.dtype),
                _gather(v_cache, slots, v_scale, q.dtype), allowed, scale)
    return out[row, pos]
