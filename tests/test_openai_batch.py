"""OpenAI Batch API files through the batch job: request lines in, `output.jsonl` /
`errors.jsonl` out.

Oracles: the `openai` package's own response types (`ChatCompletion.model_validate`,
`Completion.model_validate`) parse every output line; every custom_id is answered exactly
once, in input order; usage equals the engine's token counts and the text equals
`LLM.generate` on the same prompt with the values OpenAI's API reference gives a request
(a body without `temperature` / `top_p` samples at 1 / 1: `expected` states that rule, it
does not ask nanoserve; sample i of n: the request alone with seed + i); every logprob
field equals the engine's logprobs read the way OpenAI documents them (chat: each token's
logprob, UTF-8 bytes and its top K with theirs; completions: `tokens`, `token_logprobs`, a
`top_logprobs` dict of the K most likely tokens' text per token, `text_offset` each token's
character offset in the generated text); bad lines and unsupported body fields are error
lines naming the problem; duplicate custom_ids are refused before Ray; a driver killed
mid-job and run again gives the same files as an uninterrupted run. Model: the tiny random
Llama with the default model's tokenizer and chat template.

What these tests catch (each is a mutation of `ray_jobs/output/openai_files.py` or
`ray_jobs/input/openai_requests.py` in `tests/mutations.py`, run there to see it fail):
- chat `top_logprobs` values not the engine's (e.g. all 0.0): the job test's top-K check;
- completion `top_logprobs` dicts emptied: the same test's dict check;
- `text_offset` all 0: the same test's offset rule;
- a request without `temperature` run greedy (nanoserve's default, not OpenAI's 1):
  `test_request_lines_are_recognised_and_mapped`, and the job test through `expected`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from nanoserve.errors import InputError
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.structured import structured_from_request
from nanoserve_cli import main as nanoserve_main
from ray_jobs import run_batch_job
from ray_jobs.input.io import scan_input
from ray_jobs.input.openai_requests import flatten_request, is_request
from ray_jobs.input.storage import OutputDir
from ray_jobs.output.manifest import SUCCESS_NAME
from ray_jobs.output.openai_files import ERRORS_NAME, OUTPUT_NAME

REPO = Path(__file__).resolve().parents[1]
KV_BYTES = 32 << 20
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
LIMIT_S = 300


def req(custom_id, url, body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tiny_job_model, smollm2_gguf_path):
    """The tiny random Llama with the default model's chat template."""
    from nanoserve.weights.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("models") / "tiny-chat"
    shutil.copytree(tiny_job_model, folder)
    template = Tokenizer.from_path(smollm2_gguf_path).chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return folder


@pytest.fixture(scope="module")
def chat_llm(chat_model):
    from nanoserve.llm import LLM

    return LLM(model=str(chat_model), device="cpu", kv_cache_bytes=KV_BYTES)


def chat_prompt(tok, messages):
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                      add_special_tokens=False)


# --- reading request lines (no Ray) ------------------------------------------------------------


def test_request_lines_are_recognised_and_mapped():
    assert is_request(req("a", CHAT, {})) and not is_request({"prompt": "x", "id": 1})
    row, why = flatten_request(req("a", CHAT, {
        "model": "gpt-4o-mini", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 1,
        "stop": "\n", "logprobs": True, "top_logprobs": 3, "user": "u1", "stream": False,
        "response_format": {"type": "json_object"}, "ignore_eos": True, "top_k": 5,
        "presence_penalty": 0, "tools": None}))
    assert why is None
    assert row == {"id": "a", "url": CHAT, "model": "gpt-4o-mini", "temperature": 0.5,
                   "top_p": 0.9, "n": 2, "seed": 1, "response_format": {"type": "json_object"},
                   "top_k": 5, "ignore_eos": True, "max_tokens": 7, "stop": ["\n"], "logprobs": 3,
                   "messages": [{"role": "user", "content": "Hi there"}]}
    row, why = flatten_request(req("b", COMP, {"prompt": [1, 2, 3], "logprobs": 2,
                                               "echo": False, "max_tokens": 4,
                                               "temperature": None}))
    # OpenAI's API reference: temperature and top_p each "Defaults to 1" (a null is absent)
    assert why is None and row == {"id": "b", "url": COMP, "prompt_token_ids": [1, 2, 3],
                                   "logprobs": 2, "max_tokens": 4, "temperature": 1.0,
                                   "top_p": 1.0}


