"""The LoRA kernels (CPU): the PyTorch reference against a per-token loop written from the
formula (y[n] += B_s (A_s x[n]) per part, slot -1 untouched), the grouping's invariants, and
the Triton shrink/expand against the reference under Triton's interpreter, in a child pytest
(as tests/test_fused_moe.py does: `TRITON_INTERPRET=1` must be set before Triton is
imported). To run those directly:
`TRITON_INTERPRET=1 NANOSERVE_TRITON_INTERPRET=1 pytest tests/test_lora_kernels.py -k test_interp_`.
bfloat16 on tensor cores and CUDA-graph capture: tests/test_lora_gpu.py; compiled for
Hopper: tests/test_kernels_compile.py."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpreted, run_interpreted

from nanoserve_kernels.lora import lora_add_reference, lora_groups

# A fused q/k/v with only q and v targeted: its parts' columns of y, rows of b, widths.
QV = ((0, 0, 48), (80, 48, 16))


def make_case(n: int, k: int, slots: int, rank: int, slices, out: int, seed: int = 0,
              dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = sum(w for _, _, w in slices)
    x = torch.randn(n, k, generator=g).to(dtype)
    a = (0.3 * torch.randn(slots, len(slices) * rank, k, generator=g)).to(dtype)
    b = (0.3 * torch.randn(slots, width, rank, generator=g)).to(dtype)
    y = torch.randn(n, out, generator=g).to(dtype)
    index = torch.randint(-1, slots, (n,), generator=g)
    return y, x, a, b, index


def per_token(y, x, a, b, slices, index):
    """The formula, one token at a time in float64."""
    out = y.double().clone()
    r = a.shape[1] // len(slices)
    for n, s in enumerate(index.tolist()):
        if s < 0:
            continue
        for j, (y_off, b_off, w) in enumerate(slices):
            t = a[s, j * r:(j + 1) * r].double() @ x[n].double()  # [r]
            out[n, y_off:y_off + w] += b[s, b_off:b_off + w].double() @ t
    return out


@pytest.mark.parametrize("n,slots,rank,slices,out", [
    (1, 1, 4, ((0, 0, 32),), 32), (9, 3, 8, QV, 96), (40, 4, 5, ((0, 0, 20), (20, 20, 20)), 40)])
def test_reference_equals_the_formula_per_token(n, slots, rank, slices, out):
    y, x, a, b, index = make_case(n, 24, slots, rank, slices, out, seed=n)
    index[-1] = slots - 1  # at least one token with an adapter,
    if n > 1:
        index[0] = -1  # and one without
    got = y.clone()
    lora_add_reference(got, x, a, b, slices, index)
    want = per_token(y, x, a, b, slices, index)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[index < 0], y[index < 0])  # no adapter: y untouched, bit for bit
    assert not torch.equal(got[index >= 0], y[index >= 0])


def test_reference_writes_a_strided_view_in_place():
    """y a column view of a wider output (a fused projection's): only its columns change."""
    y, x, a, b, index = make_case(6, 16, 2, 4, QV, 96)
    full = torch.randn(6, 200)
    before = full.clone()
    view = full[:, 50:146]
    view.copy_(y)
    before[:, 50:146] = y
    lora_add_reference(view, x, a, b, QV, index)
    want = per_token(y, x, a, b, QV, index)
    assert torch.allclose(full[:, 50:146].double(), want, atol=1e-5)
    assert torch.equal(full[:, :50], before[:, :50]) and torch.equal(full[:, 146:], before[:, 146:])


def test_bad_shapes_are_refused():
    y, x, a, b, index = make_case(4, 16, 2, 4, QV, 96)
    with pytest.raises(ValueError, match="do not agree"):
        lora_add_reference(y, x[:, :8], a, b, QV, index)
    with pytest.raises(ValueError, match="outside"):
        lora_add_reference(y[:, :60], x, a, b, QV, index)


def test_groups_sort_tokens_by_slot_stably():
    index = torch.tensor([2, -1, 0, 2, 2, -1, 0, 3])
    order, starts = lora_groups(index, 4)
    assert starts.tolist() == [2, 4, 4, 7, 8]  # slot -1's 2 tokens first; slot 1 empty
    assert order.tolist() == [1, 5, 2, 6, 0, 3, 4, 7]
    order, starts = lora_groups(torch.full((5,), -1), 3)
    assert starts.tolist() == [5, 5, 5, 5]


# --- the Triton kernels under the interpreter -----------------------------------------------


def test_lora_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    if interpreted():
        pytest.skip("already inside the interpreter run")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def interp():
    if not interpreted():
        pytest.skip("run by test_lora_kernels_under_the_triton_interpreter")
    from nanoserve_kernels import lora

    return lora


@pytest.mark.parametrize("n,k,slots,rank,slices,out", [
    (1, 64, 1, 16, ((0, 0, 64),), 64),               # one decode row, one part
    (17, 40, 3, 8, QV, 96),                          # parts with a gap between them (k not)
    (37, 72, 4, 20, ((0, 0, 70), (70, 70, 70)), 140),  # rank not a power of two, tiles partial
    (5, 16, 2, 4, ((0, 0, 24), (24, 24, 8), (32, 32, 8)), 40)])  # q/k/v of a small model
def test_interp_lora_add_matches_reference(interp, n, k, slots, rank, slices, out):
    y, x, a, b, index = make_case(n, k, slots, rank, slices, out, seed=n)
    want = y.clone()
    lora_add_reference(want, x, a, b, slices, index)
    got = y.clone()
    interp.lora_add(got, x, a, b, slices, index)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[index < 0], y[index < 0])


