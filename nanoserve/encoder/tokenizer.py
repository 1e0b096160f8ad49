"""An encoder's tokenizer: its folder's `tokenizer.json` (WordPiece for BERT, Unigram for
XLM-R, BPE for ModernBERT) through the `tokenizers` library, for texts and text pairs.

Invariants: each encoding carries the tokenizer's own special tokens (its post-processor:
[CLS] a [SEP] b [SEP] for BERT, <s> a </s></s> b </s> for XLM-R) and segment ids
(token_type_ids: 0 for the first text and its specials, 1 for the second's in BERT's
template); encodings longer than `max_tokens` are cut by the library's `longest_first`
strategy, as transformers' fast tokenizers cut with `truncation=True`: tokens come off the
longer text of a pair first, the special tokens stay. Padding is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers

from nanoserve.errors import InputError, ModelError


class EncoderTokenizer:
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


__all__ = ["EncoderTokenizer"]
