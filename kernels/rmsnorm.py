"""RMSNorm of each row, in one kernel launch (the PyTorch form is seven).

    y = weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype),   x32 = x.float()

The order of roundings is transformers' `LlamaRMSNorm`: normalise in float32, cast to the
input's dtype, then scale by the weight in that dtype (computed in float32 and rounded
once, as a torch product of two bf16 tensors is).

- `rms_norm_reference`: PyTorch, the oracle.
- `rms_norm`: Triton, one program per row ([rows, d] with d <= 16384).
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_power_of_2, tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, d, stride_x, stride_o, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm; same contract as `rms_norm_reference` (weight in x's dtype)."""
    if not HAS_TRITON:
        raise RuntimeError("rms_norm needs Triton; use the reference instead")
    d = x.shape[-1]
    if weight.shape != (d,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{d}] in {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, d, rows.stride(0), out.stride(0),
                                           eps, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out.view(x.shape)


__all__ = ["rms_norm", "rms_norm_reference"]
