"""The FP8 KV cache's number format: keys and values stored as float8 e4m3 with one scale
per layer for K and one for V, shared by the store kernels, the attention kernels and
their references.

    stored  = e4m3(clamp(x * (1 / scale), -448, 448))   rounded to nearest, ties to even
    read    = float32(stored) * scale

e4m3 has 3 mantissa bits: a value in the normal range (|x / scale| >= 2^-6) comes back
within a relative error of 2^-4 (half a unit in the last place); below it, within an
absolute error of 2^-10 * scale (subnormal spacing 2^-9); beyond 448 * scale, clamped.
`1 / scale` is computed on the host and rounded to float32 once, so the kernels and the
references multiply by the same number (for scale 1.0 and powers of two this is exactly
`x / scale`).

A cache of any other dtype (the model's: bfloat16, float16, float32) stores values as
they are, and its scales must be 1.0.

`quantize_e4m3` is the Triton side. It rounds to the e4m3 grid in float32 arithmetic and
only then casts, so the cast itself is exact: Triton's CPU interpreter converts float32
to float8 wrongly (it rounds ties away from zero and drops the carry into the exponent,
so 7.94 becomes 4.0), and with the rounding done first the interpreter runs the same
code the GPU runs and matches torch's conversion bit for bit.
"""

from __future__ import annotations

import struct

import torch

from nanoserve_kernels._triton import tl, triton

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def inverse_scale(scale: float) -> float:
    """1 / scale, rounded to float32 (what a Triton float argument holds); no torch call, as
    every store launch asks for it."""
    return struct.unpack("f", struct.pack("f", 1.0 / scale))[0]


def check_kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Scales are positive finite numbers, and 1.0 unless the cache is FP8."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(s, (int, float)) and 0.0 < s < float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {s!r}")
    if not is_fp8(cache_dtype) and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"a {cache_dtype} cache takes no scales (k_scale, v_scale = "
                         f"{k_scale}, {v_scale}); only an FP8 cache does")


def quantize_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8 e4m3 of `x / scale` (see the module docstring)."""
    inv = torch.tensor(inverse_scale(scale), dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def dequantize_reference(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries as `dtype` (float32 or float64: the references' math): FP8 entries
    times the scale; other caches as they are."""
    if is_fp8(cache.dtype):
        return cache.to(dtype) * scale
    return cache.to(dtype)


@triton.jit
def quantize_e4m3(x, inv_scale):
    """x (float32) * inv_scale, clamped to +-448 and rounded to nearest-even on the e4m3
    grid; returned as float32 holding an exact e4m3 value (the cast after it is exact)."""
    y = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent of y
    e = tl.maximum(e, -6)  # below 2^-6: e4m3's subnormals, spacing 2^-9
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    down = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    m = y * up  # |m| < 16, exact: the e4m3 grid is now the integers
    # + 1.5 * 2^23 rounds to an integer, ties to even (the GPU compiler fuses the product
    # above into this add as one FMA: the same result, the product being exact)
    m = (m + 12582912.0) - 12582912.0
    return m * down


__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "check_kv_scales",
    "dequantize_reference",
    "inverse_scale",
    "is_fp8",
    "quantize_e4m3",
    "quantize_reference",
]
