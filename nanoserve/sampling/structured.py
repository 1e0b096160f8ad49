"""Structured outputs: a row's text held to a JSON schema, a regular expression, a list of
choices or an EBNF grammar, through xgrammar.

How a constrained row runs (both schedulers, through `nanoserve.sampling.params.sample_next`):
before each of its tokens is sampled, its `RowMatcher` (the grammar's state after the row's
tokens so far) fills one row of a token bitmask on the host, `int32 [rows, ceil(V/32)]`
(bit j of word i allows token 32*i + j); the bitmask is copied to the logits' device and
disallowed tokens' logits become -inf there, before temperature, top-k/top-p and the draw
(a greedy row: the argmax among its allowed tokens, `nanoserve_kernels/argmax.py`). The sampled token
advances the matcher (`Sequence.append`). A matcher that accepts one of the model's EOS
tokens has terminated: the row ends with finish_reason 'stop'. A row cut by max_tokens
first ends with 'length', and its text may not parse. A row whose grammar allows no token
at all (found on the device: its draw comes out -1) ends with 'error'.

`GrammarCache` (one per engine) builds xgrammar's tokenizer info once from the model's
tokenizer (tokenizer.json or GGUF: the `tokenizers` backend, with the model's whole EOS
list as stop tokens and the model's vocabulary size, so ids the tokenizer lacks are never
allowed) and compiles each distinct constraint once (errors too): a schema shared by a
million rows compiles once per worker.

What is refused, with a message naming the problem (`StructuredOutputs.problems` for the
shape, `GrammarCache.compile` for the content): not exactly one kind; a schema that is not
JSON or not a schema; a JSON-schema keyword xgrammar would silently ignore
(`UNSUPPORTED_KEYWORDS`, remote `$ref`); a regex or EBNF grammar that does not compile; an
empty choice list or a non-string choice.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where tensors are made: a job's driver checks constraints only
    import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON-schema keywords xgrammar accepts but does not enforce: a schema using them would
# produce text that does not validate, so it is refused instead.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "dependentSchemas",
                        "dependentRequired", "contains", "minContains", "maxContains",
                        "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
                        "dependencies")
_XGR_PREFIX = re.compile(r"\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class StructuredOutputs:
    """One row's constraint; exactly one field is set. `json`: a JSON schema as JSON text
    (a dict is serialised); `json_object`: any JSON object; `regex`: the whole text matches
    it; `choice`: the text is one of these strings; `grammar`: an EBNF (GBNF) grammar whose
    start rule is `root`."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            # The schema's own key order: properties are generated in it.
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, tuple):
            choice = self.choice
            object.__setattr__(self, "choice", tuple(choice) if isinstance(choice, list)
                               else choice)

    @property
    def kind(self) -> str:
        return next((k for k in KINDS if getattr(self, k) not in (None, False)), "")

    def problems(self) -> list[str]:
        """What is wrong with its shape (the content is checked by compiling it)."""
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            return [f"structured output needs exactly one of {', '.join(KINDS)}; got "
                    f"{', '.join(kinds) or 'none'}"]
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice:
                return ["guided_choice must be a non-empty list of strings"]
            if any(not isinstance(c, str) or c == "" for c in self.choice):
                return ["guided_choice must hold non-empty strings"]
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                return [f"guided_{name} must be a non-empty string"]
        if self.json is not None:
            return _schema_problems(self.json)
        return []

    def describe(self) -> str:
        return self.kind if self.kind != "json" else "json schema"


def _schema_problems(text: str) -> list[str]:
    try:
        schema = json.loads(text)
    except ValueError as e:
        return [f"the JSON schema is not valid JSON ({e})"]
    if isinstance(schema, bool):
        return [] if schema else ["the JSON schema `false` accepts no value"]
    if not isinstance(schema, dict):
        return [f"the JSON schema must be a JSON object, got {type(schema).__name__}"]
    found = _unsupported(schema)
    if found:
        return [f"the JSON schema uses {found}, which structured outputs do not support"]
    return []


def _unsupported(node: Any) -> str | None:
    """The first keyword of `UNSUPPORTED_KEYWORDS` (or a remote `$ref`) in a schema."""
    if isinstance(node, list):
        return next((f for n in node if (f := _unsupported(n))), None)
    if not isinstance(node, dict):
        return None
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"a $ref outside the schema ({ref!r})"
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            if isinstance(value, dict):
                found = next((f for v in value.values() if (f := _unsupported(v))), None)
                if found:
                    return found
            continue
        if key in ("enum", "const", "default", "examples", "required"):
            continue
        if key in UNSUPPORTED_KEYWORDS:
            return f"'{key}'"
        found = _unsupported(value)
        if found:
            return found
    return None


