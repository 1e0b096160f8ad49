"""Chat templates and stop tokens of Qwen2.5, Qwen3 and Mistral through nanoserve's sandboxed
renderer, held to transformers' own `apply_chat_template` and generation config on the same
tokenizer folder.

The templates in tests/chat_templates/ are the families' published ones (Qwen2.5-Instruct's
tokenizer_config.json, Qwen3's, Mistral-7B-Instruct-v0.1's). Each folder is the SmolLM2
byte-level BPE tokenizer (already cached for the tests) given the family's special tokens,
its template in tokenizer_config.json and its EOS list in generation_config.json, saved by
transformers: what differs between the families here is the template and the special ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoserve.weights.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

FAMILIES = {
    # family: (template file, special tokens, eos token, generation_config eos tokens)
    "qwen2.5": ("qwen2.5-instruct.jinja", {}, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "qwen3": ("qwen3.jinja", {"additional_special_tokens": ["<think>", "</think>"]},
              "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "mistral": ("mistral-7b-instruct-v0.1.jinja", {"bos_token": "<s>", "eos_token": "</s>"},
                "</s>", ["</s>"]),
}

CHATML_CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "<think>\nThe user wants one.\n</think>\n\nBlue."},
        {"role": "user", "content": "Another one, in 日本語 please 😀"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
]
MISTRAL_CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語 please 😀"},
    ],
]


@pytest.fixture(scope="module")
def base_folder(smollm2_gguf_path, tmp_path_factory):
    """The SmolLM2 tokenizer as transformers saves it (read from the GGUF once)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("base-tokenizer")
    AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name,
                                  local_files_only=True).save_pretrained(folder)
    return folder


def make_family_folder(family: str, base: Path, folder: Path) -> Path:
    from transformers import AutoTokenizer

    template, specials, eos, gen_eos = FAMILIES[family]
    hf = AutoTokenizer.from_pretrained(base, local_files_only=True)
    if specials:
        hf.add_special_tokens(specials)
    hf.eos_token = eos
    hf.chat_template = (TEMPLATES / template).read_text()
    hf.save_pretrained(folder)
    # the template as the families ship it: inside tokenizer_config.json
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = hf.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    eos_ids = [hf.convert_tokens_to_ids(t) for t in gen_eos]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_folder(request, base_folder, tmp_path_factory):
    family = request.param
    return family, make_family_folder(family, base_folder, tmp_path_factory.mktemp(family))


def _cases(family: str):
    if family == "mistral":
        return [(c, {}) for c in MISTRAL_CONVERSATIONS]
    cases = [(c, {}) for c in CHATML_CONVERSATIONS] + [(CHATML_CONVERSATIONS[1], {"tools": TOOLS})]
    if family == "qwen3":
        cases += [(c, {"enable_thinking": False}) for c in CHATML_CONVERSATIONS[:3]]
    return cases


def test_chat_template_matches_transformers(family_folder):
    from transformers import AutoTokenizer

    family, folder = family_folder
    oracle = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ours = Tokenizer.from_path(folder)
    assert ours.chat_template == oracle.chat_template
    for conversation, extra in _cases(family):
        for gen in (True, False):
            want = oracle.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=gen, **extra)
            got = ours.apply_chat_template(conversation, add_generation_prompt=gen, **extra)
            assert got == want, (conversation, extra)
            assert ours.encode(got, add_special_tokens=False) == oracle.encode(
                want, add_special_tokens=False)


def test_stop_tokens_are_the_generation_config_list(family_folder):
    from transformers import AutoTokenizer, GenerationConfig

    family, folder = family_folder
    oracle = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    want = GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id
    want = want if isinstance(want, list) else [want]
    ours = Tokenizer.from_path(folder)
    assert set(ours.eos_token_ids) == set(want) | {oracle.eos_token_id}
    if family.startswith("qwen"):  # <|im_end|> ends a turn, <|endoftext|> a document
        assert set(ours.eos_token_ids) == {oracle.convert_tokens_to_ids("<|im_end|>"),
                                           oracle.convert_tokens_to_ids("<|endoftext|>")}


def test_mistral_template_refusal_is_a_value_error(base_folder, tmp_path):
    ours = Tokenizer.from_path(make_family_folder("mistral", base_folder, tmp_path))
    with pytest.raises(ValueError, match="rejected the conversation: Conversation roles must"):
        ours.apply_chat_template([{"role": "assistant", "content": "Hi"}])
