"""A decode step's rotary embedding of queries and keys, fused with the store of its keys
and values into the paged cache: one launch per layer where `nanoserve_kernels/rotary.py` and
`nanoserve_kernels/kv_store.py` take two, and the rotated keys never round-trip through memory.

Input: qkv [N, Hq + 2 Hkv, D], the fused q/k/v projection of N tokens (heads q | k | v,
head dimension contiguous, any token and head strides); cos/sin [N, D]; slot_mapping [N]
int64 (a slot < 0 stores nothing: the padding rows of a bucketed step); the layer's caches
[num_blocks, block_size, Hkv, D]. Output: q [N, Hq, D] rotated, contiguous. In place:
rotated k and plain v at each token's slot, cast to the cache's dtype (an FP8 cache:
quantized by k_scale / v_scale after rounding to q's dtype, as `nanoserve_kernels.kv_store` does).

- `rotary_store_reference`: `rotary_reference` on q and k, then `store_kv_reference`.
- `rotary_store`: Triton, one program per token over all its heads. Each output is
  computed in float32 and rounded once, as `nanoserve_kernels/rotary.py` does, so in half precision
  its values equal the rotary kernel's followed by the store kernel's, bit for bit (in
  float32, up to where the compiler contracts a product and a sum into one FMA).
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton
from nanoserve_kernels.kv_quant import inverse_scale, is_fp8, quantize_e4m3
from nanoserve_kernels.kv_store import check_store_args, store_kv_reference
from nanoserve_kernels.rotary import check_rotary_args, rotary_reference


def _split(qkv: torch.Tensor, num_q_heads: int) -> tuple[torch.Tensor, ...]:
    if qkv.dim() != 3:
        raise ValueError(f"qkv must be [N, Hq + 2 Hkv, D], got shape {tuple(qkv.shape)}")
    heads = qkv.shape[1] - num_q_heads
    if num_q_heads < 1 or heads < 2 or heads % 2:
        raise ValueError(f"qkv's {qkv.shape[1]} heads are not {num_q_heads} q heads plus "
                         "k and v heads of one count")
    hkv = heads // 2
    return (qkv[:, :num_q_heads], qkv[:, num_q_heads:num_q_heads + hkv],
            qkv[:, num_q_heads + hkv:])


def rotary_store_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, num_q_heads: int, *,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    q, k, v = _split(qkv, num_q_heads)
    check_store_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    store_kv_reference(rotary_reference(k, cos, sin), v, k_cache, v_cache, slot_mapping,
                       k_scale=k_scale, v_scale=v_scale)
    return rotary_reference(q, cos, sin).contiguous()


@triton.jit
def _rotate(row_ptr, heads, stride_h, c1, c2, s1, s2, NUM: tl.constexpr,
            H_PAD: tl.constexpr, HALF: tl.constexpr):
    """The rotated halves (float32) of heads `heads`..+NUM of one token's row."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF)
    mask = h[:, None] < NUM
    ptrs = row_ptr + (heads + h[:, None]) * stride_h + d[None, :]
    a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return a * c1 - b * s1, b * c2 + a * s2


@triton.jit
def _rotary_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_cache_ptr,
                         v_cache_ptr, stride_n, stride_h, stride_cn, stride_sn,
                         stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                         k_inv_scale, v_inv_scale,
                         HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr,
                         HKV_PAD: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                         FP8: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    # cos/sin repeat their first half ([f | f] frequencies), as the model builds them
    c1 = tl.load(cos_ptr + n * stride_cn + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + n * stride_cn + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + n * stride_sn + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + n * stride_sn + HALF + d).to(tl.float32)[None, :]
    row = qkv_ptr + n * stride_n
    ty = q_out_ptr.dtype.element_ty

    lo, hi = _rotate(row, 0, stride_h, c1, c2, s1, s2, HQ, HQ_PAD, HALF)
    hq = tl.arange(0, HQ_PAD)
    q_mask = hq[:, None] < HQ
    out = q_out_ptr + n * HQ * 2 * HALF + hq[:, None] * 2 * HALF + d[None, :]
    tl.store(out, lo.to(ty), mask=q_mask)
    tl.store(out + HALF, hi.to(ty), mask=q_mask)

    slot = tl.load(slot_ptr + n)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        hk = tl.arange(0, HKV_PAD)
        k_mask = hk[:, None] < HKV
        k_lo, k_hi = _rotate(row, HQ, stride_h, c1, c2, s1, s2, HKV, HKV_PAD, HALF)
        kc = k_cache_ptr + block * stride_kb + offset * stride_ko + hk[:, None] * stride_kh
        # rounded to q's dtype first (rotary's output), then to the cache's, as the two
        # unfused kernels do
        k_lo, k_hi = k_lo.to(ty), k_hi.to(ty)
        dd = tl.arange(0, 2 * HALF)
        v = tl.load(row + (HQ + HKV + hk[:, None]) * stride_h + dd[None, :], mask=k_mask)
        if FP8:
            k_lo = quantize_e4m3(k_lo.to(tl.float32), k_inv_scale)
            k_hi = quantize_e4m3(k_hi.to(tl.float32), k_inv_scale)
            v = quantize_e4m3(v.to(tl.float32), v_inv_scale)
        tl.store(kc + d[None, :], k_lo.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(kc + HALF + d[None, :], k_hi.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        vc = v_cache_ptr + block * stride_vb + offset * stride_vo + hk[:, None] * stride_vh
        tl.store(vc + dd[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=k_mask)


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_q_heads: int, *, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """Triton form of `rotary_store_reference`; slots are not range-checked on the device."""
    if not HAS_TRITON:
        raise RuntimeError("rotary_store needs Triton; use the reference instead")
    q, k, v = _split(qkv, num_q_heads)
    check_store_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_rotary_args(qkv, cos, sin)
    N, H, D = qkv.shape
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head dimension must be contiguous")
    hkv = k.shape[1]
    out = torch.empty((N, num_q_heads, D), dtype=qkv.dtype, device=qkv.device)
    if N:
        _rotary_store_kernel[(N,)](
            qkv, cos, sin, slot_mapping, out, k_cache, v_cache, qkv.stride(0),
            qkv.stride(1), cos.stride(0), sin.stride(0), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), inverse_scale(k_scale), inverse_scale(v_scale), HQ=num_q_heads,
            HKV=hkv, HQ_PAD=next_power_of_2(num_q_heads),
            HKV_PAD=next_power_of_2(hkv), HALF=D // 2, PAGE=k_cache.shape[1],
            FP8=is_fp8(k_cache.dtype))
    return out


__all__ = ["rotary_store", "rotary_store_reference"]
