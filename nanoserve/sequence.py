"""Per-row generation state: the tokens so far, the row's sampling key, and the stop rules.

A row finishes with reason 'stop' on an EOS token (unless `ignore_eos`), on one of its
`stop_token_ids`, or when its text contains one of its `stop` strings (the text is cut
before it); with reason 'length' when it has `max_tokens` tokens or the model's context
is full. Finished rows take no further tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.sampling import SamplingParams, row_seed


@dataclass
class SequenceOutput:
    token_ids: list[int]
    text: str | None  # None when no tokenizer was given
    finish_reason: str  # 'stop' or 'length'
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...],
                 max_context: int, tokenizer=None) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt: a row needs at least one token")
        if len(prompt_ids) >= max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {max_context}"
            )
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.key: int | None = row_seed(params)  # the row's sampling key (None: greedy)
        # Tokens this row may still add: its cap, or what the context has room for.
        self.max_new = min(params.max_tokens, max_context - len(prompt_ids))
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self.tokenizer = tokenizer
        self._detok = None
        if params.stop:
            from nanoserve.tokenizer import IncrementalDetokenizer

            self._detok = IncrementalDetokenizer(tokenizer)
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self.output_ids: list[int] = []
        self.num_cached_tokens = 0  # set by a scheduler that found the prompt's prefix cached
        self.finish_reason: str | None = None
        self._stop_text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token: int) -> None:
        if self.finished:
            raise RuntimeError("a finished sequence takes no tokens")
        self.output_ids.append(token)
        if token in self._stop_ids:
            self.finish_reason = "stop"
        elif self._detok is not None and self._hit_stop_string(token):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new:
            self.finish_reason = "length"

    def _hit_stop_string(self, token: int) -> bool:
        before = len(self._detok.text)
        self._detok.push(token)
        text = self._detok.text
        start = max(0, before - self._max_stop_len + 1)
        hits = [i for s in self.params.stop if (i := text.find(s, start)) != -1]
        if hits:
            self._stop_text = text[: min(hits)]
            return True
        return False

    def output(self) -> SequenceOutput:
        if self._stop_text is not None:
            text = self._stop_text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        else:
            text = None
        return SequenceOutput(list(self.output_ids), text, self.finish_reason or "length",
                              len(self.prompt_ids), self.num_cached_tokens)
