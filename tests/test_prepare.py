"""ray_jobs.preparation.prepare: the prompt column rule, job-level column errors, and error rows.

The tokenizer here is a stand-in with an obvious rule (BOS 1, then one id per UTF-8 byte),
so every expected token list is computed by hand; the real tokenizer is exercised by the
end-to-end tests."""

from __future__ import annotations

import pyarrow as pa
import pytest

from nanoserve.errors import InputError
from nanoserve.sampling.params import SamplingParams
from ray_jobs.input.files import InputChunk
from ray_jobs.preparation.prepare import RowPreparer, plan_columns

DEFAULTS = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
            "stop": (), "ignore_eos": False}
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


class ByteTokenizer:
    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [b + 2 for b in text.encode()]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]['content'] must be a string")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def prepare(rows, schema=None, max_context=64, **plan_kwargs):
    batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    plan = plan_columns(batch.schema, **plan_kwargs)
    preparer = RowPreparer(plan, ByteTokenizer(), max_context, vocab_size=258, defaults=DEFAULTS)
    return preparer.prepare(InputChunk(batch, None), first_position=100)


def test_no_prompt_column_lists_the_columns_found():
    with pytest.raises(InputError, match="no prompt column.*columns found: 'text', 'id'"):
        plan_columns(pa.schema([("text", pa.string()), ("id", pa.int64())]))


def test_named_prompt_column_must_exist_and_hold_a_prompt():
    schema = pa.schema([("text", pa.string()), ("n", pa.int64())])
    with pytest.raises(InputError, match="no column 'body'.*columns found: 'text', 'n'"):
        plan_columns(schema, prompt_column="body")
    with pytest.raises(InputError, match="column 'n' has type int64"):
        plan_columns(schema, prompt_column="n")
    assert plan_columns(schema, prompt_column="text").prompt_columns == (("text", "text"),)


def test_default_prompt_columns_must_have_their_kind():
    with pytest.raises(InputError, match="column 'prompt' has type int64"):
        plan_columns(pa.schema([("prompt", pa.int64())]))
    with pytest.raises(InputError, match="column 'messages' has type string"):
        plan_columns(pa.schema([("messages", pa.string())]))


def test_output_column_clash_and_id_clash_are_refused():
    with pytest.raises(InputError, match="'error'.*clash"):
        plan_columns(pa.schema([("prompt", pa.string()), ("error", pa.string())]))
    with pytest.raises(InputError, match="'id' column would clash"):
        plan_columns(pa.schema([("prompt", pa.string()), ("id", pa.int64()), ("uid", pa.string())]),
                     id_column="uid")
    with pytest.raises(InputError, match="no column 'uid'"):
        plan_columns(pa.schema([("prompt", pa.string())]), id_column="uid")


def test_sampling_columns_must_be_numeric():
    with pytest.raises(InputError, match="'temperature'.*must be numeric"):
        plan_columns(pa.schema([("prompt", pa.string()), ("temperature", pa.string())]))


def test_output_schema_is_id_inputs_results():
    plan = plan_columns(pa.schema([("uid", pa.string()), ("prompt", pa.string())]), id_column="uid")
    assert plan.output_schema().names == [
        "id", "uid", "prompt", "generated_text", "generated_token_ids", "num_input_tokens",
        "num_generated_tokens", "finish_reason", "error"]
    assert plan.output_schema().field("id").type == pa.string()
    assert plan.output_schema().field("generated_token_ids").type == pa.list_(pa.int32())


def test_each_row_uses_its_first_present_prompt_column():
    schema = pa.schema([("prompt", pa.string()), ("messages", MESSAGES),
                        ("prompt_token_ids", pa.list_(pa.int64()))])
    rows = prepare([
        {"prompt": "hi", "messages": [{"role": "user", "content": "ignored"}]},
        {"messages": [{"role": "user", "content": "yo"}]},
        {"prompt_token_ids": [5, 6, 7]},
    ], schema)
    assert rows[0].prompt_token_ids == (1, ord("h") + 2, ord("i") + 2)
    chat = "<user>yo<assistant>"  # rendered, then encoded without BOS
    assert rows[1].prompt_token_ids == tuple(b + 2 for b in chat.encode())
    assert rows[2].prompt_token_ids == (5, 6, 7)
    assert [r.position for r in rows] == [100, 101, 102]
    assert [r.id for r in rows] == [100, 101, 102]  # no id column: ids are positions
    assert all(r.error is None for r in rows)


