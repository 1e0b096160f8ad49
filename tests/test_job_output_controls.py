"""Output controls through the batch job, the Ray Data processor and `nanoserve generate`:
structured outputs, logprobs and n samples, with the real local Ray.

Oracles: `json.loads` + `jsonschema` for JSON rows, `re.fullmatch` for regex rows, the list
for choice rows; every answered row (or sample) equals `LLM.generate` on its prompt alone
with the same values (sample i: the row alone with seed + i and n = 1), its logprobs
included; the Arrow types are the documented ones; bad input is an error row naming the
problem (n of them for a row asking for n samples), or one `error:` line before Ray for a
job-wide flag. The default model runs where the text's quality matters (constrained rows
that must finish), the tiny random model with the default model's tokenizer elsewhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import ray_jobs.dispatch.job_run as job_run
from nanoserve.errors import InputError
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.structured import StructuredOutputs
from nanoserve_cli import main as nanoserve_main
from ray_jobs import run_batch_job
from ray_jobs.output.manifest import REPORT_NAME, Manifest
from ray_jobs.preparation.result_columns import LOGPROBS_TYPE, RESULT_COLUMNS
from ray_jobs.workers.worker import BatchWorker, GenerationRequest

KV_BYTES = 32 << 20

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
SENTIMENT = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]}},
    "required": ["sentiment"], "additionalProperties": False}
YEAR = r"[0-9]{4}"
YES_NO = ["yes", "no"]


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True),
                      add_special_tokens=False)


def rows_by_key(out):
    """{(id, sample_index): row} of a job's output; every key exactly once."""
    rows = ds.dataset(out).to_table().to_pylist()
    keys = [(r["id"], r.get("sample_index") or 0) for r in rows]
    assert len(keys) == len(set(keys)), "an (id, sample_index) was written twice"
    return dict(zip(keys, rows))


def assert_equals_engine(row, want):
    """A result row against the engine's `SequenceOutput` for the same request."""
    assert row["error"] is None, row["error"]
    assert row["generated_token_ids"] == want.token_ids
    assert row["generated_text"] == want.text
    assert row["finish_reason"] == want.finish_reason
    assert row["num_generated_tokens"] == len(want.token_ids)
    for name in ("logprobs", "prompt_logprobs"):
        entries = getattr(want, name)
        if entries is None:
            assert row.get(name) is None
            continue
        got = row[name]
        assert [(e["token_id"], e["rank"]) for e in got] == [(e.token_id, e.rank)
                                                            for e in entries]
        assert [e["logprob"] for e in got] == pytest.approx([e.logprob for e in entries],
                                                            abs=1e-5)
        assert [[t["token_id"] for t in e["top"]] for e in got] == [
            [t for t, _ in e.top] for e in entries]
        assert [t["logprob"] for e in got for t in e["top"]] == pytest.approx(
            [lp for e in entries for _, lp in e.top], abs=1e-5)


# --- the default model: constrained rows that parse, validate and match -------------------

CONSTRAINED_ROWS = [
    {"id": "person", "messages": [{"role": "user", "content":
                                   "Extract the person: Maria Lopez is 34 years old."}],
     "guided_json": PERSON, "max_tokens": 40},
    {"id": "review", "messages": [{"role": "user", "content":
                                   "Review: I love this phone, it is great!"}],
     "response_format": {"type": "json_schema",
                         "json_schema": {"name": "review", "schema": SENTIMENT, "strict": True}},
     "max_tokens": 20},
    {"id": "year", "messages": [{"role": "user", "content":
                                 "What year did the Berlin Wall fall?"}],
     "guided_regex": YEAR, "max_tokens": 8},
    {"id": "sky", "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
     "guided_choice": YES_NO, "max_tokens": 4},
    {"id": "plain", "prompt": "The capital of France is", "max_tokens": 6},
    {"id": "plain-chat", "messages": [{"role": "user", "content": "Name a color."}],
     "max_tokens": 6},
]
CONSTRAINTS = {"person": StructuredOutputs(json=PERSON),
               "review": StructuredOutputs(json=SENTIMENT),
               "year": StructuredOutputs(regex=YEAR),
               "sky": StructuredOutputs(choice=tuple(YES_NO))}


