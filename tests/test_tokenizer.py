"""Tokenizer, incremental detokenizer and chat templates, held to transformers' tokenizer for
the same files (GGUF and a Hugging Face folder written by transformers).

One known, intended difference: for the `smollm` pre-tokenizer transformers' GGUF loader applies
only GPT-2's regex, while llama.cpp (and SmolLM2's own tokenizer.json) first split off every
number character. The two disagree only where whitespace meets numbers (a run of whitespace
before an ASCII digit, a space before a multi-byte number character such as '²'); there the
oracle is llama.cpp's rule spelled out below (`_llamacpp_smollm_encode`), built on transformers.
"""

from __future__ import annotations

import json
import random
import shutil
import unicodedata

import numpy as np
import pytest

from nanoserve.errors import ModelError
from nanoserve.weights.chat_template import ChatTemplate, validate_messages
from nanoserve.weights.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ångström façade",
    "日本語のテキストと中文字符，한국어도。",
    "emoji 😀👍🏽🇫🇷 and family 👨\u200d👩\u200d👧\u200d👦!",
    "Привет, мир! Ёлка",
    "مرحبا بالعالم",
    "a    b\t\tc\n\n\nd  \n ",
    "   leading and trailing   ",
    "\t\ttabs\tinside\t",
    "line1\r\nline2\rline3\n\n",
    "12345 6789 3.14159 1,000,000 2024-01-31 v2.0",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|im_end|>more<|endoftext|> and <|im_start|>",
    "I'm sure they'll've done it, won't they? DON'T",
    "non\u00a0breaking\u2009thin\u200bzero width",
]

# Whitespace before numbers: where llama.cpp's `smollm` rule and transformers' GGUF loader
# part ways (see the module docstring).
NUMBER_CASES = [
    "½ ² ³ Ⅻ",
    "x =  12",
    "  1",
    "\n    42\n",
    "if x:\n        return 0\n",
    "a\t\t3\t\t4",
    "٣٤٥ and ٣  ٤",
    "values:   1   22   333",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語 please 😀"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello\n\nwith  spaces"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": ""},
    ],
]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def ours(smollm2_gguf_path):
    return Tokenizer.from_path(smollm2_gguf_path)


@pytest.fixture(scope="session")
def hf(smollm2_gguf_path):
    """transformers' tokenizer built from the same GGUF file: the oracle."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent,
                                         gguf_file=smollm2_gguf_path.name,
                                         local_files_only=True)


@pytest.fixture(scope="session")
def hf_folder(hf, tmp_path_factory):
    """The oracle tokenizer saved by transformers as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gguf_vocab(hf):
    """The first 4096 tokens of SmolLM2's vocabulary and the merges among them, to write small
    GGUF files with other tokenizer settings (small, so they load quickly)."""
    size = 4096
    model = json.loads(hf.backend_tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)[:size]
    kept = set(tokens)
    merges = [f"{a} {b}" for a, b in model["merges"] if {a, b, a + b} <= kept]
    control = set(hf.all_special_tokens)
    types = [3 if token in control else 1 for token in tokens]  # llama.cpp: 3 CONTROL, 1 NORMAL
    return {"tokens": tokens, "merges": merges, "token_types": types,
            "chat_template": hf.chat_template}


