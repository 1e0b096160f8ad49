"""Stage input: the input scanned once, then read as a stream of Arrow record batches.

The input (files, folders, Hive keys, compression: `ray_jobs.input.files`) is a set of
`.parquet` and JSON Lines files. Passthrough columns keep the Arrow types their Parquet
files have (large strings, string views, dictionaries, decimals, timestamps, structs ...);
where files of one input disagree, `pa.unify_schemas(promote_options="permissive")` widens
losslessly (string and large_string to large_string, int32 and int64 to int64, ...) or
refuses (InputError). JSON Lines are read by `ray_jobs.input.jsonl`.
`scan_input` checks every file before the job starts (Parquet: the footer and the id column;
JSONL: one streaming parse pass) and returns the one Arrow schema all rows are read with;
`iter_chunks` then streams the rows in that schema, a bounded number at a time.

What is a job-level problem (an `InputError` from `scan_input`, before any work) and what
is a row-level one (a row error reported with its chunk: the row becomes an `error` output
row and the job goes on):
- job level: no such path; an unknown file type; a folder without input files; an input
  without rows (empty files, or Parquet files with a schema and 0 rows: there is nothing to
  do, and an empty output would hide a mistake); a JSONL line that is not JSON or not a
  JSON object (named by file and line); an unreadable Parquet file; a Parquet file whose
  column has another type than the rest of the input gives it; an id column (`id`, or the one
  named) that holds values other than strings or integers, is null in every row, or repeats
  an id (an example is named: output rows are matched to input rows by id;
  `ray_jobs.input.ids`);
- row level: in a JSONL file, a line that is not valid UTF-8 or that escapes an unpaired
  surrogate, or a value that does not fit its column's type (`ray_jobs.input.jsonl`). (A
  row whose id alone is null is an error row too; `prepare` makes it.)

Invariants:
- nothing here holds more than one chunk (`chunk_rows` rows) of one file in memory; to check
  that ids are unique, `scan_input` keeps a 64-bit hash of each row's id and its position
  on disk, in buckets read one at a time (memory flat in the number of rows);
- rows come out in file order (sorted names), then row order within a file; a row's
  position in that stream is its default id.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nanoserve import InputError
from ray_jobs.input.files import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_ID_COLUMN,
    DEFAULT_SHARD_ROWS,
    InputChunk,
    InputFile,
    InputInfo,
    check_input_format,
    list_input_files,
)
from ray_jobs.input.ids import _IdScan
from ray_jobs.input.json_shapes import drop_narrow
from ray_jobs.input.jsonl import _ARROW_ERRORS, FileCuts, _iter_jsonl, _scan_jsonl
from ray_jobs.input.storage import storage_error
from ray_jobs.options import JOB


def scan_input(path: str | Path, chunk_rows: int = DEFAULT_CHUNK_ROWS,
               id_column: str | None = None, input_format: str = JOB["input_format"].default,
               shard_rows: int = DEFAULT_SHARD_ROWS) -> InputInfo:
    """Check every input file, unify their schemas and check the ids.

    Types: nulls and ints widen. A JSONL column takes the type most of its values have
    (values of other types become row errors when read); a Parquet file whose column does
    not agree with that type, or an id column whose values disagree, is an InputError.
    `id_column`: the column of row ids; None means `id` where the input has one (the rule
    `prepare.plan_columns` follows). JSONL files are parsed once here, streaming; Parquet
    files have their footers and id column read. `shard_rows`: the scan records where
    every `shard_rows`-th row of a JSONL file starts (`InputInfo.cuts`), so that a worker
    reads its shard from there (`ray_jobs.input.shards`)."""
    files = list_input_files(path)
    check_input_format(input_format, files)
    id_name = id_column or DEFAULT_ID_COLUMN
    openai_rows = 0
    ids = _IdScan(id_name, lambda f: _file_ids(f, id_name, chunk_rows, input_format))
    layouts: list[pa.Schema | list[str]] = []  # per file: its schema, or (JSONL) its columns
    jsonl_types: dict[str, dict[pa.DataType, int]] = {}  # column -> {type: values of it}
    num_rows = 0
    file_rows: list[int] = []
    cuts: list[FileCuts | None] = []
    for f in files:
        before = num_rows
        if f.kind == "parquet":
            cuts.append(None)
            pfile = _parquet_file(f)
            schema = _with_partition_fields(pfile.schema_arrow.remove_metadata(), f)
            layouts.append(schema)
            n = pfile.metadata.num_rows
            for values in _parquet_ids(pfile, f, id_name, chunk_rows):
                ids.add(f, values)
            num_rows += n
        else:
            names: dict[str, None] = {}
            cuts.append(FileCuts(shard_rows))
            for chunk in _scan_jsonl(f, chunk_rows, id_name, input_format, cuts[-1]):
                openai_rows += chunk.openai_rows
                for fld, col in zip(chunk.batch.schema, chunk.batch.columns):
                    names.setdefault(fld.name)
                    counts = jsonl_types.setdefault(fld.name, {})
                    counts[fld.type] = counts.get(fld.type, 0) + len(col) - col.null_count
                ids.add(f, _chunk_ids(chunk, id_name))
                num_rows += chunk.batch.num_rows
            layouts.append(list(names))
        file_rows.append(num_rows - before)
    try:
        types = {name: _column_type(name, counts, strict=name == id_name)
                 for name, counts in jsonl_types.items()}
        schemas = [s if isinstance(s, pa.Schema) else pa.schema([(n, types[n]) for n in s])
                   for s in layouts]
        schema = pa.unify_schemas([s for s in schemas if len(s)] or [pa.schema([])],
                                  promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise InputError(f"{path}: the input's columns do not agree in type: {e}") from None
    if num_rows == 0:
        raise InputError(f"{path}: the input has no rows (nothing to do)")
    has_ids = id_name in schema.names
    if has_ids:
        ids.check(schema.field(id_name).type, custom_ids=openai_rows > 0 and id_name == "id")
    return InputInfo(root=str(path), files=tuple(files), schema=schema, num_rows=num_rows,
                     id_column=id_name if has_ids else None, input_format=input_format,
                     openai_rows=openai_rows, file_rows=tuple(file_rows), cuts=tuple(cuts),
                     shard_rows=shard_rows)


def _parquet_ids(pfile: pq.ParquetFile, f: InputFile, id_name: str, chunk_rows: int
                 ) -> Iterator[pa.Array]:
    """A Parquet file's ids, a chunk at a time: its id column, the partition key of that
    name, or nulls."""
    n = pfile.metadata.num_rows
    if id_name in pfile.schema_arrow.names and n:
        for batch in _parquet_batches(pfile, f, chunk_rows, columns=[id_name]):
            yield batch.column(0)
    elif id_name in dict(f.partition) and n:  # a partition key named like the id column
        yield pa.array([dict(f.partition)[id_name]] * n)
    elif n:
        yield pa.nulls(n)


def _chunk_ids(chunk: InputChunk, id_name: str) -> pa.Array:
    i = chunk.batch.schema.get_field_index(id_name)
    return chunk.batch.column(i) if i >= 0 else pa.nulls(chunk.batch.num_rows)


def _file_ids(f: InputFile, id_name: str, chunk_rows: int, input_format: str
              ) -> Iterator[pa.Array]:
    """A file's ids again, as `scan_input` read them (to name a repeated one)."""
    if f.kind == "parquet":
        yield from _parquet_ids(_parquet_file(f), f, id_name, chunk_rows)
    else:
        for chunk in _iter_jsonl(f, chunk_rows, schema=None, id_column=id_name,
                                 input_format=input_format):
            yield _chunk_ids(chunk, id_name)


