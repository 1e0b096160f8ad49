"""Reasoning parsers: a reasoning model's output split into its thinking and its answer,
at the token level, by the think block's special tokens (vLLM's parser names).

- `qwen3`: Qwen3's template lets the model open `<think>` itself (or writes an empty block
  when `enable_thinking` is false); output that never opens a block is all answer.
- `deepseek_r1`: the R1 distills' template opens the block in the prompt, so output starts
  in reasoning whether or not it writes `<think>` again.
For both, a prompt whose last think tag is an opening `<think>` (a forced think block)
starts the output in reasoning.

Invariants:
- the split is exact on token ids: reasoning ids + answer ids + the tag tokens between them
  are the output's ids, in order; the tags belong to neither part;
- an unfinished block (no `</think>` in the output) keeps the partial reasoning, and the
  answer is empty (`finished` False): the caller reports the row's finish_reason as it
  ended ('length' when it hit max_tokens while thinking);
- a tokenizer without both tags as single tokens is a ValueError naming the parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning_ids: tuple[int, ...] | None  # None: the output has no think block
    answer_ids: tuple[int, ...]
    finished: bool  # False: the think block was still open at the output's end

    @property
    def num_reasoning_tokens(self) -> int:
        return len(self.reasoning_ids or ())


class ReasoningParser:
    """One parser bound to a tokenizer's think tags (`think_ids`: (open, close))."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose {', '.join(PARSERS)}")
        ids = tuple(tokenizer.token_to_id(t) for t in (THINK_OPEN, THINK_CLOSE))
        if None in ids:
            raise ValueError(f"reasoning parser {name!r}: the tokenizer has no single "
                             f"{THINK_OPEN} / {THINK_CLOSE} tokens")
        self.name = name
        self.tokenizer = tokenizer
        self.open_id, self.close_id = ids

    def starts_in_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """Whether output after this prompt begins inside a think block."""
        if self.name == "deepseek_r1":
            return True
        for t in reversed(prompt_ids):
            if t == self.close_id:
                return False
            if t == self.open_id:
                return True
        return False

    def split(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> ReasoningSplit:
        ids = list(output_ids)
        inside = self.starts_in_reasoning(prompt_ids)
        start = 0
        if ids and ids[0] == self.open_id:
            inside, start = True, 1
        if not inside:
            return ReasoningSplit(None, tuple(ids), True)
        try:
            end = ids.index(self.close_id, start)
        except ValueError:
            return ReasoningSplit(tuple(ids[start:]), (), False)
        return ReasoningSplit(tuple(ids[start:end]), tuple(ids[end + 1:]), True)

    def split_text(self, prompt_ids: Sequence[int], output_ids: Sequence[int]
                   ) -> tuple[str | None, str, int, bool]:
        """(reasoning text or None, answer text, reasoning tokens, finished)."""
        s = self.split(prompt_ids, output_ids)
        reasoning = None if s.reasoning_ids is None else self.tokenizer.decode(s.reasoning_ids)
        return reasoning, self.tokenizer.decode(s.answer_ids), s.num_reasoning_tokens, s.finished