def _write_tokenizer_gguf(path, vocab, *, model="gpt2", pre="smollm", add_bos=False):
    """A GGUF file holding a tokenizer and one tiny tensor (enough for transformers)."""
    from nanoserve.testing import write_tiny_gguf

    def metadata(writer):
        writer.add_context_length(64)
        writer.add_embedding_length(8)
        writer.add_block_count(1)
        writer.add_feed_forward_length(16)
        writer.add_head_count(2)
        writer.add_head_count_kv(1)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(vocab["tokens"])
        writer.add_token_types(vocab["token_types"])
        writer.add_token_merges(vocab["merges"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(vocab["chat_template"])

    write_tiny_gguf(path, "llama", [("token_embd.weight",
                                     np.zeros((len(vocab["tokens"]), 8), np.float32), None)],
                    metadata=metadata)
    return path


def _llamacpp_smollm_encode(hf, text):
    """llama.cpp's `smollm` rule: every number character (Unicode category N) is its own piece,
    then GPT-2's regex and BPE run on each piece (transformers' tokenizer does that part)."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch]
            current = ""
        else:
            current += ch
    pieces.append(current)
    return [i for piece in pieces if piece for i in hf.encode(piece, add_special_tokens=False)]


# ------------------------------------------------------------------ encode / decode (GGUF)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [t for t in CORPUS + NUMBER_CASES if "<|" not in t])
def test_encode_follows_llamacpp_number_split(ours, hf, text):
    assert ours.encode(text) == _llamacpp_smollm_encode(hf, text)


def test_special_tokens_in_text_are_single_ids(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.token_to_id("<|im_start|>") == 1
    assert ids[-1] == ours.token_to_id("<|im_end|>") == 2


def test_encode_batch_matches_encode(ours):
    texts = CORPUS + NUMBER_CASES
    assert ours.encode_batch(texts) == [ours.encode(t) for t in texts]
    assert ours.encode_batch(texts, add_special_tokens=False) == [
        ours.encode(t, add_special_tokens=False) for t in texts
    ]


@pytest.mark.parametrize("text", CORPUS + NUMBER_CASES)
def test_decode_matches_transformers(ours, hf, text):
    ids = hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_decode_random_ids_matches_transformers(ours, hf):
    rng = random.Random(0)
    batch = [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
             for _ in range(50)]
    batch += [[rng.randrange(17) for _ in range(6)]]  # special tokens only
    for skip in (True, False):
        expected = [hf.decode(ids, skip_special_tokens=skip) for ids in batch]
        assert [ours.decode(ids, skip_special_tokens=skip) for ids in batch] == expected
        assert ours.decode_batch(batch, skip_special_tokens=skip) == expected


def test_special_ids_match_transformers(ours, hf):
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids == (hf.eos_token_id,)
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.vocab_size == len(hf)


def test_encode_rejects_non_text(ours):
    with pytest.raises(ValueError, match="text must be a string, got NoneType"):
        ours.encode(None)
    with pytest.raises(ValueError, match=r"texts\[1\] must be a string, got int"):
        ours.encode_batch(["ok", 3])
    with pytest.raises(ValueError, match="text is not valid Unicode: surrogates not allowed"):
        ours.encode("lone surrogate \ud800")
    with pytest.raises(ValueError, match=r"texts\[1\] is not valid Unicode"):
        ours.encode_batch(["ok", "bad \udc80"])


# ------------------------------------------------------------------ incremental detokenization


def _detokenize_one_by_one(tokenizer, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks = [detok.push(i) for i in ids]
    return detok, chunks


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_decode(ours, hf, skip):
    texts = CORPUS + NUMBER_CASES + ["Mixed: 😀 emoji, 日本語, Ёлка, 👨\u200d👩\u200d👧 🇯🇵 end"]
    for text in texts:
        ids = ours.encode(text)
        detok, chunks = _detokenize_one_by_one(ours, ids, skip_special_tokens=skip)
        tail = detok.flush()
        assert "".join(chunks) + tail == hf.decode(ids, skip_special_tokens=skip)
        assert detok.text == "".join(chunks) + tail
        assert detok.token_ids == ids
        assert tail == ""  # every text here ends on a whole character
        for chunk in chunks:
            assert "\ufffd" not in chunk, (text, chunks)


def test_incremental_holds_back_split_characters(ours):
    ids = ours.encode("😀")
    assert len(ids) > 1, "the emoji must span several tokens for this test"
    _, chunks = _detokenize_one_by_one(ours, ids)
    assert chunks[:-1] == [""] * (len(ids) - 1)
    assert chunks[-1] == "😀"


def test_incremental_flush_returns_incomplete_tail(ours):
    ids = ours.encode("ok 😀")[:-1]  # generation stopped inside the emoji's bytes
    detok, chunks = _detokenize_one_by_one(ours, ids)
    tail = detok.flush()
    assert "\ufffd" not in "".join(chunks)
    assert "".join(chunks) + tail == ours.decode(ids)
    assert tail.endswith("\ufffd")


def test_incremental_with_prompt_context(ours):
    prompt = ours.encode(ours.apply_chat_template([{"role": "user", "content": "hi"}]))
    generated = ours.encode("Hello! 你好 😀 <|im_end|>")
    detok, chunks = _detokenize_one_by_one(ours, generated, prompt_ids=prompt)
    assert "".join(chunks) + detok.flush() == ours.decode(generated)
    assert detok.token_ids == generated


class _WindowRecorder:
    """Stands in for a Tokenizer and records the length of every decoded id list."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_decodes_a_bounded_window(ours):
    text = " ".join(["word", "😀", "日本語", "Ёлка", "🇯🇵"] * 200)
    ids = ours.encode(text)
    recorder = _WindowRecorder(ours)
    detok, chunks = _detokenize_one_by_one(recorder, ids)
    assert "".join(chunks) + detok.flush() == ours.decode(ids)
    assert len(ids) > 1000
    assert max(recorder.lengths) <= 8  # a few tokens of one character, not the whole text


# ------------------------------------------------------------------ chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, hf, conversation, add_generation_prompt):
    expected = hf.apply_chat_template(conversation, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation,
                                    add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_inserts_default_system_prompt(ours):
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", "messages must be a list"),
        ([], "messages is empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": None}],
         r"messages\[1\]\['content'\] must be a string, got NoneType"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         r"messages\[0\]\['content'\] must be a string, got list"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]\['role'\] must be a string, got int"),
    ],
)
def test_bad_messages_are_value_errors(ours, messages, message):
    with pytest.raises(ValueError, match=message):
        ours.apply_chat_template(messages)