def structured_from_request(fields: dict[str, Any]) -> StructuredOutputs | None:
    """The constraint a request asks for, from OpenAI's `response_format` (`{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}}` or `{"type":
    "json_object"}`; `{"type": "text"}` is none) or vLLM's `guided_json` (schema as an object
    or JSON text), `guided_regex`, `guided_choice`, `guided_grammar`. Keys that are absent
    or None are not asked for. Raises ValueError for a malformed request or more than one
    constraint."""
    asked: dict[str, Any] = {}
    fmt = fields.get("response_format")
    if fmt is not None:
        if isinstance(fmt, str):
            try:
                fmt = json.loads(fmt)
            except ValueError as e:
                raise ValueError(f"response_format is not valid JSON ({e})") from None
        if not isinstance(fmt, dict) or "type" not in fmt:
            raise ValueError("response_format must be an object with a 'type'")
        kind = fmt["type"]
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError("response_format json_schema needs {'json_schema': "
                                 "{'name': ..., 'schema': {...}}}")
            asked["json"] = spec["schema"]
        elif kind == "json_object":
            asked["json_object"] = True
        elif kind != "text":
            raise ValueError(f"response_format type {kind!r} is not one of json_schema, "
                             f"json_object, text")
    for key, name in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = fields.get(key)
        if value is None:
            continue
        if name in asked:
            raise ValueError(f"{key} and response_format both ask for a constraint")
        if name == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"guided_json is not valid JSON ({e})") from None
        if name == "choice" and not isinstance(value, (list, tuple)):
            raise ValueError("guided_choice must be a list of strings")
        asked[name] = value
    if not asked:
        return None
    if len(asked) > 1:
        raise ValueError(f"a row may ask for one structured output, got {', '.join(asked)}")
    if "json" in asked and not isinstance(asked["json"], (dict, bool)):
        raise ValueError("the JSON schema must be a JSON object")
    so = StructuredOutputs(**asked)
    problems = so.problems()
    if problems:
        raise ValueError(problems[0])
    return so


_REGEX_SPECIAL = frozenset("\\.^$*+?{}[]|()/")


