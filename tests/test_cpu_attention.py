"""The CPU's attention (`nanoserve_kernels.cpu_attention`, what the engine runs on the CPU) against the
references it replaces there: random pools, block tables, context lengths, packed prompts of
mixed lengths (padded together, and one by one past the padding bound), GQA groups, windows
and dtypes; and which one `nanoserve_kernels.backend` picks."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve_kernels import backend
from nanoserve_kernels.cpu_attention import (
    decode_attention_cpu,
    paged_prefill_attention_cpu,
    prefill_attention_cpu,
)
from nanoserve_kernels.paged_attention import paged_decode_attention_reference
from nanoserve_kernels.paged_prefill import paged_prefill_attention_reference
from nanoserve_kernels.prefill_attention import prefill_attention_reference

TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}


def case(rng: random.Random, dtype: torch.dtype, batch: int, hkv: int, group: int,
         block_size: int, head_dim: int = 16):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    lens = [rng.randint(1, 5 * block_size) for _ in range(batch)]
    width = max(-(-n // block_size) for n in lens) + rng.randint(0, 2)
    num_blocks = batch * width + 3
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    free = list(range(num_blocks))
    rng.shuffle(free)
    for i, n in enumerate(lens):  # each row's own blocks; padding entries stay block 0
        for j in range(-(-n // block_size)):
            tables[i, j] = free.pop()
    q = torch.randn(batch, hkv * group, head_dim, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(1, 1), (3, 3), (2, 4), (4, 1)])
def test_cpu_read_equals_the_reference(dtype, hkv, group):
    rng = random.Random(f"{dtype}-{hkv}-{group}")
    for trial in range(12):
        batch = rng.choice([1, 2, 5, 9])
        block_size = rng.choice([1, 4, 16])
        q, k, v, tables, lens = case(rng, dtype, batch, hkv, group, block_size)
        window = rng.choice([None, None, 1, 3, 7, 1000])
        scale = q.shape[-1] ** -0.5
        want = paged_decode_attention_reference(q, k, v, tables, lens, scale, window=window)
        got = decode_attention_cpu(q, k, v, tables, lens, scale, window=window)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                   msg=f"trial {trial}: lens {lens.tolist()}, window {window}")


def test_cpu_read_checks_like_the_reference():
    q, k, v, tables, lens = case(random.Random(1), torch.float32, 3, 2, 2, 4)
    assert decode_attention_cpu(q[:0], k, v, tables[:0], lens[:0], 1.0).shape == (0, 4, 16)
    for bad_lens, message in ((torch.tensor([0, 1, 1], dtype=torch.int32), "context_lens >= 1"),
                              (torch.tensor([1, 1, 999], dtype=torch.int32), "blocks")):
        for fn in (decode_attention_cpu, paged_decode_attention_reference):
            with pytest.raises(ValueError, match=message):
                fn(q, k, v, tables, bad_lens, 1.0)
    with pytest.raises(ValueError, match="window"):
        decode_attention_cpu(q, k, v, tables, lens, 1.0, window=0)


def packed(rng: random.Random, lengths: list[int], hq: int, hkv: int, dtype: torch.dtype,
           head_dim: int = 16):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    n = sum(lengths)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))],
                      dtype=torch.int32)
    return (torch.randn(n, hq, head_dim, generator=g).to(dtype), cu)


def mixed_lengths(rng: random.Random) -> list[int]:
    """Rows of similar lengths (one padded call) or one long row among short ones (one call
    per row), zero-length rows included."""
    if rng.random() < 0.5:
        return [rng.randint(0, 12) for _ in range(rng.randint(1, 7))]
    return [rng.randint(0, 3) for _ in range(rng.randint(3, 8))] + [rng.randint(30, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(1, 1), (3, 3), (2, 4)])
def test_cpu_prefill_equals_the_reference(dtype, hkv, group):
    rng = random.Random(f"prefill-{dtype}-{hkv}-{group}")
    for trial in range(10):
        lengths = mixed_lengths(rng)
        q, cu = packed(rng, lengths, hkv * group, hkv, dtype)
        k, _ = packed(rng, lengths, hkv, hkv, dtype)
        v, _ = packed(rng, lengths, hkv, hkv, dtype)
        window = rng.choice([None, None, 1, 3, 1000])
        scale = q.shape[-1] ** -0.5
        want = prefill_attention_reference(q, k, v, cu, max(lengths), scale, window=window)
        got = prefill_attention_cpu(q, k, v, cu, max(lengths), scale, window=window)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                   msg=f"trial {trial}: lengths {lengths}, window {window}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(1, 1), (3, 3), (2, 4)])
def test_cpu_paged_prefill_equals_the_reference(dtype, hkv, group):
    """New tokens after cached context: each row's last n of its context are new."""
    rng = random.Random(f"paged-{dtype}-{hkv}-{group}")
    for trial in range(10):
        block_size = rng.choice([1, 4, 16])
        _, k, v, tables, lens = case(rng, dtype, rng.choice([1, 3, 6]), hkv, group, block_size)
        new = [rng.choice([0, 1, n, rng.randint(0, n)]) for n in lens.tolist()]
        q, cu = packed(rng, new, hkv * group, hkv, dtype)
        scale = q.shape[-1] ** -0.5
        window = rng.choice([None, 1, 3, 20])
        want = paged_prefill_attention_reference(q, k, v, tables, cu, lens, max(new), scale,
                                                 window=window)
        got = paged_prefill_attention_cpu(q, k, v, tables, cu, lens, max(new), scale,
                                          window=window)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                   msg=f"trial {trial}: new {new}, context {lens.tolist()}, "
                                       f"window {window}")


