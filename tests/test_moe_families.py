"""Qwen3-MoE, Mixtral and Qwen2-MoE held to transformers' own model classes: tiny random checkpoints
(routers that spread the tokens over the experts), saved by `save_pretrained` (per-expert
tensor names, one file or sharded) or with transformers 5.x's stacked module names,
compared on float32 logits and on greedy tokens through the dense, paged, static-batch and
continuous paths and `LLM`; FP8 block-wise experts against their dequantized twin."""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import hf_greedy
from safetensors.torch import save_file
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.model import build_model
from nanoserve.model.moe import SparseMoeBlock
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve.static.generate import greedy_generate, greedy_generate_batch, pool_for
from nanoserve.weights.weights import load_checkpoint, validate_checkpoint

VOCAB = 256
CASES = [
    # (family, options, how it is saved)
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                       mlp_only_layers=[1]), "per-expert"),
    ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                       decoder_sparse_step=2, tie_word_embeddings=True), "sharded"),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6), "per-expert"),
    ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2), "stacked"),
    # Qwen2-MoE: a shared expert beside the routed ones; q/k/v biases; window on layer 0
    ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=40,
                       use_sliding_window=True, sliding_window=5, max_window_layers=2),
     "per-expert"),
]
MODELS = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
          "mixtral": (MixtralConfig, MixtralForCausalLM),
          "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}
IDS = [f"{f}-{i}-{how}" for i, (f, _, how) in enumerate(CASES)]


def tiny_config(family: str, **options):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if family != "mixtral":
        common["moe_intermediate_size"] = 32
    return MODELS[family][0](**{**common, **options})


def save_moe(folder, family: str, options: dict, how: str, seed: int = 0):
    torch.manual_seed(seed)
    hf = MODELS[family][1](tiny_config(family, **options)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "expert" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    if how == "stacked":  # the names of transformers 5.x's modules, experts stacked
        hf.config.save_pretrained(folder)
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            sd.pop("lm_head.weight")
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        hf.save_pretrained(folder, max_shard_size="40KB" if how == "sharded" else "5GB")
    return hf


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def moe_pair(request, tmp_path_factory):
    family, options, how = request.param
    folder = tmp_path_factory.mktemp(family)
    hf = save_moe(folder, family, options, how)
    config, sd = load_checkpoint(folder)
    return request.param, folder, hf, build_model(config, sd)


def test_checkpoint_layout_and_config(moe_pair):
    (family, options, how), folder, hf, model = moe_pair
    names = json.dumps(sorted(p.name for p in folder.iterdir()))
    assert ("index.json" in names) == (how == "sharded"), names
    config = validate_checkpoint(folder)
    assert config == model.config
    moe = tuple(i for i, layer in enumerate(hf.model.layers)
                if type(layer.mlp).__name__.endswith("SparseMoeBlock"))
    assert config.moe_layers == moe and moe
    assert all(isinstance(model.model.layers[i].mlp, SparseMoeBlock) == (i in moe)
               for i in range(config.num_hidden_layers))
    assert config.num_experts == hf.config.num_experts
    assert config.num_experts_per_tok == hf.config.num_experts_per_tok
    assert config.norm_topk_prob == getattr(hf.config, "norm_topk_prob", True)
    for i, layer in enumerate(hf.model.layers):
        theirs = (hf.config.sliding_window if family == "mixtral"
                  else getattr(layer.self_attn, "sliding_window", None) or None)
        assert config.attention_window(i) == theirs, i
    assert config.qk_norm == (family == "qwen3_moe")
    assert config.qkv_bias == (family == "qwen2_moe")
    assert config.shared_expert_intermediate_size == (40 if family == "qwen2_moe" else 0)


def test_logits_equal_transformers(moe_pair):
    _, _, hf, model = moe_pair
    ids = torch.randint(0, VOCAB, (3, 30), generator=torch.Generator().manual_seed(1))
    ours = model(ids, torch.arange(30).expand(3, 30), None, AttentionMetadata.prefill())
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (ours - ref).abs().max().item() <= 1e-4


def test_greedy_tokens_equal_transformers_dense_paged_batched(moe_pair):
    """Every path's rows equal transformers' tokens for the prompt alone: routing is per
    token, so a row never depends on the rows beside it."""
    _, _, hf, model = moe_pair
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (3, 11, 17)]
    new = 16
    want = [hf_greedy(hf, p, new) for p in prompts]
    assert [greedy_generate(model, p, new) for p in prompts] == want
    assert greedy_generate_batch(model, prompts[1:2], new) == want[1:2]
    assert greedy_generate_batch(model, prompts, new, (), pool_for(model, prompts, new, 4)) == want
    params = [SamplingParams(max_tokens=new, temperature=0.0)] * len(prompts)
    for mode in ("eager", "static"):  # "static": the fixed tensors a GPU's graphs capture
        outs, _ = generate_continuous(model, prompts, params, (),
                                      pool_for(model, prompts, new, 4), max_batch_size=2,
                                      step_mode=mode)
        assert [o.token_ids for o in outs] == want, mode


