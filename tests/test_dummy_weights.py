"""`LLM(load_format="dummy")` (nanoserve/weights/dummy_weights.py): random weights of the config's
shape, drawn on the device, FP8 projections with quantization="fp8"; on the CPU."""

from __future__ import annotations

import pytest
import torch

from nanoserve.errors import NanoserveError
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.weights import fp8
from nanoserve.weights.dummy_weights import random_model
from nanoserve.weights.weights import expected_shapes


def _config(tiny_model_dir):
    return ModelConfig.from_json_file(tiny_model_dir / "config.json")


def test_random_model_has_the_checkpoint_s_shapes(tiny_model_dir):
    config = _config(tiny_model_dir)
    model = random_model(config, torch.float32, "cpu")
    state = model.state_dict()
    for name, shape in expected_shapes(config).items():
        assert tuple(state[name].shape) == shape, name
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.015 < model.model.embed_tokens.weight.std().item() < 0.025


def test_random_fp8_model_holds_fp8_projections_and_runs(tiny_model_dir, monkeypatch):
    config = _config(tiny_model_dir)
    model = random_model(config, torch.float32, "cpu", quantization="fp8")
    for layer in model.model.layers:
        for m in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up,
                  layer.mlp.down_proj):
            assert isinstance(m, fp8.Fp8Linear) and m.weight.dtype == fp8.FP8
    assert model.model.layers[0].self_attn.qkv.weight.shape == (96 + 2 * 32, 96)
    assert model.lm_head.weight.dtype == torch.float32
    ids = torch.randint(0, 128, (2, 10))
    pos = torch.arange(10).expand(2, 10)
    logits = model(ids, pos, None, AttentionMetadata.prefill())  # _scaled_mm runs on the CPU
    assert logits.shape == (2, 10, 128) and torch.isfinite(logits).all()


def test_llm_dummy_load_reads_no_weights(tmp_path):
    from nanoserve.llm import LLM
    from nanoserve.testing import save_tiny_byte_llama

    folder = save_tiny_byte_llama(tmp_path / "m")
    (folder / "model.safetensors").unlink()  # only config.json and the tokenizer are read
    llm = LLM(str(folder), device="cpu", load_format="dummy", kv_cache_bytes=8 << 20)
    assert llm.model.lm_head.weight.shape == (258, 64)
    with pytest.raises(NanoserveError, match="load_format must be auto or dummy"):
        LLM(str(folder), device="cpu", load_format="random")


MOE_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1]}


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_random_moe_model(quantization):
    """A mixture of experts from its config alone: stacked experts of the config's shapes,
    FP8 with quantization="fp8" (each expert's matrices per row; the references run them)."""
    from nanoserve.model.moe import SparseMoeBlock

    config = ModelConfig.from_hf_dict(MOE_CONFIG)
    model = random_model(config, torch.float32, "cpu", quantization=quantization)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock) and moe.gate.weight.shape == (8, 64)
    assert moe.experts.gate_up_proj.shape == (8, 64, 64)
    assert moe.experts.down_proj.shape == (8, 64, 32)
    if quantization:
        assert moe.experts.gate_up_proj.dtype == fp8.FP8
        assert moe.experts.down_proj_scale.shape == (8, 64)
    else:
        state = model.state_dict()
        for name, shape in expected_shapes(config).items():
            assert tuple(state[name].shape) == shape, name
    logits = model(torch.randint(0, 128, (2, 6)), torch.arange(6).expand(2, 6), None,
                   AttentionMetadata.prefill())
    assert logits.shape == (2, 6, 128) and torch.isfinite(logits).all()