def test_cpu_prefills_check_like_the_references():
    rng = random.Random(3)
    q, cu = packed(rng, [3, 2], 4, 2, torch.float32)
    k, _ = packed(rng, [3, 2], 2, 2, torch.float32)
    for fn in (prefill_attention_cpu, prefill_attention_reference):
        with pytest.raises(ValueError, match="max_seqlen"):
            fn(q, k, k, cu, 2, 1.0)
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(q, k, k, torch.tensor([0, 3, 4], dtype=torch.int32), 3, 1.0)
    _, kc, vc, tables, lens = case(rng, torch.float32, 2, 2, 2, 4)
    for fn in (paged_prefill_attention_cpu, paged_prefill_attention_reference):
        with pytest.raises(ValueError, match="context_lens"):
            fn(q, kc, vc, tables, cu, torch.tensor([2, 2], dtype=torch.int32), 3, 1.0)


def test_backend_runs_the_cpu_paths_on_the_cpu(monkeypatch):
    """The engine's dispatchers on the CPU: the CPU paths, or the references themselves when
    NANOSERVE_KERNELS=reference (side-by-side checks of the two paths)."""
    rng = random.Random(2)
    q, k, v, tables, lens = case(rng, torch.float32, 4, 3, 3, 16)
    qp, cu = packed(rng, [2, 3, 1, 4], 9, 3, torch.float32)
    kp, _ = packed(rng, [2, 3, 1, 4], 3, 3, torch.float32)
    calls = []
    for name in ("decode_attention_cpu", "paged_decode_attention_reference",
                 "prefill_attention_cpu", "prefill_attention_reference",
                 "paged_prefill_attention_cpu", "paged_prefill_attention_reference"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    monkeypatch.delenv("NANOSERVE_KERNELS", raising=False)
    if backend.use_triton("cpu"):
        pytest.skip("Triton's interpreter serves the CPU in this process")
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
        backend.decode_attention(q, k, v, tables, lens, 0.125)
        backend.prefill_attention(qp, kp, kp, cu, 4, 0.125)
        backend.paged_prefill_attention(qp, k, v, tables, cu, lens.clamp(min=4), 4, 0.125)
    assert calls == ["decode_attention_cpu", "prefill_attention_cpu",
                     "paged_prefill_attention_cpu", "paged_decode_attention_reference",
                     "prefill_attention_reference", "paged_prefill_attention_reference"]
