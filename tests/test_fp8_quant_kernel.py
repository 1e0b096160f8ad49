"""nanoserve_kernels/fp8_quant.py on the CPU: the reference against independent math (each value the
nearest e4m3 value to x / scale, scale = the row's max / 448), and the Triton kernel against
the reference under Triton's interpreter, in a child process (TRITON_INTERPRET must be set
before Triton is imported; see tests/test_kernels.py). The interpreter's own float -> e4m3
cast mis-rounds a few values (mostly those that round up into the next power of two: 124.3
becomes 64, not 128), so there the scales must be equal and the codes equal on at least 95%
of the elements (seen: 97.8-99.1%); on a GPU the kernel equals the reference bit for bit (tests/test_fp8_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from nanoserve_kernels.fp8_quant import FP8, quantize_rows_reference

REPO = Path(__file__).resolve().parents[1]


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, from its 256 codes (0x7f and 0xff are NaN)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    return codes[torch.isfinite(codes)].unique()


def test_reference_rounds_to_the_nearest_e4m3_value():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * torch.logspace(-4, 3, 6)[:, None]
    x[3] = 0.0
    q, scale = quantize_rows_reference(x)
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.equal(scale, amax.clamp(min=1e-12) / 448.0)
    y = x / scale  # [6, 300]
    nearest = (_e4m3_values()[None, None, :] - y[..., None]).abs().amin(-1)
    assert torch.equal((q.float() - y).abs(), nearest)
    assert (q[3].float() == 0).all()


def test_reference_caps_the_row_max_and_saturates():
    x = torch.tensor([[10.0, -10.0, 0.25, 0.125]])
    q, scale = quantize_rows_reference(x, ub=0.5)
    assert torch.equal(scale, torch.tensor([[0.5]]) / 448.0)
    assert q.float().tolist() == [[448.0, -448.0, 224.0, 112.0]]


def test_bfloat16_input_gives_float32_scales():
    x = torch.randn(3, 40).to(torch.bfloat16)
    q, scale = quantize_rows_reference(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    q32, s32 = quantize_rows_reference(x.float())
    assert torch.equal(scale, s32) and torch.equal(q.view(torch.uint8), q32.view(torch.uint8))


CHILD = textwrap.dedent("""
    import torch
    from nanoserve_kernels.fp8_quant import quantize_rows, quantize_rows_reference
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for k, ub in ((64, None), (1500, None), (2100, 0.5)):
            x = (torch.randn(5, k, generator=g) * torch.logspace(-3, 2, 5)[:, None]).to(dtype)
            x[2] = 0
            q, s = quantize_rows(x, ub)
            rq, rs = quantize_rows_reference(x, ub)
            assert torch.equal(s, rs), (dtype, k, ub)
            same = (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
            assert same >= 0.95, (dtype, k, ub, same)  # seen: 97.8-99.1%
    print("ok")
""")


def test_kernel_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "NANOSERVE_TRITON_INTERPRET": "1",
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
