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

Steering while a row runs (`ThinkSteer`, made by `Sequence` when the engine has a parser
and the row has a structured output or a thinking budget): the row thinks freely; its
structured output applies from the token after `</think>` (the grammar's start is the
answer's start); with `max_thinking_tokens` N the think block holds at most N tokens: at N
the engine forces `</think>` itself (as the N-th token it forces a newline first, when the
tokenizer has one as a single token and the block's last token does not already end a
line, as the templates write it), and the answer follows. A qwen3 row whose prompt has not
opened a block may open one with its first token (its first mask allows `<think>` beside
the grammar's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.model.families import by_architecture
from nanoserve.options import ENGINE

# What `reasoning_parser` may say (declared in `nanoserve.options.ENGINE`): "auto" picks from
# the model family where that is certain (`pick_parser`), "none" turns the split off, and
# the parsers' names.
CHOICES = ENGINE["reasoning_parser"].choices
PARSERS = tuple(c for c in CHOICES if c not in ("auto", "none"))
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
        ids = _think_ids(name, tokenizer)
        self.name = name
        self.tokenizer = tokenizer
        self.open_id, self.close_id = ids
        nl = tokenizer.encode("\n", add_special_tokens=False)
        self.newline_id: int | None = nl[0] if len(nl) == 1 else None
        self._ends_line: dict[int, bool] = {}

    def ends_line(self, token: int) -> bool:
        """Whether `token`'s text ends with a newline (cached per token)."""
        hit = self._ends_line.get(token)
        if hit is None:
            hit = self._ends_line[token] = self.tokenizer.decode([token]).endswith("\n")
        return hit

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


FREE, MAY_OPEN, THINKING, ANSWER = "free", "may_open", "thinking", "answer"


def _bit(token: int) -> tuple[int, int]:
    """(word, int32 value) of `token`'s bit in a bitmask row."""
    v = 1 << (token % 32)
    return token // 32, v - (1 << 32) if v >= 1 << 31 else v


class ThinkSteer:
    """One row's steering under a reasoning parser, used where a structured output's
    matcher is (`nanoserve.sampling.structured.fill_bitmasks`, `accept_tokens`): free while it
    thinks, the forced end of the block once its budget is spent, its grammar (if any) from
    the answer's first token. `accept` advances it by each token, in order."""

    def __init__(self, parser: ReasoningParser, prompt_ids: Sequence[int], grammar: Any = None,
                 budget: int | None = None) -> None:
        self.parser, self.grammar, self.budget = parser, grammar, budget
        self.stop_ids = frozenset(grammar.stop_ids) if grammar is not None else frozenset()
        self.num_reasoning = 0
        self.last = prompt_ids[-1] if prompt_ids else None
        self.forced: list[int] = []
        if parser.starts_in_reasoning(prompt_ids):
            self.phase = THINKING
        else:
            self.phase = MAY_OPEN
        self._plan()

    @property
    def terminated(self) -> bool:
        return self.phase == ANSWER and self.grammar is not None and self.grammar.terminated

    @property
    def thinking(self) -> bool:
        return self.phase == THINKING

    def _plan(self) -> None:
        """In a block: the tokens to force next, once the budget says so."""
        if self.phase != THINKING or self.budget is None or self.forced:
            return
        p = self.parser
        if self.num_reasoning >= self.budget:
            self.forced = [p.close_id]
        elif (self.num_reasoning == self.budget - 1 and p.newline_id is not None
              and not (self.last is not None and p.ends_line(self.last))):
            self.forced = [p.newline_id]

    def accept(self, token: int) -> bool:
        token = int(token)
        if self.forced:
            if token != self.forced[0]:
                return False
            self.forced.pop(0)
        p = self.parser
        ok = True
        if self.phase == MAY_OPEN:
            if token == p.open_id:
                self.phase = THINKING
            else:
                self.phase = ANSWER
                if self.grammar is not None:
                    ok = self.grammar.accept(token)
        elif self.phase == THINKING:
            if token == p.close_id:
                self.phase = ANSWER
            else:
                self.num_reasoning += 1
        elif self.grammar is not None:
            ok = self.grammar.accept(token)
        self.last = token
        self._plan()
        return ok

    def fill(self, bitmask: Any, index: int) -> None:
        """Row `index` of the host bitmask: the forced token alone, every token while it
        thinks freely (or before a qwen3 row opened a block, without a grammar), its grammar's
        tokens in the answer (before the answer: and `<think>`)."""
        row = bitmask[index]
        if self.forced:
            word, value = _bit(self.forced[0])
            row.zero_()
            row[word] = value
        elif self.grammar is None or self.phase == THINKING:
            row.fill_(-1)
        else:
            self.grammar.fill(bitmask, index)
            if self.phase == MAY_OPEN:
                word, value = _bit(self.parser.open_id)
                row[word] = int(row[word]) | value


def steer_for(parser: ReasoningParser | None, prompt_ids: Sequence[int], grammar: Any,
              budget: int | None) -> Any:
    """What steers a row: its grammar's matcher alone (or None) without a parser or without
    a reason to steer its thinking; else a `ThinkSteer`."""
    if parser is None or (grammar is None and budget is None):
        return grammar
    return ThinkSteer(parser, prompt_ids, grammar, budget)


def has_think_tags(tokenizer: Any) -> bool:
    return all(tokenizer.token_to_id(t) is not None for t in (THINK_OPEN, THINK_CLOSE))


def _think_ids(name: str, tokenizer: Any) -> tuple[int, int]:
    """The tokenizer's (<think>, </think>) ids; ValueError naming parser `name` without them."""
    ids = tuple(tokenizer.token_to_id(t) for t in (THINK_OPEN, THINK_CLOSE))
    if None in ids:
        raise ValueError(f"reasoning parser {name!r}: the tokenizer has no single "
                         f"{THINK_OPEN} / {THINK_CLOSE} tokens")
    return ids  # type: ignore[return-value]


def opens_think_in_prompt(tokenizer: Any) -> bool:
    """Whether the chat template's generation prompt ends inside an opened think block (the
    DeepSeek-R1 distills', QwQ's, the Qwen3 thinking-only models')."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - no template, or one that needs more than this
        return False
    return text.rstrip().endswith(THINK_OPEN)


def pick_parser(architecture: str, tokenizer: Any) -> tuple[str | None, str]:
    """The reasoning parser the model family calls for (its `reasoning_parser` in
    nanoserve/model/families.py), where certain, and why (one phrase for the job summary). None
    where the tokenizer has no single <think> / </think> tokens, or the family is not known
    to think."""
    if not has_think_tags(tokenizer):
        return None, "the tokenizer has no <think> / </think> tokens"
    if opens_think_in_prompt(tokenizer):
        return "deepseek_r1", "its chat template opens <think> in the prompt"
    family = by_architecture(architecture)
    if family is not None and family.reasoning_parser is not None:
        return family.reasoning_parser, f"a {family.name} model with <think> / </think> tokens"
    return None, "the model family is not known to think (give --reasoning-parser)"


def choose_reasoning_parser(option: str | None, architecture: str, tokenizer: Any
                            ) -> tuple[str | None, str | None]:
    """What the engine will run for `reasoning_parser` `option` ("auto", "none"/None, or a
    parser's name) on a model of `architecture` with `tokenizer`, decided without building a
    parser: (the parser's name, or None for no split; a line saying which and why, or None
    where nothing was asked of a model that cannot think: `option` auto/none and no think
    tags). Passing the name on as an `LLM`'s `reasoning_parser` runs that parser. ValueError
    for an unknown name or a tokenizer without the tags (a parser given by name)."""
    name, line = _choose(option, architecture, tokenizer)
    if option in (None, "none", "auto") and not has_think_tags(tokenizer):
        return name, None  # a model that cannot think: nothing to say
    return name, line


def resolve_parser(name: str | None, architecture: str, tokenizer: Any
                   ) -> tuple[ReasoningParser | None, str]:
    """The parser for `reasoning_parser` `name` ("auto", "none"/None, or a parser's name)
    and a line saying which and why (`LLM.__init__`, once per engine). ValueError for an
    unknown name or a tokenizer without the tags (a parser given by name)."""
    picked, line = _choose(name, architecture, tokenizer)
    return (ReasoningParser(picked, tokenizer) if picked else None), line


def _choose(option: str | None, architecture: str, tokenizer: Any) -> tuple[str | None, str]:
    """(the parser's name or None, the line saying which and why) for `option`."""
    if option is None or option == "none":
        return None, "reasoning parser: none"
    if option == "auto":
        picked, why = pick_parser(architecture, tokenizer)
        if picked is None:
            return None, f"reasoning parser: none ({why})"
        return picked, f"reasoning parser: {picked} (auto: {why})"
    if option not in PARSERS:
        raise ValueError(f"unknown reasoning parser {option!r}; choose {', '.join(CHOICES)}")
    _think_ids(option, tokenizer)
    return option, f"reasoning parser: {option}"


def split_completions(parser: ReasoningParser | None, prompts: Sequence[Any],
                      params: Sequence[Any], outs: list[Any]) -> list[Any]:
    """Under a parser, each completion (`SequenceOutput`, in place; a prompt's n samples
    consecutive) with its think block split from its answer: `reasoning`,
    `num_reasoning_tokens`, and `text` the answer alone (an error's text untouched). The
    engine's one place for the split (`LLM.generate`, `EngineLoop`'s results). A prompt is
    token ids or a `MultimodalPrompt` (its `token_ids`)."""
    if parser is None:
        return outs
    owners = [getattr(p, "token_ids", p) for p, sp in zip(prompts, params) for _ in range(sp.n)]
    for prompt, out in zip(owners, outs, strict=True):
        reasoning, answer, n, _ = parser.split_text(prompt, out.token_ids)
        out.reasoning, out.num_reasoning_tokens = reasoning, n
        if out.finish_reason != "error":
            out.text = answer
    return outs
