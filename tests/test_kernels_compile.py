"""Every Triton kernel, launched as its wrapper launches it, compiles for a Hopper GPU
(sm_90) on a machine without one.

The interpreter tests (tests/test_kernels.py) run the kernels' Python on the CPU, which
accepts code the GPU compiler refuses (a variable whose block shape changes inside an
`if`, say). Here each wrapper is called with CPU tensors while `JITFunction.run` only
records its arguments; each recorded launch is then compiled ahead of time, through
PTX to a cubin with the ptxas Triton ships, for compute capability 9.0. Nothing runs.

On a machine without a GPU the engine does not import Triton (`nanoserve_kernels/_triton.py`), so the
kernels are not defined for it in the test run's process: there these tests run in a child
pytest with `NANOSERVE_TRITON_IMPORT=1` (`test_kernels_compile_in_a_child_process`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from nanoserve_kernels._triton import HAS_TRITON, IMPORT_ENV  # noqa: E402

needs_kernels = pytest.mark.skipif(
    not HAS_TRITON, reason="run by test_kernels_compile_in_a_child_process (Triton imported)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.int32: "*i32", torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv",
           torch.uint16: "*u16"}


def _launches(monkeypatch, calls) -> list[tuple[JITFunction, tuple, dict]]:
    """Run `calls` (wrappers of kernels) recording each kernel launch instead of running it."""
    seen: list[tuple[JITFunction, tuple, dict]] = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, kwargs))

    monkeypatch.setattr(JITFunction, "run", record)
    for call in calls:
        call()
    return seen


def _compile(fn: JITFunction, args: tuple, kwargs: dict) -> None:
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    signature, constexprs = {}, {}
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = POINTER[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(v).__name__}")
    triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER, options=options)


def _wrapper_calls(dtype: torch.dtype):
    from nanoserve_kernels.activation import silu_and_mul
    from nanoserve_kernels.argmax import argmax_scatter
    from nanoserve_kernels.kv_store import store_kv
    from nanoserve_kernels.logprobs import logprob_rows
    from nanoserve_kernels.paged_attention import paged_decode_attention
    from nanoserve_kernels.paged_prefill import paged_prefill_attention
    from nanoserve_kernels.prefill_attention import prefill_attention, prefill_work
    from nanoserve_kernels.rmsnorm import add_rms_norm, rms_norm
    from nanoserve_kernels.rotary import rotary
    from nanoserve_kernels.rotary_store import rotary_store

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, block, num_blocks = 8, 2, 64, 16, 12

    def t(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    kc, vc = t(num_blocks, block, hkv, d), t(num_blocks, block, hkv, d)
    tables = torch.arange(1, 1 + 3 * 4, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([5, 40, 64], dtype=torch.int32)
    q = t(3, hq, d)
    cu = torch.tensor([0, 5, 12, 30], dtype=torch.int32)
    qkv = t(30, hq + 2 * hkv, d)
    cos, sin = t(30, d), t(30, d)
    slots = torch.arange(30, dtype=torch.int64)
    calls = [
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=1),
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=3, block_n=16),
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=3,
                                       even_splits=True, block_n=16),
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, window=7),
        lambda: prefill_attention(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cu, 18,
                                  0.125),
        lambda: prefill_attention(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cu, 18,
                                  0.125, window=5),
        lambda: prefill_attention(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cu, 18,
                                  0.125, work=torch.from_numpy(prefill_work([5, 7, 18], 9))),
        lambda: paged_prefill_attention(qkv[:, :hq], kc, vc, tables, cu, lens, 18, 0.125),
        lambda: paged_prefill_attention(qkv[:, :hq], kc, vc, tables, cu, lens, 18, 0.125,
                                        work=torch.from_numpy(prefill_work([5, 7, 18], 9, 16))),
        lambda: store_kv(qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], kc, vc, slots),
        lambda: rms_norm(t(30, 256), t(256), 1e-5),
        lambda: add_rms_norm(t(30, 256), t(30, 256), t(256), 1e-5),
        lambda: rotary(qkv[:, :hq + hkv], cos, sin),
        lambda: rotary_store(qkv, cos, sin, kc, vc, slots, hq),
        lambda: silu_and_mul(t(30, 512)),
        lambda: argmax_scatter(t(3, 9000), torch.tensor([2, 0, 1]),
                               torch.zeros(4, dtype=torch.int64)),
        lambda: logprob_rows(t(3, 9000), torch.tensor([2, 0, 8999]), 5),
        lambda: logprob_rows(t(3, 9000), torch.tensor([2, 0, 8999]), 0),
    ]
    return calls


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_kernel_compiles_for_hopper(monkeypatch, dtype):
    launches = _launches(monkeypatch, _wrapper_calls(dtype))
    names = {fn.__name__ for fn, _, _ in launches}
    # every kernel module took part (the two split kernels, both argmax launches, ...)
    assert {"_paged_decode_kernel", "_combine_splits_kernel", "_prefill_kernel",
            "_paged_prefill_kernel", "_store_kv_kernel", "_rms_norm_kernel",
            "_add_rms_norm_kernel", "_rotary_kernel", "_rotary_store_kernel",
            "_silu_and_mul_kernel", "_chunk_max_kernel", "_pick_kernel",
            "_logprob_chunk_kernel", "_logprob_merge_kernel"} <= names, names
    monkeypatch.undo()
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)


def _fp8_wrapper_calls(dtype: torch.dtype):
    """The kernels that read or write an FP8 (e4m3) KV pool, with scales."""
    from nanoserve_kernels.kv_store import store_kv
    from nanoserve_kernels.paged_attention import F16_TILING, paged_decode_attention
    from nanoserve_kernels.paged_prefill import paged_prefill_attention
    from nanoserve_kernels.rotary_store import rotary_store

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, block, num_blocks = 8, 2, 64, 16, 12
    kc, vc = (torch.randn(num_blocks, block, hkv, d, generator=g).to(torch.float8_e4m3fn)
              for _ in range(2))
    tables = torch.arange(1, 1 + 3 * 4, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([5, 40, 64], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, 5, 12, 30], dtype=torch.int32)
    qkv = torch.randn(30, hq + 2 * hkv, d, generator=g).to(dtype)
    cos, sin = torch.randn(30, d).to(dtype), torch.randn(30, d).to(dtype)
    slots = torch.arange(30, dtype=torch.int64)
    s = {"k_scale": 0.5, "v_scale": 2.0}
    block_n, warps, stages = F16_TILING  # the "f16" form as it launches on CUDA
    f16 = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "fp8_form": "f16"}
    return [
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=1, **s),
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=3,
                                       block_n=16, **s),
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=1, **f16, **s),
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=2,
                                       even_splits=True, **f16, **s),
        # the "e4m3" form as it launches on CUDA (128-token steps, two stages)
        lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.125, num_splits=1,
                                       block_n=128, num_stages=2, fp8_form="e4m3", **s),
        lambda: paged_prefill_attention(qkv[:, :hq], kc, vc, tables, cu, lens, 18, 0.125, **s),
        lambda: store_kv(qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], kc, vc, slots, **s),
        lambda: rotary_store(qkv, cos, sin, kc, vc, slots, hq, **s),
    ]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_kv_kernels_compile_for_hopper(monkeypatch, dtype):
    launches = _launches(monkeypatch, _fp8_wrapper_calls(dtype))
    assert {"_paged_decode_kernel", "_combine_splits_kernel", "_paged_prefill_kernel",
            "_store_kv_kernel", "_rotary_store_kernel"} <= {fn.__name__ for fn, _, _ in launches}
    monkeypatch.undo()
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)


def _fp8_activation_calls(dtype: torch.dtype):
    """The kernels around an FP8 projection: those quantizing their output for it, and those
    applying its output's scales (`nanoserve_kernels.scaled_rows`)."""
    from nanoserve_kernels.activation import silu_and_mul_fp8
    from nanoserve_kernels.fp8_quant import quantize_rows
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8, rms_norm_fp8
    from nanoserve_kernels.scaled_rows import scale_rows

    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def scales(m, n):
        return torch.rand(m, 1, generator=g), torch.rand(1, n, generator=g)

    return [
        lambda: quantize_rows(t(5, 4096)),
        lambda: rms_norm_fp8(t(5, 4096), t(4096), 1e-5),
        lambda: add_rms_norm_fp8(t(5, 4096), t(5, 4096), t(4096), 1e-5, 0.5),
        lambda: add_rms_norm_fp8(t(5, 4096), t(5, 4096), t(4096), 1e-5, None, scales(5, 4096)),
        lambda: add_rms_norm(t(5, 4096), t(5, 4096), t(4096), 1e-5, scales(5, 4096)),
        lambda: silu_and_mul_fp8(t(5, 2 * 14336), form="row"),  # one pass
        lambda: silu_and_mul_fp8(t(5, 2 * 28672), 0.5, form="row"),  # two passes
        lambda: silu_and_mul_fp8(t(5, 2 * 14336), None, scales(5, 2 * 14336), form="row"),
        lambda: silu_and_mul_fp8(t(5, 2 * 14336), 0.5, form="split"),
        lambda: silu_and_mul_fp8(t(5, 2 * 14336), None, scales(5, 2 * 14336), form="split"),
        lambda: scale_rows(t(5, 6144), *scales(5, 6144), dtype),
    ]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_activation_kernels_compile_for_hopper(monkeypatch, dtype):
    launches = _launches(monkeypatch, _fp8_activation_calls(dtype))
    assert {"_quantize_rows_kernel", "_rms_norm_kernel", "_add_rms_norm_kernel",
            "_silu_and_mul_fp8_kernel", "_scale_rows_kernel"} <= {fn.__name__
                                                                  for fn, _, _ in launches}
    monkeypatch.undo()
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)


