"""An FP8 GEMM's output with its scales still to apply, and the one step that applies them.

`nanoserve.weights.fp8.Fp8Linear` multiplies e4m3 operands with `torch._scaled_mm` at unit scales
(one scale per tensor: cuBLAS picks its kernel by the shape; its kernel for row-wise scales
is one 128 x 128 tile at every size, up to 2.2x slower at decode sizes on the H200), and the
scales are applied after, by the kernel that reads the output next:

    y[m, n] = ((raw[m, n] * row_scale[m]) * col_scale[n]), rounded to y's dtype

raw [M, N] (the e4m3 products summed in float32, rounded to bfloat16; float32 on the CPU),
row_scale [M, 1] float32 (the activation's per-token scales), col_scale [1, N] float32 (the
weight's per output channel). Products in float32 in that order, as the reference computes
them, so every form below gives the same y bit for bit.

- `scale_rows_reference(raw, row_scale, col_scale, dtype)`: PyTorch, the oracle.
- `scale_rows(...)`: Triton, one program per (row, column block), for an output whose next
  kernel does not apply the scales itself (the q/k/v projection's).
- `load_scaled(...)`: the step inside another kernel (nanoserve_kernels/rmsnorm.py's residual add,
  nanoserve_kernels/activation.py's silu-and-mul), as float32 values of y.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, tl, triton

_BLOCK = 1024


def scale_rows_reference(raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """raw [M, N], row_scale [M, 1], col_scale [1, N] -> y [M, N] in dtype."""
    return ((raw.float() * row_scale) * col_scale).to(dtype)


@triton.jit
def load_scaled(raw_ptr, rs_ptr, cs_ptr, row, stride_raw, cols, mask, dtype: tl.constexpr):
    """y at `cols` of `row` (float32 values of y rounded to dtype); the column scales are
    read at `cols` too (a caller reading the second half of a row passes those columns)."""
    raw = tl.load(raw_ptr + row * stride_raw + cols, mask=mask, other=0.0).to(tl.float32)
    rs = tl.load(rs_ptr + row)
    cs = tl.load(cs_ptr + cols, mask=mask, other=0.0)
    return ((raw * rs) * cs).to(dtype).to(tl.float32)


@triton.jit
def _scale_rows_kernel(raw_ptr, rs_ptr, cs_ptr, out_ptr, n, stride_raw, stride_o,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = out_ptr.dtype.element_ty
    y = load_scaled(raw_ptr, rs_ptr, cs_ptr, row, stride_raw, cols, mask, dtype)
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


def scale_rows(raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Triton form of `scale_rows_reference` (raw with unit stride along its rows; the
    scales contiguous float32)."""
    if not HAS_TRITON:
        raise RuntimeError("scale_rows needs Triton; use the reference instead")
    m, n = raw.shape
    check_scales(row_scale, col_scale, m, n)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    out = torch.empty((m, n), dtype=dtype, device=raw.device)
    if m:
        _scale_rows_kernel[(m, triton.cdiv(n, _BLOCK))](
            raw, row_scale, col_scale, out, n, raw.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out


def check_scales(row_scale: torch.Tensor, col_scale: torch.Tensor, m: int, n: int) -> None:
    """The kernels' contract on the scales: float32, contiguous, [M, 1] and [1, N]."""
    for name, s, shape in (("row_scale", row_scale, (m, 1)), ("col_scale", col_scale, (1, n))):
        if s.dtype != torch.float32 or tuple(s.shape) != shape or not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 {list(shape)}, got "
                             f"{s.dtype} {list(s.shape)}")


__all__ = ["check_scales", "load_scaled", "scale_rows", "scale_rows_reference"]
