"""FP8 GEMMs on a GPU of compute capability 8.9+ (the H200): each checkpoint format, built
with `Fp8Linear` (`torch._scaled_mm`), held to what e4m3's rounding of the activations
allows (below), through the engine's `LLM.generate` (captured continuous step equal to the
eager one), the dequantized path of GPUs without FP8 (forced: equal to the twin), and
online quantization of a bf16 checkpoint layer by layer (peak memory far below bf16 + FP8
copies). Skipped elsewhere.

The tolerance comes from the format, not from a share picked by hand. Against its
dequantized twin an FP8 model differs by its weights (exactly the twin's, or one more e4m3
rounding for block-wise scales requantized per row: checked on their own) and by every
activation entering an FP8 projection, rounded to e4m3 (per token, or by the static input
scale). The rounding model: the float32 model with the FP8 model's own weights, each such
activation moved by an independent uniform draw within half an e4m3 step of its value
(`e4m3_spread`); its logits over `DRAWS` draws give each logit's spread sigma. (The model
fits: with this test's code run on the CPU, which runs the FP8-GEMM path too, the FP8
model's errors over 8 formats x 66,048 logits were at most 4.7 sigma, their mean square
0.87-0.98 of the predicted, in float32 and in bfloat16 alike.) Then:
- every logit within LAMBDA sigma of the model's float32 logit, plus twice the bfloat16
  noise of that model's logits (bfloat16 activations on the GPU);
- the mean square error within 1.5x the mean square that the spread and that noise
  predict: a systematic error shows here long before any single logit is out;
- greedy tokens equal wherever the float32 top token leads every other by more than both
  tolerances, and such clear positions are at least a quarter of all.

What these tests catch (GPU-only mutations in `tests/mutations.py`, skipped without a GPU):
- activations quantized with a static input scale 3% off the one their products are
  scaled back by (`nanoserve/weights/fp8.py`): the old bounds (logits within 12% of the largest,
  85% of greedy tokens equal) passed it; the largest logit error and the mean square here
  do not (measured on the CPU: a logit 10 sigma out, 4.9x the predicted mean square).
"""

from __future__ import annotations

import random

import pytest
import torch
from e4m3_rounding import (
    _PROJECTIONS,
    CLEAR_SHARE,
    LAMBDA,
    assert_within_rounding,
    e4m3_spread,
)

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import build_model
from nanoserve.testing import FP8_FORMATS, save_fp8_checkpoint, save_tiny_byte_llama
from nanoserve.weights.fp8 import (
    Fp8Linear,
    build_with_fp8,
    fp8_supported,
    quantize_per_channel,
    quantize_rows,
)
from nanoserve.weights.weights import load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and not fp8_supported("cuda"),
                       reason="needs FP8 compute (compute capability 8.9+)"),
]

def assert_weights_are_the_twins(model, twin_sd):
    """Each FP8 projection's dequantized weight is the twin's (per-tensor and per-channel
    scales), or within one e4m3 rounding of it (block-wise scales, requantized per row)."""
    for i, layer in enumerate(model.model.layers):
        for part, name, parts in _PROJECTIONS:
            m = getattr(getattr(layer, part), name)
            if not isinstance(m, Fp8Linear):
                continue
            twin = torch.cat([twin_sd[f"model.layers.{i}.{part}.{p}.weight"].float()
                              for p in parts]).to(m.weight.device)
            got = m.dequantized()
            step = twin.abs() / 16 + m.weight_scale.reshape(-1, 1) * 2.0**-9
            assert torch.equal(got, twin) or bool(((got - twin).abs() <= step).all()), (i, name)


def sharp_byte_llama(folder):
    """The tiny byte-level Llama (hidden 64, intermediate 128, vocab 258) with its LM head
    scaled by 8: random weights give near-flat logits, and greedy tokens only mean something
    where the top-2 margin exceeds the quantization noise."""
    from safetensors.torch import load_file, save_file

    save_tiny_byte_llama(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return sharp_byte_llama(tmp_path_factory.mktemp("sharp") / "float")


@pytest.fixture(scope="module", params=FP8_FORMATS)
def fp8_dirs(request, float_dir):
    root = float_dir.parent / request.param
    fp8 = save_fp8_checkpoint(float_dir, root / "fp8", request.param, root / "twin",
                              ignore=("lm_head", "model.layers.0.mlp.down_proj"))
    return fp8, root / "twin"


def _logits(model, ids):
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, pos, None, AttentionMetadata.prefill())


