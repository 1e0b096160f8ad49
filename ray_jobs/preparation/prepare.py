"""Stage preparation: from input rows to generation requests, on the worker that reads
them. Which column holds the prompt, tokenization, per-row sampling values, and the rows
that become `error` rows without ever reaching the engine.

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
given (each must be in the vocabulary). Images (a vision-language model): a chat row's
image content parts, or a `prompt` row's `image` column (the row then becomes one user
turn, its images before its text), are read and decoded while the row is prepared, on the
worker, and each image's placeholder is widened to its token count
(`ray_jobs.preparation.row_images`, `nanoserve.multimodal.prompt`).

A row becomes an error row (`PreparedRow.error` set) when it could not be read (the
chunk's row errors), its id is null, its prompt is null, empty or only whitespace (text),
its bytes are not UTF-8, its messages are malformed or the template fails on them (an
unsafe operation included: a template problem touches only the chat rows, plain prompts
still run), an image of it cannot be used (missing, broken, over the size caps, a web
URL; or the model takes no images), its token ids are out of range, its prompt leaves no
room in the model's context (prompt tokens + 1 > max_position_embeddings), its per-row
sampling values are invalid (`n` outside 1-128, `logprobs` / `prompt_logprobs` outside
0-20, an empty stop string, ...), or its structured output cannot be used: a malformed
`response_format`, a schema that is not JSON or not a schema, a JSON-schema feature the
grammar engine does not enforce, a regex or grammar that does not compile, an empty choice
list, or a choice list whose every choice needs more tokens than the row's `max_tokens`. A
row that asked for n samples and fails as a whole gives n error rows (one when its `n`
itself is invalid).

Structured outputs per row: OpenAI's `response_format` or vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` columns
(`nanoserve.sampling.structured.structured_from_request`); a row that sets any of them replaces the
job's default constraint (`{"type": "text"}` asks for none). Each constraint is compiled
here once, on the driver, by one `GrammarCache` for the job (made at the first constrained
row: building it costs seconds), so a bad one is an error row before any worker. A JSON
document (schema, response format) may be JSON text or, from Parquet, a struct; a struct's
null fields are dropped (Arrow gives a struct every key any row has), so a schema that
needs a JSON `null` value is best stored as JSON text.

Job-level problems are `InputError`s, raised before any worker starts: from
`plan_columns` (no prompt column, a column of the wrong type, a name clash with an output
column) and from `RowPreparer` (invalid job sampling options or a job-wide structured
output that does not compile; chat rows for a model whose chat template is missing or
does not compile).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from nanoserve import (
    MAX_N,
    GrammarCache,
    InputError,
    ModelConfig,
    ModelError,
    NanoserveError,
    SamplingParams,
    StructuredOutputs,
    check_room,
    structured_from_request,
    token_budget,
)
from ray_jobs.input.files import DEFAULT_ID_COLUMN, InputChunk
from ray_jobs.preparation.result_columns import CONTROL_COLUMNS, RESULT_COLUMNS, result_schema
from ray_jobs.preparation.row_images import (
    IMAGE_COLUMN,
    ModelImages,
    check_takes_images,
    copies_image_column,
    image_column_kind,
    image_sources,
    plain_conversation,
    prompt_turn,
)

PROMPT_COLUMNS = ("prompt", "messages", "prompt_token_ids")  # default candidates, in order
INT_OVERRIDES = ("max_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs",
                 "max_thinking_tokens")
FLOAT_OVERRIDES = ("temperature", "top_p")
OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "logprobs",
                    "prompt_logprobs", "max_thinking_tokens")
# Per-row values that are not numbers: stop strings (a list of strings, or one string) and
# ignore_eos (true/false).
OTHER_OVERRIDES = ("stop", "ignore_eos", "choice_scores")
# Per-row structured outputs (OpenAI's and vLLM's request fields).
CONSTRAINT_COLUMNS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")
# Per-row chat-template options (vLLM's field): a JSON object, as JSON text or a struct.
TEMPLATE_KWARGS_COLUMN = "chat_template_kwargs"
# The job-wide flag of each kind of default constraint (for messages).
_FLAG_OF_KIND = {"json": "--json-schema", "regex": "--regex", "choice": "--choice"}

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
    constraint_columns: tuple[str, ...] = ()  # the CONSTRAINT_COLUMNS the input has
    template_kwargs_column: bool = False  # the input has a `chat_template_kwargs` column
    image_column: str | None = None  # the `image` column, where the input has one (not all null)

    @property
    def id_type(self) -> pa.DataType:
        if self.id_column is None:
            return pa.int64()
        return self.input_schema.field(self.id_column).type

    def prompt_of(self, values: dict[str, Any], what: str) -> tuple[str, str]:
        """(column, kind) of the first prompt column a row's `values` fill; ValueError (the
        row's error: no `what`) when every one is null."""
        for column, kind in self.prompt_columns:
            if values.get(column) is not None:
                return column, kind
        names = " / ".join(c for c, _ in self.prompt_columns)
        raise ValueError(f"no {what}: {names} is null")

    def passthrough_fields(self, controls: tuple[str, ...] = ()) -> list[pa.Field]:
        """The input columns an output row repeats: all but `id` (written first), the
        request columns `logprobs` / `prompt_logprobs` where `controls` has result columns of
        those names (the number asked is the length of each entry's `top`), and an `image`
        column of bytes (`ray_jobs.preparation.row_images`: paths are repeated, bytes are not)."""
        return [f for f in self.input_schema if f.name != "id" and f.name not in controls
                and not (f.name == self.image_column and not copies_image_column(f.type))]

    def output_schema(self, controls: tuple[str, ...] = ()) -> pa.Schema:
        """`id`, then the input columns (`passthrough_fields`), then the results
        (`ray_jobs.preparation.result_columns.result_schema(controls)`). InputError if an input column clashes with
        an output-control column."""
        if "sample_index" in controls and "sample_index" in self.input_schema.names:
            raise InputError("input column 'sample_index' clashes with the output column of "
                             "that name (rows ask for n samples); rename it")
        fields = [pa.field("id", self.id_type)] + self.passthrough_fields(controls)
        return pa.schema(fields + list(result_schema(controls)))


