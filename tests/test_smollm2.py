"""The real default model (SmolLM2-135M-Instruct, from its GGUF) held to transformers:
greedy tokens of the dense, paged and batched paths equal transformers' greedy
generation, token for token."""

from __future__ import annotations

import pytest
import torch

from nanoserve.model.model import build_model
from nanoserve.static.generate import greedy_generate, greedy_generate_batch, greedy_generate_paged
from nanoserve.weights.tokenizer import Tokenizer
from nanoserve.weights.weights import load_checkpoint

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Le chat est assis sur",
    "机器学习是",
    "Once upon a time, in a small village by the sea,",
    "Die Hauptstadt von Deutschland ist",
    "SELECT name, COUNT(*) FROM users",
]
CHAT = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    config, sd = load_checkpoint(smollm2_gguf_path)
    return build_model(config, sd), Tokenizer.from_path(smollm2_gguf_path)


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    texts = PLAIN + [tok.apply_chat_template(m, add_generation_prompt=True) for m in CHAT]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2, prompts, smol):
    model, tok = smol
    eos = tuple(tok.eos_token_ids)
    outs = []
    for p in prompts:
        with torch.no_grad():
            seq = hf_smollm2.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=list(eos), pad_token_id=eos[0])
        outs.append(seq[0, len(p):].tolist())
    return outs, eos


def test_logits_equal_transformers(smol, hf_smollm2, prompts):
    from nanoserve.model.attention import AttentionMetadata

    model, _ = smol
    for p in prompts[:3]:
        ids = torch.tensor([p])
        ours = model(ids, torch.arange(len(p))[None], None, AttentionMetadata.prefill())
        with torch.no_grad():
            ref = hf_smollm2(ids).logits.float()
        assert (ours - ref).abs().max().item() <= 1e-3


def test_dense_greedy_equals_transformers(smol, prompts, hf_greedy):
    model, _ = smol
    ref, eos = hf_greedy
    assert len(prompts) >= 8
    for p, r in zip(prompts, ref):
        assert greedy_generate(model, p, NEW_TOKENS, eos) == r


def test_paged_greedy_equals_transformers(smol, prompts, hf_greedy):
    model, _ = smol
    ref, eos = hf_greedy
    for p, r in zip(prompts, ref):
        assert greedy_generate_paged(model, p, NEW_TOKENS, eos) == r


def test_batched_greedy_equals_transformers(smol, prompts, hf_greedy):
    model, _ = smol
    ref, eos = hf_greedy
    assert greedy_generate_batch(model, prompts, NEW_TOKENS, eos) == ref
