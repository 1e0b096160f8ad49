"""An encoder checkpoint as one module: `body` (BERT's or ModernBERT's blocks) and, for a
classification checkpoint, `head` (nanoserve/encoder/heads.py).

    model = load_encoder("bert-folder/", torch.float32, torch.device("cpu"))
    hidden = model.encode(ids, cu_seqlens)              # [N, d]: rows packed back to back
    logits = model.classify(ids, cu_seqlens, types)     # [B, num_labels]

Inputs: ids [N] long, the rows back to back; cu_seqlens [B + 1] their offsets (row b owns
ids[cu[b]:cu[b+1]], every row at least one token and at most
`config.max_position_embeddings`); token_type_ids [N] (BERT's segments; None: all 0).
No KV cache and no causal mask: one forward per batch, nothing kept after it.
`hidden_states` is the decoder models' signature (nanoserve/embed.py's `Embedder` runs it):
ids [1, N], positions ignored (an encoder counts them per row), meta's `cu_seqlens`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanoserve.encoder.bert import BertEncoder
from nanoserve.encoder.config import EncoderConfig, read_encoder_config
from nanoserve.encoder.heads import build_head
from nanoserve.encoder.layers import PackedRows
from nanoserve.encoder.modernbert import ModernBertEncoder
from nanoserve.encoder.weights import load_into, read_tensors
from nanoserve.errors import InputError, ModelError
from nanoserve.model.encoder_families import is_encoder_config


class EncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.body = BertEncoder(cfg) if cfg.family.kind == "bert" else ModernBertEncoder(cfg)
        self.head = build_head(cfg)

    @property
    def device(self) -> torch.device:
        return self.body.word.weight.device

    def _rows(self, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> PackedRows:
        rows = PackedRows.from_cu_seqlens(cu_seqlens.to(ids.device))
        if len(rows.lens) == 0 or int(rows.lens.min()) < 1 or int(rows.cu_seqlens[-1]) != len(ids):
            raise InputError("cu_seqlens must split the ids into rows of at least one token")
        if rows.max_len > self.config.max_position_embeddings:
            raise InputError(f"a row has {rows.max_len} tokens, more than the model's "
                             f"{self.config.max_position_embeddings}")
        return rows

    def encode(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [N, d] of packed rows."""
        return self.body(ids, self._rows(ids, cu_seqlens), token_type_ids)

    def classify(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, num_labels] of packed rows (ModelError for a base model)."""
        if self.head is None:
            raise ModelError(f"{self.config.architecture} has no classification head")
        rows = self._rows(ids, cu_seqlens)
        return self.head(self.body(ids, rows, token_type_ids), rows)

    def hidden_states(self, ids: torch.Tensor, positions: Any, cache: Any, meta: Any,
                      token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's signature: ids [1, N] -> [1, N, d] (see the module docstring)."""
        del positions, cache
        return self.encode(ids[0], meta.cu_seqlens, token_type_ids)[None]


def is_encoder_folder(path: str | Path) -> bool:
    """Whether `path` is a checkpoint folder whose config.json names a supported encoder."""
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        d = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(d, dict) and is_encoder_config(d)


@torch.inference_mode()
def load_encoder(path: str | Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> EncoderModel:
    """A checkpoint folder (config.json + safetensors) as an EncoderModel in eval mode."""
    cfg = read_encoder_config(path)
    with torch.device("cpu"):
        model = EncoderModel(cfg)
    load_into(model, cfg, read_tensors(path), str(path))
    return model.to(device=device, dtype=dtype).eval()


__all__ = ["EncoderModel", "is_encoder_folder", "load_encoder"]