def output_controls(plan: ColumnPlan, defaults: dict[str, Any],
                    reasoning: bool = False) -> tuple[str, ...]:
    """The output-control columns a job's output has (see `ray_jobs.preparation.result_columns.CONTROL_SCHEMA`):
    `sample_index` when the default n is above 1 or the input has an `n` column, `logprobs`
    / `prompt_logprobs` when the job's default asks for them or the input has the column.
    A function of the options and the input's columns, never of the rows' values, so every
    part of a job has the same schema."""
    columns = set(plan.override_columns)
    out = []
    if defaults.get("n", 1) != 1 or "n" in columns:
        out.append("sample_index")
    for name in ("logprobs", "prompt_logprobs"):
        if defaults.get(name) is not None or name in columns:
            out.append(name)
    if defaults.get("choice_scores") or "choice_scores" in columns:
        out.append("choice_scores")
    if reasoning:  # a reasoning parser: `reasoning` and `num_reasoning_tokens`
        out += ["reasoning", "num_reasoning_tokens"]
    return tuple(c for c in CONTROL_COLUMNS if c in out)


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
    for n in (n for n in OTHER_OVERRIDES if n in names):
        t = schema.field(n).type
        flag = n in ("ignore_eos", "choice_scores")
        fits = pat.is_null(t) or (pat.is_boolean(t) if flag else _is_text(t) or (
            (pat.is_list(t) or pat.is_large_list(t))
            and (pat.is_null(t.value_type) or _is_text(t.value_type))))
        if not fits:
            want = "true/false" if flag else "a list of strings (or one string)"
            raise InputError(f"column {n!r} (a per-row sampling value) must hold {want}, "
                             f"not {t}")
        overrides += (n,)
    constraints = tuple(n for n in CONSTRAINT_COLUMNS if n in names)
    for n in constraints:
        t = schema.field(n).type
        if pat.is_null(t):
            continue
        if n in ("response_format", "guided_json"):
            fits, want = _is_text(t) or pat.is_struct(t), "JSON text (a string) or an object"
        elif n == "guided_choice":
            fits = ((pat.is_list(t) or pat.is_large_list(t))
                    and (pat.is_null(t.value_type) or _is_text(t.value_type)))
            want = "a list of strings"
        else:
            fits, want = _is_text(t), "text (a string)"
        if not fits:
            raise InputError(f"column {n!r} (a per-row structured output) must hold {want}, "
                             f"not {t}")
    has_kwargs = TEMPLATE_KWARGS_COLUMN in names
    if has_kwargs:
        t = schema.field(TEMPLATE_KWARGS_COLUMN).type
        if not (pat.is_null(t) or _is_text(t) or pat.is_struct(t)):
            raise InputError(f"column {TEMPLATE_KWARGS_COLUMN!r} (per-row chat-template "
                             f"options) must hold JSON text (a string) or an object, not {t}")
    images = None
    if IMAGE_COLUMN in names and image_column_kind(schema.field(IMAGE_COLUMN).type):
        images = IMAGE_COLUMN
    return ColumnPlan(prompts, id_column, overrides, schema, constraints, has_kwargs, images)


