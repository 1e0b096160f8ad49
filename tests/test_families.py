"""Qwen2 (Qwen2.5), Qwen3 and Mistral held to transformers' own model classes: tiny random
checkpoints saved with save_pretrained, loaded through the real folder path, compared on
float32 logits and on greedy tokens through the dense, paged and batched (static and
continuous) paths, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_greedy_near, hf_greedy
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import build_model
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve.static.generate import greedy_generate, greedy_generate_batch, pool_for
from nanoserve.weights.weights import load_checkpoint

VOCAB = 256
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_config(family: str, heads: int, kv_heads: int, tied: bool, window: int | None):
    config_cls, _ = FAMILIES[family]
    common = dict(
        vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2,
    )
    if family == "mistral":
        return config_cls(**common, sliding_window=window)
    # Qwen: the window only with use_sliding_window, and only on layers >= max_window_layers
    # (here layer 1: a window layer next to a full-attention layer).
    return config_cls(**common, use_sliding_window=window is not None,
                      sliding_window=window, max_window_layers=1)


def save_family(folder, family, heads, kv_heads, tied, window, seed=0):
    torch.manual_seed(seed)
    _, model_cls = FAMILIES[family]
    hf = model_cls(tiny_config(family, heads, kv_heads, tied, window)).eval()
    # Non-trivial norm weights and biases, so a missing or misplaced one would show.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    hf.save_pretrained(folder)
    return hf


CASES = [
    # (family, query heads, kv heads, tied, window)
    ("qwen2", 4, 4, False, None),  # ratio 1, untied
    ("qwen2", 8, 2, True, 5),  # ratio 4, tied, window on layer 1
    ("qwen3", 4, 4, True, None),  # ratio 1, tied
    ("qwen3", 6, 2, False, 7),  # ratio 3, untied, window on layer 1
    ("mistral", 4, 4, False, None),  # ratio 1, no window (v0.2 style)
    ("mistral", 8, 2, True, 6),  # ratio 4, tied, window on every layer (v0.1 style)
    ("mistral", 4, 2, False, 4096),  # the v0.1 window, longer than every context here
]
IDS = [f"{f}-{h}:{kv}-{'tied' if t else 'untied'}-w{w}" for f, h, kv, t, w in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def family_pair(request, tmp_path_factory):
    """(case, transformers model, our float32 model) from one saved checkpoint folder."""
    family, heads, kv_heads, tied, window = request.param
    folder = tmp_path_factory.mktemp(family)
    hf = save_family(folder, family, heads, kv_heads, tied, window)
    config, sd = load_checkpoint(folder)
    return request.param, hf, build_model(config, sd)


def test_config_reads_the_family(family_pair):
    (family, _, _, tied, window), hf, model = family_pair
    config = model.config
    assert config.architecture == type(hf).__name__
    assert config.qkv_bias == (family == "qwen2")
    assert config.qk_norm == (family == "qwen3")
    assert config.tie_word_embeddings == tied
    for layer in range(config.num_hidden_layers):
        theirs = getattr(hf.model.layers[layer].self_attn, "sliding_window", None)
        if family == "mistral":
            theirs = hf.config.sliding_window
        assert config.attention_window(layer) == theirs, layer
    if family != "mistral" and window is not None:
        assert config.attention_window(0) is None and config.attention_window(1) == window


@pytest.mark.parametrize("family,extra", [
    ("qwen2", {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    ("mistral", {"sliding_window": 4096}),
    ("mistral", {"sliding_window": None}),
])
def test_window_layers_of_4x_style_configs_equal_transformers(family, extra):
    """config.json dicts as 4.x checkpoints write them (no layer_types unless given): the
    window of each layer equals what transformers' config class and attention layer derive."""
    from nanoserve.model.config import ModelConfig

    config_cls, model_cls = FAMILIES[family]
    d = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, **extra)
    hf = model_cls(config_cls(**d))
    ours = ModelConfig.from_hf_dict({**d, "architectures": [model_cls.__name__],
                                     "model_type": family})
    for layer in range(3):
        theirs = getattr(hf.model.layers[layer].self_attn, "sliding_window", None)
        if family == "mistral":
            theirs = hf.config.sliding_window
        assert ours.attention_window(layer) == theirs, layer


def test_logits_equal_transformers(family_pair):
    """40 tokens: past every small window, so the window's edge is inside the prompt."""
    _, hf, model = family_pair
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40).expand(3, 40)
    ours = model(ids, pos, None, AttentionMetadata.prefill())
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (ours - ref).abs().max().item() <= 1e-4


