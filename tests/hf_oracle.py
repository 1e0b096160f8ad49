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
