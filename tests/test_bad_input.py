"""Bad input through the real `nanoserve batch` command line.

Job-level problems: exit status 2, one stderr line `error: ...` (no traceback), found
before Ray is joined or started (the `no_ray` fixture fails the test if the job gets that
far) and before any output part exists. Row-level problems: one `error` row each
(finish_reason 'error', the `error` column says what is wrong) while the job completes
(exit 0) and every other row is answered; answered rows are held to `LLM.generate` run on
that prompt alone (tokenized here, independently of the job).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from nanoserve.sampling.params import SamplingParams
from nanoserve_cli import main as nanoserve_main

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 3


def run_cli(capsys, *args):
    """`nanoserve batch ARGS --no-progress` in this process: (exit status, stderr lines,
    stdout)."""
    rc = nanoserve_main(["batch", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines(), captured.out


def assert_one_error_line(rc, err, *fragments):
    assert rc == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])


def assert_no_parts(out: Path):
    assert not out.exists() or not list(out.glob("part-*"))




def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- job-level problems ------------------------------------------------------------------------


def test_missing_file(tmp_path, capsys, no_ray):
    rc, err, _ = run_cli(capsys, tmp_path / "nope.jsonl", "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "no such file or folder", "nope.jsonl")
    assert_no_parts(tmp_path / "out")


def test_empty_jsonl_file_is_refused_as_no_rows(tmp_path, capsys, no_ray):
    (tmp_path / "in.jsonl").write_bytes(b"")
    rc, err, _ = run_cli(capsys, tmp_path / "in.jsonl", "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "in.jsonl", "has no rows")
    assert not (tmp_path / "out").exists()


def test_parquet_with_schema_and_no_rows_is_refused_as_no_rows(tmp_path, capsys, no_ray):
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "in.parquet")
    rc, err, _ = run_cli(capsys, tmp_path / "in.parquet", "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "in.parquet", "has no rows")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["prompts.csv", "prompts.txt"])
def test_unknown_file_type(tmp_path, capsys, no_ray, name):
    (tmp_path / name).write_text("prompt\nhello\n")
    rc, err, _ = run_cli(capsys, tmp_path / name, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, name, "unknown input type", ".parquet or JSON Lines")


def test_folder_without_supported_files(tmp_path, capsys, no_ray):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("prompt\nhi\n")
    (data / "_b.jsonl").write_text('{"prompt": "hidden"}\n')
    rc, err, _ = run_cli(capsys, data, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "holds no .parquet or JSON Lines")


def test_no_prompt_column_lists_the_columns_found(tmp_path, capsys, no_ray):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "hi", "lang": "en"}])
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "no prompt column", "columns found: 'text', 'lang'")


def test_prompt_column_of_integers(tmp_path, capsys, no_ray):
    pq.write_table(pa.table({"prompt": [1, 2, 3]}), tmp_path / "in.parquet")
    rc, err, _ = run_cli(capsys, tmp_path / "in.parquet", "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "column 'prompt' has type int64", "text (string)")


def test_messages_column_of_strings(tmp_path, capsys, no_ray):
    rows = [{"messages": json.dumps([{"role": "user", "content": "hi"}])}] * 2
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "column 'messages' has type string",
                          "list of {role, content}", "not as a string")


def test_malformed_jsonl_line_names_file_and_line(tmp_path, capsys, no_ray):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n')
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "in.jsonl:4: not valid JSON")


@pytest.mark.parametrize("line, kind", [("[1, 2]", "list"), ('"x"', "string"), ("7", "number"),
                                        ("null", "null")])
def test_jsonl_line_that_is_not_an_object(tmp_path, capsys, no_ray, line, kind):
    path = tmp_path / "in.jsonl"
    path.write_text(f'{{"prompt": "a"}}\n{line}\n')
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, f"in.jsonl:2: each line must be a JSON object, got {kind}")


def test_duplicate_ids_name_an_example(tmp_path, capsys, no_ray):
    rows = [{"id": f"q{i}", "prompt": "hi"} for i in range(5)] + [{"id": "q3", "prompt": "yo"}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "duplicates", "'q3' appears 2 times",
                          "in.jsonl line 4 and in.jsonl line 6")


def test_duplicate_ids_found_through_the_buckets_on_disk(tmp_path, capsys, no_ray, monkeypatch):
    """Ids spilled to disk every 4 rows (not every million): the same answer as in memory,
    the first repeated id by position named, nulls skipped, and the spill folder removed."""
    import tempfile

    import ray_jobs.input.ids as ids

    monkeypatch.setattr(ids, "ID_SPILL_ROWS", 4)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    rows = [{"id": None if i % 10 == 3 else f"q{i}", "prompt": "hi"} for i in range(100)]
    rows += [{"id": "q37", "prompt": "a"}, {"id": "q5", "prompt": "b"}, {"id": None, "prompt": "c"}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "'q5' appears 2 times", "in.jsonl line 6 and in.jsonl line 102",
                          "(1 other ids repeat too)")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_duplicate_ids_held_in_memory_after_a_spill(tmp_path, capsys, no_ray, monkeypatch):
    """Two files, ids spilled every 4: the first file's four ids go to disk, the second's
    two stay in memory when the scan ends, and one of those repeats an id on disk."""
    import ray_jobs.input.ids as ids

    monkeypatch.setattr(ids, "ID_SPILL_ROWS", 4)
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "prompt": list("abcd")}), data / "a.parquet")
    pq.write_table(pa.table({"id": [5, 2], "prompt": ["e", "f"]}), data / "b.parquet")
    rc, err, _ = run_cli(capsys, data, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "2 appears 2 times", "a.parquet row 1", "b.parquet row 1")


def test_duplicate_ids_across_parquet_files(tmp_path, capsys, no_ray):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), data / "a.parquet")
    pq.write_table(pa.table({"id": [3, 2], "prompt": ["c", "d"]}), data / "b.parquet")
    rc, err, _ = run_cli(capsys, data, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "2 appears 2 times", "a.parquet row 1", "b.parquet row 1")


def test_id_column_null_in_every_row_is_refused(tmp_path, capsys, no_ray):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": None, "prompt": "a"}] * 2)
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "column 'id'", "null in every row")


@pytest.mark.parametrize("ids, what", [([1, "b"], "incompatible types"),
                                       ([1.5, 2.5], "strings or integers")])
def test_id_column_of_unusable_type_is_refused(tmp_path, capsys, no_ray, ids, what):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "a"} for i in ids])
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out")
    assert_one_error_line(rc, err, "'id'", what)


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-0.5"], "temperature must be a finite number >= 0, got -0.5"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--top-k", "-3"], "top_k must be an integer >= 0"),
    (["--seed", str(2**70)], "seed must be in"),
    (["--stop", ""], "stop strings must be non-empty"),
])
def test_invalid_sampling_options(tmp_path, capsys, no_ray, flags, fragment):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out", *flags)
    assert_one_error_line(rc, err, "invalid sampling options", fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, fragment", [
    (["--batch-size", "0"], "batch_size must be an integer >= 1, got 0"),
    (["--num-workers", "0"], "num_workers must be >= 1"),
])
def test_invalid_execution_options(tmp_path, capsys, no_ray, flags, fragment):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out", *flags)
    assert_one_error_line(rc, err, fragment)


def test_job_level_error_in_a_fresh_process(tmp_path):
    """The installed entry point's form (`python -m nanoserve_cli`): one line, no traceback,
    and no Ray session files written anywhere under the temp dir it was given."""
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve_cli", "batch", "in.jsonl", "-o", "out"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: column 'id' (the row ids) holds duplicates: 1 appears 2 times, at in.jsonl "
        "line 1 and in.jsonl line 2; ids must be unique (output rows are matched to input "
        "rows by id)"]
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no out/, no ns-ray-*


# --- row-level problems: one job, one error row per case -------------------------------------

GOOD = {  # case -> row; each must be answered
    "good-prompt": {"prompt": "The capital of France is"},
    "good-messages": {"messages": [{"role": "user", "content": "Say hi."}]},
    "good-token-ids": {"prompt_token_ids": [504, 2988, 314]},
    "good-override": {"prompt": "Once upon a time", "temperature": 0.8, "top_p": 0.9,
                      "top_k": 20, "seed": 5, "max_tokens": 2},
}
BAD = {  # case -> (row, what its error must say)
    "empty-prompt": ({"prompt": ""}, "empty prompt"),
    "whitespace-prompt": ({"prompt": " \n\t "}, "holds only whitespace"),
    "null-prompt": ({"prompt": None}, "no prompt: prompt / messages / prompt_token_ids is null"),
    "prompt-not-text": ({"prompt": 42}, "line 8: prompt is an integer, but the other rows have "
                                        "strings there"),
    "too-long": ({"prompt": "word " * 9000}, "the model's context is 8192 tokens"),
    "negative-temperature": ({"prompt": "hi", "temperature": -1.0}, "temperature must be a finite"),
    "top-p-above-1": ({"prompt": "hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    "zero-max-tokens": ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    "negative-top-k": ({"prompt": "hi", "top_k": -4}, "top_k must be an integer >= 0"),
    "fractional-max-tokens": ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens must be an integer"),
    "temperature-not-number": ({"prompt": "hi", "temperature": "hot"},
                               "temperature is a string, but the other rows have numbers there"),
    "huge-seed": ({"prompt": "hi", "temperature": 0.5, "seed": 1e30}, "seed must be in"),
    "messages-string": ({"messages": "hello"},
                        "messages is a string, but the other rows have lists of objects"),
    "messages-missing-content": ({"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
    "messages-non-dict": ({"messages": [{"role": "user", "content": "a"}, "b"]},
                          "messages[1] is a string, but the other rows have objects"),
    "messages-not-a-list": ({"messages": 42}, "messages is an integer"),
    "messages-content-not-text": ({"messages": [{"role": "user", "content": 3}]},
                                  "messages[0].content is an integer"),
    "messages-empty": ({"messages": []}, "messages is empty"),
    "token-id-out-of-vocab": ({"prompt_token_ids": [1, 49152]}, "token id 49152, outside the vocabulary"),
    "token-id-negative": ({"prompt_token_ids": [-1, 5]}, "token id -1, outside the vocabulary"),
    "token-ids-empty": ({"prompt_token_ids": []}, "empty prompt"),
}
RAW_BAD = {  # case -> (raw JSONL line, what its error must say); the row's id is its case
    "not-utf8": (b'{"id": "not-utf8", "case": "not-utf8", "prompt": "caf\xe9 au lait"}',
                 "in.jsonl line {line} is not valid UTF-8"),
    "lone-surrogate": (b'{"id": "lone-surrogate", "case": "lone-surrogate", "prompt": "a\\ud800b"}',
                       "in.jsonl line {line} holds an unpaired surrogate escape"),
}
NULL_ID_CASE = "null-id"


@pytest.fixture(scope="module")
def row_job(tmp_path_factory, ray_session):
    """One job over every row-level case (plus good rows), through the CLI on the shared
    local Ray. Returns (exit status, stderr, output rows by case, line numbers by case)."""
    folder = tmp_path_factory.mktemp("row-job")
    lines, line_of = [], {}
    for case, row in GOOD.items():
        lines.append(json.dumps({"id": case, "case": case, **row}).encode())
    for case, (row, _) in BAD.items():
        lines.append(json.dumps({"id": case, "case": case, **row}).encode())
    lines += [raw for raw, _ in RAW_BAD.values()]
    lines.append(json.dumps({"id": None, "case": NULL_ID_CASE, "prompt": "hi"}).encode())
    for n, raw in enumerate(lines, start=1):
        line_of[json.loads(raw.decode("utf-8", "replace"))["case"]] = n
    assert line_of["prompt-not-text"] == 8  # BAD's expected message names this line
    path = folder / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = folder / "out"
    rc = nanoserve_main(["batch", str(path), "-o", str(out), "--max-tokens", str(MAX_TOKENS),
                         "--batch-size", "4", "--no-progress"])
    table = ds.dataset(out).to_table() if out.exists() else None
    rows = {r["case"]: r for r in table.to_pylist()} if table is not None else {}
    return rc, rows, line_of, table


def test_row_job_completes_and_writes_every_row(row_job):
    rc, rows, line_of, table = row_job
    assert rc == 0
    assert sorted(rows) == sorted(line_of)
    assert table.num_rows == len(line_of)
    errors = {c for c, r in rows.items() if r["finish_reason"] == "error"}
    assert errors == set(BAD) | set(RAW_BAD) | {NULL_ID_CASE}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_row_becomes_an_error_row(row_job, case):
    _, rows, _, _ = row_job
    row = rows[case]
    assert row["finish_reason"] == "error"
    assert BAD[case][1] in row["error"], row["error"]
    assert row["generated_token_ids"] is None and row["generated_text"] is None
    assert row["num_generated_tokens"] == 0
    assert row["id"] == case  # the row keeps its id and input columns


@pytest.mark.parametrize("case", sorted(RAW_BAD))
def test_unreadable_jsonl_line_becomes_an_error_row_naming_file_and_line(row_job, case):
    _, rows, line_of, _ = row_job
    row = rows[case]
    assert row["finish_reason"] == "error"
    assert RAW_BAD[case][1].format(line=line_of[case]) in row["error"], row["error"]
    assert row["id"] == case


def test_null_id_becomes_an_error_row(row_job):
    _, rows, _, _ = row_job
    row = rows[NULL_ID_CASE]
    assert row["id"] is None and row["finish_reason"] == "error"
    assert "the row has no id (column 'id' is null)" in row["error"]


def test_good_rows_are_answered(row_job):
    _, rows, _, _ = row_job
    for case in GOOD:
        got = rows[case]
        assert got["error"] is None, (case, got["error"])
        assert got["finish_reason"] in ("stop", "length")
        assert 1 <= got["num_generated_tokens"] == len(got["generated_token_ids"]) <= MAX_TOKENS


@pytest.mark.parametrize("case", ["good-prompt", "good-override"])
def test_good_rows_equal_the_prompt_generated_alone(row_job, smollm2_llm, case):
    """Among error rows, a good row is what `LLM.generate` makes of its prompt alone, with
    its own per-row sampling values."""
    _, rows, _, _ = row_job
    row, got = GOOD[case], rows[case]
    ids = smollm2_llm.tokenizer.encode(row["prompt"])
    params = SamplingParams(max_tokens=row.get("max_tokens", MAX_TOKENS),
                            temperature=row.get("temperature", 0.0), top_p=row.get("top_p", 1.0),
                            top_k=row.get("top_k", 0), seed=row.get("seed"))
    (want,) = smollm2_llm.generate([ids], [params])
    assert got["num_input_tokens"] == len(ids)
    assert got["generated_token_ids"] == want.token_ids
    assert got["generated_text"] == want.text
    assert got["finish_reason"] == want.finish_reason


def test_duplicate_ids_in_a_named_id_column(tmp_path, capsys, no_ray):
    rows = [{"uid": "a", "prompt": "hi"}, {"uid": "a", "prompt": "yo"}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    rc, err, _ = run_cli(capsys, path, "-o", tmp_path / "out", "--id-column", "uid")
    assert_one_error_line(rc, err, "column 'uid'", "'a' appears 2 times")
