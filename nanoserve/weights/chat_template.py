"""Chat templates: Jinja2 templates that turn a conversation into prompt text, rendered the
way Hugging Face tokenizers render them, inside a sandbox.

A chat template ships with the model (GGUF metadata or `tokenizer_config.json`), so it is
untrusted code. It is rendered in Jinja2's `ImmutableSandboxedEnvironment` with the options and
helpers transformers gives templates (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, a
`{% generation %}` block, `raise_exception`, `strftime_now`, a JSON `tojson`), so a model's
template renders here exactly as it does there.

Invariants:
- a template never reaches Python internals: every unsafe attribute access or call ends the
  render with `ValueError("chat template tried unsafe operation: ...")`; nothing is rendered
  in its place;
- the template sees only plain data (str, int, float, bool, None, lists, tuples, dicts) rebuilt
  from the caller's arguments, never the caller's objects, so it cannot change them;
- every problem with the conversation (the caller's input) is a `ValueError` with a message
  that names the offending message; a template that does not compile is a `ModelError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoserve.errors import ModelError


def validate_messages(messages: Any, content_parts: bool = False) -> list[dict[str, Any]]:
    """Check a conversation and return a plain copy of it.

    A conversation is a non-empty list (or tuple) of dicts, each with a string `role` and a
    string `content`; other keys (e.g. `name`) are kept, except those whose value is None
    (templates test for a key's presence). With `content_parts` (a vision-language model) a
    content may also be a list of parts, dicts with a string `type` (OpenAI's content
    parts). Raises ValueError naming the first bad message.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            "messages must be a list of {'role': str, 'content': str} dicts, "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{i}] must be a dict with string 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r}")
            if key == "content" and content_parts and isinstance(message[key], list):
                _check_parts(message[key], i)
            elif not isinstance(message[key], str):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a string, "
                    f"got {type(message[key]).__name__}"
                )
        plain.append({_plain(k): _plain(v) for k, v in message.items() if v is not None})
    return plain


def _check_parts(parts: list, i: int) -> None:
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise ValueError(f"messages[{i}]['content'][{j}] must be a dict with a string 'type'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}]['content'][{j}] is a text part without string 'text'")


class ChatTemplate:
    """One compiled chat template.

    `ChatTemplate(source)` compiles `source` (ModelError if it is not valid Jinja);
    `.render(messages, add_generation_prompt=..., bos_token=..., ...)` returns the prompt text.
    """

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source:
            raise ModelError("the model's chat template is empty or not text")
        self.source = source
        try:
            self._template = _ENVIRONMENT.from_string(source)
        except TemplateSyntaxError as e:
            raise ModelError(f"the model's chat template is not valid Jinja (line {e.lineno}): "
                             f"{e.message}") from None

    def variables(self) -> frozenset[str]:
        """The names the template reads from its context (Jinja's undeclared variables:
        `messages`, `bos_token`, options such as `enable_thinking`, ...). An option outside
        them changes nothing in the rendered text."""
        import jinja2.meta

        return frozenset(jinja2.meta.find_undeclared_variables(_ENVIRONMENT.parse(self.source)))

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        content_parts: bool = False,
        **variables: Any,
    ) -> str:
        """Render a conversation. `variables` are further template variables (bos_token,
        eos_token, tools, documents, ...), passed as plain data.

        Raises ValueError when the messages are malformed, when the template rejects them
        (its `raise_exception`), fails on them, or tries an unsafe operation.
        """
        context = {k: _plain(v) for k, v in variables.items()}
        context["messages"] = validate_messages(messages, content_parts)
        context["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(**context)
        except SecurityError as e:
            raise ValueError(f"chat template tried unsafe operation: {e}") from None
        except _TemplateRaised as e:
            raise ValueError(f"chat template rejected the conversation: {e}") from None
        except (TemplateError, TypeError) as e:  # e.g. an undefined key used, `str + int`
            raise ValueError(f"chat template failed on this conversation: "
                             f"{type(e).__name__}: {e}") from None


class _TemplateRaised(TemplateError):
    """Raised by a template's own `raise_exception(message)`."""


class _Undefined(jinja2.Undefined):
    """Jinja's lenient undefined (templates rely on it: a missing key renders as ''), except
    when the value stands for a refused unsafe access: that one raises SecurityError as soon
    as it is used in any way, printing included, so a probe cannot pass silently."""

    __slots__ = ()

    def _refused(self) -> bool:
        return self._undefined_exception is SecurityError

    def __str__(self) -> str:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__str__()

    def __iter__(self):  # type: ignore[override]
        if self._refused():
            self._fail_with_undefined_error()
        return super().__iter__()

    def __bool__(self) -> bool:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__bool__()

    def __len__(self) -> int:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__len__()


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    at inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (no dunder smuggling)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Dict:
    """`dict(...)` for templates without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _plain(value: Any) -> Any:
    """A copy of `value` made only of JSON-like builtins (exact str/int/float/bool/None,
    list, tuple, dict); anything else becomes the placeholder '<TypeName>'."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


MAX_PRODUCT_SIZE = 1 << 20  # longest string/list a template may build with * (and |int ** cap)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` intercepted so a template cannot build a huge string,
    list or number (`{{ 'a' * 10**9 }}`) and exhaust memory."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, int) and abs(right) > 64:
                raise SecurityError("exponent too large in chat template")
            return left**right
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                if len(seq) * n > MAX_PRODUCT_SIZE:
                    raise SecurityError("chat template tried to build a value over 1 MiB")
        return left * right


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        undefined=_Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


_ENVIRONMENT = _make_environment()


# Variables the renderer sets itself; template options may not replace them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "content_parts")


def template_kwargs(value: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """Chat-template options (vLLM's `chat_template_kwargs`, e.g. `{"enable_thinking":
    false}`) as a plain dict: `value` is None (no options), a mapping, or its JSON text.

    Invariant: the options only ever become template variables (plain data, see `_plain`),
    never code. ValueError, one line naming `name`, when `value` is not a JSON object with
    string keys or sets a variable the renderer owns (`messages`, `add_generation_prompt`).
    """
    if value is None:
        return {}
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{name} keys must be strings, got {bad[0]!r}")
    reserved = [k for k in value if k in RESERVED_TEMPLATE_VARIABLES]
    if reserved:
        raise ValueError(f"{name} may not set {reserved[0]!r} (the renderer sets it)")
    return {k: _plain(v) for k, v in value.items()}
