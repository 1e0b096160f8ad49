"""Rotary position embedding of many heads in one launch (the PyTorch form is five).

    out = x * cos + rotate_half(x) * sin,   rotate_half([a | b]) = [-b | a]

per token n and head h: x [N, H, D] (any strides but the last), cos/sin [N, D] -> out
[N, H, D] contiguous. The kernel computes each output in float32 and rounds it once; the
PyTorch form on half-precision tensors also rounds each product, so in bf16/fp16 the two
may differ by one unit in the last place (equal in float32 up to float32 rounding).

- `rotary_reference`: PyTorch, the oracle (transformers' `apply_rotary_pos_emb` form).
- `rotary`: Triton, one program per token over all its heads.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xn, stride_xh,
                   stride_cn, stride_sn, HALF: tl.constexpr, H_PAD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF)
    mask = h[:, None] < heads
    x_row = x_ptr + n * stride_xn + h[:, None] * stride_xh
    a = tl.load(x_row + d[None, :], mask=mask, other=0.0)
    b = tl.load(x_row + HALF + d[None, :], mask=mask, other=0.0)
    ty = a.dtype
    # cos/sin repeat their first half ([f | f] frequencies), as the model builds them
    c1 = tl.load(cos_ptr + n * stride_cn + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + n * stride_cn + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + n * stride_sn + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + n * stride_sn + HALF + d).to(tl.float32)[None, :]
    a32, b32 = a.to(tl.float32), b.to(tl.float32)
    lo = a32 * c1 - b32 * s1
    hi = b32 * c2 + a32 * s2
    out_row = out_ptr + n * heads * 2 * HALF + h[:, None] * 2 * HALF
    tl.store(out_row + d[None, :], lo.to(ty), mask=mask)
    tl.store(out_row + HALF + d[None, :], hi.to(ty), mask=mask)


def check_rotary_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """What the rotary kernels need: x [N, H, D] (D an even power of two), cos and sin
    [N, D] in x's dtype, every head dimension contiguous."""
    N, H, D = x.shape
    if D % 2 or D & (D - 1):
        raise ValueError(f"head_dim must be an even power of two, got {D}")
    if cos.shape != (N, D) or sin.shape != (N, D) or cos.dtype != x.dtype:
        raise ValueError(f"cos/sin must be [{N}, {D}] in {x.dtype}")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton form of `rotary_reference` (x [N, H, D] with x.stride(-1) == 1)."""
    if not HAS_TRITON:
        raise RuntimeError("rotary needs Triton; use the reference instead")
    check_rotary_args(x, cos, sin)
    N, H, D = x.shape
    out = torch.empty((N, H, D), dtype=x.dtype, device=x.device)
    if N:
        _rotary_kernel[(N,)](x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0),
                             sin.stride(0), HALF=D // 2, H_PAD=next_power_of_2(H))
    return out


__all__ = ["rotary", "rotary_reference"]
