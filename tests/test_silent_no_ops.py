"""What a job would otherwise ignore silently is one `warning:` line: a per-row column that is
not an option but is close to one (it passes through as data and its rows run with the
job's settings), a `--chat-template-kwargs` key the model's chat template never reads; and
the summary counts the rows that ended with an empty answer (finish_reason 'stop', no text).

One job on the tiny random model (default model's tokenizer) with a small chat template that
reads `enable_thinking`; its empty answer comes from a regex that only the empty text
matches, so the row's first token is the end of the sequence."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pyarrow.dataset as ds
import pytest

from ray_jobs import run_batch_job
from ray_jobs.output.manifest import REPORT_NAME
from ray_jobs.preparation.silent_no_ops import column_slips, unread_template_kwargs

KV_BYTES = 32 << 20
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}(no thinking)\n"
            "{% endif %}{% endif %}")
ROWS = [
    {"prompt": "Row one", "max_token": 1, "temprature": 0.5},  # two misspelt options
    {"messages": [{"role": "user", "content": "Hello"}]},
    {"prompt": "Row three", "guided_regex": "a{0}"},  # only '' matches: an empty answer
]


def test_close_misspellings_of_per_row_options_are_named():
    lines = column_slips(["id", "prompt", "max_token", "Temperature", "seeds", "max_new_tokens",
                          "topic", "text", "max_tokens", "guided_choices"])
    named = [re.search(r"column '(.*?)' .*did you mean '(.*?)'\?$", x).groups() for x in lines]
    assert named == [("max_token", "max_tokens"), ("Temperature", "temperature"),
                     ("seeds", "seed"), ("max_new_tokens", "max_tokens"),
                     ("guided_choices", "guided_choice")]
    assert lines[0] == ("warning: column 'max_token' is not a per-row option: it passes "
                        "through to the output as data, and its rows run with the job's "
                        "settings; did you mean 'max_tokens'?")


def test_template_kwargs_the_template_never_reads():
    tok = SimpleNamespace(chat_template=None)
    assert unread_template_kwargs(tok, {"enable_thinking": False}, "--x") == []  # no template
    tok = SimpleNamespace(chat_template=TEMPLATE)
    assert unread_template_kwargs(tok, {"enable_thinking": False}, "--x") == []  # it reads it
    assert unread_template_kwargs(tok, {"enable_thinkng": False, "colour": "red"}, "--x") == [
        "warning: --x: the model's chat template never reads 'enable_thinkng', so it changes "
        "nothing; did you mean 'enable_thinking'?",
        "warning: --x: the model's chat template never reads 'colour', so it changes nothing"]


@pytest.fixture(scope="module")
def model_with_template(tiny_job_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_job_model, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def test_a_job_warns_at_once_and_counts_empty_answers(ray_session, model_with_template,
                                                      tmp_path, capfd):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    summary = run_batch_job(path, tmp_path / "out", model=str(model_with_template),
                            max_tokens=3, kv_cache_bytes=KV_BYTES, progress=False,
                            chat_template_kwargs={"enable_thinkng": False})
    err = capfd.readouterr().err
    slips = [f"warning: column '{a}' is not a per-row option: it passes through to the output "
             f"as data, and its rows run with the job's settings; did you mean '{b}'?"
             for a, b in (("max_token", "max_tokens"), ("temprature", "temperature"))]
    kwargs = ("warning: --chat-template-kwargs: the model's chat template never reads "
              "'enable_thinkng', so it changes nothing; did you mean 'enable_thinking'?")
    empty = ("warning: 1 row(s) ended with an empty answer (finish_reason 'stop', "
             "generated_text ''): the model ended them at once, as a chat model given a raw "
             "'prompt' often does (give it 'messages')")
    assert summary.warnings == (*slips, kwargs, empty)
    for line in (*slips, kwargs, empty):
        assert err.count(line) == 1, err  # on stderr once: the first three before any work
    assert summary.empty_answers == 1
    assert re.fullmatch(r"rows: 3 \(stop \d, length \d, error 0; 1 empty answer\(s\)\)",
                        summary.format().splitlines()[0])
    rows = {r["id"]: r for r in ds.dataset(tmp_path / "out").to_table().to_pylist()}
    assert (rows[0]["max_token"], rows[0]["temprature"]) == (1, 0.5)  # data, not options
    assert (rows[2]["generated_text"], rows[2]["finish_reason"]) == ("", "stop")
    page = (tmp_path / "out" / REPORT_NAME).read_text()
    assert '<td data-key="empty_answers">1</td>' in page
    assert page.count('<p class="warning">warning: ') == 4
