"""ray_jobs.input.shards and the scan's JSONL read: Arrow's block reader (the driver's fast path)
gives the line-by-line scan's answer (schema, row count, cut points, OpenAI rows), and the
shards cover every row exactly once, in input order.

The oracle is the line-by-line scan itself (`ray_jobs.input.jsonl._iter_jsonl`, every block sent
there) and `iter_chunks`, which reads the whole input in one stream."""

from __future__ import annotations

import json

import pytest

import ray_jobs.input.jsonl as jsonl
from ray_jobs.input.io import iter_chunks, scan_input
from ray_jobs.input.shards import InputSpec, iter_shards, num_shards, read_shard

PLAIN = [{"prompt": f"row {i} " + "word " * (i % 7), "max_tokens": i % 3 or None,
          "temperature": 0.5 if i % 4 else 1} for i in range(40)]

# Each a file's text: blocks that the fast path reads, and blocks it leaves to the lines.
TEXTS = {
    "plain": "".join(json.dumps(r) + "\n" for r in PLAIN),
    "crlf, no final newline": "\r\n".join(json.dumps(r) for r in PLAIN),
    "blank lines and a byte order mark": "\ufeff" + "".join(
        json.dumps(r) + ("\n\n  \n" if i % 9 == 0 else "\n") for i, r in enumerate(PLAIN)),
    "mixed types in a column": "".join(
        json.dumps({"prompt": "p", "seed": "x" if i == 30 else i}) + "\n" for i in range(40)),
    "chat rows and later columns": "".join(
        json.dumps({"messages": [{"role": "user", "content": f"m{i}"}]} if i % 5 == 0 else
                   {"prompt": f"p{i}", **({"extra": True} if i > 30 else {})}) + "\n"
        for i in range(40)),
    "ids and OpenAI requests": "".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": f"p{i}"}} if i % 10 == 3 else
                   {"id": f"r{i}", "prompt": f"p{i}"}) + "\n" for i in range(40)),
    "surrogate escapes": "".join(
        (json.dumps({"prompt": f"p{i}"}) if i != 17 else '{"prompt": "bad \\ud800"}') + "\n"
        for i in range(40)),
}


def scan_both(path, monkeypatch, shard_rows=7):
    """(fast scan, line-by-line scan), both over blocks of ~300 bytes."""
    monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 300)
    fast = scan_input(path, chunk_rows=5, shard_rows=shard_rows)
    monkeypatch.setattr(jsonl, "_arrow_block", lambda *a: None)
    slow = scan_input(path, chunk_rows=5, shard_rows=shard_rows)
    monkeypatch.undo()
    return fast, slow


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_fast_scan_agrees_with_the_line_by_line_scan(tmp_path, monkeypatch, name):
    path = tmp_path / "in.jsonl"
    path.write_bytes(TEXTS[name].encode("utf-8", "surrogatepass"))
    fast, slow = scan_both(path, monkeypatch)
    assert fast.schema == slow.schema
    assert (fast.num_rows, fast.file_rows, fast.openai_rows, fast.id_column) == (
        slow.num_rows, slow.file_rows, slow.openai_rows, slow.id_column)
    (fc,), (sc,) = fast.cuts, slow.cuts
    assert (list(fc.offsets), list(fc.lines)) == (list(sc.offsets), list(sc.lines))


def test_the_fast_scan_reads_arrow_blocks_where_it_can(tmp_path, monkeypatch):
    """The plain file goes through Arrow's reader, not a Python object a row."""
    path = tmp_path / "in.jsonl"
    path.write_text(TEXTS["plain"])
    monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 300)
    monkeypatch.setattr(jsonl, "_iter_jsonl", None)  # any call would fail
    assert scan_input(path, chunk_rows=5, shard_rows=7).num_rows == len(PLAIN)


@pytest.mark.parametrize("name", list(TEXTS))
def test_shards_read_every_row_once_in_input_order(tmp_path, monkeypatch, name):
    path = tmp_path / "in.jsonl"
    path.write_bytes(TEXTS[name].encode("utf-8", "surrogatepass"))
    monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 300)
    info = scan_input(path, chunk_rows=5, shard_rows=7)
    spec = InputSpec.of(info, 5)
    shards = list(iter_shards(info))
    assert len(shards) == num_shards(info) == -(-info.num_rows // 7)
    assert [s.first_position for s in shards] == list(range(0, info.num_rows, 7))
    got = [(row, line) for s in shards for chunk in read_shard(spec, s)
           for row, line in zip(chunk.batch.to_pylist(), chunk.lines)]
    want = [(row, line) for chunk in iter_chunks(info, 5)
            for row, line in zip(chunk.batch.to_pylist(), chunk.lines)]
    assert got == want and len(got) == info.num_rows


def test_parquet_shards_read_their_rows_across_row_groups(tmp_path):
    """Parquet: two files in Hive folders, row groups of 6 and 5 rows, shards of 7 rows and
    chunks of 5, so shards start and end inside row groups. Each shard's rows are its file's
    rows start_row .. start_row + num_rows as pyarrow reads the file itself, with the
    folder's key as a column; every row once, in input order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"lang=en/a.parquet": (40, 6), "lang=fr/b.parquet": (13, 5)}
    for rel, (n, group) in files.items():
        (tmp_path / rel).parent.mkdir(parents=True)
        pq.write_table(pa.table({"id": [f"{rel[5:7]}{i}" for i in range(n)],
                                 "prompt": [f"row {i} of {rel}" for i in range(n)],
                                 "max_tokens": [i % 4 + 1 for i in range(n)]}),
                       tmp_path / rel, row_group_size=group)
    assert pq.ParquetFile(tmp_path / "lang=en/a.parquet").metadata.num_row_groups == 7
    info = scan_input(tmp_path, chunk_rows=5, shard_rows=7)
    spec = InputSpec.of(info, 5)
    shards = list(iter_shards(info))
    assert [(s.file, s.start_row, s.num_rows) for s in shards] == [
        (0, 0, 7), (0, 7, 7), (0, 14, 7), (0, 21, 7), (0, 28, 7), (0, 35, 5),
        (1, 0, 7), (1, 7, 6)]
    names = list(files)
    seen = []
    for s in shards:
        chunks = list(read_shard(spec, s))
        assert all(c.batch.num_rows <= 5 for c in chunks)
        got = [row for c in chunks for row in c.batch.to_pylist()]
        want = pq.read_table(tmp_path / names[s.file]).slice(s.start_row, s.num_rows).to_pylist()
        assert [{k: r[k] for k in ("id", "prompt", "max_tokens")} for r in got] == want
        assert {r["lang"] for r in got} == {names[s.file][5:7]}
        seen += [r["id"] for r in got]
    assert seen == [f"en{i}" for i in range(40)] + [f"fr{i}" for i in range(13)]
