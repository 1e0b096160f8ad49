"""An encoder's tokenizer: its folder's `tokenizer.json` (WordPiece for BERT, Unigram for
XLM-R, BPE for ModernBERT) through the `tokenizers` library, for texts and text pairs. A
decoder classifier's texts and pairs too (nanoserve/classify.py: byte-level BPE, its own
post-processor's BOS or EOS, segment ids unused), as transformers' fast tokenizer gives them.

Invariants: each encoding carries the tokenizer's own special tokens (its post-processor:
[CLS] a [SEP] b [SEP] for BERT, <s> a </s></s> b </s> for XLM-R) and segment ids
(token_type_ids: 0 for the first text and its specials, 1 for the second's in BERT's
template); encodings longer than `max_tokens` are cut by the library's `longest_first`
strategy, as transformers' fast tokenizers cut with `truncation=True`: tokens come off the
longer text of a pair first, the special tokens stay. Padding is off.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from nanoserve.errors import InputError, ModelError


class EncoderTokenizer:
    instruction = None  # no prompt around the texts (a reranker's tokenizer has one)

    def __init__(self, backend: tokenizers.Tokenizer, max_tokens: int) -> None:
        self.backend = backend
        self.max_tokens = max_tokens
        backend.no_padding()
        backend.enable_truncation(max_length=max_tokens, strategy="longest_first")

    @classmethod
    def from_folder(cls, folder: str | Path, max_tokens: int) -> EncoderTokenizer:
        file = Path(folder) / "tokenizer.json"
        if not file.is_file():
            raise ModelError(f"{folder}: no tokenizer.json (nanoserve needs a fast tokenizer file)")
        try:
            return cls(tokenizers.Tokenizer.from_file(str(file)), max_tokens)
        except Exception as e:  # the library raises a bare Exception on bad content
            raise ModelError(f"{file} could not be loaded: {e}") from None

    def with_limit(self, max_tokens: int) -> EncoderTokenizer:
        """The same tokenizer cutting to `max_tokens` (self when it already does), on a copy
        of the backend: this one keeps its own limit."""
        if max_tokens == self.max_tokens:
            return self
        return type(self)(tokenizers.Tokenizer.from_str(self.backend.to_str()), max_tokens)

    def encode(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Texts -> (ids, token_type_ids) per text, cut to max_tokens."""
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t.strip():
                raise InputError(f"input {i} is empty or not a string")
        encs = self.backend.encode_batch(list(texts))
        return [e.ids for e in encs], [e.type_ids for e in encs]

    def encode_pairs(self, pairs: Sequence[tuple[str, str]]
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """(text_1, text_2) pairs -> (ids, token_type_ids) per pair, cut to max_tokens."""
        for i, p in enumerate(pairs):
            if (not isinstance(p, (tuple, list)) or len(p) != 2
                    or not all(isinstance(t, str) and t.strip() for t in p)):
                raise InputError(f"pair {i} is not two non-empty texts")
        encs = self.backend.encode_batch([(a, b) for a, b in pairs])
        return [e.ids for e in encs], [e.type_ids for e in encs]

    def encode_row(self, text: str, text_2: str | None = None
                   ) -> tuple[list[int], list[int], bool]:
        """One text (or pair) -> (ids, token_type_ids, whether it was cut to max_tokens)."""
        enc = self.backend.encode(text) if text_2 is None else self.backend.encode(text, text_2)
        return enc.ids, enc.type_ids, bool(enc.overflowing)


def read_encoder_classifier(folder: str | Path) -> tuple[Any, EncoderTokenizer]:
    """A sequence-classification encoder's config and tokenizer, without its weights.
    ModelError, one line naming the supported architectures, for anything else (a decoder,
    a GGUF file, a base encoder without a head)."""
    from nanoserve.encoder.config import read_encoder_config
    from nanoserve.model.encoder_families import ENCODERS

    heads = ", ".join(f.architecture for f in ENCODERS)
    path = Path(folder)
    config = path / "config.json" if path.is_dir() else None
    arch = "no config.json"
    if config is not None and config.is_file():
        try:
            d = json.loads(config.read_text())
            arch = repr((d.get("architectures") or [d.get("model_type")])[0])
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, IndexError):
            arch = "an unreadable config.json"
    try:
        if config is None:
            raise ModelError("not a folder")
        cfg = read_encoder_config(path)
    except ModelError:
        raise ModelError(f"model {path} ({arch}) is not an encoder with a sequence-"
                         f"classification head; classify and score run {heads}") from None
    if cfg.headless:
        raise ModelError(f"model {path} ({cfg.architecture}) has no sequence-classification "
                         f"head; classify and score run {heads}")
    return cfg, EncoderTokenizer.from_folder(path, cfg.max_position_embeddings)


__all__ = ["EncoderTokenizer", "read_encoder_classifier"]