@pytest.fixture(scope="module")
def constrained_job(tmp_path_factory, ray_session, smollm2_gguf_path):
    folder = tmp_path_factory.mktemp("constrained-job")
    path = write_jsonl(folder / "rows.jsonl", CONSTRAINED_ROWS)
    summary = run_batch_job(path, folder / "out", model=str(smollm2_gguf_path), batch_size=4,
                            progress=False)
    return summary, folder / "out"


def test_constrained_rows_parse_validate_and_match(constrained_job):
    summary, out = constrained_job
    by_id = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    assert summary.rows == len(CONSTRAINED_ROWS) and summary.error_rows == 0
    for name in ("person", "review", "year", "sky"):
        assert by_id[name]["finish_reason"] == "stop", (name, by_id[name]["generated_text"])
    jsonschema.validate(json.loads(by_id["person"]["generated_text"]), PERSON)
    jsonschema.validate(json.loads(by_id["review"]["generated_text"]), SENTIMENT)
    assert re.fullmatch(YEAR, by_id["year"]["generated_text"])
    assert by_id["sky"]["generated_text"] in YES_NO
    # No n column, no logprobs: the output has exactly the plain job's result columns.
    names = ds.dataset(out).schema.names
    assert names[-len(RESULT_COLUMNS):] == list(RESULT_COLUMNS)
    assert not {"sample_index", "logprobs", "prompt_logprobs"} & set(names)
    # JSON documents in JSONL are passed through as their JSON text.
    assert json.loads(by_id["person"]["guided_json"]) == PERSON
    # Default output controls leave the manifest's settings as a job before them wrote them.
    assert set(Manifest.load(out).settings["sampling"]) == {
        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"}


def test_constrained_and_plain_rows_equal_the_engine_alone(constrained_job, smollm2_llm):
    _, out = constrained_job
    by_id = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    tok = smollm2_llm.tokenizer
    for row in CONSTRAINED_ROWS:
        ids = (tok.encode(row["prompt"]) if "prompt" in row
               else chat_ids(tok, row["messages"][0]["content"]))
        params = SamplingParams(max_tokens=row["max_tokens"],
                                structured_outputs=CONSTRAINTS.get(row["id"]))
        (want,) = smollm2_llm.generate([ids], [params])
        assert_equals_engine(by_id[row["id"]], want)


def test_a_schema_property_order_is_the_order_generated(smollm2_llm):
    from nanoserve.sampling.structured import structured_from_request

    so = structured_from_request({"guided_json": json.dumps(PERSON)})  # name, then age
    ids = chat_ids(smollm2_llm.tokenizer, "Extract the person: Maria Lopez is 34 years old.")
    (out,) = smollm2_llm.generate([ids], [SamplingParams(max_tokens=40, structured_outputs=so)])
    assert list(json.loads(out.text)) == ["name", "age"]


def test_compiling_a_choice_with_spaces_prints_nothing(tiny_llm, capfd):
    from nanoserve.sampling.structured import GrammarCache

    cache = GrammarCache(tiny_llm.tokenizer, tiny_llm.config.vocab_size, tiny_llm.eos_token_ids)
    cache.compile(StructuredOutputs(choice=("yes", "no")))  # the tokenizer info, built once
    capfd.readouterr()
    cache.check(StructuredOutputs(choice=("not at all", "yes")))
    assert capfd.readouterr().err == ""


# --- n samples and logprobs (tiny model) ----------------------------------------------------

N_ROWS = [
    {"prompt": "Row zero says hello", "n": 3, "temperature": 0.9, "seed": 7, "logprobs": 2},
    {"prompt": "Row one", "prompt_logprobs": 1, "max_tokens": 3},
    {"prompt": "Row two is plain"},
    {"prompt": "", "n": 2},  # an error row asking for 2 samples: 2 error rows
    {"prompt": "Row four", "n": 0},  # an invalid n: one error row
    {"prompt": "Row five", "n": 129},
    {"prompt": "Row six", "logprobs": 21},
]
N_KEYS = {(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0)}
N_MAX_TOKENS = 4


@pytest.fixture(scope="module")
def n_job(tmp_path_factory, ray_session, tiny_job_model):
    folder = tmp_path_factory.mktemp("n-job")
    path = write_jsonl(folder / "rows.jsonl", N_ROWS)
    summary = run_batch_job(path, folder / "out", model=str(tiny_job_model),
                            max_tokens=N_MAX_TOKENS, batch_size=4, kv_cache_bytes=KV_BYTES,
                            progress=False)
    return summary, folder / "out"


def test_n_job_writes_one_row_per_id_and_sample(n_job):
    summary, out = n_job
    by_key = rows_by_key(out)
    assert set(by_key) == N_KEYS
    assert (summary.rows, summary.input_rows, summary.error_rows) == (10, 7, 5)
    assert re.search(r"^rows: 10 for 7 input rows \(stop \d+, length \d+, error 5\)$",
                     summary.format(), re.M), summary.format()
    assert sum(summary.finish_reasons.values()) == 10
    assert Manifest.load(out).rows_done == 10
    page = (out / REPORT_NAME).read_text()
    data = json.loads(re.search(r'id="nanoserve-report-data">(.*?)</script>', page,
                                re.S).group(1).replace("<\\/", "</"))
    assert (data["totals"]["rows"], data["totals"]["error_rows"]) == (10, 5)
    assert data["summary"]["input_rows"] == 7
    assert data["spans"]["rows"] == 5  # samples the workers answered
    assert summary.output_tokens == sum(r["num_generated_tokens"] for r in by_key.values())
    for i in range(3):  # input columns repeated on every sample
        assert by_key[(0, i)]["prompt"] == N_ROWS[0]["prompt"] and by_key[(0, i)]["n"] == 3


def test_n_job_output_types_are_the_documented_ones(n_job):
    _, out = n_job
    schema = ds.dataset(out).schema
    assert schema.field("sample_index").type == pa.int32()
    want = pa.list_(pa.struct([
        ("token_id", pa.int32()), ("logprob", pa.float32()), ("rank", pa.int32()),
        ("top", pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))]))
    assert LOGPROBS_TYPE == want
    assert schema.field("logprobs").type == want
    assert schema.field("prompt_logprobs").type == want
    # The request columns of those names are replaced by the results; `n` is passed through.
    assert schema.names.count("logprobs") == 1 and schema.field("n").type == pa.int64()
    assert schema.names[-3:] == ["sample_index", "logprobs", "prompt_logprobs"]


