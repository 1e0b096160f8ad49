"""Encoder models: BERT, XLM-RoBERTa and ModernBERT (nanoserve/model/encoder_families.py), for
embeddings, classification and cross-encoder scores over packed rows (no KV cache).

    from nanoserve.encoder import Encoder
    enc = Encoder.load("folder/")

One concept per module (the records, one per architecture, are `nanoserve.model.encoder_families`): config (config.json), layers (packed
bidirectional attention), bert / modernbert (the blocks), heads (classification heads and
their logits' meaning), weights (transformers' tensor names), model (the module and its
loader), tokenizer (texts and pairs), api (`Encoder`). Names are imported on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"Encoder": "nanoserve.encoder.api", "EncoderModel": "nanoserve.encoder.model",
         "load_encoder": "nanoserve.encoder.model", "Prediction": "nanoserve.model.labels",
         "interpret": "nanoserve.model.labels", "EncoderConfig": "nanoserve.encoder.config",
         "ENCODERS": "nanoserve.model.encoder_families"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'nanoserve.encoder' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = sorted(_LAZY)
