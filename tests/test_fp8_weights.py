"""FP8 weights on the CPU: each checkpoint format (written by `save_fp8_checkpoint` with its
exact tensor names, dtypes, shapes and config keys) loads, dequantized, to exactly its
dequantized float32 twin, and within float tolerance of transformers on that twin; unknown
configs are refused in one line. The FP8 GEMM path (`Fp8Linear`, `torch._scaled_mm`, which
torch runs on the CPU too) is held to the dequantized matmul, and the whole FP8-GEMM model
(the GPU path, forced here) to the twin within the activation-quantization tolerance."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM as HFLlama

from nanoserve.errors import ModelError
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import build_model
from nanoserve.model.quantization import read_scheme
from nanoserve.testing import FP8_FORMATS, save_fp8_checkpoint
from nanoserve.weights import fp8
from nanoserve.weights.fp8 import Fp8Linear, build_with_fp8
from nanoserve.weights.weights import load_checkpoint, validate_checkpoint

IGNORED = ("lm_head", "model.layers.0.mlp.down_proj")  # kept bf16 in every FP8 checkpoint


@pytest.fixture(scope="module", params=FP8_FORMATS)
def fp8_dirs(request, tiny_model_dir, tmp_path_factory):
    """(FP8 checkpoint, its dequantized twin) of the tiny Llama (hidden 96, intermediate
    160: no side a multiple of 128, so every block-wise edge block is partial)."""
    root = tmp_path_factory.mktemp(request.param)
    save_fp8_checkpoint(tiny_model_dir, root / "fp8", request.param, root / "twin",
                        ignore=IGNORED)
    return request.param, root / "fp8", root / "twin"


def _logits(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return model(ids, pos, None, AttentionMetadata.prefill())


IDS = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_files_have_the_format_s_names_dtypes_and_shapes(fp8_dirs):
    fmt, path, _ = fp8_dirs
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        q = f.get_slice("model.layers.1.mlp.gate_proj.weight")
        assert q.get_dtype() == "F8_E4M3" and q.get_shape() == [160, 96]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "BF16"
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
        scale_name = "weight_scale_inv" if fmt.startswith("fp8-block") else "weight_scale"
        scale = f.get_slice(f"model.layers.1.mlp.gate_proj.{scale_name}").get_shape()
    want = {"ct-tensor-static": [1], "ct-tensor-scalar": [], "ct-channel-dynamic": [160, 1],
            "ct-block": [2, 1], "fbgemm": [160, 1], "fp8-block": [2, 1],
            "fp8-block-small": [5, 2], "fp8-tensor-static": []}[fmt]
    assert scale == want
    assert ("model.layers.1.mlp.gate_proj.input_scale" in names) == fmt.endswith("static")
    assert "model.layers.0.mlp.down_proj.weight_scale" not in names
    assert read_scheme(qc) is not None


def test_dequantized_load_equals_the_twin_exactly(fp8_dirs):
    _, path, twin = fp8_dirs
    config, sd = load_checkpoint(path)
    assert config.quantization is not None
    model = build_with_fp8(config, sd)  # CPU: dequantized at load
    assert all(p.dtype == torch.float32 for p in model.state_dict().values())
    tconfig, tsd = load_checkpoint(twin)
    reference = build_model(tconfig, tsd)
    for name, t in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert torch.equal(_logits(model, IDS), _logits(reference, IDS))


def test_dequantized_load_matches_transformers_on_the_twin(fp8_dirs):
    _, path, twin = fp8_dirs
    config, sd = load_checkpoint(path)
    ours = _logits(build_with_fp8(config, sd), IDS)
    with torch.no_grad():
        ref = HFLlama.from_pretrained(twin, dtype=torch.float32).eval()(IDS).logits.float()
    assert (ours - ref).abs().max().item() <= 1e-4  # float32, the bound test_model uses


def test_validate_checkpoint_accepts_fp8_files(fp8_dirs):
    _, path, _ = fp8_dirs
    assert validate_checkpoint(path).quantization == load_checkpoint(path)[0].quantization


# --- the FP8 GEMM path, on the CPU -----------------------------------------------------------


def test_fp8_linear_equals_its_reference_math():
    """_scaled_mm on e4m3 operands, then the row and column scales == the same products
    summed in float32 and scaled (exact up to float32 summation order); and within
    activation-rounding error of the float matmul."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(5, 3, 64, generator=g) * 3
    q, s = fp8.quantize_per_channel(w)
    lin = Fp8Linear(q, s.reshape(-1), bias=torch.randn(48, generator=g))
    y = lin(x)
    assert y.shape == (5, 3, 48) and y.dtype == torch.float32
    xq, xs = fp8.quantize_rows(x.reshape(-1, 64))
    ref = ((xq.float() @ q.float().t()) * xs) * s.reshape(1, -1) + lin.bias
    torch.testing.assert_close(y.reshape(-1, 48), ref, rtol=1e-5, atol=1e-5)
    exact = x @ lin.dequantized().t() + lin.bias
    # e4m3 keeps 3 mantissa bits: each activation is off by at most 1/16 of itself
    assert (y - exact).abs().max() <= 0.0625 * (x.abs() @ lin.dequantized().abs().t()).max()