def test_each_sample_equals_its_seeded_row_alone(n_job, tiny_llm):
    _, out = n_job
    by_key = rows_by_key(out)
    tok = tiny_llm.tokenizer
    ids = tok.encode(N_ROWS[0]["prompt"])
    texts = set()
    for i in range(3):
        (want,) = tiny_llm.generate([ids], [SamplingParams(
            max_tokens=N_MAX_TOKENS, temperature=0.9, seed=7 + i, logprobs=2)])
        row = by_key[(0, i)]
        assert row["sample_index"] == i
        assert_equals_engine(row, want)
        assert all(len(e["top"]) == 2 for e in row["logprobs"])
        texts.add(row["generated_text"])
    assert len(texts) > 1  # the samples differ
    (want,) = tiny_llm.generate([tok.encode(N_ROWS[1]["prompt"])],
                                [SamplingParams(max_tokens=3, prompt_logprobs=1)])
    assert len(by_key[(1, 0)]["prompt_logprobs"]) == len(tok.encode(N_ROWS[1]["prompt"])) - 1
    assert_equals_engine(by_key[(1, 0)], want)
    (want,) = tiny_llm.generate([tok.encode(N_ROWS[2]["prompt"])],
                                [SamplingParams(max_tokens=N_MAX_TOKENS)])
    assert_equals_engine(by_key[(2, 0)], want)