def test_greedy_tokens_equal_transformers_dense_paged_batched(family_pair):
    """Prompts shorter and longer than the window, 24 new tokens: decode steps cross the
    window's edge. transformers' generate is the oracle of each path: dense cache, paged
    (a batch of one), static batch, continuous batching."""
    _, hf, model = family_pair
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (3, 11, 17)]
    new = 24
    want = [hf_greedy(hf, p, new) for p in prompts]
    assert [greedy_generate(model, p, new) for p in prompts] == want
    assert greedy_generate_batch(model, prompts[1:2], new) == want[1:2]  # paged, one row
    assert greedy_generate_batch(model, prompts, new, (), pool_for(model, prompts, new, 4)) == want
    params = [SamplingParams(max_tokens=new, temperature=0.0)] * len(prompts)
    outs, _ = generate_continuous(model, prompts, params, (), pool_for(model, prompts, new, 4),
                                  max_batch_size=2)
    assert [o.token_ids for o in outs] == want


def test_prefix_cache_hits_equal_transformers(family_pair):
    """Rows that share a prefix longer than the window, run twice over one pool: the second
    run starts from the cached blocks (its prefill attends to them through the pool, within
    the window) in both step modes, and every row still equals transformers' tokens."""
    _, hf, model = family_pair
    rng = torch.Generator().manual_seed(7)
    shared = torch.randint(3, VOCAB, (13,), generator=rng).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (2, 9)]
    new = 12
    want = [hf_greedy(hf, p, new) for p in prompts]
    params = [SamplingParams(max_tokens=new, temperature=0.0)] * len(prompts)
    pool = pool_for(model, prompts * 2, new, 4)
    for run, mode in enumerate(("eager", "static", "eager")):
        outs, stats = generate_continuous(model, prompts, params, (), pool, max_batch_size=2,
                                          step_mode=mode)
        assert [o.token_ids for o in outs] == want, mode
        if run:  # each row from the shared prefix's 3 full blocks, at least
            assert stats.cached_tokens >= 2 * 12, (mode, stats.cached_tokens)


# --- GGUF (qwen2, qwen3: tensor names from the gguf package) -------------------------------


def _write_gguf(path, family: str, hf) -> None:
    """hf's weights as llama.cpp's converter writes a `family` GGUF: no q/k row permutation
    (that is llama-only), names from the gguf package's tensor-name table."""
    import gguf

    from nanoserve.testing import write_tiny_gguf

    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[family]
    names = gguf.get_tensor_name_map(arch, hf.config.num_hidden_layers)
    cfg = hf.config

    def tensors():
        for name, t in hf.state_dict().items():
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gname is not None, name
            yield gname, t.numpy(), None

    write_tiny_gguf(path, family, tensors(), cfg, head_lengths=True)


# head_dim: what transformers' GGUF loader assumes (it does not read key_length for these
# families): hidden / heads for Qwen2, Qwen3Config's default 128 for Qwen3.
@pytest.mark.parametrize("family,tied,head_dim", [("qwen2", False, 16), ("qwen3", True, 128)])
def test_gguf_equals_transformers(tmp_path, family, tied, head_dim):
    """A tiny Qwen2 / Qwen3 written as GGUF: our loader and transformers' GGUF loader give the
    same tensors, and our logits equal transformers' model on the original weights."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(3)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                     max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     bos_token_id=1, eos_token_id=2)
    hf = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    path = tmp_path / f"{family}.gguf"
    _write_gguf(path, family, hf)
    config, sd = load_checkpoint(path)
    assert config.architecture == type(hf).__name__ and config.head_dim == head_dim
    theirs = model_cls.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                       local_files_only=True).state_dict()
    for name, t in sd.items():
        assert torch.equal(t, theirs[name]), name
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = build_model(config, sd)(ids, torch.arange(12).expand(2, 12), None,
                                   AttentionMetadata.prefill())
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-4


# --- on a GPU: the Triton kernels (packed prefill, paged decode) with windows ----------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,window", [("qwen3", 7), ("mistral", 6), ("mistral", 4096)])
def test_gpu_kernels_greedy_equals_transformers(tmp_path, monkeypatch, family, window):
    """float32 on the GPU through the kernels: greedy tokens of a static batch and of
    continuous batching equal transformers' generate (CPU), and the reference kernels."""
    hf = save_family(tmp_path, family, 8, 2, False, window)
    config, sd = load_checkpoint(tmp_path)
    model = build_model(config, sd, torch.float32, "cuda")
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (1, 6, 15, 33, 70)]
    new = 40
    want = [hf_greedy(hf, p, new) for p in prompts]
    pool = pool_for(model, prompts, new, 16)
    assert_greedy_near(hf, prompts, greedy_generate_batch(model, prompts, new, (), pool), want)
    params = [SamplingParams(max_tokens=new, temperature=0.0)] * len(prompts)
    outs, _ = generate_continuous(model, prompts, params, (), pool, max_batch_size=3)
    assert_greedy_near(hf, prompts, [o.token_ids for o in outs], want)
    with monkeypatch.context() as m:
        m.setenv("NANOSERVE_KERNELS", "reference")
        assert_greedy_near(hf, prompts, greedy_generate_batch(model, prompts, new, (), pool),
                            want)