def test_static_input_scale_and_activation_cap():
    g = torch.Generator().manual_seed(0)
    q, s = fp8.quantize_per_tensor(torch.randn(32, 32, generator=g))
    x = torch.randn(4, 32, generator=g)
    lin = Fp8Linear(q, s.expand(32), input_scale=torch.tensor(0.01))
    xq = (x / 0.01).clamp(-448, 448).to(fp8.FP8).float() * 0.01
    torch.testing.assert_close(lin(x), xq @ lin.dequantized().t(), rtol=1e-5, atol=1e-5)
    capped = Fp8Linear(q, s.expand(32), activation_scale_ub=0.5)
    big = torch.full((1, 32), 10.0)  # amax 10 capped at 0.5: every value saturates at 0.5
    torch.testing.assert_close(capped(big), torch.full((1, 32), 0.5) @ lin.dequantized().t(),
                               rtol=1e-5, atol=1e-5)


def test_quantize_helpers_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 70, generator=g) * torch.logspace(-2, 1, 100)[:, None]
    for q, scale, block in ((*fp8.quantize_per_tensor(w), None),
                            (*fp8.quantize_per_channel(w), None),
                            (*fp8.quantize_blockwise(w, (32, 64)), (32, 64))):
        assert q.dtype == fp8.FP8 and q.shape == w.shape
        back = fp8.dequantize(q, scale, block)
        # round to nearest with 3 mantissa bits: 1/16 relative, plus e4m3's subnormal step
        step = scale.max() * 2.0 ** -9
        assert ((back - w).abs() <= w.abs() / 16 + step).all()
    _, bs = fp8.quantize_blockwise(w, (32, 64))
    assert bs.shape == (4, 2)
    assert torch.equal(bs[3, 1], w[96:, 64:].abs().max() / 448)


@pytest.fixture
def fp8_gemm_on_cpu(monkeypatch):
    """The FP8-GEMM build path on the CPU (torch runs `_scaled_mm` there too)."""
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)


# Activation quantization: every activation entering a projection is rounded to e4m3 (3
# mantissa bits: about 3.6% RMS relative error per element, and so per output). The tiny
# model's logits reach about 0.68; the formats show errors of 0.029-0.043 (block-wise:
# requantized per row, the most); the bound is 0.05, about 7% of the largest logit.
GEMM_LOGITS_ATOL = 0.05


def test_fp8_gemm_model_close_to_the_twin(fp8_dirs, fp8_gemm_on_cpu):
    fmt, path, twin = fp8_dirs
    config, sd = load_checkpoint(path)
    model = build_with_fp8(config, sd)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.qkv, Fp8Linear) and isinstance(mlp.gate_up, Fp8Linear)
    assert attn.q_proj is None and mlp.gate_proj is None
    assert not isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)  # ignored: float
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.float32
    tconfig, tsd = load_checkpoint(twin)
    reference = build_model(tconfig, tsd)
    ref_attn = reference.model.layers[1].self_attn
    twin_qkv = torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight, ref_attn.v_proj.weight])
    if fmt.startswith(("fp8-block", "ct-block")):  # requantized per row: one more rounding
        assert ((attn.qkv.dequantized() - twin_qkv).abs()
                <= twin_qkv.abs() / 16 + attn.qkv.weight_scale.max() * 2.0 ** -9).all()
    else:  # per-tensor scales expanded to rows, per-channel ones kept: exact
        assert torch.equal(attn.qkv.dequantized(), twin_qkv)
    ours, ref = _logits(model, IDS), _logits(reference, IDS)
    err = (ours - ref).abs().max().item()
    assert err <= GEMM_LOGITS_ATOL
    _assert_clear_argmax_agrees(ours, ref, err)