def test_bad_n_and_logprobs_are_error_rows(n_job):
    _, out = n_job
    by_key = rows_by_key(out)
    for key, fragment in {(3, 0): "empty prompt", (3, 1): "empty prompt",
                          (4, 0): "n must be an integer in [1, 128], got 0",
                          (5, 0): "n must be an integer in [1, 128], got 129",
                          (6, 0): "logprobs must be an integer in [0, 20], got 21"}.items():
        row = by_key[key]
        assert row["finish_reason"] == "error" and fragment in row["error"], (key, row["error"])
        assert row["generated_token_ids"] is None and row["logprobs"] is None
        assert row["sample_index"] == key[1]


# --- resume and --retry-errors keyed on (id, sample_index) (tiny model) ------------------

RESUME_PROMPTS = [f"Resume row {i} says {'ab' * i}" for i in range(6)]


def test_an_interrupted_n_job_resumes_each_sample_exactly_once(tmp_path, ray_session,
                                                               tiny_job_model, tiny_llm,
                                                               monkeypatch):
    rows = [{"prompt": p} for p in RESUME_PROMPTS] + [{"prompt": "   "}]  # an error row
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    options = {"model": str(tiny_job_model), "max_tokens": 3, "batch_size": 4, "n": 2,
               "temperature": 0.8, "seed": 3, "regex": r"[a-z]{2,5}",
               "kv_cache_bytes": KV_BYTES, "progress": False}
    original = job_run._JobRun._write
    written = []

    def write_then_stop(self, shard, tables):
        original(self, shard, tables)
        written.append(shard.shard_id)
        raise KeyboardInterrupt  # the driver stops after its first recorded part

    monkeypatch.setattr(job_run._JobRun, "_write", write_then_stop)
    with pytest.raises(KeyboardInterrupt):  # one shard at a time: the second is never sent
        run_batch_job(path, out, **options, max_in_flight_per_worker=1)
    monkeypatch.undo()
    first = rows_by_key(out)
    assert 0 < len(first) < 14

    summary = run_batch_job(path, out, **options)
    # A worker still running when the driver stopped may finish its part after: the rerun
    # adopts it (a whole part, written atomically). Exactly once: every sample in one part.
    assert summary.rows_resumed >= len(first) and summary.rows + summary.rows_resumed == 14
    by_key = rows_by_key(out)  # (every key exactly once)
    assert set(by_key) == {(i, s) for i in range(7) for s in (0, 1)}
    assert all(by_key[k] == v for k, v in first.items())  # written parts kept
    for i, prompt in enumerate(RESUME_PROMPTS):
        for s in (0, 1):
            (want,) = tiny_llm.generate([tiny_llm.tokenizer.encode(prompt)], [SamplingParams(
                max_tokens=3, temperature=0.8, seed=3 + s,
                structured_outputs=StructuredOutputs(regex=r"[a-z]{2,5}"))])
            assert_equals_engine(by_key[(i, s)], want)
            assert re.fullmatch(r"[a-z]{1,5}", by_key[(i, s)]["generated_text"])
    assert [by_key[(6, s)]["finish_reason"] for s in (0, 1)] == ["error", "error"]

    with pytest.raises(InputError, match=r"\(sampling\.n differ\)"):
        run_batch_job(path, out, **{**options, "n": 3})
    with pytest.raises(InputError, match=r"\(sampling\.structured_outputs\.regex differ\)"):
        run_batch_job(path, out, **{**options, "regex": "[a-z]+"})
    again = run_batch_job(path, out, **options, retry_errors=True)
    # the shard holding the error row (rows 4-6, 2 samples each), computed again
    assert (again.rows, again.error_rows) == (6, 2)
    assert set(rows_by_key(out)) == set(by_key)


