"""Datasets as they come: folder trees read recursively (Hive partitions, Spark's and
hidden files), compressed JSON Lines, `.json` files, and Parquet files written by pandas,
polars, DuckDB and Ray Data, each with its own Arrow types.

Oracles: the plain, uncompressed file read by the same reader (compressed input must give
the very same chunks); the writer's own files read back by pyarrow (the job's output must
carry every passthrough column with the input's type and values, id for id).
"""

from __future__ import annotations

import datetime
import decimal
import gzip
import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from nanoserve.errors import InputError
from ray_jobs import run_batch_job
from ray_jobs.input.files import list_input_files
from ray_jobs.input.io import iter_chunks, scan_input


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as f:
        f.write(data)
    return sink.getvalue().to_pybytes()


def rows_of(info, chunk_rows=3):
    return [r for c in iter_chunks(info, chunk_rows) for r in c.batch.to_pylist()]


def test_tree_is_read_recursively_in_path_order_with_hive_keys_and_hidden_parts_skipped(tmp_path):
    """Spark's layout (`_SUCCESS`, `.crc` files, `_temporary/`), Hive folders two deep, and
    files of several kinds: read in the sorted order of their relative paths; each row
    carries its folders' keys as string columns."""
    def put(rel, data):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)

    pq.write_table(pa.table({"prompt": ["fr a", "fr b"]}),
                   tmp_path / "x.parquet")  # top level: no keys
    put("lang=fr/year=2024/part-00000-abc.c000.snappy.parquet", b"")
    pq.write_table(pa.table({"prompt": ["fr 2024"]}),
                   tmp_path / "lang=fr/year=2024/part-00000-abc.c000.snappy.parquet")
    put("lang=en/year=2023/b.jsonl.gz", gzip.compress(jsonl([{"prompt": "en 2023"}])))
    put("lang=en/year=2023/a.json", jsonl([{"prompt": "en a"}]))
    for junk in ("_SUCCESS", "lang=en/.a.json.crc", "_temporary/0/part-9.parquet",
                 "lang=en/.hidden/z.jsonl", "lang=en/notes.txt"):
        put(junk, b"junk")

    files = list_input_files(tmp_path)
    assert [f.rel for f in files] == ["lang=en/year=2023/a.json", "lang=en/year=2023/b.jsonl.gz",
                                      "lang=fr/year=2024/part-00000-abc.c000.snappy.parquet",
                                      "x.parquet"]
    info = scan_input(tmp_path)
    assert info.schema.field("lang").type == pa.string()
    assert info.schema.field("year").type == pa.string()  # kept as written: lossless
    assert [(r["prompt"], r["lang"], r["year"]) for r in rows_of(info)] == [
        ("en a", "en", "2023"), ("en 2023", "en", "2023"), ("fr 2024", "fr", "2024"),
        ("fr a", None, None), ("fr b", None, None)]


def test_a_column_of_the_file_wins_over_its_partition_key(tmp_path):
    (tmp_path / "lang=en").mkdir()
    pq.write_table(pa.table({"prompt": ["p"], "lang": ["de"]}), tmp_path / "lang=en/a.parquet")
    (tmp_path / "lang=fr").mkdir()
    (tmp_path / "lang=fr/b.jsonl").write_bytes(jsonl([{"prompt": "q", "lang": "it"}]))
    assert [r["lang"] for r in rows_of(scan_input(tmp_path))] == ["de", "it"]


@pytest.mark.parametrize("name,pack", [
    ("p.jsonl.gz", gzip.compress), ("p.jsonl.zst", zstd), ("p.json", lambda b: b),
    ("p.ndjson", lambda b: b), ("P.JSON.GZ", gzip.compress)])
def test_compressed_and_json_named_files_read_as_the_plain_jsonl(tmp_path, name, pack):
    rows = [{"id": i, "prompt": f"row {i}", "temperature": 0.5 if i % 2 else None}
            for i in range(10)]
    (tmp_path / "plain.jsonl").write_bytes(jsonl(rows))
    (tmp_path / name).write_bytes(pack(jsonl(rows)))
    want = scan_input(tmp_path / "plain.jsonl")
    got = scan_input(tmp_path / name)
    assert got.schema == want.schema and got.num_rows == 10
    assert [c.batch for c in iter_chunks(got, 3)] == [c.batch for c in iter_chunks(want, 3)]
    assert [c.lines for c in iter_chunks(got, 3)] == [c.lines for c in iter_chunks(want, 3)]


def test_json_that_is_not_json_lines_is_one_clear_error(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "x"}, {"prompt": "y"}]))
    with pytest.raises(InputError, match=r"a JSON array file\? write one object per line\) "
                                         r"\(a \.json file is read as JSON Lines"):
        scan_input(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps({"prompt": "x"}, indent=2))
    with pytest.raises(InputError, match=r"b.json:1: not valid JSON .*read as JSON Lines"):
        scan_input(tmp_path / "b.json")