@pytest.mark.parametrize("line, fragment", [
    (req("a", CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [],
                     "frequency_penalty": 0.3}),
     "unsupported body field(s) 'tools', 'frequency_penalty' for /v1/chat/completions"),
    (req("a", COMP, {"prompt": "x", "echo": True}), "unsupported body field(s) 'echo'"),
    (req("a", COMP, {"prompt": "x", "stream": True}), "unsupported body field(s) 'stream'"),
    (req("a", "/v1/embeddings", {"input": "x"}), 'url "/v1/embeddings" is not supported'),
    ({**req("a", CHAT, {}), "method": "GET"}, 'method "GET" is not supported'),
    ({"custom_id": "a", "url": CHAT, "body": {}}, "lacks 'method'"),
    ({**req("a", CHAT, {}), "extra": 1}, "unknown request field(s) 'extra'"),
    (req("a", CHAT, []), "body must be a JSON object"),
    (req("a", CHAT, {"messages": []}), "body.messages must be a non-empty list"),
    (req("a", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
     "an image_url part needs image_url.url"),
    (req("a", CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
     'a part of type "input_audio" is not supported (text and image_url parts are)'),
    (req("a", COMP, {"prompt": ["one", "two"]}), "one prompt per request line"),
    (req("a", CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
     "top_logprobs needs body.logprobs true"),
    (req(7, CHAT, {}), "custom_id must be a non-empty string"),
])
def test_a_request_that_cannot_run_names_why(line, fragment):
    row, why = flatten_request(line)
    assert why is not None and fragment in why, why
    assert set(row) == {"id", "url"}


def test_duplicate_custom_ids_are_refused_before_any_work(tmp_path, capsys, no_ray):
    rows = [req(f"r{i}", COMP, {"prompt": f"p{i}"}) for i in range(4)]
    path = write_jsonl(tmp_path / "requests.jsonl", rows + [req("r2", COMP, {"prompt": "again"})])
    with pytest.raises(InputError, match=r"custom_id 'r2' appears 2 times, at requests.jsonl line 3 and "
                                         r"requests.jsonl line 5"):
        scan_input(path)
    rc = nanoserve_main(["batch", str(path), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "'r2' appears 2 times" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_input_format_openai_makes_other_lines_error_rows_and_refuses_parquet(tmp_path, no_ray):
    path = write_jsonl(tmp_path / "in.jsonl", [req("a", COMP, {"prompt": "x"}),
                                               {"custom_id": "b", "prompt": "y"}])
    info = scan_input(path, input_format="openai")
    assert info.openai_rows == 2
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in.parquet")
    with pytest.raises(InputError, match="--input-format openai reads JSON Lines"):
        scan_input(tmp_path / "in.parquet", input_format="openai")
    plain = scan_input(write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "x"}]))
    assert plain.openai_rows == 0


# --- a job over a request file (tiny model, local Ray) -------------------------------------


def job_requests(chat_llm):
    """The request file; its stop string is a word the completion writes without it."""
    tok = chat_llm.tokenizer
    (free,) = chat_llm.generate([tok.encode("Once upon a time")],
                                [SamplingParams(max_tokens=8)])
    words = free.text.split()
    stop = words[2] if len(words) > 2 else words[-1]
    return [
        req("chat-n", CHAT, {"model": "gpt-4o-mini", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}], "max_tokens": 5, "n": 2,
            "temperature": 0.8, "seed": 11, "logprobs": True, "top_logprobs": 2}),
        req("comp-stop", COMP, {"model": "gpt-3.5-turbo-instruct", "prompt": "Once upon a time",
                                "max_tokens": 8, "stop": [stop], "logprobs": 3,
                                "temperature": 0}),
        req("bad-url", "/v1/embeddings", {"model": "x", "input": "hi"}),
        req("chat-json", CHAT, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Give a JSON object."}]}], "max_completion_tokens": 6,
            "response_format": {"type": "json_object"}, "seed": 5}),
        req("unsupported", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}),
        req("comp-ids", COMP, {"prompt": [504, 2988, 314], "max_tokens": 3, "seed": 3}),
        req("comp-logprobs", COMP, {"prompt": "The river", "max_tokens": 6, "seed": 4,
                                    "logprobs": 2}),
        # no temperature: OpenAI samples at 1, so its two samples are two draws
        req("chat-default", CHAT, {"messages": [{"role": "user", "content": "Say hi."}],
                                   "max_tokens": 6, "n": 2, "seed": 7, "logprobs": True,
                                   "top_logprobs": 3}),
        {"custom_id": "no-method", "url": CHAT, "body": {"messages": [
            {"role": "user", "content": "x"}]}},
        req("empty", COMP, {"prompt": "", "max_tokens": 3}),
    ]


