"""ray_jobs.input.io (with .files and .jsonl): input files as a stream of record batches, schema
unification; and atomic parts (ray_jobs.output.manifest.write_part_atomic)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from nanoserve.errors import InputError
from ray_jobs.input.files import list_input_files
from ray_jobs.input.io import iter_chunks, scan_input
from ray_jobs.output.manifest import write_part_atomic


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_all(info, chunk_rows=1024):
    return [row for chunk in iter_chunks(info, chunk_rows) for row in chunk.batch.to_pylist()]


def test_missing_path_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file or folder"):
        list_input_files(tmp_path / "nope.jsonl")


def test_unknown_file_type_is_an_input_error(tmp_path):
    p = tmp_path / "prompts.csv"
    p.write_text("prompt\nhi\n")
    with pytest.raises(InputError, match="unknown input type '.csv'"):
        scan_input(p)


def test_folder_lists_inputs_in_name_order_and_skips_hidden(tmp_path):
    for name in ("b.jsonl", "a.parquet", "_SUCCESS", ".tmp.jsonl", "notes.txt", "c.jsonl"):
        (tmp_path / name).write_text("")
    assert [p.name for p in list_input_files(tmp_path)] == ["a.parquet", "b.jsonl", "c.jsonl"]


def test_folder_without_inputs_is_an_input_error(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="holds no"):
        list_input_files(tmp_path)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(InputError, match=r"in\.jsonl:3: not valid JSON"):
        scan_input(p)


@pytest.mark.parametrize("line, where", [
    ('{"id": 2, "prompt": "b"', "Expecting ',' delimiter, at the end of the line, column 24"),
    ('{"id": 2 "prompt": "b"}', "Expecting ',' delimiter, column 10"),
    ('{"id": 2, "prompt": "b"}}', "Extra data, column 25"),
])
def test_malformed_jsonl_line_names_the_column_in_its_line(tmp_path, line, where):
    """The column of the fault in its own line (json alone counts the line's newline, and
    puts a line cut short at column 1 of the next)."""
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\r\n' + line + "\r\n")
    with pytest.raises(InputError) as e:
        scan_input(p)
    assert str(e.value) == f"{p}:2: not valid JSON ({where})"


def test_jsonl_line_that_is_not_an_object_is_an_input_error(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"prompt": "a"}\n["b"]\n')
    with pytest.raises(InputError, match=r"in\.jsonl:2: each line must be a JSON object, got list"):
        scan_input(p)


def test_empty_file_has_no_rows(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(InputError, match="no rows"):
        scan_input(p)


def test_empty_file_among_others_is_skipped(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    info = scan_input(tmp_path)
    assert info.num_rows == 2
    assert read_all(info) == [{"prompt": "x"}, {"prompt": "y"}]


def test_invalid_utf8_line_becomes_a_row_error(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "bad \xff byte", "id": 7}\n{"prompt": "ok2"}\n')
    info = scan_input(p)
    (chunk,) = list(iter_chunks(info))
    assert chunk.batch.num_rows == 3
    assert set(chunk.row_errors) == {1}
    assert "line 2 is not valid UTF-8" in chunk.row_errors[1]
    assert chunk.batch.to_pylist()[1]["id"] == 7


def test_jsonl_streams_in_bounded_chunks_in_order(tmp_path):
    rows = [{"prompt": f"p{i}", "n": i} for i in range(10)]
    info = scan_input(write_jsonl(tmp_path / "in.jsonl", rows), chunk_rows=3)
    sizes = [c.batch.num_rows for c in iter_chunks(info, chunk_rows=3)]
    assert sizes == [3, 3, 3, 1]
    assert read_all(info, 3) == rows


def test_parquet_streams_in_bounded_chunks_in_order(tmp_path):
    table = pa.table({"prompt": [f"p{i}" for i in range(10)], "n": list(range(10))})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=4)
    info = scan_input(tmp_path / "in.parquet")
    assert info.num_rows == 10
    chunks = list(iter_chunks(info, chunk_rows=3))
    assert all(c.batch.num_rows <= 3 for c in chunks)
    assert pa.Table.from_batches([c.batch for c in chunks]).equals(table)


def test_jsonl_types_widen_across_chunks(tmp_path):
    rows = [{"prompt": "a", "temperature": 0, "tag": None},
            {"prompt": "b", "temperature": 0},
            {"prompt": "c", "temperature": 0.5, "tag": "x"}]
    info = scan_input(write_jsonl(tmp_path / "in.jsonl", rows), chunk_rows=1)
    assert info.schema.field("temperature").type == pa.float64()
    assert info.schema.field("tag").type == pa.string()
    got = read_all(info, chunk_rows=1)
    assert [r["temperature"] for r in got] == [0.0, 0.0, 0.5]
    assert [r["tag"] for r in got] == [None, None, "x"]


def test_jsonl_column_of_incompatible_types_is_named(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": "x"}])
    with pytest.raises(InputError, match="column 'id'"):
        scan_input(p)
    with pytest.raises(InputError, match="id has incompatible types"):  # clash across chunks
        scan_input(p, chunk_rows=1)


def test_messages_column_reads_as_list_of_structs(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "yo", "name": "bob"}]}]
    info = scan_input(write_jsonl(tmp_path / "in.jsonl", rows))
    t = info.schema.field("messages").type
    assert pa.types.is_list(t) and pa.types.is_struct(t.value_type)
    assert {f.name for f in t.value_type} == {"role", "content", "name"}


def test_folder_of_parquet_and_jsonl_unifies_columns(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "b"], "x": [1, 2]}), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "c", "y": "why"}])
    info = scan_input(tmp_path)
    assert info.schema.names == ["prompt", "x", "y"]
    assert read_all(info) == [{"prompt": "a", "x": 1, "y": None},
                              {"prompt": "b", "x": 2, "y": None},
                              {"prompt": "c", "x": None, "y": "why"}]


def test_unreadable_parquet_is_an_input_error(tmp_path):
    (tmp_path / "in.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        scan_input(tmp_path / "in.parquet")


def test_part_write_is_atomic_and_leaves_no_temporary(tmp_path):
    table = pa.table({"id": [1, 2], "generated_text": ["a", "b"]})
    write_part_atomic(table, tmp_path / "part-00000.parquet")
    assert [p.name for p in tmp_path.iterdir()] == ["part-00000.parquet"]
    assert ds.dataset(tmp_path).to_table().equals(table)


def test_json_documents_in_jsonl_are_read_as_their_json_text(tmp_path):
    """`guided_json` / `response_format` objects of different keys are not merged into one
    struct with nulls: each row keeps its document, as JSON text; strings stay as written."""
    a = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    b = {"type": "object", "properties": {"y": {"const": None}}}
    rows = [{"prompt": "p", "guided_json": a}, {"prompt": "p", "guided_json": json.dumps(b)},
            {"prompt": "p", "guided_json": b, "response_format": {"type": "json_object"}},
            {"prompt": "p"}]
    info = scan_input(write_jsonl(tmp_path / "in.jsonl", rows))
    assert info.schema.field("guided_json").type == pa.string()
    assert info.schema.field("response_format").type == pa.string()
    got = read_all(info)
    assert [None if r["guided_json"] is None else json.loads(r["guided_json"])
            for r in got] == [a, b, b, None]
    assert json.loads(got[2]["response_format"]) == {"type": "json_object"}
