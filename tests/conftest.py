"""Shared pytest fixtures. Each section belongs to one area of the engine; keep sections apart."""

from __future__ import annotations

import pytest

# --- weights / model store: the real default model and its transformers oracle -------------


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """The default model's GGUF file, fetched into the user's cache (`$NANOSERVE_CACHE` or
    ~/.cache/nanoserve) at most once per machine."""
    from nanoserve.model_store import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' `LlamaForCausalLM` loaded from the same GGUF file (float32, eval mode):
    the oracle for weights, logits and greedy tokens. Loaded once per session (~15 s)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        smollm2_gguf_path.parent,
        gguf_file=smollm2_gguf_path.name,
        dtype=torch.float32,
        local_files_only=True,
    )
    return model.eval()


# --- end of weights / model store fixtures ---------------------------------------------------
