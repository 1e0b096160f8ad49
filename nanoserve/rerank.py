"""A causal LM as a reranker, the way Qwen3-Reranker's model card runs it: a (query,
document) pair is a chat prompt whose answer is "yes" or "no", and its score is the
probability of "yes" against "no" at the prompt's last position.

    rr = Reranker.load("Qwen3-Reranker-0.6B/")              # a *ForCausalLM folder
    p = rr.rerank([("what is a panda?", "The giant panda is a bear."), ...])  # [B] in [0, 1]
    logits = rr.score(pairs)                                # [B, 2]: ("no", "yes") logits

The prompt, as the model card writes it (`PREFIX`, the user turn, `SUFFIX`):

    <|im_start|>system\\nJudge whether the Document meets the requirements based on the Query
    and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\\n
    <|im_start|>user\\n<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {doc}
    <|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

(the system line is one line; the assistant turn opens with an empty think block). It is
tokenized as the card does: prefix and suffix alone, without special tokens, and the user
turn's text between them cut from its end to the limit less their length (`truncated`). The
instruction defaults to the card's (`DEFAULT_INSTRUCTION`).

The score is softmax over the LM's logits of the tokens "no" and "yes" (the vocabulary's
tokens of those names, as the card's `convert_tokens_to_ids`) at the last position, its
"yes" entry: one packed prefill without a KV cache (nanoserve/embed.py's `pooled_prefill`,
the last token's final normed hidden state), times those two rows of the LM head. So the
reranker reads as a two-label classifier with labels ("no", "yes") (`config.id2label`), and
the score job's two-label rule, the probability of label 1, is P(yes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from nanoserve.errors import InputError, ModelError
from nanoserve.options import ENGINE

SYSTEM_PROMPT = ('Judge whether the Document meets the requirements based on the Query and the '
                 'Instruct provided. Note that the answer can only be "yes" or "no".')
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
LABELS = ("no", "yes")  # the two logits, in this order: the score is label 1's probability
_TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")


def user_turn(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The user turn's text of one pair (the model card's `format_instruction`)."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


class RerankTokenizer:
    """A (query, document) pair to the reranker's prompt ids, at most `max_tokens` long.

    Invariants: every row is `prefix + user turn ids + suffix`; only the user turn is cut (from
    its end); `label_ids` are the ("no", "yes") token ids. ModelError when the vocabulary
    lacks one of them or of the chat format's tokens; InputError when the limit leaves no
    room for the user turn."""

    def __init__(self, backend: tokenizers.Tokenizer, max_tokens: int,
                 instruction: str | None = None, source: str = "the tokenizer") -> None:
        self.backend, self.max_tokens = backend, max_tokens
        self.instruction = instruction or DEFAULT_INSTRUCTION
        missing = [t for t in (*LABELS, *_TEMPLATE_TOKENS) if backend.token_to_id(t) is None]
        if missing:
            raise ModelError(f"{source} has no token {missing[0]!r}: a reranker is a causal LM "
                             f"with Qwen3-Reranker's chat format and single 'yes' / 'no' tokens")
        self.label_ids = tuple(backend.token_to_id(t) for t in LABELS)
        self.prefix = backend.encode(PREFIX, add_special_tokens=False).ids
        self.suffix = backend.encode(SUFFIX, add_special_tokens=False).ids
        self.budget = max_tokens - len(self.prefix) - len(self.suffix)
        if self.budget < 1:
            raise InputError(f"the input limit of {max_tokens} tokens leaves no room for a pair "
                             f"beside the reranker's prompt ({max_tokens - self.budget} tokens)")

    @classmethod
    def from_folder(cls, folder: str | Path, max_tokens: int,
                    instruction: str | None = None) -> RerankTokenizer:
        from nanoserve.weights.tokenizer import Tokenizer

        return cls(Tokenizer.from_path(folder).backend, max_tokens, instruction, str(folder))

    def with_limit(self, max_tokens: int) -> RerankTokenizer:
        return type(self)(self.backend, max_tokens, self.instruction)

    def with_instruction(self, instruction: str) -> RerankTokenizer:
        return type(self)(self.backend, self.max_tokens, instruction)

    def encode_row(self, query: str, document: str | None = None
                   ) -> tuple[list[int], list[int], bool]:
        """One pair -> (prompt ids, segment ids (all 0, unused), whether the pair was cut)."""
        if document is None:
            raise InputError("a reranker scores (query, document) pairs, not single texts")
        middle = self.backend.encode(user_turn(query, document, self.instruction),
                                     add_special_tokens=False).ids
        ids = self.prefix + middle[:self.budget] + self.suffix
        return ids, [0] * len(ids), len(middle) > self.budget

    def encode_pairs(self, pairs: Sequence[tuple[str, str]]
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """(query, document) pairs -> (ids, segment ids) per pair, each cut to max_tokens."""
        for i, p in enumerate(pairs):
            if (not isinstance(p, (tuple, list)) or len(p) != 2
                    or not all(isinstance(t, str) and t.strip() for t in p)):
                raise InputError(f"pair {i} is not two non-empty texts")
        rows = [self.encode_row(q, d) for q, d in pairs]
        return [r[0] for r in rows], [r[1] for r in rows]


def reranker_config(config: Any) -> Any:
    """A causal LM's `ModelConfig` read as the reranker's head: two labels ("no", "yes"),
    single-label (softmax over the two)."""
    return dataclasses.replace(config, num_labels=len(LABELS), id2label=LABELS,
                               problem_type="single_label_classification")


class Reranker:
    """A causal LM's last-position "no" / "yes" logits over prompts of pairs (see the module
    docstring); the classifiers' face (nanoserve/classify.py's `Classifier`)."""

    def __init__(self, model: Any, tokenizer: RerankTokenizer,
                 max_batch_tokens: int | None = None) -> None:
        if model.config.headless:
            raise ModelError(f"a reranker needs an LM head; {model.config.architecture} has none")
        self.model = model
        self.config = reranker_config(model.config)
        self.tokenizer = tokenizer
        from nanoserve.embed import DEFAULT_MAX_BATCH_TOKENS

        self.max_batch_tokens = max(1, int(max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS))
        # the LM head's rows of "no" and "yes": [2, d] (two logits, not the vocabulary's)
        self.head = model.lm_head.weight[list(tokenizer.label_ids)].detach()

    @classmethod
    def load(cls, folder: str | Path, dtype: Any = ENGINE["dtype"].default, device: str = "auto",
             max_batch_tokens: int | None = None, instruction: str | None = None) -> Reranker:
        """A *ForCausalLM checkpoint folder as a reranker (no KV pool)."""
        import torch

        from nanoserve.embed import _dtype
        from nanoserve.model.model import build_model
        from nanoserve.weights.weights import load_checkpoint

        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                           if device == "auto" else device)
        config, state = load_checkpoint(folder)
        tokenizer = RerankTokenizer.from_folder(folder, config.max_position_embeddings,
                                                instruction)
        model = build_model(config, state, _dtype(dtype, dev), dev)
        return cls(model, tokenizer, max_batch_tokens)

    def classify_ids(self, ids: Sequence[Sequence[int]], types: Any = None) -> Any:
        """Prompt ids (from `tokenizer`) -> logits [B, 2] float32 on the CPU: ("no", "yes")."""
        import torch
        import torch.nn.functional as F

        from nanoserve.embed import pooled_prefill, token_batches

        rows = [list(r) for r in ids]
        out = torch.empty(len(rows), len(LABELS), dtype=torch.float32)
        with torch.inference_mode():
            for start, end in token_batches([len(r) for r in rows], self.max_batch_tokens):
                last = pooled_prefill(self.model, rows[start:end], "last")  # [b, d] float32
                out[start:end] = F.linear(last.to(self.head.dtype), self.head).float().cpu()
        return out

    def score(self, pairs: Sequence[tuple[str, str]]) -> Any:
        """(query, document) pairs -> logits [B, 2] float32: ("no", "yes")."""
        return self.classify_ids(self.tokenizer.encode_pairs(pairs)[0])

    def rerank(self, pairs: Sequence[tuple[str, str]]) -> Any:
        """(query, document) pairs -> P(yes) [B] float32: softmax over ("no", "yes")."""
        return self.score(pairs).softmax(-1)[:, 1]

    def predict(self, logits: Any) -> list[Any]:
        """Logits -> one `Prediction` per row (label "yes" or "no", both probabilities)."""
        from nanoserve.model.labels import interpret

        return interpret(logits, self.config)


__all__ = ["DEFAULT_INSTRUCTION", "LABELS", "PREFIX", "SUFFIX", "SYSTEM_PROMPT", "RerankTokenizer",
           "Reranker", "reranker_config", "user_turn"]
