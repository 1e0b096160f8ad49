"""`Encoder`: an encoder checkpoint's embeddings, classifications and pair scores.

    enc = Encoder.load("cross-encoder/")                    # BERT, XLM-R or ModernBERT folder
    vectors = enc.embed(["a text", "another"])              # [2, d] float32 (pooled, see below)
    logits = enc.classify(["great film", "dull"])          # [2, num_labels] float32
    logits = enc.score([("query", "passage"), ...])         # [B, num_labels]: cross-encoder
    preds = enc.predict(logits)                             # labels + probs, or scores

All outputs are float32 on the CPU, in input order. Rows are packed back to back into
batches of at most `max_batch_tokens` tokens (a longer row runs alone) and cut to the
model's max positions by the tokenizer. `embed` runs nanoserve/embed.py's `Embedder` over
the base model (pooling from the folder's sentence-transformers files, else mean,
normalised); `classify` and `score` need a `*ForSequenceClassification` checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanoserve.embed import DEFAULT_MAX_BATCH_TOKENS, Embedder, _dtype
from nanoserve.encoder.model import EncoderModel, load_encoder
from nanoserve.encoder.tokenizer import EncoderTokenizer
from nanoserve.model.labels import Prediction, interpret
from nanoserve.options import ENGINE


class Encoder:
    def __init__(self, model: EncoderModel, folder: str | Path,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        self.model = model
        self.config = model.config
        self.folder = Path(folder)
        self.tokenizer = EncoderTokenizer.from_folder(folder, self.config.max_position_embeddings)
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self._embedders: dict[tuple, Embedder] = {}

    @classmethod
    def load(cls, folder: str | Path, dtype: str | torch.dtype = ENGINE["dtype"].default, device: str = "auto",
             max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> Encoder:
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                           if device == "auto" else device)
        return cls(load_encoder(folder, _dtype(dtype, dev), dev), folder, max_batch_tokens)

    def embed(self, texts: Sequence[str], **pooling: Any) -> torch.Tensor:
        """[B, dim] float32: `Embedder.embed` on this model (pooling options as its)."""
        key = tuple(sorted(pooling.items()))
        if key not in self._embedders:
            self._embedders[key] = Embedder.for_encoder(self.model, self.folder,
                                                        self.max_batch_tokens, **pooling)
        return self._embedders[key].embed(list(texts))

    def classify(self, texts: Sequence[str]) -> torch.Tensor:
        """Texts -> logits [B, num_labels] float32."""
        return self._logits(*self.tokenizer.encode(texts))

    def score(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor:
        """(text_1, text_2) pairs -> logits [B, num_labels] float32 (segment ids 0 / 1)."""
        return self._logits(*self.tokenizer.encode_pairs(pairs))

    def classify_ids(self, ids: Sequence[Sequence[int]],
                     types: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Token ids already tokenized (and cut) by `tokenizer`, with their segment ids (None:
        all 0) -> logits [B, num_labels] float32."""
        ids = [list(r) for r in ids]
        types = [list(t) for t in types] if types is not None else [[0] * len(r) for r in ids]
        return self._logits(ids, types)

    def predict(self, logits: torch.Tensor) -> list[Prediction]:
        """Logits -> one Prediction per row, by the config's problem_type (`nanoserve.model.labels.interpret`)."""
        return interpret(logits, self.config)

    @torch.inference_mode()
    def _logits(self, ids: list[list[int]], types: list[list[int]]) -> torch.Tensor:
        out = torch.empty(len(ids), self.config.num_labels, dtype=torch.float32)
        dev = self.model.device
        start = 0
        while start < len(ids):
            end, total = start, 0
            while end < len(ids) and (end == start or total + len(ids[end]) <= self.max_batch_tokens):
                total += len(ids[end])
                end += 1
            lens = torch.tensor([len(r) for r in ids[start:end]])
            cu = torch.zeros(len(lens) + 1, dtype=torch.long)
            cu[1:] = torch.cumsum(lens, 0)
            flat = torch.tensor([t for r in ids[start:end] for t in r], device=dev)
            tt = torch.tensor([t for r in types[start:end] for t in r], device=dev)
            out[start:end] = self.model.classify(flat, cu.to(dev), tt).float().cpu()
            start = end
        return out


__all__ = ["Encoder"]