def test_validate_messages_returns_a_plain_copy():
    original = [{"role": "user", "content": "hi", "name": "ann", "tool_calls": None}]
    plain = validate_messages(original)
    assert plain == [{"role": "user", "content": "hi", "name": "ann"}]
    plain[0]["content"] = "changed"
    assert original[0]["content"] == "hi"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ joiner.__init__.__globals__['os'] }}",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{{ c }}{% endfor %}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ messages.append({'role': 'x', 'content': 'y'}) }}",
        "{{ '{0.__class__}'.format(messages) }}",
    ],
)
def test_template_sandbox_refuses_python_internals(source):
    with pytest.raises(ValueError, match="chat template tried unsafe operation"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_template_helpers():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% generation %}|{{ add_generation_prompt }}{% endgeneration %}"
    )
    text = template.render([{"role": "user", "content": "é"}], bos_token="<s>")
    assert text == '<s>[{"role": "user", "content": "é"}]|4|True'
    with pytest.raises(ValueError, match="chat template rejected the conversation: first must"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_syntax_error_is_model_error():
    with pytest.raises(ModelError, match="not valid Jinja"):
        ChatTemplate("{% for m in messages %}")


# ------------------------------------------------------------------ Hugging Face folder


def test_folder_matches_transformers(hf_folder, ours):
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(hf_folder, local_files_only=True)
    folder_tok = Tokenizer.from_path(hf_folder)
    for text in CORPUS + NUMBER_CASES:
        assert folder_tok.encode(text) == oracle.encode(text)
    texts = CORPUS + NUMBER_CASES
    assert folder_tok.encode_batch(texts) == [oracle.encode(t) for t in texts]
    ids = oracle.encode("<|im_start|>Hi 😀<|im_end|>")
    for skip in (True, False):
        assert folder_tok.decode(ids, skip_special_tokens=skip) == oracle.decode(
            ids, skip_special_tokens=skip)
    for conversation in CONVERSATIONS:
        assert folder_tok.apply_chat_template(conversation) == oracle.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)
    assert folder_tok.bos_token_id == oracle.bos_token_id
    assert folder_tok.eos_token_ids == (oracle.eos_token_id,)
    assert folder_tok.pad_token_id == oracle.pad_token_id
    assert folder_tok.vocab_size == len(oracle)


def _copy_folder(hf_folder, tmp_path, edit_config=None, edit_tokenizer=None):
    folder = tmp_path / "tok"
    shutil.copytree(hf_folder, folder)
    for name, edit in (("tokenizer_config.json", edit_config), ("tokenizer.json", edit_tokenizer)):
        if edit is not None:
            data = json.loads((folder / name).read_text())
            edit(data)
            (folder / name).write_text(json.dumps(data))
    return folder


