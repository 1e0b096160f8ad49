"""From input rows to generation requests, on the driver: which column holds the prompt,
tokenization, per-row sampling values, and the rows that become `error` rows without ever
reaching a worker.

Which column is the prompt (`plan_columns`):
- `--prompt-column NAME`: that column, read as text (string), chat messages (list of
  {role, content}) or token ids (list of int) according to its type;
- otherwise every present column among `prompt` (text), `messages` (chat) and
  `prompt_token_ids` (ids) is a candidate, and each row uses the first of them, in that
  order, that is not null in the row. So one JSONL file may mix `prompt` rows and
  `messages` rows.

How a prompt becomes tokens: text is `tokenizer.encode(text)` (the model's BOS rule);
chat messages are rendered with the model's chat template (generation prompt added) and
encoded without adding special tokens (the template writes them); token ids are used as
given (each must be in the vocabulary).

A row becomes an error row (`PreparedRow.error` set) when it could not be read (the
chunk's row errors), its id is null, its prompt is null, empty or only whitespace (text),
its bytes are not UTF-8, its messages are malformed or the template fails on them (an
unsafe operation included: a template problem touches only the chat rows, plain prompts
still run), its token ids are out of range, its prompt leaves no room in the model's
context (prompt tokens + 1 > max_position_embeddings), or its per-row sampling values are
invalid. Job-level problems are `InputError`s, raised before any worker starts: from
`plan_columns` (no prompt column, a column of the wrong type, a name clash with an output
column) and from `RowPreparer` (invalid job sampling options; chat rows for a model whose
chat template is missing or does not compile).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from nanoserve.config import ModelConfig
from nanoserve.errors import InputError, ModelError, NanoserveError
from nanoserve.sampling import SamplingParams
from ray_jobs.io import DEFAULT_ID_COLUMN, RESULT_COLUMNS, RESULT_SCHEMA, InputChunk

PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")  # default candidates, in order
INT_OVERRIDES = ("max_tokens", "top_k", "seed")
FLOAT_OVERRIDES = ("temperature", "top_p")
OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed")

TEXT, MESSAGES, TOKEN_IDS = "text", "messages", "token_ids"
_KIND_OF_NAME = {"prompt": TEXT, "messages": MESSAGES, "prompt_token_ids": TOKEN_IDS}
_HINTS = {(MESSAGES, TEXT): " (JSON text? store each conversation as a list of objects, "
                             "not as a string)",
          (TOKEN_IDS, TEXT): " (for prompt text use a 'prompt' column)"}
_KIND_WORDS = {TEXT: "text (string)", MESSAGES: "chat messages (list of {role, content})",
               TOKEN_IDS: "token ids (list of int)"}


@dataclass(frozen=True)
class ColumnPlan:
    """How the job reads its input's columns. `prompt_columns` are (column, kind) pairs in
    order of preference; `id_column` is None when ids are row positions."""

    prompt_columns: tuple[tuple[str, str], ...]
    id_column: str | None
    override_columns: tuple[str, ...]
    input_schema: pa.Schema

    @property
    def id_type(self) -> pa.DataType:
        if self.id_column is None:
            return pa.int64()
        return self.input_schema.field(self.id_column).type

    def output_schema(self) -> pa.Schema:
        """`id`, then every input column (an input `id` column only once), then the results."""
        fields = [pa.field("id", self.id_type)]
        fields += [f for f in self.input_schema if f.name != "id"]
        return pa.schema(fields + list(RESULT_SCHEMA))


def _kind_of_type(t: pa.DataType) -> str | None:
    """The prompt kind a column of type `t` holds; None for an all-null column; '' if none."""
    if pat.is_null(t):
        return None
    if pat.is_dictionary(t):  # pandas categoricals, dictionary-encoded Parquet columns
        t = t.value_type
    if pat.is_string_view(t) or pat.is_binary_view(t):  # polars' strings
        return TEXT
    if pat.is_string(t) or pat.is_large_string(t) or pat.is_binary(t) or pat.is_large_binary(t):
        return TEXT
    if pat.is_list(t) or pat.is_large_list(t):
        item = t.value_type
        if pat.is_integer(item):
            return TOKEN_IDS
        if pat.is_struct(item) and {"role", "content"} <= {f.name for f in item}:
            return MESSAGES
    return ""


def plan_columns(schema: pa.Schema, prompt_column: str | None = None,
                 id_column: str | None = None) -> ColumnPlan:
    """Decide how to read `schema`; every job-level problem is an InputError listing the
    columns found."""
    names = schema.names
    found = ", ".join(repr(n) for n in names) or "(none)"
    if prompt_column is not None:
        if prompt_column not in names:
            raise InputError(f"no column {prompt_column!r} (--prompt-column); columns found: {found}")
        kind = _kind_of_type(schema.field(prompt_column).type)
        if kind == "":
            raise InputError(
                f"column {prompt_column!r} has type {schema.field(prompt_column).type}; a prompt "
                f"column holds {', '.join(_KIND_WORDS.values())}"
            )
        prompts = ((prompt_column, kind or TEXT),)
    else:
        prompts = tuple((n, _KIND_OF_NAME[n]) for n in PROMPT_COLUMNS if n in names)
        if not prompts:
            raise InputError(
                "no prompt column: expected 'prompt' (text), 'messages' (chat) or "
                f"'prompt_token_ids', or name one with --prompt-column; columns found: {found}"
            )
        for name, kind in prompts:
            found_kind = _kind_of_type(schema.field(name).type)
            if found_kind not in (kind, None):
                raise InputError(
                    f"column {name!r} has type {schema.field(name).type}; it must hold "
                    f"{_KIND_WORDS[kind]}{_HINTS.get((kind, found_kind), '')}"
                )
    if id_column is not None and id_column not in names:
        raise InputError(f"no column {id_column!r} (--id-column); columns found: {found}")
    if id_column is None and DEFAULT_ID_COLUMN in names:
        id_column = DEFAULT_ID_COLUMN
    if id_column is not None and id_column != "id" and "id" in names:
        raise InputError(
            f"the input has an 'id' column but ids come from {id_column!r}; the output's 'id' "
            f"column would clash: rename one of them"
        )
    clashes = [n for n in names if n in RESULT_COLUMNS]
    if clashes:
        raise InputError(
            f"input column(s) {', '.join(map(repr, clashes))} clash with output columns; "
            f"rename them"
        )
    overrides = tuple(n for n in OVERRIDE_COLUMNS if n in names)
    for n in overrides:
        t = schema.field(n).type
        if not (pat.is_null(t) or pat.is_integer(t) or pat.is_floating(t)):
            raise InputError(f"column {n!r} (a per-row sampling value) must be numeric, not {t}")
    return ColumnPlan(prompts, id_column, overrides, schema)


@dataclass(frozen=True)
class PreparedRow:
    """One input row, ready for a batch. Exactly one of (`params`, `error`) is set; an error
    row has no tokens and never goes to a worker."""

    position: int  # 0-based place in the input stream
    id: Any
    values: dict[str, Any]  # the input columns, passed through to the output
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams | None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params is not None else 0


class RowPreparer:
    """Turns input chunks into `PreparedRow`s. `defaults` are SamplingParams fields (the
    job's options); per-row override columns replace them where not null.

    Built before any worker starts, it refuses (InputError) what would fail every row:
    invalid job sampling options, and chat rows for a model whose chat template is missing
    or does not compile (a tokenizer without a `chat_template` attribute is not checked)."""

    def __init__(self, plan: ColumnPlan, tokenizer: Any, max_context: int, vocab_size: int,
                 defaults: dict[str, Any]) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.defaults = dict(defaults)
        try:
            SamplingParams(**self.defaults)
        except ValueError as e:
            raise InputError(f"invalid sampling options: {e}") from None
        self._check_chat_template()

    def _check_chat_template(self) -> None:
        chat_columns = [c for c, kind in self.plan.prompt_columns if kind == MESSAGES
                        and not pat.is_null(self.plan.input_schema.field(c).type)]
        if not chat_columns or not hasattr(self.tokenizer, "chat_template"):
            return
        from nanoserve.chat_template import ChatTemplate

        source = self.tokenizer.chat_template
        if not source:
            raise InputError(
                f"the input has chat messages (column {chat_columns[0]!r}) but the model has "
                f"no chat template; give prompt text or prompt token ids instead"
            )
        try:
            ChatTemplate(source)
        except NanoserveError as e:
            raise InputError(f"the input has chat messages (column {chat_columns[0]!r}) but "
                             f"{e}") from None

    def prepare(self, chunk: InputChunk, first_position: int) -> list[PreparedRow]:
        rows = chunk.batch.to_pylist()
        out = []
        for i, values in enumerate(rows):
            position = first_position + i
            row_id = position if self.plan.id_column is None else values[self.plan.id_column]
            error = chunk.row_errors.get(i)
            if error is None and row_id is None:
                error = f"the row has no id (column {self.plan.id_column!r} is null)"
            ids: tuple[int, ...] = ()
            params = None
            if error is None:
                try:
                    ids = self._prompt_ids(values)
                    params = self._params(values, len(ids))
                except (ValueError, TypeError) as e:  # the row's own data is at fault
                    error, ids, params = str(e), (), None
            out.append(PreparedRow(position, row_id, values, ids, params, error))
        return out

    def _prompt_ids(self, values: dict[str, Any]) -> tuple[int, ...]:
        for column, kind in self.plan.prompt_columns:
            value = values.get(column)
            if value is not None:
                ids = self._encode(value, kind, column)
                break
        else:
            names = " / ".join(c for c, _ in self.plan.prompt_columns)
            raise ValueError(f"no prompt: {names} is null")
        if not ids:
            raise ValueError(f"empty prompt (column {column!r})")
        if len(ids) + 1 > self.max_context:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_context} "
                f"tokens, which leaves no room to generate"
            )
        return ids

    def _encode(self, value: Any, kind: str, column: str) -> tuple[int, ...]:
        if kind == TEXT:
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"column {column!r} is not valid UTF-8 ({e.reason})") from None
            if value and value.isspace():
                raise ValueError(f"empty prompt (column {column!r} holds only whitespace)")
            return tuple(self.tokenizer.encode(value)) if value else ()
        if kind == MESSAGES:
            text = self._render_chat(value)
            return tuple(self.tokenizer.encode(text, add_special_tokens=False))
        bad = [t for t in value if t is None or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"column {column!r} holds token id {bad[0]}, outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        return tuple(int(t) for t in value)

    def _render_chat(self, messages: Any) -> str:
        """The chat template's text for one row's messages. Keys whose value is null are
        dropped first (Arrow gives every message every key any message has). The template is
        untrusted code: whatever it raises is this row's error, never the job's."""
        if isinstance(messages, list):
            messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict)
                        else m for m in messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TypeError, NanoserveError):
            raise
        except Exception as e:  # e.g. ZeroDivisionError, RecursionError inside the template
            raise ValueError(f"chat template failed on this conversation: "
                             f"{type(e).__name__}: {e}") from None

    def _params(self, values: dict[str, Any], num_prompt_tokens: int) -> SamplingParams:
        fields = dict(self.defaults)
        for name in self.plan.override_columns:
            value = values.get(name)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            if name in INT_OVERRIDES and isinstance(value, float):
                if not value.is_integer():
                    raise ValueError(f"{name} must be an integer, got {value!r}")
                value = int(value)
            fields[name] = value
        try:
            params = SamplingParams(**fields)
        except ValueError as e:
            raise ValueError(f"invalid sampling values: {e}") from None
        room = self.max_context - num_prompt_tokens  # >= 1, checked with the prompt
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        return params


def load_model_meta(path: Path) -> tuple[ModelConfig, Any]:
    """The model's config and tokenizer, without loading its weights, after checking from
    the checkpoint's headers that the workers will be able to load it
    (`nanoserve.weights.validate_checkpoint`: a ModelError naming the model otherwise).
    Kept for the next job of this process while the model's files keep their sizes and
    mtimes."""
    path = path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    try:
        return _load_model_meta(path, stamp)
    except ModelError as e:  # say which model, where the message does not
        if str(path) in str(e) or path.name in str(e):
            raise
        raise ModelError(f"model {path}: {e}") from None


@functools.lru_cache(maxsize=2)
def _load_model_meta(path: Path, stamp: tuple) -> tuple[ModelConfig, Any]:
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import validate_checkpoint

    return validate_checkpoint(path), Tokenizer.from_path(path)