def _moe_calls(dtype: torch.dtype):
    """The fused MoE kernels (nanoserve_kernels/fused_moe.py): routing, and both grouped GEMMs
    in the compute dtype and on FP8 experts with per-channel and 128 x 128 block scales."""
    from nanoserve.weights.fp8 import quantize_blockwise, quantize_per_channel
    from nanoserve_kernels.fused_moe import fused_experts
    from nanoserve_kernels.moe_routing import align_pairs, route, route_reference

    g = torch.Generator().manual_seed(0)
    m, d, inner, experts = 5, 256, 256, 8
    x = torch.randn(m, d, generator=g).to(dtype)
    logits = torch.randn(m, experts, generator=g)
    w13 = 0.1 * torch.randn(experts, 2 * inner, d, generator=g)
    w2 = 0.1 * torch.randn(experts, d, inner, generator=g)

    def fp8(w, block):
        qs = [quantize_blockwise(w[e], block) if block else quantize_per_channel(w[e])
              for e in range(experts)]
        scales = [s if block else s[:, 0] for _, s in qs]
        return torch.stack([q for q, _ in qs]), torch.stack(scales)

    (q13, s13), (q2, s2) = fp8(w13, None), fp8(w2, None)
    (b13, bs13), (b2, bs2) = fp8(w13, (128, 128)), fp8(w2, (128, 128))
    big = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    top2, top3 = route_reference(logits, 2, True), route_reference(logits, 3, False)
    return [  # (the recorded routing launch writes nothing: the GEMMs get real routes)
        lambda: route(logits, 8, True),
        lambda: align_pairs(torch.randint(0, 128, (300, 8), dtype=torch.int32), 128, 16),
        lambda: fused_experts(x, *top2, w13.to(dtype), w2.to(dtype)),
        lambda: fused_experts(x, *top3, w13.to(dtype), w2.to(dtype), config=big),
        lambda: fused_experts(x, *top2, q13, q2, w13_scale=s13, w2_scale=s2),
        lambda: fused_experts(x, *top2, b13, b2, w13_scale=bs13, w2_scale=bs2,
                              block=(128, 128)),
    ]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_kernels_compile_for_hopper(monkeypatch, dtype):
    launches = _launches(monkeypatch, _moe_calls(dtype))
    assert {"_route_kernel", "_align_kernel", "_moe_gemm_kernel", "_quantize_rows_kernel",
            "_quantize_groups_kernel"} <= {
        fn.__name__ for fn, _, _ in launches}
    monkeypatch.undo()
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)


