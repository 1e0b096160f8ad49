"""The CPU's paged decode read (`paged_decode_attention_cpu`, what the engine runs on the
CPU) against the reference it rearranges: random pools, block tables, context lengths,
GQA groups, windows and dtypes; and which one `kernels.backend.decode_attention` picks."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import backend
from kernels.paged_attention import paged_decode_attention_cpu, paged_decode_attention_reference

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
        got = paged_decode_attention_cpu(q, k, v, tables, lens, scale, window=window)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                   msg=f"trial {trial}: lens {lens.tolist()}, window {window}")


def test_cpu_read_checks_like_the_reference():
    q, k, v, tables, lens = case(random.Random(1), torch.float32, 3, 2, 2, 4)
    assert paged_decode_attention_cpu(q[:0], k, v, tables[:0], lens[:0], 1.0).shape == (0, 4, 16)
    for bad_lens, message in ((torch.tensor([0, 1, 1], dtype=torch.int32), "context_lens >= 1"),
                              (torch.tensor([1, 1, 999], dtype=torch.int32), "blocks")):
        for fn in (paged_decode_attention_cpu, paged_decode_attention_reference):
            with pytest.raises(ValueError, match=message):
                fn(q, k, v, tables, bad_lens, 1.0)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_cpu(q, k, v, tables, lens, 1.0, window=0)


def test_backend_runs_the_cpu_read_on_the_cpu(monkeypatch):
    """The engine's dispatcher on the CPU: the CPU read, or the reference itself when
    NANOSERVE_KERNELS=reference (side-by-side checks of the two paths)."""
    q, k, v, tables, lens = case(random.Random(2), torch.float32, 4, 3, 3, 16)
    calls = []
    for name in ("paged_decode_attention_cpu", "paged_decode_attention_reference"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    monkeypatch.delenv("NANOSERVE_KERNELS", raising=False)
    if backend.use_triton("cpu"):
        pytest.skip("Triton's interpreter serves the CPU in this process")
    backend.decode_attention(q, k, v, tables, lens, 0.125)
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    backend.decode_attention(q, k, v, tables, lens, 0.125)
    assert calls == ["paged_decode_attention_cpu", "paged_decode_attention_reference"]
