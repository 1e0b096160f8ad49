"""The Llama forward held to transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nanoserve.cache.pool import CacheShape, DenseKVCache
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import build_model
from nanoserve.weights.weights import load_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_hf_config(heads: int, kv_heads: int, tied: bool, llama3: bool) -> LlamaConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3:
        rope = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    return LlamaConfig(
        vocab_size=256, hidden_size=16 * heads, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters=rope, bos_token_id=1, eos_token_id=2,
    )


def save_tiny(tmp_path, heads, kv_heads, tied, llama3, shards: bool, seed=0):
    torch.manual_seed(seed)
    hf = HFLlama(tiny_hf_config(heads, kv_heads, tied, llama3)).eval()
    # Non-trivial norm weights, so a missing or swapped norm would show.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if shards else "1GB")
    return hf


CASES = [
    # (query heads, kv heads, tied, llama3 rope, sharded)
    (4, 4, False, False, False),  # ratio 1
    (6, 2, True, False, True),  # ratio 3, tied, sharded
    (8, 2, False, True, True),  # ratio 4, llama3 scaling, sharded
    (8, 2, True, True, False),  # ratio 4, tied, llama3
]


@pytest.mark.parametrize("heads,kv_heads,tied,llama3,shards", CASES)
def test_logits_equal_transformers(tmp_path, heads, kv_heads, tied, llama3, shards):
    hf = save_tiny(tmp_path, heads, kv_heads, tied, llama3, shards)
    if shards:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config, sd = load_checkpoint(tmp_path)
    model = build_model(config, sd)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 40), generator=g)
    pos = torch.arange(40).expand(3, 40)
    ours = model(ids, pos, None, AttentionMetadata.prefill())
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("heads,kv_heads,tied,llama3,shards", CASES[:3])
def test_dense_cache_decode_equals_full_forward(tmp_path, heads, kv_heads, tied, llama3, shards):
    """Prefill 7 tokens then decode one at a time: each step's logits equal the full
    forward's logits at that position (positions past 64 exercise llama3 scaling)."""
    save_tiny(tmp_path, heads, kv_heads, tied, llama3, shards)
    config, sd = load_checkpoint(tmp_path)
    model = build_model(config, sd)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    full = model(ids, torch.arange(90)[None], None, AttentionMetadata.prefill())
    cache = DenseKVCache(CacheShape.of(config), 90)
    step = model(ids[:, :7], torch.arange(7)[None], cache, AttentionMetadata.prefill())
    got = [step]
    for t in range(7, 90):
        got.append(model(ids[:, t:t + 1], torch.tensor([[t]]), cache, AttentionMetadata.prefill()))
    assert (torch.cat(got, dim=1) - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.15), (torch.float16, 0.03)])
def test_half_precision_close_to_float32(tmp_path, dtype, tol):
    save_tiny(tmp_path, 8, 2, False, False, False)
    config, sd = load_checkpoint(tmp_path)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(16).expand(2, 16)
    ref = build_model(config, sd)(ids, pos, None, AttentionMetadata.prefill())
    half = build_model(config, sd, dtype=dtype)
    assert half.dtype == dtype
    out = half(ids, pos, None, AttentionMetadata.prefill())
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= tol * ref.abs().max().item()