def test_a_shard_holds_every_sample_of_its_rows(tmp_path, ray_session, tiny_job_model):
    """batch_size counts input rows (the driver never reads a row's n): 3 rows of n = 3 are
    one shard of batch_size 4, and its part holds their 9 samples."""
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"p{i}", "n": 3} for i in range(3)])
    out = tmp_path / "out"
    summary = run_batch_job(path, out, model=str(tiny_job_model), max_tokens=2,
                            batch_size=4, kv_cache_bytes=KV_BYTES, progress=False)
    assert (summary.num_shards, summary.rows, summary.input_rows) == (1, 9, 3)
    assert set(rows_by_key(out)) == {(i, s) for i in range(3) for s in range(3)}


# --- bad input: error rows (tiny model) -----------------------------------------------------

BAD_ROWS = [
    {"prompt": "good one"},
    {"prompt": "x", "guided_json": "{not json"},
    {"prompt": "x", "guided_json": "[1, 2]"},
    {"prompt": "x", "guided_json": {"type": 5}},
    {"prompt": "x", "guided_json": {"type": "string", "not": {"maxLength": 2}}},
    {"prompt": "x", "guided_regex": "[a-", "n": 2},
    {"prompt": "x", "guided_choice": []},
    {"prompt": "x", "guided_choice": ["a long answer that needs many tokens"], "max_tokens": 3},
    {"prompt": "x", "response_format": {"type": "xml"}},
    {"prompt": "x", "guided_grammar": 'root ::= "a" | '},
    {"prompt": "x", "guided_regex": "[a-z]{20}", "max_tokens": 3},  # cut by max_tokens: length
    {"prompt": "good two", "guided_choice": ["yes", "no"]},
    {"prompt": "good three", "response_format": {"type": "text"}},
]
BAD_MESSAGES = {
    1: "guided_json is not valid JSON",
    2: "the JSON schema must be a JSON object",
    3: "the JSON schema could not be compiled",
    4: "the JSON schema uses 'not', which structured outputs do not support",
    5: "the regex could not be compiled",
    6: "guided_choice must be a non-empty list of strings",
    7: "no choice of the choice list can be written within max_tokens (3 tokens): the "
       "shortest, 'a long answer that needs many tokens', needs",
    8: "response_format type 'xml' is not one of json_schema, json_object, text",
    9: "the grammar could not be compiled",
}


@pytest.fixture(scope="module")
def bad_rows_job(tmp_path_factory, ray_session, tiny_job_model):
    folder = tmp_path_factory.mktemp("bad-rows")
    path = write_jsonl(folder / "rows.jsonl", BAD_ROWS)
    summary = run_batch_job(path, folder / "out", model=str(tiny_job_model), max_tokens=4,
                            batch_size=4, kv_cache_bytes=KV_BYTES, progress=False)
    return summary, rows_by_key(folder / "out")


@pytest.mark.parametrize("index", sorted(BAD_MESSAGES))
def test_a_bad_constraint_is_an_error_row_naming_it(bad_rows_job, index):
    _, by_key = bad_rows_job
    samples = [by_key[k] for k in sorted(by_key) if k[0] == index]
    assert len(samples) == BAD_ROWS[index].get("n", 1)
    for row in samples:
        assert row["finish_reason"] == "error", row
        assert BAD_MESSAGES[index] in row["error"], row["error"]
        assert row["generated_text"] is None and row["num_generated_tokens"] == 0


def test_the_rest_of_a_batch_with_bad_constraints_is_answered(bad_rows_job, tiny_llm):
    summary, by_key = bad_rows_job
    assert summary.error_rows == sum(BAD_ROWS[i].get("n", 1) for i in BAD_MESSAGES)
    tok = tiny_llm.tokenizer
    cases = {0: SamplingParams(max_tokens=4),
             10: SamplingParams(max_tokens=3, structured_outputs=StructuredOutputs(
                 regex="[a-z]{20}")),
             11: SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(
                 choice=("yes", "no"))),
             12: SamplingParams(max_tokens=4)}
    for i, params in cases.items():
        (want,) = tiny_llm.generate([tok.encode(BAD_ROWS[i]["prompt"])], [params])
        assert_equals_engine(by_key[(i, 0)], want)
    assert by_key[(10, 0)]["finish_reason"] == "length"  # cut short: need not match
    assert by_key[(11, 0)]["generated_text"] in ("yes", "no")