def _column_type(name: str, counts: dict[pa.DataType, int], strict: bool) -> pa.DataType:
    """One JSONL column's type from its chunks' types (with how many values each holds):
    the types that unify are merged, and the group holding the most values wins (ties: the
    first seen). `strict`: every type must unify (ArrowTypeError otherwise)."""
    groups: list[tuple[pa.DataType, int]] = []
    for t, n in drop_narrow(name, counts).items():
        for k, (group_type, group_n) in enumerate(groups):
            try:
                merged = _unify(name, group_type, t)
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                if strict:
                    raise
                continue
            groups[k] = (merged, group_n + n)
            break
        else:
            groups.append((t, n))
    return max(groups, key=lambda g: g[1])[0]  # max keeps the first of equals


def _unify(name: str, a: pa.DataType, b: pa.DataType) -> pa.DataType:
    return pa.unify_schemas([pa.schema([(name, a)]), pa.schema([(name, b)])],
                            promote_options="permissive").field(name).type


def iter_chunks(info: InputInfo, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[InputChunk]:
    """Every row of the input, in read order, as chunks of at most `chunk_rows` rows in
    `info.schema` (columns a file lacks are null). A file that became unreadable since the
    scan is an InputError naming it."""
    for f in info.files:
        if f.kind == "parquet":
            for batch in _parquet_batches(_parquet_file(f), f, chunk_rows):
                if batch.num_rows:
                    batch = _with_partition_columns(batch, f)
                    yield InputChunk(_conform_or_fail(batch, info.schema, f), f)
        else:
            yield from _iter_jsonl(f, chunk_rows, schema=info.schema, id_column=info.id_column,
                                   input_format=info.input_format)


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """`batch` with exactly the fields of `schema`, in its order: missing ones null, others cast."""
    columns = []
    for f in schema:
        i = batch.schema.get_field_index(f.name)
        if i < 0:
            columns.append(pa.nulls(batch.num_rows, f.type))
        else:
            col = batch.column(i)
            columns.append(col if col.type == f.type else col.cast(f.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _with_partition_fields(schema: pa.Schema, f: InputFile) -> pa.Schema:
    """`schema` plus a string field per partition key the file does not have itself."""
    for key, _ in f.partition:
        if key not in schema.names:
            schema = schema.append(pa.field(key, pa.string()))
    return schema


def _with_partition_columns(batch: pa.RecordBatch, f: InputFile) -> pa.RecordBatch:
    """`batch` plus the file's partition keys as string columns (those it lacks)."""
    for key, value in f.partition:
        if key not in batch.schema.names:
            batch = batch.append_column(key, pa.array([value] * batch.num_rows, pa.string()))
    return batch


def _conform_or_fail(batch: pa.RecordBatch, schema: pa.Schema, path: InputFile) -> pa.RecordBatch:
    try:
        return conform(batch, schema)
    except _ARROW_ERRORS as e:
        raise InputError(f"{path}: a column does not fit the input's schema ({e})") from None


def _parquet_file(path: InputFile) -> pq.ParquetFile:
    loc = path.loc
    try:
        source = loc.path if loc.local else loc.fs.open_input_file(loc.path)
        return pq.ParquetFile(source)
    except (pa.ArrowInvalid, OSError) as e:
        if not loc.local and not isinstance(e, pa.ArrowInvalid):
            raise storage_error(loc.uri, e) from None
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None


def _parquet_batches(pfile: pq.ParquetFile, path: InputFile, chunk_rows: int,
                     columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    batches = pfile.iter_batches(batch_size=chunk_rows, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path}: not a readable Parquet file ({e})") from None
        yield batch