def test_id_column_and_passthrough_values():
    rows = prepare([{"id": "a", "prompt": "x", "extra": [1, 2]}])
    assert rows[0].id == "a"
    assert rows[0].values == {"id": "a", "prompt": "x", "extra": [1, 2]}


def test_bad_rows_become_error_rows():
    schema = pa.schema([("prompt", pa.string()), ("messages", MESSAGES),
                        ("prompt_token_ids", pa.list_(pa.int64())), ("temperature", pa.float64()),
                        ("max_tokens", pa.int64())])
    rows = prepare([
        {"prompt": ""},
        {},
        {"messages": [{"role": "user", "content": None}]},
        {"prompt_token_ids": [3, 999]},
        {"prompt_token_ids": []},
        {"prompt": "x" * 63},  # 64 tokens with BOS: no room left in a 64-token context
        {"prompt": "fine", "temperature": -1.0},
        {"prompt": "fine", "max_tokens": 0},
    ], schema)
    errors = [r.error for r in rows]
    assert all(e is not None for e in errors)
    assert all(r.params is None and r.prompt_token_ids == () for r in rows)
    assert "empty prompt" in errors[0]
    assert "no prompt" in errors[1]
    assert "content" in errors[2]
    assert "token id 999" in errors[3]
    assert "empty prompt" in errors[4]
    assert "prompt has 64 tokens; the model's context is 64" in errors[5]
    assert "temperature" in errors[6]
    assert "max_tokens" in errors[7]


def test_invalid_utf8_bytes_are_an_error_row():
    rows = prepare([{"prompt": b"ok"}, {"prompt": b"\xff\xfe"}], pa.schema([("prompt", pa.binary())]))
    assert rows[0].prompt_token_ids == (1, ord("o") + 2, ord("k") + 2)
    assert "not valid UTF-8" in rows[1].error


def test_read_errors_of_the_chunk_become_error_rows():
    batch = pa.RecordBatch.from_pylist([{"prompt": "a"}, {"prompt": "b"}])
    plan = plan_columns(batch.schema)
    preparer = RowPreparer(plan, ByteTokenizer(), 64, 258, DEFAULTS)
    rows = preparer.prepare(InputChunk(batch, None, {1: "line 2 is not valid UTF-8"}), 0)
    assert rows[0].error is None and rows[1].error == "line 2 is not valid UTF-8"


def test_per_row_values_override_defaults_and_max_tokens_fits_the_context():
    schema = pa.schema([("prompt", pa.string()), ("temperature", pa.float64()),
                        ("seed", pa.float64()), ("max_tokens", pa.int64())])
    rows = prepare([
        {"prompt": "ab", "temperature": 0.7, "seed": 3.0},
        {"prompt": "ab", "temperature": float("nan"), "max_tokens": 100},  # NaN: not set
    ], schema, max_context=12)
    assert rows[0].params == SamplingParams(**{**DEFAULTS, "temperature": 0.7, "seed": 3})
    # 3 prompt tokens in a 12-token context leave room for 9, not 100.
    assert rows[1].params == SamplingParams(**{**DEFAULTS, "max_tokens": 9})


def test_invalid_job_defaults_are_an_input_error():
    plan = plan_columns(pa.schema([("prompt", pa.string())]))
    with pytest.raises(InputError, match="top_p"):
        RowPreparer(plan, ByteTokenizer(), 64, 258, {**DEFAULTS, "top_p": 2.0})


# --- output controls: n, logprobs and structured outputs per row ----------------------------


def test_an_error_row_gives_the_samples_it_asked_for():
    schema = pa.schema([("prompt", pa.string()), ("n", pa.int64())])
    rows = prepare([{"prompt": "", "n": 3}, {"prompt": "", "n": 0}, {"prompt": ""},
                    {"prompt": "ab", "n": 2}], schema)
    assert [(r.error is not None, r.n) for r in rows] == [(True, 3), (True, 1), (True, 1),
                                                          (False, 2)]
    assert rows[3].params.n == 2


