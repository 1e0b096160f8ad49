"""Tensor parallelism on the CPU (gloo, float32): tiny random Llama (tied head), Qwen3
(q/k norms), Qwen3-MoE, Mixtral and Qwen2-MoE (q/k/v biases, a shared expert) checkpoints split
over 2 and 4 processes give the greedy tokens of one unsharded rank (itself held to
transformers elsewhere, and here on Llama), and their all-gathered prefill logits equal
the unsharded model's within 1e-5. One spawn per world size serves every checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_oracle import hf_greedy

from nanoserve.cache.pool import CacheShape
from nanoserve.errors import ModelError
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.lora import LoraWeights
from nanoserve.model.model import build_model
from nanoserve.model.parallel import (
    TensorParallel,
    kv_heads_of,
    shard_model,
    sharded_config,
)
from nanoserve.static.generate import greedy_generate_batch
from nanoserve.static.tensor_parallel import _load_shard, run_tensor_parallel
from nanoserve.testing import tiny_hf_model
from nanoserve.weights.weights import load_checkpoint

VOCAB = 254  # not a multiple of 4: the last rank's head slice is padded
FAMILIES = {"llama": dict(tie_word_embeddings=True), "qwen3": {}, "qwen3_moe": {},
            "mixtral": {}, "qwen2_moe": {}}
PROMPTS = [[5, 9, 33, 71, 2 + 100, 17, 8], [40, 41, 42], [200, 3, 7, 7, 250, 11, 90, 12, 13]]
NEW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family, options in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        hf = tiny_hf_model(family, VOCAB, **options)
        hf.save_pretrained(folder)
        out[family] = (str(folder), hf)
    return out


def _one_rank(folder: str):
    config, sd = load_checkpoint(folder)
    return build_model(config, sd)


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    from nanoserve.cache.pool import DenseKVCache

    cache = DenseKVCache(CacheShape.of(model.config), len(ids), dtype=model.dtype,
                         device="cpu")
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache,
                     AttentionMetadata.prefill())[0]


def _every_checkpoint(tp: TensorParallel, folders: list[str]) -> list[tuple]:
    """On each rank: per checkpoint, (greedy tokens, prefill logits, the rank's KV heads)."""
    out = []
    for folder in folders:
        model = _load_shard(tp, folder, torch.float32)
        tokens = greedy_generate_batch(model, PROMPTS, NEW)
        logits = _prefill_logits(model, PROMPTS[0]).tolist()
        out.append((tokens, logits, CacheShape.of(model.config).num_kv_heads))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def sharded_runs(request, checkpoints):
    folders = [f for f, _ in checkpoints.values()]
    runs = run_tensor_parallel(_every_checkpoint, request.param, folders)
    return request.param, dict(zip(checkpoints, runs))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_and_logits_equal_one_rank(sharded_runs, checkpoints, family):
    n, runs = sharded_runs
    tokens, logits, kv_heads = runs[family]
    folder, hf = checkpoints[family]
    model = _one_rank(folder)
    assert tokens == greedy_generate_batch(model, PROMPTS, NEW)
    want = _prefill_logits(model, PROMPTS[0])
    torch.testing.assert_close(torch.tensor(logits), want, atol=1e-5, rtol=1e-5)
    # rank 0's KV pool holds only its own KV heads: 2 KV heads split over 2, one replicated over 4
    assert kv_heads == 1
    if family == "llama":
        assert tokens[0] == hf_greedy(hf, PROMPTS[0], NEW)


def test_sharded_config_divides_and_replicates(checkpoints):
    config, _ = load_checkpoint(checkpoints["qwen3_moe"][0])
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    two = sharded_config(config, TensorParallel(1, 2))
    assert (two.num_attention_heads, two.num_key_value_heads) == (2, 1)
    assert (two.intermediate_size, two.moe_intermediate_size) == (config.intermediate_size // 2,
                                                                 config.moe_intermediate_size // 2)
    # 4 ranks, 2 KV heads: ranks 0, 1 share KV head 0, ranks 2, 3 KV head 1
    assert [kv_heads_of(config, TensorParallel(r, 4)) for r in range(4)] == [(0, 1), (0, 1),
                                                                            (1, 1), (1, 1)]
    with pytest.raises(ModelError, match="num_attention_heads"):
        sharded_config(config, TensorParallel(0, 8))
    with pytest.raises(ModelError, match="num_key_value_heads"):
        sharded_config(replace(config, num_attention_heads=6, num_key_value_heads=3),
                       TensorParallel(0, 2))


def test_fp8_is_refused(checkpoints):
    config, _ = load_checkpoint(checkpoints["llama"][0])
    with pytest.raises(ModelError, match="FP8"):
        sharded_config(replace(config, quantization=object()), TensorParallel(0, 2))


def test_one_rank_shard_is_the_model(checkpoints):
    folder = checkpoints["qwen3"][0]
    config, sd = load_checkpoint(folder)
    model = shard_model(config, sd, TensorParallel(0, 1))
    torch.testing.assert_close(_prefill_logits(model, PROMPTS[2]),
                               _prefill_logits(_one_rank(folder), PROMPTS[2]), atol=0, rtol=0)


def test_lora_on_a_shard_is_refused(checkpoints):
    config, sd = load_checkpoint(checkpoints["llama"][0])
    model = shard_model(config, sd, TensorParallel(0, 2))  # built only: no collective runs
    slots = LoraWeights(model.config, {"q_proj"}, 2, 1, torch.float32, "cpu")
    with pytest.raises(ModelError, match="tensor parallelism"):
        slots.attach(model)