def test_corrupt_compressed_file_is_one_clear_error(tmp_path):
    data = gzip.compress(jsonl([{"prompt": f"row {i} " * 50} for i in range(200)]))
    (tmp_path / "c.jsonl.gz").write_bytes(data[:len(data) // 2] + b"\x00" * 64)
    with pytest.raises(InputError, match=r"c.jsonl.gz: cannot read"):
        scan_input(tmp_path / "c.jsonl.gz")


def test_parquet_named_gz_is_not_an_input(tmp_path):
    (tmp_path / "a.parquet.gz").write_bytes(b"x")
    with pytest.raises(InputError, match="unknown input type '.gz'"):
        list_input_files(tmp_path / "a.parquet.gz")


# --- files as the common writers produce them, through the whole job ----------------------------


def _pandas(folder):
    import pandas as pd

    df = pd.DataFrame({
        "id": [0, 1, 2, 3],
        "prompt": ["Say one", "Say two", "Say three", "Say four"],
        "topic": pd.Categorical(["a", "b", "a", "c"]),  # dictionary<string>
        "when": pd.to_datetime(["2024-01-01 10:00", "2024-02-01 00:00", "2024-03-01 00:00",
                                "2024-04-01 00:00"]).tz_localize("Europe/Paris"),
        "score": [0.5, None, 1.5, 2.5],
    })
    df.to_parquet(folder / "pandas.parquet")


def _polars(folder):
    import polars as pl

    pl.DataFrame({
        "id": [0, 1, 2, 3],
        "prompt": ["Say one", "Say two", "Say three", "Say four"],
        "meta": [{"k": 1, "v": "x"}, {"k": 2, "v": None}, None, {"k": 4, "v": "z"}],
        "tags": [["a"], [], ["b", "c"], None],
        "price": [decimal.Decimal("1.10"), decimal.Decimal("2.25"), None,
                  decimal.Decimal("-3.00")],
        "lang": ["en", "fr", "en", "fr"],
    }).write_parquet(folder, partition_by="lang")


def _duckdb(folder):
    import duckdb

    con = duckdb.connect()
    con.execute(
        "COPY (SELECT i AS id, 'Say ' || i AS prompt, (i * 1.25)::DECIMAL(10, 2) AS price, "
        "TIMESTAMPTZ '2024-01-01 00:00:00+00' + to_days(i) AS ts, DATE '2024-05-01' AS d, "
        "{'a': i, 'b': 'x' || i} AS st, [i, i + 1] AS li, "
        "CASE WHEN i % 2 = 0 THEN 'en' ELSE 'fr' END AS lang FROM range(4) t(i)) "
        f"TO '{folder}' (FORMAT parquet, PARTITION_BY (lang), OVERWRITE_OR_IGNORE)")


def _ray_data(folder):
    import ray

    table = pa.table({
        "id": pa.array([0, 1, 2, 3], pa.int64()),
        "prompt": pa.array(["Say one", "Say two", "Say three", "Say four"], pa.large_string()),
        "at": pa.array([datetime.datetime(2024, 1, i + 1) for i in range(4)],
                       pa.timestamp("ms")),
        "amount": pa.array([decimal.Decimal(f"{i}.5") for i in range(4)], pa.decimal128(8, 1)),
        "blob": pa.array([b"\x00\x01", b"", None, b"z"], pa.binary()),
    })
    ray.data.from_arrow(table).repartition(2).write_parquet(str(folder))


WRITERS = {"pandas": _pandas, "polars": _polars, "duckdb": _duckdb, "ray_data": _ray_data}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_files_of_common_writers_pass_through_the_job_with_their_types(
        writer, ray_session, tiny_job_model, tmp_path):
    """The writer's dataset (as it lays it out: one file, partition folders, uuid-named
    parts) runs through the job; the output holds every input column with the type pyarrow
    reads from the writer's files (the Hive keys as strings) and the same values, by id."""
    folder = tmp_path / "in"
    folder.mkdir()
    WRITERS[writer](folder)
    want, schema = {}, None
    for path in sorted(folder.rglob("*.parquet")):
        table = pq.ParquetFile(path).read()  # the file alone, as its writer wrote it
        schema = schema or table.schema.remove_metadata()
        for part in path.relative_to(folder).parts[:-1]:
            key, _, value = part.partition("=")
            if value and key not in table.column_names:  # a key the file lacks
                table = table.append_column(key, pa.array([value] * len(table), pa.string()))
        for row in table.to_pylist():
            want[row["id"]] = row

    summary = run_batch_job(folder, tmp_path / "out", model=str(tiny_job_model), max_tokens=1,
                            batch_size=2, kv_cache_bytes=32 << 20, progress=False)
    assert summary.rows == 4 and summary.error_rows == 0
    out = ds.dataset(tmp_path / "out", format="parquet").to_table()
    for field in schema:
        assert out.schema.field(field.name).type == field.type, field.name
    got = {r["id"]: r for r in out.to_pylist()}
    assert sorted(got) == sorted(want)
    for i, row in want.items():
        assert {k: got[i][k] for k in row} == row, i
