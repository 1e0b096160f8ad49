"""The fused MoE kernel (CPU): its PyTorch references against independent math
(transformers' routers, a per-token loop), the pair alignment's invariants, the tile-config
lookup; and the Triton kernels against the references under Triton's interpreter, in a
child pytest (as tests/test_kernels.py does: `TRITON_INTERPRET=1` must be set before Triton
is imported). To run those directly:
`TRITON_INTERPRET=1 NANOSERVE_TRITON_INTERPRET=1 pytest tests/test_fused_moe.py -k test_interp_`.
bfloat16 and FP8 tensor cores, and CUDA-graph capture: tests/test_fused_moe_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted, run_interpreted

from nanoserve.weights.fp8 import quantize_blockwise, quantize_per_channel
from nanoserve_kernels.fused_moe import fused_experts_reference, fused_moe_reference
from nanoserve_kernels.fused_moe_configs import default_config, get_config, shape_key
from nanoserve_kernels.moe_routing import align_pairs_reference, max_sorted_pairs, route_reference

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_case(m: int, d: int, inner: int, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g)
    logits = 2 * torch.randn(m, experts, generator=g)
    w13 = 0.1 * torch.randn(experts, 2 * inner, d, generator=g)
    w2 = 0.1 * torch.randn(experts, d, inner, generator=g)
    return x, logits, w13, w2


def fp8_experts(w: torch.Tensor, block: tuple[int, int] | None):
    """Stacked [E, N, K] -> e4m3 and scales ([E, N] per channel, or block grids)."""
    if block is None:
        qs = [quantize_per_channel(w[e]) for e in range(w.shape[0])]
        return torch.stack([q for q, _ in qs]), torch.stack([s[:, 0] for _, s in qs])
    qs = [quantize_blockwise(w[e], block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


# --- the references -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_unnormalised", "mixtral"])
def test_route_reference_equals_transformers_routers(family):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if family == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8,
                                                 num_experts_per_tok=2))
        top_k, renorm = 2, True
    else:
        renorm = family == "qwen3_moe"
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16,
                                                   num_experts_per_tok=4,
                                                   norm_topk_prob=renorm))
        top_k = 4
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, ids = router(x)
    ours_w, ours_ids = route_reference(logits, top_k, renorm)
    assert torch.equal(ours_ids.long(), ids)
    assert torch.allclose(ours_w, weights.float(), atol=1e-7, rtol=0)


def test_fused_experts_reference_equals_a_per_token_loop():
    x, logits, w13, w2 = make_case(9, 32, 16, 6)
    weights, ids = route_reference(logits, 3, True)
    want = torch.zeros_like(x)
    for t in range(9):
        for slot in range(3):
            e = int(ids[t, slot])
            gate, up = (w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, slot] * (w2[e] @ (F.silu(gate) * up))
    got = fused_experts_reference(x, weights, ids, w13, w2)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [None, (16, 16)])
def test_fp8_reference_is_close_to_the_float_experts(block):
    """FP8 experts (weights and activations rounded to e4m3) stay within e4m3's error of the
    float experts they stand for."""
    x, logits, w13, w2 = make_case(7, 32, 16, 4)
    q13, s13 = fp8_experts(w13, block)
    q2, s2 = fp8_experts(w2, block)
    want = fused_moe_reference(x, logits, w13, w2, 2, True)
    got = fused_moe_reference(x, logits, q13, q2, 2, True, w13_scale=s13, w2_scale=s2,
                              block=block)
    assert (got - want).norm() / want.norm() < 0.08


@pytest.mark.parametrize("m,k,experts,block_m", [(1, 8, 128, 16), (5, 2, 4, 4), (33, 3, 7, 8),
                                                 (64, 8, 16, 32)])
def test_align_pairs_invariants(m, k, experts, block_m):
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)])
    sorted_ids, tile_experts = align_pairs_reference(ids.int(), experts, block_m)
    pairs = m * k
    assert sorted_ids.numel() == max_sorted_pairs(pairs, experts, block_m)  # shape from sizes
    assert sorted_ids.numel() % block_m == 0
    assert tile_experts.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    flat = ids.reshape(-1)
    for tile, e in enumerate(tile_experts.tolist()):
        chunk = sorted_ids[tile * block_m:(tile + 1) * block_m]
        chunk = chunk[chunk < pairs]
        if e < 0:
            assert chunk.numel() == 0
        else:
            assert chunk.numel() and (flat[chunk] == e).all()
            assert chunk.tolist() == sorted(chunk.tolist())  # pairs in id order
    used = tile_experts[tile_experts >= 0]
    assert used.tolist() == sorted(used.tolist())  # expert runs in expert order
    assert set(used.tolist()) == set(flat.tolist())


def test_config_lookup(tmp_path):
    path = tmp_path / "configs.json"
    tuned = {"1": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
             "256": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8,
                     "num_stages": 3}}
    path.write_text(json.dumps({shape_key(128, 768, 2048, "bfloat16"): tuned}))
    assert get_config(100, 128, 768, 2048, "bfloat16", path=path)["BLOCK_M"] == 16
    assert get_config(4096, 128, 768, 2048, "bfloat16", path=path)["BLOCK_M"] == 64
    assert get_config(4096, 128, 768, 2048, "fp8", 128, path=path) == default_config(4096, 128)
    committed = json.loads((REPO_ROOT / "nanoserve_kernels/fused_moe_configs.json").read_text())
    for by_m in committed.values():
        for config in by_m.values():
            assert set(config) == set(default_config(1))


# --- the Triton kernels under the interpreter -----------------------------------------------


def test_fused_moe_kernels_under_the_triton_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    if interpreted():
        pytest.skip("already inside the interpreter run")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def interp():
    if not interpreted():
        pytest.skip("run by test_fused_moe_kernels_under_the_triton_interpreter")
    from nanoserve_kernels import fused_moe, moe_routing

    return fused_moe, moe_routing


SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("m,experts,k,renorm", [(1, 128, 8, True), (37, 16, 4, False),
                                                (3, 5, 1, True)])
def test_interp_route_matches_reference(interp, m, experts, k, renorm):
    _, moe_routing = interp
    logits = 3 * torch.randn(m, experts, generator=torch.Generator().manual_seed(m))
    w, ids = moe_routing.route(logits, k, renorm)
    want_w, want_ids = route_reference(logits, k, renorm)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, want_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("m,k,experts,block_m", [(1, 8, 128, 16), (37, 4, 16, 16),
                                                 (300, 2, 8, 64), (5, 1, 3, 16)])
def test_interp_align_pairs_matches_reference(interp, m, k, experts, block_m):
    """The one-program kernel gives the reference's tensors exactly (more pairs than one
    step of it holds: 600 > 64)."""
    _, moe_routing = interp
    g = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)]).int()
    got = moe_routing.align_pairs(ids, experts, block_m)
    want = align_pairs_reference(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("m,d,inner,experts,k", [(1, 64, 32, 8, 2), (13, 48, 40, 6, 3),
                                                 (24, 32, 32, 4, 4)])
def test_interp_fused_moe_matches_reference(interp, m, d, inner, experts, k):
    """float32; K and N not multiples of the tiles (48, 40), a token per tile and fuller
    tiles, top-1 to top-4."""
    fused_moe, _ = interp
    x, logits, w13, w2 = make_case(m, d, inner, experts, seed=m)
    got = fused_moe.fused_moe(x, logits, w13, w2, k, True, config=SMALL)
    want = fused_moe_reference(x, logits, w13, w2, k, True)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)


def test_interp_fused_moe_default_config(interp):
    fused_moe, _ = interp
    x, logits, w13, w2 = make_case(40, 64, 64, 8)
    got = fused_moe.fused_moe(x, logits, w13, w2, 2, False)
    assert torch.allclose(got, fused_moe_reference(x, logits, w13, w2, 2, False),
                          atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_interp_fused_moe_fp8_matches_reference(interp, block):
    """e4m3 experts, per channel or per 32 x 32 block, the activations quantized as the
    reference does (per token, or per token and 32 columns)."""
    fused_moe, _ = interp
    x, logits, w13, w2 = make_case(6, 64, 64, 4, seed=3)
    q13, s13 = fp8_experts(w13, block)
    q2, s2 = fp8_experts(w2, block)
    scales = dict(w13_scale=s13, w2_scale=s2, block=block)
    got = fused_moe.fused_moe(x, logits, q13, q2, 2, True, config=SMALL, **scales)
    want = fused_moe_reference(x, logits, q13, q2, 2, True, **scales)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_interp_backend_runs_the_kernel_in_the_moe_layer(interp):
    from nanoserve_kernels import backend

    assert backend.use_triton("cpu")
    x, logits, w13, w2 = make_case(5, 32, 16, 4)
    got = backend.fused_moe(x, logits, w13, w2, 2, True)
    assert torch.allclose(got, fused_moe_reference(x, logits, w13, w2, 2, True), atol=2e-6)