def expected(chat_llm, request):
    """(prompt ids, [SamplingParams per sample], chat?) of a request the job answers. A
    value the body leaves out is OpenAI's default (its API reference: temperature 1, top_p
    1), except max_tokens: the job's --max-tokens (16 here), as the README says."""
    body = request["body"]
    tok = chat_llm.tokenizer
    values = {"max_tokens": body.get("max_completion_tokens", body.get("max_tokens", 16)),
              "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0)}
    if "seed" in body:
        values["seed"] = body["seed"]
    if "stop" in body:
        values["stop"] = tuple(body["stop"])
    if "response_format" in body:
        values["structured_outputs"] = structured_from_request(
            {"response_format": json.dumps(body["response_format"])})
    chat = request["url"] == CHAT
    if chat:
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                     else "".join(p["text"] for p in m["content"])} for m in body["messages"]]
        ids = chat_prompt(tok, messages)
        if body.get("logprobs"):
            values["logprobs"] = body.get("top_logprobs", 0)
    else:
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt)
        if "logprobs" in body:
            values["logprobs"] = body["logprobs"]
    n = body.get("n", 1)
    params = [SamplingParams(**{**values, **({"seed": values["seed"] + i} if "seed" in values
                                               else {})}) for i in range(n)]
    return ids, params, chat


@pytest.fixture(scope="module")
def openai_job(tmp_path_factory, ray_session, chat_model, chat_llm):
    folder = tmp_path_factory.mktemp("openai-job")
    requests = job_requests(chat_llm)
    path = write_jsonl(folder / "requests.jsonl", requests)
    summary = run_batch_job(path, folder / "out", model=str(chat_model), max_tokens=16,
                            batch_size=4, kv_cache_bytes=KV_BYTES, progress=False)
    return requests, summary, folder / "out"


def test_every_custom_id_once_in_input_order(openai_job):
    requests, summary, out = openai_job
    answered = [line["custom_id"] for line in read_jsonl(out / OUTPUT_NAME)]
    failed = [line["custom_id"] for line in read_jsonl(out / ERRORS_NAME)]
    order = [r["custom_id"] for r in requests]
    assert sorted(answered + failed) == sorted(order)
    assert answered == [c for c in order if c in answered]
    assert failed == [c for c in order if c in failed]
    assert set(failed) == {"bad-url", "unsupported", "no-method", "empty"}
    assert (out / SUCCESS_NAME).exists() and list(out.glob("part-*.parquet"))
    assert summary.input_rows == len(requests)