def test_norms_and_activations_quantize_for_their_fp8_projections(fp8_dirs, fp8_gemm_on_cpu,
                                                                  monkeypatch):
    """A norm or silu-and-mul feeding a per-token FP8 projection returns its output already
    quantized (`fuse_activation_quant`); a static input scale, a projection kept in float
    and the final norm (LM head) are left alone; the logits are exactly those of the same
    model quantizing in the projections, and of the model whose projections apply their
    own scales (no `ScaledRows` to the residual adds and silu-and-mul)."""
    from nanoserve.model.model import FP8Out

    fmt, path, _ = fp8_dirs
    config, sd = load_checkpoint(path)
    model = build_with_fp8(config, sd)
    static = fmt in ("ct-tensor-static", "fp8-tensor-static")
    layers = model.model.layers
    flags = [(layer.input_layernorm.fp8_out, layer.post_attention_layernorm.fp8_out,
              layer.mlp.fp8_act) for layer in layers]
    assert model.model.norm.fp8_out is None
    if static:
        assert all(f is None for row in flags for f in row)
        return
    assert flags[0][2] is None  # layer 0's down_proj is kept in float
    assert all(isinstance(f, FP8Out) for row in flags for f in row if f is not flags[0][2])
    ub = config.quantization.activation_scale_ub
    assert all(f.ub == ub for row in flags for f in row if f is not None)
    fused = _logits(model, IDS)
    for layer in layers:
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = None
        layer.mlp.fp8_act = None
    assert torch.equal(fused, _logits(model, IDS))
    monkeypatch.setattr(Fp8Linear, "keeps_scales", False)
    assert torch.equal(fused, _logits(model, IDS))


def _assert_clear_argmax_agrees(ours, ref, err):
    """Greedy tokens agree wherever the reference's top-2 margin exceeds twice the largest
    logit error (elsewhere a tie within the error may go either way)."""
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * err
    assert clear.float().mean() >= 0.25  # seen: 0.31-0.44 (random logits are near-flat)
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_online_fp8_quantizes_projections_only(tiny_model_dir, fp8_gemm_on_cpu):
    config, sd = load_checkpoint(tiny_model_dir)
    reference = build_model(config, dict(sd))
    model = build_with_fp8(config, sd, quantization="fp8")
    for layer in model.model.layers:
        assert all(isinstance(m, Fp8Linear) for m in (
            layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj))
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    ours, ref = _logits(model, IDS), _logits(reference, IDS)
    err = (ours - ref).abs().max().item()
    assert err <= GEMM_LOGITS_ATOL
    _assert_clear_argmax_agrees(ours, ref, err)


# --- refusals --------------------------------------------------------------------------------


def test_online_fp8_is_refused_on_the_cpu_in_one_line(tiny_model_dir):
    config, sd = load_checkpoint(tiny_model_dir)
    with pytest.raises(ModelError) as e:
        build_with_fp8(config, sd, quantization="fp8")
    assert "compute capability 8.9" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ModelError, match="unknown quantization 'int8'"):
        fp8.check_quantization("int8", "cpu")


def test_llm_refuses_online_fp8_on_the_cpu(tiny_model_dir):
    from nanoserve.llm import LLM

    with pytest.raises(ModelError, match="needs FP8 compute"):
        LLM(str(tiny_model_dir), device="cpu", quantization="fp8")


UNSUPPORTED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128},
    "int8 compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
    "w4a16 compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
    "fp8 e5m2": {"quant_method": "fp8", "fmt": "e5m2"},
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unknown_quantization_configs_are_refused_in_one_line(tmp_path, tiny_model_dir, name):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["quantization_config"] = UNSUPPORTED[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    for load in (load_checkpoint, validate_checkpoint):
        with pytest.raises(ModelError) as e:
            load(tmp_path)
        message = str(e.value)
        assert "\n" not in message
        assert "fbgemm_fp8" in message and "compressed-tensors float-quantized" in message


def test_fp8_weight_without_its_scale_is_named(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    save_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", "fbgemm", tmp_path / "twin")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    config, sd = load_checkpoint(tmp_path / "fp8")
    with pytest.raises(ModelError, match="model.layers.1.self_attn.k_proj.weight_scale"):
        build_with_fp8(config, sd)


def test_llm_generate_with_fp8_gemms_on_the_cpu(tmp_path, fp8_gemm_on_cpu):
    """The engine (continuous scheduler) over an FP8 checkpoint on the FP8-GEMM path: first
    tokens (teacher-forced by the prompt) agree with the dequantized twin's on at least 75%
    of prompts (seen: all), on a byte-level Llama whose LM head is scaled by 8 so that
    random logits have clear winners."""
    import random

    from safetensors.torch import load_file, save_file

    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.testing import save_tiny_byte_llama

    folder = save_tiny_byte_llama(tmp_path / "float")
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    save_fp8_checkpoint(folder, tmp_path / "fp8", "ct-channel-dynamic", tmp_path / "twin")
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(str(tmp_path / "fp8"), device="cpu", kv_cache_bytes=16 << 20)
    assert isinstance(llm.model.model.layers[0].self_attn.qkv, Fp8Linear)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    twin = LLM(str(tmp_path / "twin"), device="cpu", kv_cache_bytes=16 << 20)
    want = [c.token_ids for c in twin.generate(prompts, params)]
    assert sum(a[0] == b[0] for a, b in zip(got, want)) >= 0.75 * len(prompts)
