"""Chat-template options (`chat_template_kwargs`): the job's flag, the per-row column, the
OpenAI request field and `LLM.chat` all reach the template as variables. The template is
Qwen3's real one (tests/chat_templates/qwen3.jinja): `enable_thinking: false` makes it write
an empty think block after the generation prompt, which is the observable checked here."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from nanoserve.errors import InputError
from nanoserve.sampling.params import SamplingParams
from nanoserve.weights.chat_template import ChatTemplate, template_kwargs
from ray_jobs.input.files import InputChunk
from ray_jobs.input.openai_requests import flatten_request
from ray_jobs.preparation.prepare import RowPreparer, plan_columns
from ray_jobs.workers.options import JobOptions

QWEN3 = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
CONVERSATION = [{"role": "user", "content": "Hi"}]
DEFAULTS = {"max_tokens": 8, "temperature": 0.0}


class Qwen3TextTokenizer:
    """Encodes a prompt as its characters (code points), so the rendered text is readable
    back from the ids; renders with the sandboxed Qwen3 template."""

    chat_template = QWEN3

    def __init__(self):
        self.template = ChatTemplate(QWEN3)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    **kwargs)


def rendered(rows, job_kwargs=None):
    batch = pa.RecordBatch.from_pylist(rows)
    preparer = RowPreparer(plan_columns(batch.schema), Qwen3TextTokenizer(), 4096, 1 << 20,
                           DEFAULTS, chat_template_kwargs=job_kwargs)
    return [("".join(map(chr, r.prompt_token_ids)) if r.error is None else None, r.error)
            for r in preparer.prepare(InputChunk(batch, None), 0)]


def test_template_kwargs_parse_and_refuse_in_one_line():
    assert template_kwargs(None) == {}
    assert template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, match in (("[1]", "must be a JSON object"), ("{", "not valid JSON"),
                       ({"messages": []}, "may not set 'messages'"),
                       ({"add_generation_prompt": False}, "may not set")):
        with pytest.raises(ValueError, match=match) as e:
            template_kwargs(bad)
        assert "\n" not in str(e.value)


def test_job_kwargs_reach_the_template_and_a_row_overrides_them():
    rows = [{"messages": CONVERSATION, "chat_template_kwargs": None},
            {"messages": CONVERSATION, "chat_template_kwargs": '{"enable_thinking": true}'},
            {"messages": CONVERSATION, "chat_template_kwargs": '{"enable_thinking": 3'}]
    (plain, _), (thinking, _), (_, error) = rendered(rows, '{"enable_thinking": false}')
    assert plain.endswith(EMPTY_THINK)
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking
    assert "chat_template_kwargs is not valid JSON" in error
    # without options the template thinks (its default)
    (default, _), = rendered([{"messages": CONVERSATION}])
    assert default == thinking


def test_row_kwargs_as_a_struct_column():
    (text, error), = rendered([{"messages": CONVERSATION,
                                "chat_template_kwargs": {"enable_thinking": False}}])
    assert error is None and text.endswith(EMPTY_THINK)


def test_bad_job_kwargs_are_one_line_input_errors():
    with pytest.raises(InputError, match="--chat-template-kwargs must be a JSON object"):
        JobOptions(chat_template_kwargs="[true]")
    with pytest.raises(InputError, match="--chat-template-kwargs may not set 'messages'"):
        rendered([{"messages": CONVERSATION}], {"messages": []})
    assert JobOptions(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs \
        == '{"enable_thinking": false}'


def test_openai_body_field_becomes_the_row_column():
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": CONVERSATION, "chat_template_kwargs": {"enable_thinking": False}}}
    row, error = flatten_request(line)
    assert error is None and json.loads(row["chat_template_kwargs"]) == {"enable_thinking": False}
    (text, _), = rendered([{"messages": row["messages"],
                            "chat_template_kwargs": row["chat_template_kwargs"]}])
    assert text.endswith(EMPTY_THINK)
    line["body"]["chat_template_kwargs"] = [1]
    assert flatten_request(line)[1] == "body.chat_template_kwargs must be a JSON object"


def test_llm_chat_passes_kwargs_to_the_template(tiny_llm, monkeypatch):
    tok = tiny_llm.tokenizer
    monkeypatch.setattr(tok, "_chat_template_source", QWEN3)
    monkeypatch.setattr(tok, "_chat_template", None)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text.endswith(EMPTY_THINK)
    want = tiny_llm.generate([tok.encode(text, add_special_tokens=False)], params)
    got = tiny_llm.chat(CONVERSATION, params, chat_template_kwargs={"enable_thinking": False})
    assert got[0].num_prompt_tokens == want[0].num_prompt_tokens
    assert got[0].token_ids == want[0].token_ids
    thinking = tok.encode(tok.apply_chat_template(CONVERSATION), add_special_tokens=False)
    assert tiny_llm.chat(CONVERSATION, params)[0].num_prompt_tokens == len(thinking) \
        != want[0].num_prompt_tokens