def _is_text(t: pa.DataType) -> bool:
    if pat.is_dictionary(t):
        t = t.value_type
    return pat.is_string(t) or pat.is_large_string(t) or pat.is_string_view(t)


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
    # Output rows (samples) it gives: params.n; for an error row the n it asked for, or 1
    # when that is not a valid n.
    n: int = 1
    # The prompt's images (`nanoserve.multimodal.image_input.ImageInput`), in the order of their
    # placeholders in `prompt_token_ids` (each already its image's token count long).
    images: tuple[Any, ...] = ()

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
    invalid job sampling options, a job-wide structured output (`defaults`'
    `structured_outputs`) that does not compile or, when no row overrides `max_tokens`,
    whose choices all need more tokens than the job's, and chat rows for a model whose chat
    template is missing or does not compile (a tokenizer without a `chat_template`
    attribute is not checked). `eos_token_ids`: the model's (xgrammar's stop tokens);
    `grammars`: a grammar cache to share (an engine's), else one is made when needed;
    `images`: a vision-language model's image token and image settings (None: the model
    takes no images, and a row with images is an error row)."""

    def __init__(self, plan: ColumnPlan, tokenizer: Any, max_context: int, vocab_size: int,
                 defaults: dict[str, Any], eos_token_ids: tuple[int, ...] = (),
                 grammars: GrammarCache | None = None,
                 chat_template_kwargs: dict[str, Any] | str | None = None,
                 images: ModelImages | None = None) -> None:
        from nanoserve import template_kwargs

        self.plan = plan
        self.images = images
        try:
            self.template_kwargs = template_kwargs(chat_template_kwargs,
                                                   "--chat-template-kwargs")
        except ValueError as e:
            raise InputError(str(e)) from None
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids or getattr(tokenizer, "eos_token_ids", ()))
        self.defaults = dict(defaults)
        self._grammars = grammars
        self._token_bytes: tuple[frozenset[bytes], int] | None = None
        self._shortest_choice: dict[tuple[str, ...], tuple[str, int]] = {}
        try:
            default = SamplingParams(**self.defaults)
        except ValueError as e:
            raise InputError(f"invalid sampling options: {e}") from None
        self._check_default_constraint(default)
        self._check_chat_template()

    @property
    def grammars(self) -> GrammarCache:
        """The job's one grammar cache, made at the first constraint it checks."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _check_default_constraint(self, default: SamplingParams) -> None:
        so = default.structured_outputs
        if so is None:
            return
        flag = _FLAG_OF_KIND.get(so.kind, "structured output")
        try:
            self.grammars.check(so)
            if "max_tokens" not in self.plan.override_columns and not default.choice_scores:
                self._check_choices_fit(so, default.max_tokens, "--max-tokens")
        except ValueError as e:
            raise InputError(f"invalid {flag}: {e}") from None

    def _check_chat_template(self) -> None:
        chat_columns = [c for c, kind in self.plan.prompt_columns if kind == MESSAGES
                        and not pat.is_null(self.plan.input_schema.field(c).type)]
        if not chat_columns or not hasattr(self.tokenizer, "chat_template"):
            return
        from nanoserve import ChatTemplate

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

    def prepare(self, chunk: InputChunk, first_position: int,
                read_images: bool = True) -> list[PreparedRow]:
        """The chunk's rows, prepared. A row's images are read and decoded here (on the
        worker that runs it); with `read_images` False they are not read at all, and a row
        with images gets no prompt tokens: only for rows that are made error rows without
        running (the driver's, `ray_jobs.workers.tasks.ShardRunner.run(error=...)`)."""
        out = []
        for position, row_id, values, error, parsed in read_rows(
                chunk, first_position, self.plan.id_column,
                lambda values: self._request(values, read_images)):
            ids, images, params = parsed or ((), (), None)
            n = params.n if params is not None else self._asked_n(values)
            out.append(PreparedRow(position, row_id, values, ids, params, error, n, images))
        return out

    def _request(self, values: dict[str, Any], read_images: bool
                 ) -> tuple[tuple[int, ...], tuple[Any, ...], SamplingParams]:
        ids, images = self._prompt(values, read_images)
        return ids, images, self._params(values, len(ids))

    def _asked_n(self, values: dict[str, Any]) -> int:
        """The samples an error row asked for (its `n`, else the job's), or 1 if that is not
        a valid n."""
        n = values.get("n") if "n" in self.plan.override_columns else None
        if n is None or (isinstance(n, float) and math.isnan(n)):
            n = self.defaults.get("n", 1)
        if isinstance(n, float) and n.is_integer():
            n = int(n)
        return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1

    def _prompt(self, values: dict[str, Any], read_images: bool
                ) -> tuple[tuple[int, ...], tuple[Any, ...]]:
        """The row's prompt token ids and images (see `prepare` for `read_images`)."""
        column, kind = self.plan.prompt_of(values, "prompt")
        value = values[column]
        image = values.get(self.plan.image_column) if self.plan.image_column else None
        images: tuple[Any, ...] = ()
        if image is not None and not (isinstance(image, list) and not image):
            if kind != TEXT:
                raise ValueError(f"column {IMAGE_COLUMN!r} goes with a 'prompt' (text) row, and "
                                 f"this row's prompt is column {column!r}: put a chat row's "
                                 f"images in its messages' content parts")
            text = self._text(value, column)
            if not text:
                raise ValueError(f"empty prompt (column {column!r})")
            ids, images = self._chat(prompt_turn(text, image_sources(image)), values,
                                     read_images)
        elif kind == MESSAGES:
            ids, images = self._chat(value, values, read_images)
        else:
            ids = self._encode(value, kind, column)
        if ids is None:  # images not read: no tokens
            return (), ()
        if not ids:
            raise ValueError(f"empty prompt (column {column!r})")
        check_room(len(ids), self.max_context)
        return ids, images

    def _text(self, value: Any, column: str) -> str:
        """A text prompt's string ('' when empty); ValueError for bytes that are not UTF-8
        or only whitespace."""
        value = text_of(value, column)
        if value and value.isspace():
            raise ValueError(f"empty prompt (column {column!r} holds only whitespace)")
        return value

    def _chat(self, messages: Any, values: dict[str, Any], read_images: bool
              ) -> tuple[tuple[int, ...] | None, tuple[Any, ...]]:
        """A conversation's prompt token ids and images (`nanoserve.multimodal.prompt.chat_prompt`:
        each image read, decoded and its placeholder widened), or (None, ()) for one with
        images when `read_images` is False."""
        plain, has_images = plain_conversation(messages)
        kwargs = self._row_template_kwargs(values)
        if not has_images:
            text = self._in_template(lambda: self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=True, **kwargs))
            return tuple(self.tokenizer.encode(text, add_special_tokens=False)), ()
        check_takes_images(self.images)
        if not read_images:
            return None, ()
        from nanoserve import chat_prompt

        images = self.images
        prompt = self._in_template(lambda: chat_prompt(
            self.tokenizer, images.image_token_id, images.config, plain, **kwargs))
        return tuple(prompt.token_ids), prompt.images

    def _encode(self, value: Any, kind: str, column: str) -> tuple[int, ...]:
        if kind == TEXT:
            value = self._text(value, column)
            return tuple(self.tokenizer.encode(value)) if value else ()
        return token_ids_of(value, column, self.vocab_size)

    def _row_template_kwargs(self, values: dict[str, Any]) -> dict[str, Any]:
        """The job's chat-template options, updated key by key with the row's
        `chat_template_kwargs` (ValueError, the row's error, when that is not an object)."""
        row = values.get(TEMPLATE_KWARGS_COLUMN) if self.plan.template_kwargs_column else None
        if row is None:
            return self.template_kwargs
        from nanoserve import template_kwargs

        if isinstance(row, dict):
            row = _json_value(row)
        return {**self.template_kwargs, **template_kwargs(row, TEMPLATE_KWARGS_COLUMN)}

    @staticmethod
    def _in_template(render: Any) -> Any:
        """`render()`, which runs the chat template over a row's messages (null keys already
        dropped: `plain_conversation`). The template is untrusted code: whatever it raises
        is this row's error, never the job's."""
        try:
            return render()
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
            if name == "stop":
                value = (value,) if isinstance(value, str) else tuple(value)
            if name in INT_OVERRIDES and isinstance(value, float):
                if not value.is_integer():
                    raise ValueError(f"{name} must be an integer, got {value!r}")
                value = int(value)
            fields[name] = value
        constraint = self._constraint(values)
        if constraint is not False:
            fields["structured_outputs"] = constraint
        try:
            params = SamplingParams(**fields)
        except ValueError as e:
            raise ValueError(f"invalid sampling values: {e}") from None
        budget = token_budget(params.max_tokens, num_prompt_tokens, self.max_context)
        if params.max_tokens > budget:
            params = dataclasses.replace(params, max_tokens=budget)
        if params.structured_outputs is not None and not params.choice_scores:
            self._check_choices_fit(params.structured_outputs, params.max_tokens, "max_tokens")
        return params

    def _constraint(self, values: dict[str, Any]) -> StructuredOutputs | None | bool:
        """The row's own structured output (None: it asks for none), checked by compiling
        it; False when the row sets no constraint column (the job's default applies).
        ValueError names the problem."""
        fields = {}
        for name in self.plan.constraint_columns:
            value = values.get(name)
            if value is not None:
                fields[name] = _json_value(value) if isinstance(value, dict) else value
        if not fields:
            return False
        so = structured_from_request(fields)
        if so is not None:
            self.grammars.check(so)
        return so

    def _check_choices_fit(self, so: StructuredOutputs, max_tokens: int, name: str) -> None:
        """ValueError when every choice of a choice list needs more than `max_tokens`
        tokens (so the row could only end cut short, its text none of the choices). A choice
        needs its shortest spelling in the vocabulary's tokens: the grammar allows any."""
        if so.choice is None:
            return
        if so.choice not in self._shortest_choice:  # once per choice list
            need = {c: self._min_tokens(so, c) for c in so.choice}
            shortest = min(need, key=lambda c: need[c])
            self._shortest_choice[so.choice] = (shortest, need[shortest])
        shortest, need = self._shortest_choice[so.choice]
        if need > max_tokens:
            raise ValueError(
                f"no choice of the choice list can be written within {name} ({max_tokens} "
                f"tokens): the shortest, {shortest!r}, needs {need}; raise {name}")

    def _min_tokens(self, so: StructuredOutputs, text: str) -> int:
        """The fewest tokens of the model's vocabulary (stop and special tokens aside) whose
        bytes spell `text`; a large number if none do."""
        if self._token_bytes is None:
            info = self.grammars.compile(so).tokenizer_info
            skip = set(info.stop_token_ids) | set(info.special_token_ids)
            spelled = frozenset(b for i, b in enumerate(info.decoded_vocab) if b and i not in skip)
            self._token_bytes = (spelled, max(map(len, spelled)))
        spelled, longest = self._token_bytes
        data = text.encode("utf-8")
        best = [0] + [len(data) + 1] * len(data)  # best[i]: tokens spelling data[:i]
        for i in range(1, len(data) + 1):
            for j in range(max(0, i - longest), i):
                if best[j] + 1 < best[i] and data[j:i] in spelled:
                    best[i] = best[j] + 1
        return best[-1] if best[-1] <= len(data) else 1 << 30


