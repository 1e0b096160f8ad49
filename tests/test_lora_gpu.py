"""LoRA on a CUDA device: the Triton shrink/expand against the PyTorch reference at an 8B
model's shapes in bfloat16 (decode and prefill token counts, eight rank-16 slots), the
kernels and their grouping captured in a CUDA graph and replayed over another mix of slots,
the engine's captured steps ("graph") against its uncaptured ones and PEFT's merged models,
and an FP8 checkpoint with bfloat16 adapters. Skipped without CUDA (CPU: tests/test_lora.py,
tests/test_lora_kernels.py).

Tolerances, kernel vs reference (same roundings, other summation orders): bfloat16 y within
2e-2 relative (a few ulps of y); float32 1e-4."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from nanoserve_kernels.lora import (  # noqa: E402
    lora_add,
    lora_add_reference,
    lora_groups,
    slices_tensor,
)

# An 8B model's q/k/v (hidden 4096, 32 query and 8 KV heads of 128) and down (14336 in).
QKV = ((0, 0, 4096), (4096, 4096, 1024), (5120, 5120, 1024))
DOWN = ((0, 0, 4096),)


def _case(n: int, k: int, slices, slots: int = 8, rank: int = 16, dtype=torch.bfloat16,
          seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = sum(w for _, _, w in slices)
    out = max(o + w for o, _, w in slices)
    x = torch.randn(n, k, generator=g, device="cuda").to(dtype)
    a = (0.02 * torch.randn(slots, len(slices) * rank, k, generator=g, device="cuda")).to(dtype)
    b = (0.02 * torch.randn(slots, width, rank, generator=g, device="cuda")).to(dtype)
    y = torch.randn(n, out, generator=g, device="cuda").to(dtype)
    index = torch.randint(-1, slots, (n,), generator=g, device="cuda")
    return y, x, a, b, index


@pytest.mark.parametrize("n", [1, 256, 2048])
@pytest.mark.parametrize("slices,k", [(QKV, 4096), (DOWN, 14336)])
def test_kernels_equal_the_reference_in_bfloat16(n, slices, k):
    y, x, a, b, index = _case(n, k, slices, seed=n)
    want, got = y.clone(), y.clone()
    lora_add_reference(want, x, a, b, slices, index)
    lora_add(got, x, a, b, slices, index)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[index < 0], y[index < 0])


def test_kernels_equal_the_reference_in_float32():
    y, x, a, b, index = _case(100, 1024, QKV[:2], dtype=torch.float32, seed=3)
    want, got = y.clone(), y.clone()
    lora_add_reference(want, x, a, b, QKV[:2], index)
    lora_add(got, x, a, b, QKV[:2], index)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_grouping_and_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed over another slot per token (written in place): the
    reference's values for the new mix (a captured step reads its rows' slots the same way)."""
    y, x, a, b, index = _case(64, 4096, QKV, seed=5)
    y0 = y.clone()
    slices = slices_tensor(QKV, "cuda")  # made once, outside the capture (as a projection's)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile the kernels outside the capture
        lora_add(y, x, a, b, QKV, index, lora_groups(index, 8), slices)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(y0)
        lora_add(y, x, a, b, QKV, index, lora_groups(index, 8), slices)
    for seed in (6, 7):
        index.copy_(torch.randint(-1, 8, (64,), device="cuda",
                                  generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        want = y0.clone()
        lora_add_reference(want, x, a, b, QKV, index)
        assert torch.allclose(y.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    from tests.test_lora import ADAPTERS, merged, save_peft_adapter

    pytest.importorskip("peft")
    from nanoserve.testing import save_tiny_byte_llama

    root = tmp_path_factory.mktemp("lora-gpu")
    base = save_tiny_byte_llama(root / "base")
    folders = {name: save_peft_adapter(base, root / name, *spec, seed=i + 1)
               for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, folders, {name: merged(base, f) for name, f in folders.items()}


def test_captured_steps_equal_uncaptured_and_peft(lora_models):
    """float32 on the GPU, adapters mixed over rows joining and leaving: the captured steps
    (graphs per bucket and prefill length) give the uncaptured steps' tokens, and PEFT's."""
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams
    from tests.hf_oracle import assert_greedy_near, hf_greedy

    base, folders, oracles = lora_models
    rng = random.Random(0)
    names = [None, "all7", "qvd_rs", "ou"] * 6
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(2, 60))] for _ in names]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for step in ("graph", "eager"):
        llm = LLM(str(base), dtype="float32", device="cuda", kv_cache_bytes=64 << 20,
                  max_batch_size=8, decode_step=step, lora=folders, max_loras=2)
        runs[step] = [c.token_ids for c in llm.generate(prompts, params, lora=names)]
    assert runs["graph"] == runs["eager"]
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        oracle = oracles[name] if name is not None else None
        if oracle is None:
            from transformers import LlamaForCausalLM

            oracle = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        want = [hf_greedy(oracle, prompts[i], 16) for i in rows]
        assert_greedy_near(oracle, [prompts[i] for i in rows],
                           [runs["graph"][i] for i in rows], want)


def test_fp8_checkpoint_with_bfloat16_adapters(lora_models, tmp_path):
    """FP8 GEMMs (sm_89+) with bfloat16 adapters added after them: the logits stay near
    PEFT's merge into the dequantized twin (float32, CPU)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    from nanoserve.llm import LLM
    from nanoserve.model.attention import AttentionMetadata
    from nanoserve.model.lora import LoraStep
    from nanoserve.testing import save_fp8_checkpoint
    from nanoserve.weights.fp8 import Fp8Linear
    from tests.test_lora import merged

    base, folders, _ = lora_models
    save_fp8_checkpoint(base, tmp_path / "fp8", "ct-channel-dynamic", tmp_path / "twin")
    llm = LLM(str(tmp_path / "fp8"), device="cuda", kv_cache_bytes=64 << 20,
              lora={"all7": folders["all7"]})
    assert llm.dtype == torch.bfloat16
    assert isinstance(llm.model.model.layers[0].self_attn.qkv, Fp8Linear)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    slot = llm.adapters.acquire("all7")
    step = LoraStep(torch.full((40,), slot, device="cuda"), llm.adapters.weights.num_slots)
    with torch.no_grad():
        ours = llm.model(ids.cuda(), torch.arange(40, device="cuda")[None], None,
                         AttentionMetadata.prefill(), lora=step)[0].cpu()
        want = merged(tmp_path / "twin", folders["all7"])(ids).logits[0]
    assert (ours - want).abs().max() < 0.1  # bf16 activations, e4m3 products
    from nanoserve.sampling.params import SamplingParams

    outs = llm.generate([ids[0].tolist()] * 2, SamplingParams(max_tokens=8, ignore_eos=True),
                        lora=["all7", None])
    assert [len(o.token_ids) for o in outs] == [8, 8]
