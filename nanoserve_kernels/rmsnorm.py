"""RMSNorm of each row, in one kernel launch (the PyTorch form is seven).

    y = weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype),   x32 = x.float()

The order of roundings is transformers' `LlamaRMSNorm`: normalise in float32, cast to the
input's dtype, then scale by the weight in that dtype (computed in float32 and rounded
once, as a torch product of two bf16 tensors is).

- `rms_norm_reference`: PyTorch, the oracle.
- `rms_norm`: Triton, one program per row ([rows, d] with d <= 16384).
- `add_rms_norm(x, residual, weight, eps) -> (h, y)`: the residual stream's add and the
  next norm in one launch: h = x + residual (rounded to the dtype, as a torch add is), then
  y = the RMSNorm of h; `add_rms_norm_reference` is its PyTorch form.
- `x_scales=(row_scale, col_scale)` (keyword, both add forms): x is an FP8 projection's
  output before its scales (nanoserve_kernels/scaled_rows.py), applied here as x is read: x =
  `scale_rows_reference(x, *x_scales, residual.dtype)`.
- `rms_norm_fp8(x, weight, eps, ub)` -> (q, scale) and `add_rms_norm_fp8(x, residual,
  weight, eps, ub)` -> (h, q, scale): the same, y quantized per row to float8 e4m3 in the
  same launch, exactly as `nanoserve_kernels.fp8_quant.quantize_rows` quantizes y (what an FP8
  projection after the norm needs: no launch of its own, no y written and read back).
  `*_fp8_reference`: the two references composed.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton
from nanoserve_kernels.fp8_quant import FP8, quantize_rows_reference, store_row_fp8
from nanoserve_kernels.scaled_rows import check_scales, load_scaled, scale_rows_reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d] in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    x = _scaled(x, residual, x_scales)
    h = x + residual
    return h, rms_norm_reference(h, weight, eps)


def rms_norm_fp8_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> e4m3 [M, d] and float32 scales [M, 1] (M rows of x)."""
    return quantize_rows_reference(rms_norm_reference(x, weight, eps).reshape(-1, x.shape[-1]), ub)


def add_rms_norm_fp8_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float, ub: float | None = None,
                               x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, y = add_rms_norm_reference(x, residual, weight, eps, x_scales)
    return (h, *quantize_rows_reference(y.reshape(-1, x.shape[-1]), ub))


def _scaled(x: torch.Tensor, residual: torch.Tensor,
            x_scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x as the residual add reads it: scaled (x_scales given: x [..., d] raw) or as it is."""
    if x_scales is None:
        return x
    d = x.shape[-1]
    return scale_rows_reference(x.reshape(-1, d), *x_scales, residual.dtype).view(residual.shape)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_ptr, d, stride_x, stride_o, eps, ub,
                     BLOCK: tl.constexpr, FP8_OUT: tl.constexpr, HAS_UB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _normalise_and_store(x, w_ptr, out_ptr + row * stride_o, s_ptr + row, cols, mask, d, eps,
                         ub, FP8_OUT, HAS_UB)


@triton.jit
def _add_rms_norm_kernel(x_ptr, xr_ptr, xc_ptr, r_ptr, w_ptr, h_ptr, out_ptr, s_ptr, d, stride_x,
                         stride_r, stride_h, stride_o, eps, ub, BLOCK: tl.constexpr,
                         FP8_OUT: tl.constexpr, HAS_UB: tl.constexpr, SCALED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    if SCALED:  # x: an FP8 projection's raw output, its row and column scales applied here
        x = load_scaled(x_ptr, xr_ptr, xc_ptr, row, stride_x, cols, mask,
                        h_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    _normalise_and_store(h.to(tl.float32), w_ptr, out_ptr + row * stride_o, s_ptr + row, cols,
                         mask, d, eps, ub, FP8_OUT, HAS_UB)


@triton.jit
def _normalise_and_store(x, w_ptr, out_row, s_row, cols, mask, d, eps, ub,
                         FP8_OUT: tl.constexpr, HAS_UB: tl.constexpr):
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    dtype = w_ptr.dtype.element_ty  # the input's (the weight is in it)
    normed = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(dtype)
    if FP8_OUT:
        store_row_fp8(y.to(tl.float32), out_row, s_row, cols, mask, ub, HAS_UB)
    else:
        tl.store(out_row + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm; same contract as `rms_norm_reference` (weight in x's dtype)."""
    if not HAS_TRITON:
        raise RuntimeError("rms_norm needs Triton; use the reference instead")
    return _rms_norm(x, weight, eps, None, False)[0].view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of `rms_norm_fp8_reference`."""
    if not HAS_TRITON:
        raise RuntimeError("rms_norm_fp8 needs Triton; use the reference instead")
    return _rms_norm(x, weight, eps, ub, True)


def _rms_norm(x, weight, eps, ub, fp8):
    d = x.shape[-1]
    if weight.shape != (d,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{d}] in {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=FP8 if fp8 else x.dtype, device=x.device)
    scale = torch.empty((rows.shape[0], 1) if fp8 else (1,), dtype=torch.float32,
                        device=x.device)
    if rows.shape[0]:
        block = next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, scale, d, rows.stride(0), out.stride(0), eps,
            0.0 if ub is None else float(ub), BLOCK=block, FP8_OUT=fp8, HAS_UB=ub is not None,
            num_warps=8 if block >= 4096 else 4)
    return out, scale


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of `add_rms_norm_reference` (x and residual of one shape and dtype)."""
    if not HAS_TRITON:
        raise RuntimeError("add_rms_norm needs Triton; use the reference instead")
    h, out, _ = _add_rms_norm(x, residual, weight, eps, None, False, x_scales)
    return h, out.view(x.shape)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, ub: float | None = None,
                     x_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton form of `add_rms_norm_fp8_reference`."""
    if not HAS_TRITON:
        raise RuntimeError("add_rms_norm_fp8 needs Triton; use the reference instead")
    return _add_rms_norm(x, residual, weight, eps, ub, True, x_scales)


def _add_rms_norm(x, residual, weight, eps, ub, fp8, x_scales):
    d = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if weight.shape != (d,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{d}] in {x.dtype}")
    xs, rs = x.reshape(-1, d), residual.reshape(-1, d)
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    rs = rs if rs.stride(-1) == 1 else rs.contiguous()
    if x_scales is not None:
        check_scales(*x_scales, xs.shape[0], d)
    row_s, col_s = x_scales if x_scales is not None else (xs, xs)  # unread without them
    h = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(xs.shape, dtype=FP8 if fp8 else x.dtype, device=x.device)
    scale = torch.empty((xs.shape[0], 1) if fp8 else (1,), dtype=torch.float32,
                        device=x.device)
    if xs.shape[0]:
        block = next_power_of_2(d)
        _add_rms_norm_kernel[(xs.shape[0],)](
            xs, row_s, col_s, rs, weight, h, out, scale, d, xs.stride(0), rs.stride(0),
            h.stride(0), out.stride(0), eps, 0.0 if ub is None else float(ub), BLOCK=block,
            FP8_OUT=fp8, HAS_UB=ub is not None, SCALED=x_scales is not None,
            num_warps=8 if block >= 4096 else 4)
    return h.view(x.shape), out, scale


__all__ = ["add_rms_norm", "add_rms_norm_fp8", "add_rms_norm_fp8_reference",
           "add_rms_norm_reference", "rms_norm", "rms_norm_fp8", "rms_norm_fp8_reference",
           "rms_norm_reference"]
