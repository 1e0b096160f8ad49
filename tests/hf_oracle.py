"""transformers as the oracle of the model tests: its greedy tokens from its plain forward."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens from its plain forward over the whole sequence at each
    step (no cache). Its `generate` is not used: with a Mistral `sliding_window` of 4096 and
    tiny shapes it picked a token its own forward ranks second (checked on the CPU)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_greedy_near(hf, prompts, got, want, tie=1e-4):
    """Greedy tokens equal transformers', except where transformers' own logits at the first
    divergence hold a near tie (|gap| < tie) between its token and ours: float32 on another
    device sums in another order, and a tiny random model's logits tie often. At most one
    prompt may diverge."""
    diverged = 0
    for prompt, g, w in zip(prompts, got, want, strict=True):
        if g == w:
            continue
        diverged += 1
        j = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + w[:j]])).logits[0, -1].float()
        gap = float(logits[w[j]] - logits[g[j]])
        assert 0 <= gap < tie, (j, g[j], w[j], gap)
    assert diverged <= 1, f"{diverged} prompts diverged"