@pytest.mark.parametrize("family,moe_layers", [("qwen3_moe", (0,)), ("qwen2_moe", (0, 1))])
def test_llm_generates_each_row_as_alone(tmp_path, smollm2_gguf_path, family, moe_layers):
    """`LLM` over a tiny MoE with a real tokenizer (`save_tiny_family`): a batch's rows
    equal each prompt alone."""
    from nanoserve.llm import LLM
    from nanoserve.testing import save_tiny_family

    folder = save_tiny_family(tmp_path / "m", family, smollm2_gguf_path)
    llm = LLM(model=str(folder), device="cpu", kv_cache_bytes=16 << 20)
    assert llm.config.moe_layers == moe_layers
    prompts = ["Experts route each token", "Hi", "A longer prompt about mixtures of experts"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        (alone,) = llm.generate([prompt], params)
        assert out.token_ids == alone.token_ids


@pytest.mark.parametrize("d", [
    {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
     "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
     "moe_intermediate_size": 768, "norm_topk_prob": True},
    {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
     "num_experts_per_tok": 2, "sliding_window": None},
])
def test_hub_style_configs(d):
    """config.json as the published checkpoints spell it (4.x keys: num_experts)."""
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = ModelConfig.from_hf_dict({**base, **d})
    assert config.moe_layers == (0, 1, 2)
    assert config.num_experts == d.get("num_experts", d.get("num_local_experts"))
    assert config.moe_intermediate_size == d.get("moe_intermediate_size", 96)


@pytest.mark.parametrize("use,window,first", [(False, 32768, 21), (True, 64, 3), (True, 64, 0)])
def test_qwen2_moe_window_follows_use_sliding_window(use, window, first):
    """Qwen2-MoE checkpoints carry a `sliding_window` value with `use_sliding_window: false`
    (Qwen1.5-MoE-A2.7B: 32768, 21): no layer has a window then. Each layer's window equals
    what transformers' own config class derives (`layer_types`)."""
    d = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40,
             use_sliding_window=use, sliding_window=window, max_window_layers=first)
    theirs = Qwen2MoeConfig(**d).layer_types
    ours = ModelConfig.from_hf_dict({"model_type": "qwen2_moe",
                                     "architectures": ["Qwen2MoeForCausalLM"], **d})
    for layer, kind in enumerate(theirs):
        assert ours.attention_window(layer) == (window if kind == "sliding_attention" else None)
    if not use:
        assert all(ours.attention_window(i) is None for i in range(4))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_norm_topk_prob_left_out_of_the_config(tmp_path, family):
    """A config.json without `norm_topk_prob` (older Qwen-MoE checkpoints): the default is
    transformers' own for the family, seen in the logits of the model it loads."""
    save_moe(tmp_path, family, dict(num_experts=6, num_experts_per_tok=3), "per-expert")
    d = json.loads((tmp_path / "config.json").read_text())
    del d["norm_topk_prob"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = MODELS[family][1].from_pretrained(tmp_path, dtype=torch.float32).eval()
    config, sd = load_checkpoint(tmp_path)
    assert config.norm_topk_prob == hf.config.norm_topk_prob
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    ours = build_model(config, sd)(ids, torch.arange(12).expand(2, 12), None,
                                   AttentionMetadata.prefill())
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (ours - ref).abs().max().item() <= 1e-4


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file

    from nanoserve.errors import ModelError

    save_moe(tmp_path, "mixtral", dict(num_local_experts=3, num_experts_per_tok=2), "per-expert")
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"experts\.2\.w3\.weight"):
        load_checkpoint(tmp_path)
    with pytest.raises(ModelError, match=r"experts\.2\.w3\.weight"):
        validate_checkpoint(tmp_path)


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "fp8-block-small"),
                                        ("qwen3_moe", "fp8-block"),
                                        ("mixtral", "ct-channel-dynamic")])
def test_fp8_experts_load_as_their_dequantized_twin(tmp_path, family, fmt):
    """An FP8 checkpoint whose experts are e4m3 (per expert, with their scales; the router
    stays as stored) gives on the CPU exactly the logits of its dequantized twin."""
    from nanoserve.testing import save_fp8_checkpoint
    from nanoserve.weights.fp8 import FP8, build_with_fp8

    options = (dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
               if family == "qwen3_moe" else dict(num_local_experts=4, num_experts_per_tok=2))
    save_moe(tmp_path / "src", family, options, "per-expert")
    save_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", fmt, tmp_path / "twin")
    config, sd = load_checkpoint(tmp_path / "fp8")
    gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]
    if fmt == "fp8-block-small":  # 32 x 64 blocks: gate/up's grid stacks, down's does not
        assert gate_up.dtype == FP8
        assert sd["model.layers.0.mlp.experts.gate_up_proj_scale"].shape == (8, 2, 1)
        assert sd["model.layers.0.mlp.experts.down_proj"].dtype == torch.float32
    elif fmt == "ct-channel-dynamic":
        assert sd["model.layers.0.mlp.experts.down_proj_scale"].shape == (4, 64)
    assert sd["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    model = build_with_fp8(config, sd)
    twin_config, twin_sd = load_checkpoint(tmp_path / "twin")
    twin = build_model(twin_config, twin_sd)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    pos, meta = torch.arange(9).expand(2, 9), AttentionMetadata.prefill()
    assert torch.equal(model(ids, pos, None, meta), twin(ids, pos, None, meta))


@pytest.mark.parametrize("form", ["online", "block"])
def test_fp8_moe_is_within_e4m3_rounding_on_the_cpu(tmp_path, monkeypatch, form):
    """The FP8 MoE path on the CPU (the experts' PyTorch reference, `torch._scaled_mm` for
    the projections; FP8 let through on the CPU for this test): logits within the rounding
    model of the float twin, the check tests/test_fused_moe_gpu.py runs on the kernels."""
    from e4m3_rounding import check_fp8_moe

    import nanoserve.weights.fp8 as fp8

    monkeypatch.setattr(fp8, "fp8_supported", lambda device: True)
    check_fp8_moe(tmp_path, form, "cpu")