def test_fp8_linear_on_the_gpu_equals_its_reference_math():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 512, device="cuda", generator=g)
    q, s = quantize_per_channel(w)
    lin = Fp8Linear(q, s.reshape(-1))
    for m in (1, 7, 64, 300):  # decode sizes and a prefill, row counts not multiples of 16
        x = torch.randn(m, 512, device="cuda", generator=g, dtype=torch.bfloat16)
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 256)
        xq, xs = quantize_rows(x)
        ref = (xq.float() * xs) @ (q.float() * s).t()
        # bf16 output: one rounding of values up to |ref|.max() (2^-8 relative)
        torch.testing.assert_close(y.float(), ref, rtol=1e-2,
                                   atol=float(ref.abs().max()) * 2 ** -7)


def test_fp8_linear_keeps_its_scales_for_the_kernel_after_it():
    """With keep_scales the projection returns its raw output and scales (`ScaledRows`); the
    scales applied by `scale_rows` (kernel and reference alike) give its plain output's bits."""
    from nanoserve.model.model import ScaledRows
    from nanoserve_kernels.scaled_rows import scale_rows, scale_rows_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    q, s = quantize_per_channel(torch.randn(4096, 14336, device="cuda", generator=g))
    lin = Fp8Linear(q, s.reshape(-1))
    for m in (1, 7, 256):
        x = torch.randn(2, m, 14336, device="cuda", generator=g, dtype=torch.bfloat16)
        out = lin(x, keep_scales=True)
        assert isinstance(out, ScaledRows) and out.shape == (2, m, 4096)
        y = lin(x)
        scaled = scale_rows(out.raw, out.row_scale, out.col_scale, x.dtype)
        assert torch.equal(scaled.view(y.shape), y)
        assert torch.equal(scale_rows_reference(out.raw, out.row_scale, out.col_scale,
                                                x.dtype).view(y.shape), y)
    half = Fp8Linear(q, s.reshape(-1))  # float16: raw sums overflow it, so scaled here
    y16 = half(torch.randn(3, 14336, device="cuda", generator=g, dtype=torch.float16),
               keep_scales=True)
    assert isinstance(y16, torch.Tensor) and y16.dtype == torch.float16


