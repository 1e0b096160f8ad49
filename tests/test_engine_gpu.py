"""The engine on a GPU: greedy tokens through the Triton kernels equal the PyTorch
reference path (NANOSERVE_KERNELS=reference) and the dense CPU oracle. Skipped
without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.generate import greedy_generate, greedy_generate_batch, pool_for
from nanoserve.model import build_model
from nanoserve.weights import load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _both_paths(monkeypatch, model, prompts, new_tokens, eos=()):
    pool = pool_for(model, prompts, new_tokens)
    kernels = greedy_generate_batch(model, prompts, new_tokens, eos, pool)
    with monkeypatch.context() as m:
        m.setenv("NANOSERVE_KERNELS", "reference")
        reference = greedy_generate_batch(model, prompts, new_tokens, eos, pool)
    return kernels, reference


def test_tiny_model_kernels_equal_reference_and_cpu(monkeypatch, tiny_model_dir):
    config, sd = load_checkpoint(tiny_model_dir)
    gpu = build_model(config, sd, torch.float32, "cuda")
    cpu = build_model(config, sd, torch.float32, "cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (1, 15, 16, 17, 40, 77, 3, 128)]
    kernels, reference = _both_paths(monkeypatch, gpu, prompts, 24)
    assert kernels == reference
    assert kernels == [greedy_generate(cpu, p, 24) for p in prompts]


def test_smollm2_kernels_equal_reference(monkeypatch, smollm2_gguf_path):
    from nanoserve.tokenizer import Tokenizer

    config, sd = load_checkpoint(smollm2_gguf_path)
    tok = Tokenizer.from_path(smollm2_gguf_path)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Le chat est assis sur",
             "机器学习是", "Once upon a time,", "SELECT name FROM users WHERE",
             tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}]),
             tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])]
    prompts = [tok.encode(t) for t in texts]
    eos = tuple(tok.eos_token_ids)
    model = build_model(config, sd, torch.float32, "cuda")
    kernels, reference = _both_paths(monkeypatch, model, prompts, 32, eos)
    assert kernels == reference
    # bfloat16 runs end to end and mostly agrees with float32 on the first tokens.
    bf16 = build_model(config, sd, torch.bfloat16, "cuda")
    half = greedy_generate_batch(bf16, prompts, 32, eos)
    agree = sum(h[:4] == k[:4] for h, k in zip(half, kernels))
    assert agree >= len(prompts) // 2