def test_folder_template_in_tokenizer_config(hf_folder, tmp_path):
    """The older layout: the chat template inside tokenizer_config.json. `add_bos_token` there
    does not override tokenizer.json's post-processor (transformers 5 ignores it too)."""
    from transformers import AutoTokenizer

    template = (hf_folder / "chat_template.jinja").read_text()
    folder = _copy_folder(hf_folder, tmp_path,
                          edit_config=lambda c: c.update(chat_template=template,
                                                         add_bos_token=True))
    (folder / "chat_template.jinja").unlink()

    oracle = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok = Tokenizer.from_path(folder)
    for text in ["", "Hello world", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == oracle.encode(text)
    for conversation in CONVERSATIONS:
        for gen in (True, False):
            assert tok.apply_chat_template(conversation, add_generation_prompt=gen) == (
                oracle.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=gen))


def test_folder_post_processor_adds_bos(hf_folder, tmp_path):
    from transformers import AutoTokenizer

    def bos_template(data):
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                "tokens": ["<|im_start|>"]}},
        }

    folder = _copy_folder(hf_folder, tmp_path, edit_tokenizer=bos_template)
    oracle = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tok = Tokenizer.from_path(folder)
    for text in ["", "Hello world", "<|im_end|> x"]:
        assert tok.encode(text) == oracle.encode(text)
        assert tok.encode(text, add_special_tokens=False) == oracle.encode(
            text, add_special_tokens=False)
    assert tok.encode("x")[0] == tok.bos_token_id == 1
    assert tok.encode_batch(["x", "y"]) == [oracle.encode("x"), oracle.encode("y")]


def test_folder_without_chat_template(hf_folder, tmp_path):
    folder = _copy_folder(hf_folder, tmp_path)
    (folder / "chat_template.jinja").unlink()
    tok = Tokenizer.from_path(folder)
    assert tok.chat_template is None
    with pytest.raises(ModelError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_eos_ids_from_generation_config(hf_folder, tmp_path):
    folder = _copy_folder(hf_folder, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert Tokenizer.from_path(folder).eos_token_ids == (0, 2)


def test_missing_paths_are_model_errors(tmp_path):
    with pytest.raises(ModelError, match="no such tokenizer path"):
        Tokenizer.from_path(tmp_path / "absent.gguf")
    with pytest.raises(ModelError, match="no tokenizer.json"):
        Tokenizer.from_path(tmp_path)


# ------------------------------------------------------------------ other GGUF settings


def test_gguf_llama3_rule_and_bos_match_transformers(gguf_vocab, tmp_path):
    """A file naming Llama 3's pre-tokenizer and asking for BOS."""
    from transformers import AutoTokenizer

    path = _write_tokenizer_gguf(tmp_path / "tok.gguf", gguf_vocab, pre="llama-bpe", add_bos=True)
    oracle = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    tok = Tokenizer.from_path(path)
    for text in CORPUS + NUMBER_CASES:
        assert tok.encode(text) == oracle.encode(text)
        assert tok.encode(text, add_special_tokens=False) == oracle.encode(
            text, add_special_tokens=False)
    assert tok.encode("hi")[0] == 1


def test_gguf_qwen2_rule_matches_transformers(gguf_vocab, tmp_path):
    """A file naming Qwen2's pre-tokenizer (Qwen2, Qwen2.5 and Qwen3 GGUF files): numbers
    split one character each, unlike Llama 3's groups of up to three."""
    from transformers import AutoTokenizer

    path = _write_tokenizer_gguf(tmp_path / "tok.gguf", gguf_vocab, pre="qwen2")
    oracle = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    tok = Tokenizer.from_path(path)
    for text in CORPUS + NUMBER_CASES:
        assert tok.encode(text) == oracle.encode(text)
    assert len(tok.encode("12345", add_special_tokens=False)) == 5


@pytest.mark.parametrize("model, pre, message", [
    ("gpt2", "tekken", "pre-tokenizer 'tekken' is not supported"),
    ("llama", "default", "tokenizer model 'llama' is not supported"),
])
def test_unsupported_gguf_tokenizers_are_model_errors(gguf_vocab, tmp_path, model, pre, message):
    path = _write_tokenizer_gguf(tmp_path / "tok.gguf", gguf_vocab, model=model, pre=pre)
    with pytest.raises(ModelError, match=message):
        Tokenizer.from_path(path)
