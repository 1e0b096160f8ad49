"""Write new keys/values into their cache slots.

Token n's key/value head rows `k[n], v[n] [Hkv, D]` go to slot `slot_mapping[n]` of the
layer's pool `k_cache, v_cache [num_blocks, block_size, Hkv, D]`, i.e. block
`slot // block_size`, offset `slot % block_size`. A negative slot means "do not store"
(padding tokens). Values are cast to the cache's dtype; an FP8 cache (float8 e4m3) stores
them quantized by the layer's `k_scale` / `v_scale` (`nanoserve_kernels.kv_quant`: x / scale, clamped
to +-448, rounded to nearest-even). Both functions work in place.

- `store_kv_reference`: PyTorch `index_copy_` into the flat `[num_slots, Hkv, D]` view.
- `store_kv`: Triton, one program per token copying its `[Hkv, D]` tile.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton
from nanoserve_kernels.kv_quant import (
    check_kv_scales,
    inverse_scale,
    is_fp8,
    quantize_e4m3,
    quantize_reference,
)


def check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Shape, dtype and device checks shared by the kernel and the reference (no device sync)."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [N, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k rows [Hkv, D] = {tuple(k.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 of shape [N={k.shape[0]}], got {slot_mapping.dtype} "
            f"of shape {tuple(slot_mapping.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache differ in dtype: {k_cache.dtype}, {v_cache.dtype}")
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def store_kv_reference(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [N] int64; < 0 skips the token
    *,
    k_scale: float = 1.0,  # FP8 caches only: stored = e4m3(k / k_scale)
    v_scale: float = 1.0,
) -> None:
    """PyTorch oracle for `store_kv`; also checks that every slot is inside the pool."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot {int(slots.max())} is outside the pool of {num_slots} slots")
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        try:
            flat = cache.view(num_slots, num_kv_heads, head_dim)
        except RuntimeError as exc:
            raise ValueError("the cache must be viewable as [num_slots, Hkv, D]") from exc
        if is_fp8(cache.dtype):  # index_copy_ has no float8 kernel on the CPU: copy the bytes
            flat.view(torch.uint8).index_copy_(0, slots, quantize_reference(src[keep], scale)
                                               .view(torch.uint8))
        else:
            flat.index_copy_(0, slots, src[keep].to(cache.dtype))


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [N, Hkv, D]
    v_ptr,  # [N, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [N] int64
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    k_inv_scale,  # 1 / k_scale (FP8 caches)
    v_inv_scale,  # 1 / v_scale
    PAGE: tl.constexpr,  # block_size of the cache
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8 e4m3: quantize on the way in
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + n)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + n * stride_kn + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + n * stride_vn + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    if FP8:
        k = quantize_e4m3(k.to(tl.float32), k_inv_scale)
        v = quantize_e4m3(v.to(tl.float32), v_inv_scale)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kco
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vco
    tl.store(
        kc + h[:, None] * stride_kch + d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + h[:, None] * stride_vch + d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [N] int64; < 0 skips the token
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton KV store; same contract as `store_kv_reference`, but slots are not range-checked
    on the device (no synchronization)."""
    if not HAS_TRITON:
        raise RuntimeError("store_kv needs Triton; use the reference instead")
    check_store_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    h_pad = next_power_of_2(num_kv_heads)
    d_pad = next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        inverse_scale(k_scale),
        inverse_scale(v_scale),
        PAGE=k_cache.shape[1],
        NUM_HEADS=num_kv_heads,
        H_PAD=h_pad,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        FP8=is_fp8(k_cache.dtype),
        num_warps=4 if h_pad * d_pad >= 1024 else 1,
    )


__all__ = ["check_store_args", "store_kv", "store_kv_reference"]