def test_interp_lora_add_every_token_one_slot_or_none(interp):
    y, x, a, b, _ = make_case(20, 32, 3, 8, QV, 96)
    for index in (torch.full((20,), 2), torch.full((20,), -1)):
        want, got = y.clone(), y.clone()
        lora_add_reference(want, x, a, b, QV, index)
        interp.lora_add(got, x, a, b, QV, index)
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)


def test_interp_lora_add_bfloat16_and_a_strided_output(interp):
    """bfloat16 operands (t rounded to bf16 before the expand in both forms; y rounded once),
    y a column view of a wider output. The interpreter rounds float32 to bfloat16 toward
    zero (a GPU and torch: to nearest), so t may differ by an ulp: a few of y's ulps."""
    y, x, a, b, index = make_case(11, 48, 2, 16, QV, 96, dtype=torch.bfloat16)
    want = y.clone()
    lora_add_reference(want, x, a, b, QV, index)
    full = torch.zeros(11, 130, dtype=torch.bfloat16)
    full[:, 20:116] = y
    interp.lora_add(full[:, 20:116], x, a, b, QV, index)
    got = full[:, 20:116]
    assert torch.allclose(got.float(), want.float(), atol=0.07, rtol=0.02)  # an ulp at ~8: 0.06
    assert not full[:, :20].any() and not full[:, 116:].any()


def test_interp_backend_runs_the_kernels_in_a_projection(interp):
    """`LoraProjection.add` (nanoserve/model/lora.py) through the backend's switch: the
    kernels here, the reference's values."""
    from nanoserve.model.lora import LoraProjection, LoraStep
    from nanoserve_kernels import backend

    assert backend.use_triton("cpu")
    shapes = {"q_proj": (48, 32), "v_proj": (16, 32)}
    proj = LoraProjection(("q_proj", "v_proj"), {"q_proj": 0, "v_proj": 80}, shapes, 4, 3,
                          torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    proj.load(1, {"q_proj": (torch.randn(3, 32, generator=g), torch.randn(48, 3, generator=g)),
                  "v_proj": (torch.randn(2, 32, generator=g), torch.randn(16, 2, generator=g))})
    x = torch.randn(2, 3, 32, generator=g)
    y = torch.randn(2, 3, 96, generator=g)
    step = LoraStep(torch.tensor([1, -1, 1, 1, 0, -1]), 3)
    assert step.groups is not None
    got = y.clone()
    proj.add(got, x, step)
    want = y.clone().view(6, 96)
    lora_add_reference(want, x.view(6, 32), proj.a, proj.b, proj.slices, step.index)
    assert torch.allclose(got.view(6, 96), want, atol=2e-6)
