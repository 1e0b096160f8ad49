"""Text <-> token ids, built on the `tokenizers` library, for a Hugging Face folder
(`tokenizer.json`) or a GGUF file (byte-level BPE rebuilt from its vocabulary and merges).

GGUF facts this module relies on (llama.cpp's conventions):
- `tokenizer.ggml.model == "gpt2"` is byte-level BPE: `tokens` are spelled in GPT-2's byte
  alphabet, `merges` are "left right" pairs in priority order;
- `token_type` 3 (CONTROL) marks special tokens such as `<|im_end|>` (matched whole in text,
  dropped by `decode(skip_special_tokens=True)`), 4 (USER_DEFINED) marks added tokens that are
  matched whole but are not special;
- `tokenizer.ggml.pre` names the rule that splits text before BPE. llama.cpp defines these
  rules in `llama-vocab.cpp`; `_PRE_TOKENIZER_RULES` maps the names nanoserve supports to the
  same rules expressed with `tokenizers` pre-tokenizers. `smollm` (as `starcoder`) first splits
  off every number character (`\\p{N}`), then applies GPT-2's regex;
- BOS is added only where `tokenizer.ggml.add_bos_token` is true.

Invariant: `encode(decode(ids))` is not promised, but `decode(encode(text))` is `text` for
byte-level vocabularies (special tokens included when `skip_special_tokens=False`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from nanoserve.errors import ModelError

if TYPE_CHECKING:  # imported where a template is compiled: jinja2 costs ~0.2 s to import
    from nanoserve.weights.chat_template import ChatTemplate

_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4

# GPT-2's regex, as `ByteLevel(use_regex=True)` applies it.
_GPT2 = "gpt2"
# llama.cpp's STARCODER/SMOLLM rule: `\p{N}` split off, one character each, then GPT-2's regex.
_DIGITS_THEN_GPT2 = "digits+gpt2"
# Llama 3's regex (llama.cpp's LLAMA3 rule), then bytes without a further regex.
_LLAMA3 = "llama3"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's regex (llama.cpp's QWEN2 rule, also Qwen2.5's and Qwen3's): Llama 3's with every
# number character on its own, then bytes without a further regex.
_QWEN2 = "qwen2"
_SPLITS = {
    _LLAMA3: _LLAMA3_SPLIT,
    _QWEN2: _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
}

_PRE_TOKENIZER_RULES = {
    None: _GPT2,  # files written before `tokenizer.ggml.pre` existed
    "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}

# GGUF metadata keys read here (llama.cpp names).
_GGUF_KEYS = (
    "model", "pre", "tokens", "merges", "token_type", "bos_token_id", "eos_token_id",
    "eot_token_id", "eom_token_id", "unknown_token_id", "padding_token_id", "add_bos_token",
    "add_eos_token",
)


class Tokenizer:
    """A model's tokenizer: `encode`/`encode_batch`/`decode`, its special ids and its chat
    template. Build one with `Tokenizer.from_path`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer | str,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        source: str = "",
    ) -> None:
        """backend: a ready `tokenizers.Tokenizer` (its post-processor decides BOS/EOS), or
        its JSON text, parsed on first use (`from_prepared`);
        special_tokens: template variables such as {'bos_token': '<s>'};
        source: where it came from, for error messages."""
        self._backend_obj = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._backend_json = None if self._backend_obj is not None else backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(eos_token_ids)
        self._pad_token_id = pad_token_id
        self._chat_template_source = chat_template or None
        self._chat_template: ChatTemplate | None = None  # compiled on first use
        self._special_tokens = dict(special_tokens or {})
        self._source = source

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A `.gguf` file, or a folder with `tokenizer.json` (plus optional
        `tokenizer_config.json`, `chat_template.jinja`, `config.json`,
        `generation_config.json`). Every problem is a ModelError naming the path."""
        path = Path(path).expanduser()
        if path.is_dir():
            return cls.from_folder(path)
        if path.is_file() and path.suffix == ".gguf":
            from nanoserve.weights.model_store import PreparedCacheError, prepared_default_model

            prepared = prepared_default_model(path, _prepared_contents)  # converted once
            if prepared is not None:
                try:
                    return cls.from_prepared(prepared.read_bytes("tokenizer.json").decode(),
                                             prepared.read_json("tokenizer_meta.json"),
                                             source=str(path))
                except PreparedCacheError as e:
                    prepared.discard(e)  # written again on the next load
            return cls.from_gguf(path)
        if not path.exists():
            raise ModelError(f"no such tokenizer path: {path}")
        raise ModelError(f"{path}: expected a .gguf file or a folder with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str | Path, reader: Any = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes. `reader`: an already open
        `gguf.GGUFReader` of that file (opening one parses all metadata: seconds)."""
        path = Path(path)
        meta = _read_gguf_tokenizer_metadata(path, reader)
        backend = _gguf_backend(meta, path)
        tokens = meta["tokens"]

        def token(i: int | None) -> str | None:
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos_id, eos_id, pad_id = (meta["bos_token_id"], meta["eos_token_id"],
                                  meta["padding_token_id"])
        eos_ids = _unique(meta[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id"))
        specials = {
            "bos_token": token(bos_id),
            "eos_token": token(eos_id),
            "unk_token": token(meta["unknown_token_id"]),
            "pad_token": token(pad_id),
        }
        _set_post_processor(backend, bool(meta["add_bos_token"]), bool(meta["add_eos_token"]),
                            bos=(token(bos_id), bos_id), eos=(token(eos_id), eos_id), source=path)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            chat_template=meta["chat_template"],
            special_tokens={k: v for k, v in specials.items() if v is not None},
            source=str(path),
        )

    def to_prepared(self) -> tuple[str, dict[str, Any]]:
        """This tokenizer as text: the backend's JSON and the rest as a JSON-able dict;
        `from_prepared` of the two gives the same tokenizer (the default model's prepared
        copy, `nanoserve.weights.model_store`)."""
        meta = {"bos_token_id": self._bos_token_id, "eos_token_ids": list(self._eos_token_ids),
                "pad_token_id": self._pad_token_id, "chat_template": self._chat_template_source,
                "special_tokens": self._special_tokens}
        return self._backend.to_str(), meta

    @classmethod
    def from_prepared(cls, backend_json: str, meta: dict[str, Any], source: str) -> Tokenizer:
        """The tokenizer `to_prepared` wrote. Its special ids and template are read now; the
        backend's JSON is parsed on first use (about 0.2 s for a 50k vocabulary: a worker
        given token ids loads without it, and parses it when its first rows' text is
        decoded). Raises the prepared cache's error on metadata
        that does not load; backend text that does not parse (its sha256 matched, so only a
        changed library would cause it) is rebuilt from the `.gguf` file `source` then."""
        from nanoserve.weights.model_store import PreparedCacheError

        try:
            return cls(backend_json, bos_token_id=meta["bos_token_id"],
                       eos_token_ids=meta["eos_token_ids"], pad_token_id=meta["pad_token_id"],
                       chat_template=meta["chat_template"],
                       special_tokens=meta["special_tokens"], source=source)
        except (KeyError, TypeError) as e:
            raise PreparedCacheError(f"prepared tokenizer of {source}: {e!r}") from None

    @property
    def _backend(self) -> tokenizers.Tokenizer:
        # JSON from `from_prepared`, parsed on first use (the text is kept: two threads that
        # meet here both parse it, and either result serves)
        if self._backend_obj is None:
            self._backend_obj = _parse_prepared_backend(self._backend_json, self._source)
        return self._backend_obj

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder. Special ids come from `tokenizer_config.json`
        (token strings), `generation_config.json` and `config.json` (ids); EOS ids are the
        union of all three. BOS/EOS insertion follows transformers 5: the post-processor of
        `tokenizer.json` decides; only when it has none do `add_bos_token` / `add_eos_token`
        of `tokenizer_config.json` (default false) build one."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(f"{folder}: no tokenizer.json (nanoserve needs a fast tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the library raises a bare Exception on bad JSON/content
            raise ModelError(f"{tokenizer_file} could not be loaded: {e}") from None
        tconf = _read_json(folder / "tokenizer_config.json")
        mconf = _read_json(folder / "config.json")
        gconf = _read_json(folder / "generation_config.json")

        specials = {
            name: _token_content(tconf.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        specials = {k: v for k, v in specials.items() if v is not None}
        _register_special_tokens(backend, tconf, specials.values())

        def token_id(name: str) -> int | None:
            return backend.token_to_id(specials[name]) if name in specials else None

        bos_id = token_id("bos_token")
        if bos_id is None:
            bos_id = _first_id(gconf.get("bos_token_id"), mconf.get("bos_token_id"))
        eos_ids = _unique([*_ids(gconf.get("eos_token_id")), *_ids(mconf.get("eos_token_id")),
                           token_id("eos_token")])
        pad_id = token_id("pad_token")
        if pad_id is None:
            pad_id = _first_id(gconf.get("pad_token_id"), mconf.get("pad_token_id"))

        if backend.post_processor is None:
            eos_id = token_id("eos_token")
            _set_post_processor(backend, bool(tconf.get("add_bos_token")),
                                bool(tconf.get("add_eos_token")),
                                bos=(specials.get("bos_token"), bos_id),
                                eos=(specials.get("eos_token"), eos_id), source=folder)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            chat_template=_folder_chat_template(folder, tconf),
            special_tokens=specials,
            source=str(folder),
        )

    # ---------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are
        recognised as such; `add_special_tokens` adds BOS/EOS where the model asks for them."""
        _check_text(text)
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the library refuses str that is not valid Unicode
            _check_unicode(text)
            raise

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """`encode` for many texts at once, in the library's parallel batch encoder.
        Raises ValueError naming the index of the first text that is not a string or not
        valid Unicode (the whole batch fails; encode rows one by one to isolate it)."""
        texts = list(texts)
        for i, text in enumerate(texts):
            _check_text(text, f"texts[{i}]")
        try:
            encodings = self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            for i, text in enumerate(texts):
                _check_unicode(text, f"texts[{i}]")
            raise
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. Bytes that do not form complete UTF-8 characters become U+FFFD;
        ids outside the vocabulary are dropped."""
        return self._backend.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
                     ) -> list[str]:
        return self._backend.decode_batch([_id_list(ids) for ids in batch],
                                          skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ---------------------------------------------------------------- chat

    @property
    def chat_template(self) -> str | None:
        """The model's chat template source, or None when it has none."""
        return self._chat_template_source

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text of a conversation (a list of {'role': str, 'content': str}).
        `kwargs` become template variables (tools, documents, ...). Raises ModelError when
        the model has no chat template and ValueError for a bad conversation."""
        if self._chat_template is None:
            if self._chat_template_source is None:
                raise ModelError(
                    f"the model's tokenizer ({self._source}) has no chat template; pass prompt "
                    f"text or prompt token ids instead of messages"
                )
            from nanoserve.weights.chat_template import ChatTemplate

            self._chat_template = ChatTemplate(self._chat_template_source)
        variables = {**self._special_tokens, **kwargs}
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                          **variables)

    # ---------------------------------------------------------------- special ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read it, do not change it)."""
        return self._backend

    def __repr__(self) -> str:
        return (f"Tokenizer({self._source!r}, vocab_size={self.vocab_size}, "
                f"bos={self._bos_token_id}, eos={self._eos_token_ids})")


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time.

    `push(id)` returns only newly completed text; it never returns part of a multi-byte UTF-8
    character (a byte-level token can end inside one: text that decodes to a trailing U+FFFD
    is held back until the character completes). `flush()` returns whatever is still held
    back (at the end of generation). Invariant: the pushes plus `flush()`, concatenated,
    equal `tokenizer.decode(all pushed ids)`; `.text` is their concatenation so far.

    Cost per token is O(1): it decodes only the window `ids[prefix_offset:]` of recent tokens
    (the text already returned for `ids[prefix_offset:read_offset]` is the window's known
    prefix); the window moves forward whenever text is returned.
    `prompt_ids`: the prompt's last few tokens start the window so the first token decodes
    in context; their text is not returned.
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept in the first window

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or ())[-self._PROMPT_CONTEXT:]
        self._ids: list[int] = context  # prompt context, then every pushed id
        self._prefix_offset = 0  # window start
        self._read_offset = len(context)  # ids before this are returned as text
        self._chunks: list[str] = []
        self._num_context = len(context)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ('' if none yet)."""
        self._ids.append(int(token_id))
        window = self._ids[self._prefix_offset:]
        known = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(window)
        if len(text) <= len(known) or text.endswith("\ufffd"):
            return ""  # nothing new, or a character is still incomplete
        delta = text[len(known):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Return the text still held back (an incomplete character decodes as U+FFFD)."""
        known = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        delta = text[len(known):] if len(text) > len(known) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        """The pushed ids (without the prompt context)."""
        return self._ids[self._num_context:]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""


# -------------------------------------------------------------------- GGUF


def _parse_prepared_backend(backend_json: str, source: str) -> tokenizers.Tokenizer:
    """The prepared tokenizer's backend; on text that does not parse, the prepared folder
    is discarded (written again on the next load) and the backend rebuilt from the GGUF
    file `source`."""
    from nanoserve.weights.model_store import PreparedCacheError, prepared_default_model

    try:
        return tokenizers.Tokenizer.from_str(backend_json)
    except Exception as e:  # the library raises a bare Exception on bad JSON
        error = PreparedCacheError(f"prepared tokenizer of {source}: {e}")
    prepared = prepared_default_model(Path(source), _prepared_contents)
    if prepared is not None:
        prepared.discard(error)
    return Tokenizer.from_gguf(source)._backend


def _prepared_contents(path: Path) -> dict[str, bytes]:
    """The default model's prepared files (`nanoserve.weights.model_store`), from its GGUF file."""
    from nanoserve.weights.gguf_file import open_gguf, prepared_contents

    return prepared_contents(path, Tokenizer.from_gguf(path, open_gguf(path)).to_prepared())


def _read_gguf_tokenizer_metadata(path: Path, reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF file, keys as in `_GGUF_KEYS` plus
    `chat_template`; None where the file has no value."""
    if reader is None:
        from nanoserve.weights.gguf_file import open_gguf  # raises ModelError on a bad file

        reader = open_gguf(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    meta = {key: field(f"tokenizer.ggml.{key}") for key in _GGUF_KEYS}
    meta["chat_template"] = field("tokenizer.chat_template")
    return meta


def _gguf_backend(meta: dict[str, Any], path: Path) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF vocabulary, merges, token types
    and pre-tokenizer name (no post-processor yet)."""
    if meta["model"] != "gpt2":
        raise ModelError(
            f"{path}: GGUF tokenizer model {meta['model']!r} is not supported; nanoserve reads "
            f"byte-level BPE ('gpt2') vocabularies from GGUF. Use the model's Hugging Face "
            f"folder (tokenizer.json) instead"
        )
    tokens, merges = meta["tokens"], meta["merges"]
    if not tokens or not merges:
        raise ModelError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens / merges")
    rule = _PRE_TOKENIZER_RULES.get(meta["pre"], "")
    if not rule:
        known = sorted(k for k in _PRE_TOKENIZER_RULES if k)
        raise ModelError(
            f"{path}: GGUF pre-tokenizer {meta['pre']!r} is not supported (known: "
            f"{', '.join(known)}); use the model's Hugging Face folder (tokenizer.json)"
        )
    alphabet = _byte_alphabet()
    byte_char = _bytes_to_unicode()
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # a token written as plain text: respell its bytes
            token = "".join(byte_char[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ModelError(f"{path}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                              byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(rule)
    backend.decoder = decoders.ByteLevel()

    token_type = meta["token_type"] or ()
    # A CONTROL token spelled outside the byte alphabet is a mislabel of llama.cpp's
    # converter; adding it would grow the vocabulary past the model's, so it is skipped.
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_type) if kind == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_type) if kind == _USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    return backend


def _pre_tokenizer(rule: str) -> pre_tokenizers.PreTokenizer:
    if rule == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if rule in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[rule]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise AssertionError(f"unknown pre-tokenizer rule {rule!r}")  # the table is ours


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as one printable character (printable Latin-1 bytes
    stand for themselves, the others are shifted to U+0100 and up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_bytes_to_unicode().values())


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def byte_level_bytes(piece: str | None) -> bytes | None:
    """The bytes a byte-level BPE token's string spells (GPT-2's byte alphabet), or None
    when it is not one (None, or a character outside that alphabet)."""
    if piece is None:
        return None
    decoder = _unicode_to_bytes()
    if not all(c in decoder for c in piece):
        return None
    return bytes(decoder[c] for c in piece)


# -------------------------------------------------------------------- shared helpers


def _set_post_processor(backend: tokenizers.Tokenizer, add_bos: bool, add_eos: bool, *,
                        bos: tuple[str | None, int | None], eos: tuple[str | None, int | None],
                        source: Path) -> None:
    """Make `encode(add_special_tokens=True)` add exactly BOS and/or EOS as asked."""
    parts, specials = ["$A"], []
    for wanted, (text, token_id), at_start, name in ((add_bos, bos, True, "BOS"),
                                                     (add_eos, eos, False, "EOS")):
        if not wanted:
            continue
        if text is None or token_id is None:
            raise ModelError(f"{source}: the tokenizer asks to add {name} but names no {name} "
                             f"token")
        if at_start:
            parts.insert(0, text)
        else:
            parts.append(text)
        specials.append((text, token_id))
    single = " ".join(parts)
    pair = f"{single} {' '.join(p if p != '$A' else '$B:1' for p in parts)}"
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=specials)


def _register_special_tokens(backend: tokenizers.Tokenizer, tconf: dict[str, Any],
                             named: Iterable[str]) -> None:
    """Add the special tokens `tokenizer_config.json` names but `tokenizer.json` does not
    list as added tokens (transformers does the same), so they are matched whole."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    extra: list[AddedToken] = []
    decoder = tconf.get("added_tokens_decoder") or {}
    for entry in decoder.values():
        if isinstance(entry, dict) and entry.get("content") and entry["content"] not in present:
            extra.append(AddedToken(entry["content"], special=bool(entry.get("special", True)),
                                    normalized=bool(entry.get("normalized", False)),
                                    lstrip=bool(entry.get("lstrip", False)),
                                    rstrip=bool(entry.get("rstrip", False)),
                                    single_word=bool(entry.get("single_word", False))))
            present.add(entry["content"])
    for content in named:
        if content not in present:
            extra.append(AddedToken(content, special=True, normalized=False))
            present.add(content)
    if extra:
        backend.add_special_tokens([t for t in extra if t.special])
        backend.add_tokens([t for t in extra if not t.special])


def _folder_chat_template(folder: Path, tconf: dict[str, Any]) -> str | None:
    """`chat_template.jinja` if present (transformers writes it there), else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of which
    'default' is used)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tconf.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when the file is absent."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or {'content': ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _first_id(*values: Any) -> int | None:
    for value in values:
        ids = _ids(value)
        if ids:
            return ids[0]
    return None


def _unique(ids: Iterable[int | None]) -> tuple[int, ...]:
    """The ids in first-seen order, without None and repeats."""
    seen: dict[int, None] = {}
    for i in ids:
        if i is not None:
            seen.setdefault(int(i), None)
    return tuple(seen)


def _check_text(text: Any, name: str = "text") -> None:
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")


def _check_unicode(text: str, name: str = "text") -> None:
    """ValueError if `text` holds code points UTF-8 cannot encode (lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode: {e.reason} at character {e.start}"
                         ) from None


def _id_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else [int(i) for i in ids]
