"""Small real checkpoints for tests and benchmarks (needs the `test` extra: transformers).

`save_tiny_llama` writes a tiny random `LlamaForCausalLM` through transformers' own
`save_pretrained` (so the engine loads it through the real checkpoint path), with a real
tokenizer: batch jobs over it run in seconds on a CPU and still tokenize text as the model
they stand in for would.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(folder: str | Path, tokenizer_source: str | Path) -> Path:
    """A tiny random LlamaForCausalLM (hidden 64, 2 layers, GQA 4:2, tied embeddings, seed 0)
    saved in `folder`, with the tokenizer of `tokenizer_source` (a model path) as its
    tokenizer.json; returns `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanoserve.tokenizer import Tokenizer

    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    return folder


__all__ = ["save_tiny_llama"]