def test_output_lines_parse_as_openai_types_and_equal_the_engine(openai_job, chat_llm,
                                                                  chat_model):
    requests, _, out = openai_job
    by_id = {r["custom_id"]: r for r in requests}
    longest_completion = 0  # tokens of the longest completion checked with logprobs
    for line in read_jsonl(out / OUTPUT_NAME):
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        request = by_id[line["custom_id"]]
        ids, params, chat = expected(chat_llm, request)
        parsed = (ChatCompletion if chat else Completion).model_validate(response["body"])
        assert parsed.object == ("chat.completion" if chat else "text_completion")
        assert parsed.model == chat_model.name  # the job's model, whatever the body named
        assert len(parsed.choices) == len(params)
        completion_tokens = 0
        for i, (choice, p) in enumerate(zip(parsed.choices, params, strict=True)):
            (want,) = chat_llm.generate([ids], [p])
            assert choice.index == i
            assert (choice.message.content if chat else choice.text) == want.text
            assert choice.finish_reason == want.finish_reason
            completion_tokens += len(want.token_ids)
            if p.logprobs is None:
                assert choice.logprobs is None
            elif chat:
                check_chat_logprobs(choice.logprobs.content, want, p.logprobs, chat_llm)
            else:
                check_completion_logprobs(choice.logprobs, choice.text, want, p.logprobs,
                                          chat_llm)
                longest_completion = max(longest_completion, len(want.token_ids))
        if request["body"].get("n", 1) > 1 and "temperature" not in request["body"]:
            texts = [c.message.content if chat else c.text for c in parsed.choices]
            assert len(set(texts)) == len(texts), texts  # draws at OpenAI's temperature 1
        assert parsed.usage.prompt_tokens == len(ids)
        assert parsed.usage.completion_tokens == completion_tokens
        assert parsed.usage.total_tokens == len(ids) + completion_tokens
    stopped = next(line for line in read_jsonl(out / OUTPUT_NAME)
                   if line["custom_id"] == "comp-stop")
    assert stopped["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert longest_completion >= 3  # text_offset's rule met past its first token


def token_bytes(tokenizer, token_id):
    """A byte-level BPE token's bytes, from the `tokenizers` vocabulary and transformers'
    own byte table (not nanoserve's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in tokenizer.backend.id_to_token(token_id))


def check_chat_logprobs(content, want, k, llm):
    """OpenAI's chat logprobs: one entry per generated token with its logprob and UTF-8
    bytes, and `top_logprobs` the k most likely tokens there, most likely first, each with
    its text, logprob and bytes: all the engine's."""
    tok = llm.tokenizer
    assert len(content) == len(want.logprobs) == len(want.token_ids)
    for e, w, token_id in zip(content, want.logprobs, want.token_ids, strict=True):
        assert e.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert e.token == tok.decode([token_id], skip_special_tokens=False)
        assert bytes(e.bytes) == token_bytes(tok, token_id)
        assert len(e.top_logprobs) == k == len(w.top)
        for t, (top_id, top_lp) in zip(e.top_logprobs, w.top, strict=True):
            assert t.token == tok.decode([top_id], skip_special_tokens=False)
            assert t.logprob == pytest.approx(top_lp, abs=1e-5)
            assert bytes(t.bytes) == token_bytes(tok, top_id)
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0.0


def check_completion_logprobs(lp, text, want, k, llm):
    """OpenAI's (legacy) completion logprobs: `tokens` each generated token's text,
    `token_logprobs` theirs, `top_logprobs` one {text: logprob} dict of the k most likely
    tokens per token (tokens with the same text share one key), `text_offset` each token's
    character offset in the generated text (0, then the sum of the texts before it, as
    vLLM writes it without echo)."""
    tok = llm.tokenizer
    texts = [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.tokens == texts
    assert "".join(texts).startswith(text)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert len(lp.top_logprobs) == len(want.logprobs)
    for got, w in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert len(w.top) == k
        pairs = [(tok.decode([t], skip_special_tokens=False), v) for t, v in w.top]
        assert set(got) == {t for t, _ in pairs}
        for t, v in got.items():
            assert any(v == pytest.approx(u, abs=1e-5) for s, u in pairs if s == t), (t, v)


def test_failed_requests_are_error_lines_naming_the_problem(openai_job):
    _, _, out = openai_job
    lines = {line["custom_id"]: line for line in read_jsonl(out / ERRORS_NAME)}
    for custom_id, fragment in {"bad-url": 'url "/v1/embeddings" is not supported',
                                "unsupported": "unsupported body field(s) 'tools'",
                                "no-method": "lacks 'method'",
                                "empty": "empty prompt"}.items():
        line = lines[custom_id]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 400
        error = line["response"]["body"]["error"]
        assert fragment in error["message"], error
        assert error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}


def test_plain_parquet_input_with_output_format_openai(tmp_path, ray_session, chat_model,
                                                       chat_llm, capsys):
    """The same JSONL from a Parquet file of prompt and messages rows (CLI flag), and from
    the Python API."""
    table = pa.table({"prompt": ["The sea is", None],
                      "messages": [None, [{"role": "user", "content": "Hello"}]]})
    pq.write_table(table, tmp_path / "in.parquet")
    rc = nanoserve_main(["batch", str(tmp_path / "in.parquet"), "-o", str(tmp_path / "out"),
                         "--model", str(chat_model), "--max-tokens", "3", "--no-progress",
                         "--kv-cache-memory", "0.03125", "--output-format", "openai"])
    assert rc == 0, capsys.readouterr().err
    lines = read_jsonl(tmp_path / "out" / OUTPUT_NAME)
    assert [line["custom_id"] for line in lines] == ["0", "1"]
    first = Completion.model_validate(lines[0]["response"]["body"])
    second = ChatCompletion.model_validate(lines[1]["response"]["body"])
    tok = chat_llm.tokenizer
    (want,) = chat_llm.generate([tok.encode("The sea is")], [SamplingParams(max_tokens=3)])
    assert first.choices[0].text == want.text
    (want,) = chat_llm.generate([chat_prompt(tok, [{"role": "user", "content": "Hello"}])],
                                [SamplingParams(max_tokens=3)])
    assert second.choices[0].message.content == want.text
    assert (tmp_path / "out" / ERRORS_NAME).read_text() == ""

    summary = run_batch_job(tmp_path / "in.parquet", tmp_path / "api", model=str(chat_model),
                            max_tokens=3, kv_cache_bytes=KV_BYTES, progress=False,
                            output_format="openai")
    assert summary.rows == 2
    assert [line["custom_id"] for line in read_jsonl(tmp_path / "api" / OUTPUT_NAME)] == ["0", "1"]
    plain = run_batch_job(tmp_path / "in.parquet", tmp_path / "parts", model=str(chat_model),
                          max_tokens=3, kv_cache_bytes=KV_BYTES, progress=False)
    assert plain.rows == 2 and not (tmp_path / "parts" / OUTPUT_NAME).exists()


# --- a killed driver resumed gives the same files -----------------------------------------


def without_created(lines):
    for line in lines:
        body = line["response"]["body"]
        if "created" in body:
            body["created"] = 0
    return lines


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_driver_killed_mid_job_resumes_to_the_same_files(tmp_path, ray_session, chat_model,
                                                         private_ray_env):
    requests = [req(f"q{i}", COMP if i % 3 else CHAT,  # seeded: OpenAI's temperature 1
                    {"prompt": f"Request {i} says {'ab' * (i % 5)}", "max_tokens": 2, "seed": i}
                    if i % 3 else {"messages": [{"role": "user", "content": f"Hi {i}"}],
                                   "max_tokens": 2, "n": 2, "temperature": 0.7, "seed": i})
                for i in range(60)]
    requests[7]["body"]["logit_bias"] = {"1": 5}  # an unsupported field: an error line
    path = write_jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "out"
    env = private_ray_env
    command = [sys.executable, "-m", "nanoserve_cli", "batch", str(path), "-o", str(out),
               "--model", str(chat_model), "--batch-size", "2", "--max-tokens", "2",
               "--kv-cache-memory", "0.03125", "--address", "local", "--no-progress"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + LIMIT_S
            while len(list(out.glob("part-*.parquet"))) < 2:
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no part written in time"
                time.sleep(0.02)
        finally:
            kill_group(first.pid)
            first.wait()
    assert not (out / SUCCESS_NAME).exists() and not (out / OUTPUT_NAME).exists()
    again = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=LIMIT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done by an earlier run" in again.stdout

    clean = run_batch_job(path, tmp_path / "clean", model=str(chat_model), batch_size=2,
                          max_tokens=2, kv_cache_bytes=KV_BYTES, progress=False)
    assert clean.input_rows == 60
    for name in (OUTPUT_NAME, ERRORS_NAME):
        assert without_created(read_jsonl(out / name)) == without_created(
            read_jsonl(tmp_path / "clean" / name))
    assert [line["custom_id"] for line in read_jsonl(out / ERRORS_NAME)] == ["q7"]
    assert len(read_jsonl(out / OUTPUT_NAME)) == 59

    # A rerun of the completed job writes the files again if they went missing.
    (out / OUTPUT_NAME).unlink()
    rerun = run_batch_job(path, out, model=str(chat_model), batch_size=2, max_tokens=2,
                          kv_cache_bytes=KV_BYTES, progress=False)
    assert rerun.rows == 0
    assert without_created(read_jsonl(out / OUTPUT_NAME)) == without_created(
        read_jsonl(tmp_path / "clean" / OUTPUT_NAME))


# --- object storage ------------------------------------------------------------------------


def test_s3_request_file_in_and_openai_files_out(s3, ray_session, chat_model, tmp_path):
    s3.create_bucket(Bucket="nanoserve-openai")
    requests = [req(f"s{i}", COMP, {"prompt": f"Object {i} is", "max_tokens": 2, "seed": i})
                for i in range(5)]
    body = "".join(json.dumps(r) + "\n" for r in requests).encode()
    s3.put_object(Bucket="nanoserve-openai", Key="in/requests.jsonl", Body=body)
    local = write_jsonl(tmp_path / "requests.jsonl", requests)
    options = {"model": str(chat_model), "max_tokens": 2, "batch_size": 2,
               "kv_cache_bytes": KV_BYTES, "progress": False}
    run_batch_job("s3://nanoserve-openai/in/requests.jsonl", "s3://nanoserve-openai/out",
                  **options)
    run_batch_job(local, tmp_path / "out", **options)
    remote = OutputDir.open("s3://nanoserve-openai/out")
    lines = [json.loads(x) for x in remote.read_bytes(OUTPUT_NAME).splitlines()]
    assert [line["custom_id"] for line in lines] == [f"s{i}" for i in range(5)]
    for line in lines:
        Completion.model_validate(line["response"]["body"])
    assert [line["response"]["body"]["choices"] for line in lines] == [
        line["response"]["body"]["choices"] for line in read_jsonl(tmp_path / "out" / OUTPUT_NAME)]
    assert remote.read_bytes(ERRORS_NAME) == b""
    parts = [n for n in remote.names() if n.startswith("part-")]
    assert sum(remote.parquet_num_rows(n) for n in parts) == 5


def test_per_row_stop_and_ignore_eos_columns_are_typed():
    from ray_jobs.preparation.prepare import plan_columns

    plan = plan_columns(pa.schema([("prompt", pa.string()), ("stop", pa.list_(pa.string())),
                                   ("ignore_eos", pa.bool_())]))
    assert {"stop", "ignore_eos"} <= set(plan.override_columns)
    assert "stop" in plan_columns(pa.schema([("prompt", pa.string()),
                                             ("stop", pa.string())])).override_columns
    with pytest.raises(InputError, match=r"column 'stop' \(a per-row sampling value\) must hold "
                                         r"a list of strings \(or one string\), not int64"):
        plan_columns(pa.schema([("prompt", pa.string()), ("stop", pa.int64())]))
    with pytest.raises(InputError, match="column 'ignore_eos' .* must hold true/false"):
        plan_columns(pa.schema([("prompt", pa.string()), ("ignore_eos", pa.string())]))


def test_default_model_json_schema_request_parses_and_equals_the_engine(
        tmp_path, ray_session, smollm2_gguf_path, smollm2_llm):
    """A chat request with OpenAI's json_schema response_format on the default model: the
    content is JSON valid under the schema, and equals the engine's own answer."""
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
              "required": ["city"], "additionalProperties": False}
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "place", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Where is the Eiffel Tower? Answer as JSON."}]
    path = write_jsonl(tmp_path / "requests.jsonl", [req("eiffel", CHAT, {
        "model": "gpt-4o", "messages": messages, "max_tokens": 24, "temperature": 0,
        "response_format": response_format})])
    run_batch_job(path, tmp_path / "out", model=str(smollm2_gguf_path), kv_cache_bytes=KV_BYTES,
                  progress=False)
    (line,) = read_jsonl(tmp_path / "out" / OUTPUT_NAME)
    parsed = ChatCompletion.model_validate(line["response"]["body"])
    assert parsed.model == smollm2_gguf_path.name
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    tok = smollm2_llm.tokenizer
    (want,) = smollm2_llm.generate([chat_prompt(tok, messages)], [SamplingParams(
        max_tokens=24, structured_outputs=structured_from_request(
            {"response_format": json.dumps(response_format)}))])
    assert choice.message.content == want.text
    assert parsed.usage.completion_tokens == len(want.token_ids)
    assert parsed.usage.prompt_tokens == len(chat_prompt(tok, messages))


# --- each shard's lines written on its worker, the files joined by the driver ---------------


def reference_files(input_path, out, tokenizer, model_name):
    """output.jsonl and errors.jsonl as the driver assembled them when it formatted every
    line itself (kept here as the oracle; `created` 0): the input read again in order, each
    row's samples found by id in the parts, ids hashed from the manifest's settings, the
    row's input position and its custom_id."""
    import hashlib

    from ray_jobs.input.io import iter_chunks
    from ray_jobs.output.manifest import MANIFEST_NAME
    from ray_jobs.output.openai_files import TokenText, _completion, _error_line, _is_chat
    from ray_jobs.preparation.prepare import plan_columns

    settings = json.loads((out / MANIFEST_NAME).read_text())["settings"]
    job_key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    info = scan_input(input_path)
    plan = plan_columns(info.schema)
    results = {}
    for part in sorted(out.glob("part-*.parquet")):
        for r in pq.read_table(part).to_pylist():
            results.setdefault(r["id"], []).append(r)
    token = TokenText(tokenizer)
    files = {OUTPUT_NAME: [], ERRORS_NAME: []}
    position = 0
    for chunk in iter_chunks(info):
        for values in chunk.batch.to_pylist():
            row_id = position if plan.id_column is None else values[plan.id_column]
            samples = results.pop(row_id)
            digest = hashlib.sha256(f"{job_key}:{position}:{row_id}".encode()).hexdigest()
            custom_id = None if row_id is None else str(row_id)
            failed = next((s for s in samples if s["finish_reason"] == "error"), None)
            if failed is not None:
                files[ERRORS_NAME].append(_error_line(digest, custom_id, failed["error"]))
            else:
                body = _completion(digest, _is_chat(values, plan), samples, 0, model_name, token)
                files[OUTPUT_NAME].append({
                    "id": f"batch_req_{digest[:24]}", "custom_id": custom_id,
                    "response": {"status_code": 200, "request_id": f"req_{digest[24:48]}",
                                 "body": body}, "error": None})
            position += 1
    assert results == {}  # every result row belongs to an input row
    return files


def test_files_equal_the_driver_side_assembly_and_join_the_shards_fragments(
        openai_job, chat_llm, chat_model):
    from ray_jobs.output.openai_files import fragment_names

    _, _, out = openai_job
    want = reference_files(out.parent / "requests.jsonl", out, chat_llm.tokenizer,
                           chat_model.name)
    for name in (OUTPUT_NAME, ERRORS_NAME):
        assert without_created(read_jsonl(out / name)) == want[name]
    shards = len(list(out.glob("part-*.parquet")))
    assert shards == 3  # 10 requests, 4 a shard
    for i, name in enumerate((OUTPUT_NAME, ERRORS_NAME)):
        fragments = [out / fragment_names(shard)[i] for shard in range(shards)]
        assert (out / name).read_bytes() == b"".join(f.read_bytes() for f in fragments)


def refuse_rows_in_this_process(mp):
    """This process is the job's driver (its workers are Ray's own processes): make it fail
    if it reads input rows after the scan (rows in the job's schema: a shard's, or the
    whole input again) or the rows of a part."""
    from ray_jobs.input import io, jsonl, shards

    scan = jsonl._iter_jsonl

    def scan_only(*args, schema=None, **kwargs):
        if schema is not None:
            raise AssertionError("the driver read input rows")
        return scan(*args, schema=schema, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the driver read a part's rows")

    mp.setattr(io, "_iter_jsonl", scan_only)
    mp.setattr(jsonl, "_iter_jsonl", scan_only)
    mp.setattr(shards, "_iter_jsonl", scan_only)
    mp.setattr(pq, "read_table", refuse)


def as_earlier_version(out, committed, complete):
    """The folder as the version that assembled the files on the driver left it: the
    parts of shards 0..committed-1 (their footers naming no fragments) and no fragments;
    complete with its files but output.jsonl gone, or killed before its last shards."""
    from ray_jobs.output.manifest import BESIDE_DIGEST_KEY, Manifest

    for f in [*out.glob("_output-*"), *out.glob("_errors-*"), out / OUTPUT_NAME]:
        f.unlink()
    m = Manifest.load(out)
    for part in sorted(out.glob("part-*.parquet")):
        shard, table = int(part.stem.split("-")[1]), pq.read_table(part)
        if shard < committed:
            meta = {k: v for k, v in table.schema.metadata.items() if k != BESIDE_DIGEST_KEY}
            pq.write_table(table.replace_schema_metadata(meta), part)
        else:
            part.unlink()
            m.done.discard(shard)
            m.rows_done -= table.num_rows
    if not complete:
        m.complete = False
        for name in (SUCCESS_NAME, ERRORS_NAME):
            (out / name).unlink()
    m.save(out)


def test_the_driver_reads_no_rows_and_an_earlier_versions_folder_finishes(
        tmp_path, ray_session, chat_model):
    requests = [req(f"e{i}", COMP if i % 2 else CHAT,
                    {"prompt": f"Earlier {i} says", "max_tokens": 2, "seed": i} if i % 2 else
                    {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 2,
                     "n": 2, "temperature": 0.7, "seed": i}) for i in range(11)]
    requests[5]["body"]["tools"] = []  # an unsupported field: an error line
    path = write_jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "out"
    options = {"model": str(chat_model), "max_tokens": 2, "batch_size": 3,
               "kv_cache_bytes": KV_BYTES, "progress": False}
    with pytest.MonkeyPatch.context() as mp:
        refuse_rows_in_this_process(mp)
        run_batch_job(path, out, **options)
    first = {name: without_created(read_jsonl(out / name)) for name in (OUTPUT_NAME, ERRORS_NAME)}
    assert [line["custom_id"] for line in first[ERRORS_NAME]] == ["e5"]
    assert [line["custom_id"] for line in first[OUTPUT_NAME]] == [
        r["custom_id"] for r in requests if r["custom_id"] != "e5"]

    # Killed after 3 of its 4 shards: the workers make the committed shards' lines from
    # their parts, and the driver still reads no row.
    as_earlier_version(out, committed=3, complete=False)
    with pytest.MonkeyPatch.context() as mp:
        refuse_rows_in_this_process(mp)
        summary = run_batch_job(path, out, **options)
    assert summary.input_rows == 2 and summary.rows_resumed == 14  # 9 rows: 5 of n = 2
    for name in (OUTPUT_NAME, ERRORS_NAME):
        assert without_created(read_jsonl(out / name)) == first[name]
    assert len(list(out.glob("_output-*.jsonl"))) == len(list(out.glob("_errors-*"))) == 4

    # Complete, output.jsonl gone: no worker starts, the driver makes the lines itself.
    as_earlier_version(out, committed=4, complete=True)
    again = run_batch_job(path, out, **options)
    assert again.rows == 0 and again.workers == ()
    for name in (OUTPUT_NAME, ERRORS_NAME):
        assert without_created(read_jsonl(out / name)) == first[name]


def test_retry_errors_rewrites_the_retried_shards_lines(tmp_path, ray_session, chat_model):
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers x (k, v) x kv heads x head dim x fp32 x tokens
    requests = [req(f"r{i}", COMP, {"prompt": f"Retry {i} says", "max_tokens": 2, "seed": i})
                for i in range(6)]
    requests[4]["body"]["prompt"] = " ".join(["word"] * 80)  # more than 4 blocks of 16 tokens
    path = write_jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "out"
    options = {"model": str(chat_model), "max_tokens": 2, "batch_size": 2, "progress": False}
    run_batch_job(path, out, **options, kv_cache_bytes=4 * per_block)
    assert [line["custom_id"] for line in read_jsonl(out / ERRORS_NAME)] == ["r4"]
    fragments = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.glob("_*-*.jsonl")}
    assert len(fragments) == 6

    again = run_batch_job(path, out, **options, kv_cache_bytes=KV_BYTES, retry_errors=True)
    assert again.input_rows == 2  # the shard of r4 and r5, computed again
    now = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in out.glob("_*-*.jsonl")}
    assert {n for n in fragments if now[n] != fragments[n]} == {"_output-00002.jsonl",
                                                                "_errors-00002.jsonl"}
    assert (out / ERRORS_NAME).read_bytes() == b""
    clean = tmp_path / "clean"
    run_batch_job(path, clean, **options, kv_cache_bytes=KV_BYTES)
    for name in (OUTPUT_NAME, ERRORS_NAME):
        assert without_created(read_jsonl(out / name)) == without_created(read_jsonl(clean / name))


