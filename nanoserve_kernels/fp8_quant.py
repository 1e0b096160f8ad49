"""Dynamic per-token FP8 e4m3 quantization of activations, in one launch.

    x [M, K] (any float dtype)  ->  q [M, K] e4m3, scale [M, 1] float32,  x ~= q * scale

A row's scale is its absolute maximum (capped at `ub` when given: values beyond then
saturate) over 448, the largest e4m3 value, and at least 1e-12 / 448 (a zero row). The
quotient x / scale is computed in float32 (IEEE division) and rounded to nearest even, with
saturation, as torch's cast does: the kernel equals the reference bit for bit. (The
reference divides by 448 held in a tensor on x's device: divided by a Python number, torch's
CUDA kernel multiplies by its float32 reciprocal instead, one ulp off IEEE division at times.)

- `quantize_rows_reference`: PyTorch, the oracle (a few kernels on a GPU: 14-17 us a call).
- `quantize_rows`: Triton, one program per row: a pass for the maximum, a pass to quantize.
- `row_scale`, `quantize_to_fp8`, `store_row_fp8`: the same steps as Triton functions, for
  kernels that quantize the row they compute (nanoserve_kernels/rmsnorm.py, nanoserve_kernels/activation.py).
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
_BLOCK = 1024


def exact_div(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d in IEEE division on every device (Triton's `div_rn`): d as a 0-dim tensor on
    x's device, so torch's CUDA kernel does not multiply by a rounded reciprocal."""
    return x / torch.tensor(d, dtype=x.dtype, device=x.device)


def quantize_rows_reference(x: torch.Tensor, ub: float | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    # the max-norm is |x|'s row max in one reduction; x / scale promotes to float32 itself
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True).float()
    if ub is not None:
        amax = amax.clamp(max=ub)
    scale = exact_div(amax.clamp(min=MIN_AMAX), FP8_MAX)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def row_scale(amax, ub, HAS_UB: tl.constexpr):
    """A row's scale from the largest |x| of its float32 values (capped at ub)."""
    if HAS_UB:
        amax = tl.minimum(amax, ub)
    return tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def quantize_to_fp8(x, scale):
    """float32 values -> x / scale, saturated to e4m3's range (the store's cast rounds)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)


@triton.jit
def store_row_fp8(y, q_row, s_row, cols, mask, ub, HAS_UB: tl.constexpr):
    """A whole row y (float32, in registers; 0 where masked) quantized: its scale to s_row,
    its e4m3 values to q_row + cols."""
    scale = row_scale(tl.max(tl.abs(y), axis=0), ub, HAS_UB)
    tl.store(s_row, scale)
    tl.store(q_row + cols, quantize_to_fp8(y, scale).to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, ub,
                          HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0), ub, HAS_UB)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + cols,
                 quantize_to_fp8(x, scale).to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_rows(x: torch.Tensor, ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of `quantize_rows_reference`; x [M, K] with unit stride along K."""
    if not HAS_TRITON:
        raise RuntimeError("quantize_rows needs Triton; use the reference instead")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                    0.0 if ub is None else float(ub), HAS_UB=ub is not None,
                                    BLOCK=_BLOCK)
    return q, scale


__all__ = ["FP8", "exact_div", "quantize_rows", "quantize_rows_reference", "quantize_to_fp8",
           "row_scale",
           "store_row_fp8"]
