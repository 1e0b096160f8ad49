"""The fused MoE kernel on a CUDA device: against its reference in bfloat16 (relative error
of the whole output < 1e-2) and float32 (atol/rtol 1e-4), FP8 experts per channel and per 128 x 128 block on FP8 tensor cores,
captured in a CUDA graph and replayed on new inputs; tiny Qwen3-MoE and Mixtral models
through the kernels against transformers (CPU); FP8 models (online and block-wise) within
e4m3's rounding (tests/e4m3_rounding.py). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from test_fused_moe import fp8_experts, make_case  # noqa: E402

from nanoserve_kernels.fused_moe import fused_moe, fused_moe_reference  # noqa: E402
from nanoserve_kernels.moe_routing import route, route_reference  # noqa: E402

DEV = "cuda"


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _case(m, d, inner, experts, dtype, seed=0):
    """x, w13, w2 in dtype; the router logits in float32 (bfloat16 logits tie often, and
    the kernel and torch.topk may then pick different ones of equal experts)."""
    x, logits, w13, w2 = make_case(m, d, inner, experts, seed)
    return x.to(DEV, dtype), logits.to(DEV), w13.to(DEV, dtype), w2.to(DEV, dtype)


@pytest.mark.parametrize("m", [1, 7, 256, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_matches_reference_qwen3_30b_like(m, dtype):
    """128 experts, top 8 (Qwen3-30B-A3B's routing) at a narrower width."""
    x, logits, w13, w2 = _case(m, 512, 256, 128, dtype, seed=m)
    got = fused_moe(x, logits, w13, w2, 8, True)
    want = fused_moe_reference(x, logits, w13, w2, 8, True)
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    else:  # each side rounds to bfloat16 at the same steps, from differently ordered sums
        assert _relative_error(got, want) < 1e-2


def test_route_matches_reference_on_the_gpu():
    logits = 3 * torch.randn(1000, 128, device=DEV)
    w, ids = route(logits, 8, True)
    want_w, want_ids = route_reference(logits, 8, True)
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w, atol=1e-6)


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [3, 300])
def test_fused_moe_fp8_matches_reference(block, m):
    x, logits, w13, w2 = _case(m, 512, 256, 16, torch.bfloat16, seed=1)
    q13, s13 = fp8_experts(w13.float(), block)
    q2, s2 = fp8_experts(w2.float(), block)
    scales = dict(w13_scale=s13, w2_scale=s2, block=block)
    got = fused_moe(x, logits, q13, q2, 4, True, **scales)
    want = fused_moe_reference(x, logits, q13, q2, 4, True, **scales)
    # a bfloat16 value one unit off on either side may round to another e4m3 value
    assert _relative_error(got, want) < 3e-2


def test_quantize_groups_matches_reference_bit_for_bit():
    from nanoserve_kernels.fused_moe import quantize_groups, quantize_groups_reference

    x = 3 * torch.randn(300, 2048, device=DEV, dtype=torch.bfloat16)
    x[2, 128:256] = 0  # an all-zero group
    q, s = quantize_groups(x, 128)
    want_q, want_s = quantize_groups_reference(x, 128)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def test_fused_moe_is_captured_in_a_cuda_graph():
    """Fixed shapes, no host sync: captured once, replayed on new tokens, equal to eager."""
    x, logits, w13, w2 = _case(64, 256, 128, 32, torch.bfloat16)
    fused_moe(x, logits, w13, w2, 8, True)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = fused_moe(x, logits, w13, w2, 8, True)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        nx, nl, _, _ = _case(64, 256, 128, 32, torch.bfloat16, seed=seed)
        x.copy_(nx)
        logits.copy_(nl)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(x, logits, w13, w2, 8, True))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_family_greedy_on_the_gpu_equals_transformers(tmp_path, family):
    """float32 through the kernels (static batch, continuous batching with its CUDA graphs)."""
    from hf_oracle import assert_greedy_near, hf_greedy
    from test_moe_families import CASES, save_moe

    from nanoserve.model.model import build_model
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.scheduler import generate_continuous
    from nanoserve.static.generate import greedy_generate_batch, pool_for
    from nanoserve.weights.weights import load_checkpoint

    _, options, _ = next(c for c in CASES if c[0] == family)
    hf = save_moe(tmp_path, family, options, "per-expert")
    config, sd = load_checkpoint(tmp_path)
    model = build_model(config, sd, torch.float32, DEV)
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (1, 6, 15, 33)]
    new = 24
    want = [hf_greedy(hf, p, new) for p in prompts]
    pool = pool_for(model, prompts, new, 16)
    assert_greedy_near(hf, prompts, greedy_generate_batch(model, prompts, new, (), pool), want)
    params = [SamplingParams(max_tokens=new, temperature=0.0)] * len(prompts)
    for mode in ("eager", "graph"):  # "graph": decode steps and prefills as CUDA graphs
        outs, _ = generate_continuous(model, prompts, params, (), pool, max_batch_size=3,
                                      step_mode=mode)
        assert_greedy_near(hf, prompts, [o.token_ids for o in outs], want)


@pytest.mark.parametrize("form", ["online", "block"])
def test_fp8_moe_is_within_e4m3_rounding_on_the_gpu(tmp_path, form):
    """FP8 experts through the Triton kernels: logits within the rounding model of the
    float twin (tests/e4m3_rounding.py; on the CPU the same check holds the reference)."""
    from e4m3_rounding import check_fp8_moe

    check_fp8_moe(tmp_path, form, DEV)


def test_online_fp8_moe_generates_in_cuda_graphs(tmp_path):
    """quantization="fp8" on a tiny Qwen3-MoE: a continuous batch (its CUDA graphs)
    generates every row."""
    from test_moe_families import CASES, save_moe

    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.scheduler import generate_continuous
    from nanoserve.static.generate import pool_for
    from nanoserve.weights.fp8 import build_with_fp8
    from nanoserve.weights.weights import load_checkpoint

    save_moe(tmp_path, "qwen3_moe", CASES[0][1], "per-expert")
    fp8 = build_with_fp8(*load_checkpoint(tmp_path), torch.bfloat16, DEV, quantization="fp8")
    prompts = [[5, 6, 7], list(range(3, 40))]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
    outs, _ = generate_continuous(fp8, prompts, params, (), pool_for(fp8, prompts, 12, 16),
                                  max_batch_size=2, step_mode="graph")
    assert [len(o.token_ids) for o in outs] == [12, 12]
