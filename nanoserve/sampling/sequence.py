"""Per-row generation state: the tokens so far, the row's sampling key, its structured
output's matcher, its logprobs, and the stop rules.

A row finishes with reason 'stop' on an EOS token (unless `ignore_eos`), on one of its
`stop_token_ids`, when its text contains one of its `stop` strings (the text is cut
before it), or when its structured output's grammar has terminated; with reason 'length'
when it has `max_tokens` tokens or the model's context is full (a constrained row's text
may then not parse); with reason 'error' when its grammar allows no next token. Finished
rows take no further tokens.

Sample i of a row asked for n samples is its own Sequence (`sample_index` i), drawing with
the row's seed + i (`row_seed`); the schedulers prefill the prompt once for all n.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.sampling.logprobs import Logprobs, entries
from nanoserve.sampling.params import SamplingParams, row_seed, token_budget


@dataclass
class SequenceOutput:
    token_ids: list[int]
    text: str | None  # None when no tokenizer was given
    finish_reason: str  # 'stop' or 'length'
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    sample_index: int = 0  # which of the row's n samples
    logprobs: Logprobs | None = None  # one TokenLogprob per token, when asked
    prompt_logprobs: Logprobs | None = None  # prompt tokens after the first
    error: str | None = None  # finish_reason 'error': why
    # Under a reasoning parser (`LLM(reasoning_parser=...)`): the think block's text (None:
    # the output has none) and tokens; `text` is then the answer alone.
    reasoning: str | None = None
    num_reasoning_tokens: int = 0


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...],
                 max_context: int, tokenizer=None, grammars=None, sample_index: int = 0) -> None:
        if not prompt_ids:
            raise ValueError("empty prompt: a row needs at least one token")
        # Tokens this row may still add: its cap, or what the context has room for
        # (ValueError for a prompt that leaves none).
        max_new = token_budget(params.max_tokens, len(prompt_ids), max_context)
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sample_index = sample_index
        self.key: int | None = row_seed(params, sample_index)  # sampling key (None: greedy)
        # What steers its tokens: the structured output's place in its grammar, or under a
        # reasoning parser (`grammars.reasoning`) a `ThinkSteer` over it (free thinking, a
        # thinking budget, the grammar from the answer's start).
        self.matcher = None
        if params.structured_outputs is not None:
            if grammars is None:
                raise ValueError("structured outputs need the engine's grammar cache")
            self.matcher = grammars.matcher(params.structured_outputs)  # ValueError if bad
        parser = getattr(grammars, "reasoning", None)
        if params.max_thinking_tokens is not None and parser is None:
            raise ValueError("max_thinking_tokens needs a reasoning parser (the engine's "
                             "reasoning_parser, --reasoning-parser)")
        if parser is not None:
            from nanoserve.sampling.reasoning import steer_for

            self.matcher = steer_for(parser, self.prompt_ids, self.matcher,
                                     params.max_thinking_tokens)
        # One row of `logprob_rows` per token (host floats), while the row runs.
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: Logprobs | None = None  # set by the prefill
        self.error: str | None = None
        self.max_new = max_new
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self.tokenizer = tokenizer
        self._detok = None
        if params.stop:
            from nanoserve.weights.tokenizer import IncrementalDetokenizer

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

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def constrained(self) -> bool:
        """A structured output still steers this row's next token."""
        return self.matcher is not None and self.finish_reason is None and not self.matcher.terminated

    def cannot_continue(self) -> None:
        """Its grammar allows no next token: the row ends with finish_reason 'error' (the
        token of the step that found it is dropped)."""
        self.error = ("the structured output's grammar allows no next token after "
                      f"{len(self.output_ids)} tokens: the constraint cannot be met")
        self.finish_reason = "error"

    def append(self, token: int, logprob=None,
               accepted: bool | None = None) -> None:
        """Add the next token. logprob: its row of `nanoserve.sampling.logprobs.logprob_rows` (made
        into a `TokenLogprob` only when the output is read); accepted: the caller already
        advanced the matcher by this token (a batch of rows at once), with this result.
        token -1: the row's grammar allowed no token (the masked argmax or draw found its
        bitmask empty): the row ends (`cannot_continue`), nothing appended."""
        if self.finish_reason is not None:
            raise RuntimeError("a finished sequence takes no tokens")
        if token < 0 and self.matcher is not None:
            self.cannot_continue()
            return
        self.output_ids.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if self.matcher is not None:
            if accepted is None and not self.matcher.terminated:
                accepted = self.matcher.accept(token)
            if accepted is False:
                self.error = f"token {token} does not follow the structured output's grammar"
                self.finish_reason = "error"
                return
            if self.matcher.terminated:  # (by this token: a terminated grammar ended its row)
                self.finish_reason = "stop"
                return
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
                              len(self.prompt_ids), self.num_cached_tokens, self.sample_index,
                              None if self.logprobs is None else entries(
                                  self.logprobs, self.output_ids, self.params.logprobs),
                              self.prompt_logprobs, self.error)


def samples_of(prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...],
               max_context: int, tokenizer=None, grammars=None) -> list[Sequence]:
    """The row's `params.n` samples, sample i drawing with the row's seed + i. Raises
    ValueError (a bad prompt or constraint) having made none."""
    return [Sequence(prompt_ids, params, eos_token_ids, max_context, tokenizer, grammars, i)
            for i in range(params.n)]