def test_constraint_columns_must_have_their_type():
    for column, typ in [("guided_regex", pa.int64()), ("guided_choice", pa.list_(pa.int64())),
                        ("guided_json", pa.int64()), ("response_format", pa.list_(pa.string()))]:
        with pytest.raises(InputError, match=f"column '{column}' \\(a per-row structured "
                                             f"output\\) must hold"):
            plan_columns(pa.schema([("prompt", pa.string()), (column, typ)]))


def test_output_controls_follow_the_job_options_and_the_columns():
    from ray_jobs.preparation.prepare import output_controls

    plain = plan_columns(pa.schema([("prompt", pa.string())]))
    assert output_controls(plain, DEFAULTS) == ()
    assert output_controls(plain, {**DEFAULTS, "n": 2, "prompt_logprobs": 0}) == (
        "sample_index", "prompt_logprobs")
    asked = plan_columns(pa.schema([("prompt", pa.string()), ("n", pa.int64()),
                                    ("logprobs", pa.int64())]))
    controls = output_controls(asked, DEFAULTS)
    assert controls == ("sample_index", "logprobs")
    schema = asked.output_schema(controls)
    assert schema.names == ["id", "prompt", "n", "generated_text", "generated_token_ids",
                            "num_input_tokens", "num_generated_tokens", "finish_reason",
                            "error", "sample_index", "logprobs"]
    clash = plan_columns(pa.schema([("prompt", pa.string()), ("sample_index", pa.int64())]))
    assert clash.output_schema(()).names[2] == "sample_index"  # no samples: no clash
    with pytest.raises(InputError, match="input column 'sample_index' clashes"):
        clash.output_schema(("sample_index",))


def test_structured_output_columns_are_read_checked_and_override_the_default(
        smollm2_gguf_path):
    """JSON text and Arrow structs (a struct's null fields dropped: Arrow gives every row
    every key), OpenAI's response_format, vLLM's guided_* fields; a row that sets none gets
    the job's default, `{"type": "text"}` asks for none; bad ones are error rows."""
    from nanoserve.sampling.structured import StructuredOutputs
    from ray_jobs.preparation.prepare import load_model_meta

    config, tokenizer = load_model_meta(smollm2_gguf_path)
    schema_a = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema_b = {"type": "object", "properties": {"b": {"type": "string"}}}
    rows = [{"prompt": "x", "guided_json": schema_a}, {"prompt": "x", "guided_json": schema_b},
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                "name": "b", "schema": schema_b}}},
            {"prompt": "x", "response_format": {"type": "text"}},
            {"prompt": "x", "guided_choice": ["yes", "no"]},
            {"prompt": "x"},
            {"prompt": "x", "guided_regex": "[a-"},
            {"prompt": "x", "guided_choice": ["a rather long answer"], "max_tokens": 2}]
    keys = dict.fromkeys(k for r in rows for k in r)
    batch = pa.RecordBatch.from_pydict({k: [r.get(k) for r in rows] for k in keys})
    # guided_json: one struct type with both a and b, as Parquet would hold it
    assert pa.types.is_struct(batch.schema.field("guided_json").type)
    plan = plan_columns(batch.schema)
    default = StructuredOutputs(regex="[0-9]+")
    preparer = RowPreparer(plan, tokenizer, config.max_position_embeddings, config.vocab_size,
                           {**DEFAULTS, "structured_outputs": default})
    got = preparer.prepare(InputChunk(batch, None), 0)
    assert [r.params.structured_outputs for r in got[:6]] == [
        StructuredOutputs(json=schema_a), StructuredOutputs(json=schema_b),
        StructuredOutputs(json=schema_b), None, StructuredOutputs(choice=("yes", "no")),
        default]
    assert got[6].error.startswith("the regex could not be compiled")
    assert got[7].error.startswith("no choice of the choice list can be written within "
                                   "max_tokens (2 tokens): the shortest, 'a rather long "
                                   "answer', needs ")
    assert preparer.grammars.compile(StructuredOutputs(json=schema_a))  # compiled once, cached