def test_the_worker_refuses_a_constraint_that_does_not_compile(tiny_llm):
    """A request that reaches a worker unchecked (not through the driver) with a constraint
    that does not compile: its n error rows, and the rest of the batch answered as one."""
    worker = BatchWorker.from_llm(tiny_llm)
    ids = tuple(tiny_llm.tokenizer.encode("Hello there"))
    bad = SamplingParams(max_tokens=2, n=2, structured_outputs=StructuredOutputs(regex="(a"))
    good = SamplingParams(max_tokens=2, n=2, temperature=0.5, seed=1)
    table = worker.run_batch([GenerationRequest(ids, bad), GenerationRequest(ids, good)])
    rows = table.to_pylist()
    assert [(r["sample_index"], r["finish_reason"]) for r in rows[:2]] == [(0, "error"),
                                                                          (1, "error")]
    assert all("the regex could not be compiled" in r["error"] for r in rows[:2])
    assert [r["sample_index"] for r in rows[2:]] == [0, 1]
    want = tiny_llm.generate([list(ids)], [good])
    for row, w in zip(rows[2:], want):
        assert_equals_engine(row, w)


# --- bad job-wide flags: one line, before Ray -------------------------------------------------


def run_batch_cli(capsys, *args):
    rc = nanoserve_main(["batch", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines()


@pytest.mark.parametrize("flags, fragment", [
    (["--n", "0"], "invalid sampling options: n must be an integer in [1, 128], got 0"),
    (["--n", "129"], "n must be an integer in [1, 128], got 129"),
    (["--logprobs", "21"], "logprobs must be an integer in [0, 20], got 21"),
    (["--prompt-logprobs", "-1"], "prompt_logprobs must be an integer in [0, 20], got -1"),
    (["--json-schema", "{missing}"], "--json-schema {missing}: cannot read it (No such file"),
    (["--json-schema", "{not_json}"], "--json-schema {not_json}: not valid JSON"),
    (["--json-schema", "{uses_not}"], "--json-schema {uses_not}: the JSON schema uses 'not'"),
    (["--json-schema", "{bad_type}"], "invalid --json-schema: the JSON schema could not be "
                                      "compiled"),
    (["--regex", "[a-"], "invalid --regex: the regex could not be compiled"),
    (["--regex", "a", "--choice", "b"], "give at most one structured output for the job, "
                                        "not --regex and --choice"),
    (["--choice", "a long answer that needs many tokens", "--max-tokens", "2"],
     "invalid --choice: no choice of the choice list can be written within --max-tokens (2 "
     "tokens)"),
])
def test_a_bad_job_wide_flag_is_one_line_before_ray(tmp_path, capsys, no_ray, tiny_job_model,
                                                    flags, fragment):
    files = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "not.json",
             "uses_not": tmp_path / "uses-not.json", "bad_type": tmp_path / "bad-type.json"}
    files["not_json"].write_text("{'type': 'object'}")
    files["uses_not"].write_text(json.dumps({"type": "string", "not": {"maxLength": 1}}))
    files["bad_type"].write_text(json.dumps({"type": 5}))
    flags = [f.format(**files) for f in flags]
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "out"
    rc, err = run_batch_cli(capsys, path, "-o", out, "--model", tiny_job_model, *flags)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and fragment.format(**files) in err[0], err
    assert not out.exists() or not list(out.glob("part-*"))


# --- the Ray Data processor (tiny model) ----------------------------------------------------


def test_processor_rows_with_a_constraint_and_n_samples(tmp_path, ray_session, tiny_job_model,
                                                        tiny_llm):
    from ray_jobs.data_processor import build_processor

    rows = [{"id": 0, "prompt": "Pick one", "guided_choice": YES_NO, "n": 2,
             "temperature": 0.9, "seed": 1},
            {"id": 1, "prompt": "Three digits", "guided_regex": "[0-9]{3}", "logprobs": 1},
            {"id": 2, "prompt": "Bad", "guided_regex": "[0-", "n": 3},
            {"id": 3, "prompt": "Plain"}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    process = build_processor(str(tiny_job_model), concurrency=1, num_gpus=0, batch_size=4,
                              kv_cache_bytes=KV_BYTES, max_tokens=5)
    out = process(ray_session.data.read_json(str(path))).take_all()
    by_key = {(r["id"], r["sample_index"]): r for r in out}
    assert len(by_key) == len(out) and set(by_key) == {(0, 0), (0, 1), (1, 0), (2, 0), (2, 1),
                                                      (2, 2), (3, 0)}
    tok = tiny_llm.tokenizer
    for key, params in {
            (0, 0): SamplingParams(max_tokens=5, temperature=0.9, seed=1,
                                   structured_outputs=StructuredOutputs(choice=tuple(YES_NO))),
            (0, 1): SamplingParams(max_tokens=5, temperature=0.9, seed=2,
                                   structured_outputs=StructuredOutputs(choice=tuple(YES_NO))),
            (1, 0): SamplingParams(max_tokens=5, logprobs=1,
                                   structured_outputs=StructuredOutputs(regex="[0-9]{3}")),
            (3, 0): SamplingParams(max_tokens=5, logprobs=None)}.items():
        row = dict(by_key[key])
        row["generated_token_ids"] = list(row["generated_token_ids"])
        if row["logprobs"] is not None:
            row["logprobs"] = [{**e, "top": list(e["top"])} for e in row["logprobs"]]
        (want,) = tiny_llm.generate([tok.encode(rows[key[0]]["prompt"])], [params])
        assert_equals_engine(row, want)
    assert by_key[(0, 0)]["generated_text"] in YES_NO
    assert re.fullmatch("[0-9]{3}", by_key[(1, 0)]["generated_text"])
    for s in range(3):
        assert "the regex could not be compiled" in by_key[(2, s)]["error"]
    assert by_key[(0, 1)]["prompt"] == "Pick one"  # the input row repeated per sample


def test_processor_refuses_a_default_constraint_that_does_not_compile(tiny_job_model):
    from ray_jobs.data_processor import build_processor

    with pytest.raises(InputError, match="the regex could not be compiled"):
        build_processor(str(tiny_job_model), num_gpus=0,
                        structured_outputs=StructuredOutputs(regex="[a-"))


# --- nanoserve generate (tiny model: the grammar, not the model, makes the text valid) ------


def test_generate_with_a_json_schema_prints_valid_samples_and_logprobs(tmp_path, capsys,
                                                                       tiny_job_model):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    rc = nanoserve_main(["generate", "--model", str(tiny_job_model), "--device", "cpu",
                         "--json-schema", str(schema), "--max-tokens", "100",
                         "--n", "2", "--temperature", "0.7", "--seed", "1", "--logprobs", "1",
                         "Extract the person: Maria Lopez is 34 years old."])
    printed = capsys.readouterr().out.splitlines()
    assert rc == 0
    starts = [i for i, line in enumerate(printed) if line.startswith("--- sample ")]
    assert [printed[i] for i in starts] == ["--- sample 0", "--- sample 1"]
    for i in starts:
        jsonschema.validate(json.loads(printed[i + 1]), PERSON)
        count = int(re.match(r"--- (\d+) tokens, finish_reason=stop", printed[i + 2]).group(1))
        lines = printed[i + 3:i + 3 + count]
        assert len(lines) == count
        assert all(re.fullmatch(r"    .+ -?\d+\.\d{4} \(rank \d+\); top: .+ -?\d+\.\d{4}",
                                line) for line in lines), lines


def test_generate_refuses_a_bad_schema_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc = nanoserve_main(["generate", "--json-schema", str(bad), "hello"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: --json-schema {bad}: "
                                                           f"not valid JSON"), err