def _literal(text: str) -> str:
    """A regex matching exactly `text` (only the regex syntax escaped: xgrammar's regex
    reader warns on escapes of plain characters such as a space)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ValueError(f"structured outputs need the xgrammar package ({e})") from None
    return xgrammar


def _clean(message: str) -> str:
    lines = [_XGR_PREFIX.sub("", ln).strip() for ln in str(message).splitlines()]
    return next((ln for ln in lines if ln), "unknown error")


class GrammarCache:
    """xgrammar's tokenizer info for one model and the constraints compiled for it.
    `compile` is thread-safe; each constraint compiles once (its error too)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compiler = None
        self._compiled: dict[StructuredOutputs, Any] = {}
        self._lock = threading.Lock()
        # The engine's `nanoserve.sampling.reasoning.ReasoningParser`, or None: under one, a row's
        # constraint applies after its think block, and its thinking budget holds
        # (`nanoserve.sampling.sequence.Sequence`).
        self.reasoning = None

    @property
    def words(self) -> int:
        """int32 words in one row of the bitmask."""
        return -(-self.vocab_size // 32)

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            backend = self.tokenizer.backend
            vocab = backend.get_vocab(with_added_tokens=True)
            encoded = [""] * max(len(vocab), max(vocab.values()) + 1)
            for token, i in vocab.items():
                encoded[i] = token
            encoded = encoded[: self.vocab_size]
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=self.vocab_size,
                                     stop_token_ids=list(self.eos_token_ids),
                                     add_prefix_space=meta["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, so: StructuredOutputs) -> Any:
        """xgrammar's compiled grammar for `so`; ValueError with a user's message if it does
        not compile."""
        with self._lock:
            hit = self._compiled.get(so)
            if hit is None:
                hit = self._compile(so)
                self._compiled[so] = hit
        if isinstance(hit, ValueError):
            raise ValueError(str(hit))
        return hit

    def check(self, so: StructuredOutputs) -> None:
        """Raise ValueError if `so` cannot be used (shape or content)."""
        problems = so.problems()
        if problems:
            raise ValueError(problems[0])
        self.compile(so)

    def _compile(self, so: StructuredOutputs) -> Any:
        problems = so.problems()
        if problems:
            return ValueError(problems[0])
        compiler = self._get_compiler()
        try:
            if so.json is not None:
                return compiler.compile_json_schema(so.json, any_whitespace=False)
            if so.json_object:  # OpenAI's json_object: any JSON object (not any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.regex is not None:
                return compiler.compile_regex(so.regex)
            if so.choice is not None:
                return compiler.compile_regex("|".join(_literal(c) for c in so.choice))
            return compiler.compile_grammar(so.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every kind
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(
                so.kind, so.kind)
            return ValueError(f"the {what} could not be compiled: {_clean(str(e))}")

    def matcher(self, so: StructuredOutputs) -> RowMatcher:
        return RowMatcher(self.compile(so), self.words, self.eos_token_ids)


class RowMatcher:
    """One row's place in its grammar."""

    def __init__(self, compiled: Any, words: int, stop_ids: tuple[int, ...] = ()) -> None:
        self.stop_ids = frozenset(stop_ids)
        self._m = _xgrammar().GrammarMatcher(compiled)
        self.words = words
        self.terminated = False  # it accepted a stop token: the grammar is done

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (never for
        a token sampled under this row's mask)."""
        ok = bool(self._m.accept_token(int(token)))
        self.terminated = bool(self._m.is_terminated())
        return ok

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of `bitmask` (int32, CPU)."""
        self._m.fill_next_token_bitmask(bitmask, index)


def allocate_bitmask(rows: int, words: int, pin: bool = False) -> torch.Tensor:
    """An all-allowed host bitmask [rows, words] int32 (pinned: for a CUDA device)."""
    import torch

    return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)


_fillers = threading.local()  # xgrammar's batch filler, one per thread that fills


def _filler():
    """This thread's xgrammar batch filler, on NANOSERVE_GRAMMAR_THREADS threads ("auto":
    half the machine's hardware threads, xgrammar's default)."""
    filler = getattr(_fillers, "filler", None)
    if filler is None:
        threads = os.environ.get("NANOSERVE_GRAMMAR_THREADS", "auto")
        filler = _fillers.filler = _xgrammar().BatchGrammarMatcher(
            "auto" if threads == "auto" else max(1, int(threads)))
    return filler


def accept_tokens(matchers: list[RowMatcher], tokens: list[int]) -> list[bool]:
    """Advance each matcher by its token, all in one call; whether each was allowed."""
    if len(matchers) <= 1:
        return [matchers[0].accept(tokens[0])] if matchers else []
    if any(not isinstance(m, RowMatcher) for m in matchers):  # a reasoning row's ThinkSteer
        plain = [j for j, m in enumerate(matchers) if isinstance(m, RowMatcher)]
        ok = [True] * len(matchers)
        for j, m in enumerate(matchers):
            if not isinstance(m, RowMatcher):
                ok[j] = m.accept(tokens[j])
        for j, a in zip(plain, accept_tokens([matchers[j] for j in plain],
                                             [tokens[j] for j in plain])):
            ok[j] = a
        return ok
    tokens = [int(t) for t in tokens]
    ok = _batch_accept([m._m for m in matchers], tokens)
    for m, t in zip(matchers, tokens):
        if t in m.stop_ids:  # only a stop token ends a grammar
            m.terminated = bool(m._m.is_terminated())
    return ok


def _batch_accept(matchers: list, tokens: list[int]) -> list[bool]:
    """xgrammar's batch accept. Its wrapper turns the result into bools one element at a time
    (0.3-0.45 ms for 256 rows, more than the accept itself); here, when the result holds no 0
    (one test in xgrammar's core: every token accepted, the usual case), that is read at once.
    Where xgrammar's internals differ, its public call."""
    core = getattr(getattr(_xgrammar(), "base", None), "_core", None)
    try:
        result = core.BatchGrammarMatcher.batch_accept_token(
            [m._handle for m in matchers], tokens, False)
    except (AttributeError, TypeError):
        return list(_filler().batch_accept_token(matchers, tokens))
    if len(result) == len(tokens) and type(result[0]) is int and 0 not in result:
        return [True] * len(tokens)
    return [bool(result[i]) for i in range(len(result))]


def fill_bitmasks(matchers: list[RowMatcher], bitmask: torch.Tensor,
                  rows: list[int] | None = None) -> None:
    """Row rows[j] (default: j) of `bitmask` <- the allowed next tokens of matchers[j], for
    all rows at once on xgrammar's thread pool; other rows of `bitmask` are left alone.
    (xgrammar lets go of the GIL while it fills: `FillThread` runs this beside the host's
    Python.) A row that allows no token is found on the device, by the masked argmax or
    draw (`nanoserve.sampling.params.sample_next`: token -1), not here."""
    if any(not isinstance(m, RowMatcher) for m in matchers):  # a reasoning row's ThinkSteer
        rows = list(range(len(matchers))) if rows is None else list(rows)
        plain = [j for j, m in enumerate(matchers) if isinstance(m, RowMatcher)]
        for j, m in enumerate(matchers):
            if not isinstance(m, RowMatcher):
                m.fill(bitmask, rows[j])
        if plain:
            fill_bitmasks([matchers[j] for j in plain], bitmask, [rows[j] for j in plain])
    elif len(matchers) == 1:
        matchers[0].fill(bitmask, 0 if rows is None else rows[0])
    else:
        _filler().batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)


class FillThread:
    """`fill_bitmasks` on a thread of its own, so the host's Python work runs beside it:
    xgrammar releases the GIL while it fills. `start` hands a fill over and returns once the
    thread has taken it; `wait` returns when it is done (raising what it raised). One fill
    at a time; the caller must not touch the matchers' state or the bitmask rows in
    between (reading them is fine: the fill does not advance a matcher)."""

    def __init__(self) -> None:
        self._job: tuple | None = None
        self._error: BaseException | None = None
        self._go, self._taken, self._done = threading.Event(), threading.Event(), threading.Event()
        self._done.set()
        self._thread = threading.Thread(target=self._run, name="nanoserve-mask-fill",
                                        daemon=True)
        self._thread.start()

    def start(self, matchers: list[RowMatcher], bitmask: torch.Tensor,
              rows: list[int] | None = None) -> None:
        if not self._done.is_set():
            raise RuntimeError("a mask fill is already running")
        self._job, self._error = (matchers, bitmask, rows), None
        self._done.clear()
        self._taken.clear()
        self._go.set()
        self._taken.wait()  # (this thread lets go of the GIL here, so the fill starts now)

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            job, self._job = self._job, None
            self._taken.set()
            try:
                fill_bitmasks(*job)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by `wait`
                self._error = exc
            self._done.set()


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bool mask [n, vocab] of a bitmask [n, ceil(vocab/32)] int32 (bit j of word w:
    token 32 w + j), on the bitmask's device."""
    from nanoserve_kernels.argmax import allowed_mask

    return allowed_mask(bitmask, vocab)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits set to -inf, in place. logits [n, V] (any float dtype);
    bitmask [n, ceil(V/32)] int32 on the logits' device."""
    return logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Each row's argmax among its allowed tokens: [n] int64, -1 for a row that allows none.
    logits [n, V] stay unchanged (a half-precision row's argmax is its float32's, as the
    unmasked argmax). One Triton launch pair on a GPU (`nanoserve_kernels.argmax`)."""
    from nanoserve_kernels.backend import masked_argmax as _masked_argmax

    return _masked_argmax(logits, bitmask)


def check_labels(labels: Sequence[str]) -> tuple[str, ...]:
    """The labels as a tuple; ValueError (one line) for an empty list, a label that is not
    a non-empty string, or a label given twice (a tie no score can break)."""
    labels = tuple(labels)
    if not labels:
        raise ValueError("choice scores need at least one label (the choice list is empty)")
    for label in labels:
        if not isinstance(label, str) or not label:
            raise ValueError(f"a label must be a non-empty string, got {label!r}")
    seen = set()
    for label in labels:
        if label in seen:
            raise ValueError(f"label {label!r} is given twice: the labels must differ")
        seen.add(label)
    return labels


__all__ = ["FillThread", "GrammarCache", "RowMatcher", "StructuredOutputs", "accept_tokens",
           "allocate_bitmask", "allowed_tokens", "apply_bitmask", "check_labels",
           "fill_bitmasks", "masked_argmax", "structured_from_request"]