def _lora_calls(dtype: torch.dtype):
    """The LoRA kernels (nanoserve_kernels/lora.py): shrink and expand over a fused q/k/v's
    three parts (rank 16) and a single part (rank 8, padded to 16), y a strided view."""
    from nanoserve_kernels.lora import lora_add

    g = torch.Generator().manual_seed(0)
    n, k, slots = 7, 256, 3
    x = torch.randn(n, k, generator=g).to(dtype)
    index = torch.tensor([0, -1, 2, 2, 1, -1, 0])
    qkv = ((0, 0, 256), (256, 256, 64), (320, 320, 64))
    a3 = torch.randn(slots, 3 * 16, k, generator=g).to(dtype)
    b3 = torch.randn(slots, 384, 16, generator=g).to(dtype)
    a1 = torch.randn(slots, 8, k, generator=g).to(dtype)
    b1 = torch.randn(slots, 96, 8, generator=g).to(dtype)
    y = torch.randn(n, 512, generator=g).to(dtype)
    return [lambda: lora_add(y[:, :384], x, a3, b3, qkv, index),
            lambda: lora_add(y[:, 100:196], x, a1, b1, ((0, 0, 96),), index)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_kernels_compile_for_hopper(monkeypatch, dtype):
    launches = _launches(monkeypatch, _lora_calls(dtype))
    assert {fn.__name__ for fn, _, _ in launches} == {"_shrink_kernel", "_expand_kernel"}
    monkeypatch.undo()
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)


@needs_kernels
def test_a_kernel_the_gpu_compiler_refuses_fails_here(monkeypatch):
    """The check can fail: a block whose shape changes inside an `if` runs under the
    interpreter but does not compile."""
    from triton import language as tl

    @triton.jit
    def bad(x_ptr, n, A: tl.constexpr, B: tl.constexpr):
        v = tl.load(x_ptr + tl.arange(0, A))
        if n > 0:
            v = tl.load(x_ptr + tl.arange(0, B))
        tl.store(x_ptr + tl.arange(0, A), v)

    x = torch.zeros(32)
    launches = _launches(monkeypatch, [lambda: bad[(1,)](x, 1, A=32, B=8)])
    monkeypatch.undo()
    with pytest.raises(Exception, match="redefines|type"):
        _compile(*launches[0])


def test_kernels_compile_in_a_child_process():
    """Where this process has no Triton kernels (no GPU: the engine did not import Triton),
    the tests above run in a child pytest that imports it (NANOSERVE_TRITON_IMPORT=1)."""
    if HAS_TRITON:
        pytest.skip("the kernels are defined in this process: the tests above ran here")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "NANOSERVE_TRITON_INTERPRET")}
    env[IMPORT_ENV] = "1"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "not in_a_child_process", str(Path(__file__).resolve())],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert re.search(r"\b\d+ passed", report) and "skipped" not in report, report