@pytest.mark.parametrize("ub", [None, 0.5])
def test_quantize_rows_kernel_equals_its_reference(ub):
    from nanoserve_kernels.fp8_quant import quantize_rows as kernel
    from nanoserve_kernels.fp8_quant import quantize_rows_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in ((1, 64), (7, 4096), (256, 14336), (3, 28672)):
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        x = x * torch.logspace(-3, 2, m, device="cuda", dtype=torch.bfloat16)[:, None]
        q, s = kernel(x, ub)
        rq, rs = quantize_rows_reference(x, ub)
        # the kernel's amax / 448 may round one float32 ulp off the reference's: a scale
        # within 2 ulps, codes equal almost everywhere and never more than one e4m3 step off
        torch.testing.assert_close(s, rs, rtol=2.5e-7, atol=0)
        same = (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
        assert same >= 0.995, same  # measured 0.9987
        diff = (q.float() * s - rq.float() * rs).abs()  # one e4m3 step: relative, or subnormal
        bound = 0.125 * torch.maximum(q.float().abs() * s, rq.float().abs() * rs) + 2 ** -9 * s
        assert bool((diff <= bound * 1.001).all())


def test_fp8_gemm_model_close_to_its_bf16_twin(fp8_dirs):
    fp8, twin = fp8_dirs
    config, sd = load_checkpoint(fp8)
    model = build_with_fp8(config, sd, torch.bfloat16, "cuda")
    layer = model.model.layers[1]
    assert all(isinstance(m, Fp8Linear) for m in (layer.self_attn.qkv, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up, layer.mlp.down_proj))
    assert model.lm_head.weight.dtype == torch.bfloat16
    tconfig, tsd = load_checkpoint(twin)
    assert_weights_are_the_twins(model, tsd)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    center, sigma, noise_max, noise_rms = e4m3_spread(model, tconfig, tsd,
                                                      lambda m: _logits(m, ids))
    with torch.no_grad():
        ours = _logits(model, ids)
    assert_within_rounding(ours, center, sigma, noise_max, noise_rms)


@pytest.mark.parametrize("ub", [None, 0.5])
def test_fused_fp8_outputs_equal_the_unfused_kernels(ub):
    """RMSNorm (with and without the residual add) and silu-and-mul quantizing their own
    output give the codes and scales of the plain kernel followed by `quantize_rows`, bit
    for bit, at the 8B shape's sides (hidden 4096, intermediate 14336) and batch sizes."""
    from nanoserve_kernels.activation import silu_and_mul, silu_and_mul_fp8
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8

    def same(a, b):
        return all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))

    g = torch.Generator(device="cuda").manual_seed(3)
    for m in (1, 7, 256):
        x, r = (torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16) * 4
                for _ in range(2))
        w = torch.randn(4096, generator=g, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(m, 2 * 14336, generator=g, device="cuda", dtype=torch.bfloat16) * 3
        assert same(rms_norm_fp8(x, w, 1e-5, ub), quantize_rows(rms_norm(x, w, 1e-5), ub))
        h, y = add_rms_norm(x, r, w, 1e-5)
        assert same(add_rms_norm_fp8(x, r, w, 1e-5, ub), (h, *quantize_rows(y, ub)))
        for form in ("split", "row"):  # both forms of silu-and-mul's (nanoserve_kernels/activation.py)
            assert same(silu_and_mul_fp8(gu, ub, form=form), quantize_rows(silu_and_mul(gu), ub))
    wide = torch.randn(3, 2 * 28672, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    for form in ("split", "row"):  # the 70B side: "row" in two passes
        assert same(silu_and_mul_fp8(wide, ub, form=form), quantize_rows(silu_and_mul(wide), ub))


@pytest.mark.parametrize("ub", [None, 0.5])
def test_kernels_applying_fp8_scales_equal_scale_rows_first(ub):
    """The residual adds (plain and quantizing) and silu-and-mul's FP8 form, given an FP8
    projection's raw output and scales, equal `scale_rows` then the kernel, bit for bit; and
    `scale_rows` equals its reference: at the 8B and 70B sides and decode and prefill rows."""
    from nanoserve_kernels.activation import silu_and_mul_fp8
    from nanoserve_kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8
    from nanoserve_kernels.scaled_rows import scale_rows, scale_rows_reference

    def same(a, b):
        return all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))

    def case(m, n):
        raw = torch.randn(m, n, generator=g, device="cuda").mul(300).to(torch.bfloat16)
        return raw, (torch.rand(m, 1, generator=g, device="cuda") / 100 + 1e-3,
                     torch.rand(1, n, generator=g, device="cuda") / 100 + 1e-3)

    g = torch.Generator(device="cuda").manual_seed(4)
    for m in (1, 7, 256, 700):
        raw, scales = case(m, 4096)
        y = scale_rows(raw, *scales, torch.bfloat16)
        assert torch.equal(y, scale_rows_reference(raw, *scales, torch.bfloat16))
        r = torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, generator=g, device="cuda", dtype=torch.bfloat16)
        assert same(add_rms_norm(raw, r, w, 1e-5, scales), add_rms_norm(y, r, w, 1e-5))
        assert same(add_rms_norm_fp8(raw, r, w, 1e-5, ub, scales),
                    add_rms_norm_fp8(y, r, w, 1e-5, ub))
        for inner in (14336, 28672):
            gu, gu_scales = case(m if m < 700 else 3, 2 * inner)
            assert same(silu_and_mul_fp8(gu, ub, gu_scales),
                        silu_and_mul_fp8(scale_rows(gu, *gu_scales, torch.bfloat16), ub))


def test_fp8_model_with_fused_quantization_equals_it_unfused(fp8_dirs, monkeypatch):
    """The model whose norms and activations quantize for their FP8 projections gives the
    logits of the same model quantizing inside each projection, bit for bit; and so does
    the model whose projections scale their own outputs (no `ScaledRows`)."""
    fp8, _ = fp8_dirs
    config, sd = load_checkpoint(fp8)
    model = build_with_fp8(config, sd, torch.bfloat16, "cuda")
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2)).cuda()
    fused = _logits(model, ids)
    touched = 0
    for layer in model.model.layers:
        touched += sum(f is not None for f in (layer.input_layernorm.fp8_out,
                                               layer.post_attention_layernorm.fp8_out,
                                               layer.mlp.fp8_act))
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = None
        layer.mlp.fp8_act = None
    assert touched or config.quantization.static_input
    assert torch.equal(fused, _logits(model, ids))
    monkeypatch.setattr(Fp8Linear, "keeps_scales", False)
    assert torch.equal(fused, _logits(model, ids))


def test_without_fp8_compute_the_gpu_runs_the_dequantized_twin(fp8_dirs, monkeypatch):
    """The path of GPUs before sm_89 (forced here): weights dequantized at load, bf16 logits
    equal to the twin's exactly."""
    from nanoserve.weights import fp8 as fp8_module
    monkeypatch.setattr(fp8_module, "fp8_supported", lambda device: False)
    fp8, twin = fp8_dirs
    config, sd = load_checkpoint(fp8)
    model = build_with_fp8(config, sd, torch.bfloat16, "cuda")
    assert not isinstance(model.model.layers[1].self_attn.qkv, Fp8Linear)
    tconfig, tsd = load_checkpoint(twin)
    reference = build_model(tconfig, tsd, torch.bfloat16, "cuda")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2)).cuda()
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def _prompts(n=24):
    rng = random.Random(0)
    return [[rng.randrange(0, 256) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "fp8-block"])
