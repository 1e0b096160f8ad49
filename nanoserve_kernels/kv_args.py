"""The argument checks of the paged KV-cache attention kernels: the decode kernel's
(`nanoserve_kernels.paged_attention`), the paged prefill's (`nanoserve_kernels.paged_prefill`)
and their CPU forms (`nanoserve_kernels.cpu_attention`), with the sliding window's and the
context lengths' checks they share.

Each check raises ValueError naming the argument and what it got, and reads only shapes,
dtypes and devices (no device sync), except `check_context_lens`, which reads the lengths'
values.

Invariants: one layer's pool `k_cache, v_cache [num_blocks, block_size, Hkv, D]` of q's
dtype (or both float8 e4m3, with their scales); Hq a multiple of Hkv; `block_tables [B,
max_blocks]` and `context_lens [B]` of int32 or int64; every tensor on one device.
"""

from __future__ import annotations

import torch

from nanoserve_kernels.kv_quant import check_kv_scales, is_fp8

_INDEX_DTYPES = (torch.int32, torch.int64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (*_KERNEL_DTYPES, torch.float64)  # float64: the reference only
NO_WINDOW = 2**31 - 1  # the kernels' "no window": longer than any int32 context


def check_kv_cache_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    batch: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    others: tuple[torch.Tensor, ...] = (),
) -> None:
    """The checks the paged kernels share, q [.., Hq, D] against the cache, a batch of
    `batch` rows: the pool's shape, head_dim and heads, the dtypes and FP8 scales, the
    block tables' and context lengths' shapes and dtypes, one device (`others` too)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the cache ({k_cache.shape[3]}) differ")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    cache_dtype = k_cache.dtype if is_fp8(k_cache.dtype) else q.dtype
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one of {_FLOAT_DTYPES} (or both caches be "
            f"float8_e4m3fn), got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [B={batch}, max_blocks], got shape {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [B={batch}], got shape {tuple(context_lens.shape)}")
    if block_tables.dtype not in _INDEX_DTYPES or context_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(
            "block_tables and context_lens must be int32 (or int64), got "
            f"{block_tables.dtype} and {context_lens.dtype}"
        )
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens, *others)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Shape, dtype and device checks of a decode step, shared by the kernel and the
    reference (no device sync): q [B, Hq, D], one query token a row."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    check_kv_cache_args(q, k_cache, v_cache, block_tables, context_lens, q.shape[0],
                        k_scale, v_scale)


def check_paged_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Shape, dtype and device checks of a paged prefill, shared by the kernel and the
    reference (no device sync): q [N, Hq, D], the rows' new tokens packed, cu_seqlens_q
    [B + 1] int32."""
    if q.dim() != 3:
        raise ValueError(f"q must be [N, Hq, D], got shape {tuple(q.shape)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens_q must be a 1-D int32 tensor [B + 1], got {cu_seqlens_q.dtype} "
            f"of shape {tuple(cu_seqlens_q.shape)}"
        )
    check_kv_cache_args(q, k_cache, v_cache, block_tables, context_lens,
                        cu_seqlens_q.shape[0] - 1, k_scale, v_scale, (cu_seqlens_q,))


def check_window(window: int | None) -> int:
    """`window` as the kernels take it: None -> NO_WINDOW; otherwise an int >= 1."""
    if window is None:
        return NO_WINDOW
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    return min(window, NO_WINDOW)


def check_context_lens(context_lens: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, int]:
    """(context_lens as int64, the longest context) of a non-empty batch: every row >= 1
    token, none past its block table's capacity (ValueError otherwise)."""
    lens = context_lens.long()
    if bool((lens <= 0).any()):
        raise ValueError(f"every row needs context_lens >= 1, got {lens.tolist()}")
    max_ctx = int(lens.max())
    if max_ctx > block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {max_ctx} tokens needs more than the {block_tables.shape[1]} blocks "
            f"of {block_size} tokens that block_tables holds per row"
        )
    return lens, max_ctx