def read_rows(chunk: InputChunk, first_position: int, id_column: str | None,
              parse: Callable[[dict[str, Any]], Any]
              ) -> Iterator[tuple[int, Any, dict[str, Any], str | None, Any]]:
    """Each row of `chunk` as every task's preparer reads it: (its position in the input,
    its id: the position when `id_column` is None, its values, its error, `parse(values)`).
    A row that could not be read or has a null id has that error and is not parsed; one
    whose `parse` raises ValueError or TypeError (the row's own data is at fault) has its
    message; either way the parse is None."""
    for i, values in enumerate(chunk.batch.to_pylist()):
        position = first_position + i
        row_id = position if id_column is None else values[id_column]
        error = chunk.row_errors.get(i)
        if error is None and row_id is None:
            error = f"the row has no id (column {id_column!r} is null)"
        parsed = None
        if error is None:
            try:
                parsed = parse(values)
            except (ValueError, TypeError) as e:
                error = str(e)
        yield position, row_id, values, error, parsed


def text_prompt_column(given: str | None, names: list[str]) -> str | None:
    """A text task's column (embedding, classification): the one named, else each row's
    first of `PROMPT_COLUMNS` the input has, else `text`."""
    if given is None and not any(c in names for c in PROMPT_COLUMNS) and "text" in names:
        return "text"
    return given


def text_of(value: Any, column: str) -> str:
    """A text cell as a string: bytes decoded as UTF-8 (ValueError, the row's error, when
    they are not)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"column {column!r} is not valid UTF-8 ({e.reason})") from None
    return value


def token_ids_of(value: Any, column: str, vocab_size: int) -> tuple[int, ...]:
    """A token-ids cell as ints, each in the vocabulary (ValueError, the row's error, for
    one that is not)."""
    bad = [t for t in value if t is None or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"column {column!r} holds token id {bad[0]}, outside the vocabulary "
                         f"[0, {vocab_size})")
    return tuple(int(t) for t in value)


def _json_value(value: Any) -> Any:
    """A JSON document read from an Arrow struct: its null fields dropped (Arrow gives a
    struct every key that any row's object has)."""
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def load_model_meta(path: Path) -> tuple[ModelConfig, Any]:
    """The model's config and tokenizer, without loading its weights, after checking from
    the checkpoint's headers that the workers will be able to load it
    (`nanoserve.weights.weights.validate_checkpoint`: a ModelError naming the model otherwise).
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
    from nanoserve import Tokenizer, validate_checkpoint

    return validate_checkpoint(path), Tokenizer.from_path(path)