def test_llm_generate_over_fp8_checkpoints(float_dir, fmt):
    """The engine's captured continuous step equals its eager step token for token, and its
    first tokens (teacher-forced by the prompt) are the rounding model's greedy tokens
    wherever the tolerances decide them."""
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    root = float_dir.parent / f"llm-{fmt}"
    fp8 = save_fp8_checkpoint(float_dir, root / "fp8", fmt, root / "twin")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = _prompts()
    graph = LLM(str(fp8), kv_cache_bytes=64 << 20)
    assert graph.runner.capture_summary()["step_mode"] == "graph"
    assert isinstance(graph.model.model.layers[0].self_attn.qkv, Fp8Linear)
    got = [c.token_ids for c in graph.generate(prompts, params)]
    eager = LLM(str(fp8), kv_cache_bytes=64 << 20, decode_step="eager")
    assert got == [c.token_ids for c in eager.generate(prompts, params)]
    tconfig, tsd = load_checkpoint(root / "twin")

    def last_logits(model):  # each prompt's logits at its last position: its first token
        rows = [_logits(model, torch.tensor([p], device="cuda"))[0, -1] for p in prompts]
        return torch.stack(rows)

    center, sigma, noise_max, _ = e4m3_spread(graph.model, tconfig, tsd, last_logits)
    top = center.argmax(-1, keepdim=True)
    tol = LAMBDA * sigma + 2 * noise_max
    clear = ((center.gather(-1, top) - center > tol.gather(-1, top) + tol).sum(-1)
             == center.shape[-1] - 1)
    assert clear.float().mean().item() >= CLEAR_SHARE, clear.float().mean().item()
    first = torch.tensor([g[0] for g in got], device="cuda")
    assert torch.equal(first[clear], top[..., 0][clear])


def test_online_fp8_quantizes_layer_by_layer(tmp_path):
    """A bf16 checkpoint of 8 layers (hidden 1024, intermediate 4096: 256 MiB of bf16
    projections) quantized at load: the GPU never holds more than the FP8 model, the bf16
    embeddings and head, and the temporaries of one matrix."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=512, tie_word_embeddings=False)
    HFLlama(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    config, sd = load_checkpoint(tmp_path)
    sd["lm_head.weight"] = sd["lm_head.weight"] * 8  # sharper logits (see sharp_byte_llama)
    ids = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(1)).cuda()
    proj_bytes = sum(t.numel() for n, t in sd.items() if n.endswith("proj.weight"))  # as FP8
    other_bytes = sum(t.numel() * 2 for n, t in sd.items() if not n.endswith("proj.weight"))
    largest = max(t.numel() * 2 for n, t in sd.items() if n.endswith("proj.weight"))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_with_fp8(config, dict(sd), torch.bfloat16, "cuda", quantization="fp8")
    peak = torch.cuda.max_memory_allocated() - base
    # a bf16 matrix, its float32 copy and quotient, its FP8 result: < 8 bf16 matrices
    assert peak <= proj_bytes + other_bytes + 8 * largest, (peak, proj_bytes, other_bytes)
    assert peak < proj_bytes * 2 + other_bytes  # far below bf16 + FP8 copies (3x proj_bytes)
    assert all(isinstance(layer.mlp.gate_up, Fp8Linear) for layer in model.model.layers)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    # the rounding model of this FP8 model over the same bf16 checkpoint. 8 random layers:
    # the spread grows with depth past this model's top-2 margins (on the CPU none was
    # clear), so the logits and their mean square carry the check, not the greedy tokens
    with torch.no_grad():
        ours = _logits(model, ids)
    center, sigma, noise_max, noise_rms = e4m3_spread(model, config, sd,
                                                      lambda m: _logits(m, ids))
    assert_within_rounding(ours, center, sigma, noise_max, noise_rms, clear_share=0.0)


def test_dummy_fp8_engine_generates(float_dir):
    """`LLM(load_format="dummy", quantization="fp8")`, the benchmark's engine: random FP8
    projections drawn on the GPU, every row to its max_tokens through captured steps."""
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    llm = LLM(str(float_dir), load_format="dummy", quantization="fp8", kv_cache_bytes=64 << 20)
    assert isinstance(llm.model.model.layers[1].mlp.gate_up, Fp8Linear)
    outs = llm.generate(_prompts(8), SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12] * 8
