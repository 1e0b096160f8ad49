"""SwiGLU's gate: silu(gate) * up over one fused gate-up projection, in one launch.

    x [..., 2 * I] = [gate | up]  ->  silu(gate) * up  [..., I]

silu is computed in float32 and rounded to x's dtype before the product, as
`F.silu(gate) * up` does on half-precision tensors.

- `silu_and_mul_reference`: PyTorch, the oracle.
- `silu_and_mul`: Triton, one program per (row, column block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, tl, triton

_BLOCK = 1024


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inner, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton form of `silu_and_mul_reference`."""
    if not HAS_TRITON:
        raise RuntimeError("silu_and_mul needs Triton; use the reference instead")
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even (gate | up), got {x.shape[-1]}")
    inner = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inner), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(inner, _BLOCK))
        _silu_and_mul_kernel[grid](rows, out, inner, rows.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out.view(*x.shape[:-1], inner)


__all__ = ["silu_and_mul", "silu_and_mul_reference"]