def test_an_interrupted_job_resumes_to_complete_files_with_every_request_once(
        tmp_path, ray_session, chat_model, monkeypatch):
    from ray_jobs.dispatch import job_run
    from ray_jobs.output.manifest import Manifest
    from ray_jobs.output.openai_files import fragment_names

    requests = [req(f"i{i}", CHAT, {"messages": [{"role": "user", "content": f"Hi {i}"}],
                                    "max_tokens": 2, "n": 2, "temperature": 0.7, "seed": i})
                for i in range(7)]
    requests[2]["body"]["logit_bias"] = {"1": 5}  # an unsupported field: an error line
    path = write_jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "out"
    options = {"model": str(chat_model), "max_tokens": 2, "batch_size": 3,
               "kv_cache_bytes": KV_BYTES, "progress": False}
    original = job_run._JobRun._write

    def write_then_stop(self, shard, tables):
        original(self, shard, tables)
        raise KeyboardInterrupt  # the driver stops after its first recorded shard

    monkeypatch.setattr(job_run._JobRun, "_write", write_then_stop)
    with pytest.raises(KeyboardInterrupt):  # one shard at a time: the second is never sent
        run_batch_job(path, out, **options, max_in_flight_per_worker=1)
    monkeypatch.undo()
    assert not (out / OUTPUT_NAME).exists() and not (out / SUCCESS_NAME).exists()
    # A commit cut short: the shard's record lost, and another attempt's lines over its
    # fragment (as a retry killed between its fragments and its part leaves them): its part
    # is not adopted with them, the shard is computed again.
    m = Manifest.load(out)
    (shard,) = m.done
    m.done, m.rows_done = set(), 0
    m.save(out)
    (out / fragment_names(shard)[0]).write_text('{"custom_id": "stale"}\n')

    summary = run_batch_job(path, out, **options)
    assert summary.rows_resumed == 0 and summary.input_rows == 7
    answered = [line["custom_id"] for line in read_jsonl(out / OUTPUT_NAME)]
    failed = [line["custom_id"] for line in read_jsonl(out / ERRORS_NAME)]
    assert answered == [r["custom_id"] for r in requests if r["custom_id"] != "i2"]
    assert failed == ["i2"]
    clean = tmp_path / "clean"
    run_batch_job(path, clean, **options)
    for name in (OUTPUT_NAME, ERRORS_NAME):
        assert without_created(read_jsonl(out / name)) == without_created(read_jsonl(clean / name))


def test_a_job_without_openai_files_writes_no_fragments(openai_job, tmp_path, ray_session,
                                                        chat_model):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"Plain {i}"} for i in range(3)])
    run_batch_job(path, tmp_path / "out", model=str(chat_model), max_tokens=2, batch_size=2,
                  kv_cache_bytes=KV_BYTES, progress=False)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert [n for n in names if n.endswith(".jsonl")] == []
    _, _, openai_out = openai_job
    assert len(list(openai_out.glob("_output-*.jsonl"))) == 3
