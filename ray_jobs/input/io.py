"""Stage input: dataset I/O for the batch job. Input files read as a stream of Arrow record
batches, and output parts written atomically.

Input: a `.parquet` file, a JSON Lines file (`.jsonl`, `.ndjson`, or `.json` holding one
object a line; any of them may be compressed: `.gz`, `.zst`), or a folder of them, local or
on any filesystem `ray_jobs.input.storage` resolves (`s3://bucket/prefix/`, `gs://...`). A folder is
read recursively, in the sorted order of the files' paths relative to it; a file or folder
whose name starts with `_` or `.` is skipped (Spark's `_SUCCESS`, `.crc` files), as pyarrow
skips them; suffixes match in any case. A folder named `key=value` (Hive partitioning, as
pandas, polars, DuckDB, Spark and Ray Data write it) adds the string column `key` with
`value` to the rows of every file under it, unless the file has a column of that name.
Compressed files are decompressed as a stream, a block at a time.

Passthrough columns keep the Arrow types their Parquet files have (large strings, string
views, dictionaries, decimals, timestamps, structs ...); where files of one input disagree,
`pa.unify_schemas(promote_options="permissive")` widens losslessly (string and large_string
to large_string, int32 and int64 to int64, ...) or refuses (InputError). In JSON Lines, the
values of `response_format` and `guided_json` (JSON documents: a schema, OpenAI's
response format) are read as their JSON text (a string column), objects and strings alike:
Arrow would merge objects of different keys into one struct, with nulls for the keys a row
lacks. A conversation column may mix string contents with lists of content parts, and the
`image` column one image with lists of them: such a column is read in the wider shape
(`ray_jobs.input.json_shapes`: a string content as one text part, one image as a list of one).
A JSONL line shaped as an OpenAI Batch API request (`custom_id` and `body`; every line with
`input_format` 'openai', none with 'plain') is read as the row `ray_jobs.input.openai_requests.
flatten_request` makes of it (its custom_id as `id`; a request that cannot run becomes a row
error naming why).
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
  an id (an example is named: output rows are matched to input rows by id);
- row level: a JSONL line that is not valid UTF-8 (decoded with replacement characters so
  its other fields still read) or that escapes an unpaired surrogate; in a JSONL file, a
  value that does not fit its column's type, the type most of the column's values have
  (e.g. one `messages` that is a string among lists of objects, one `temperature` that is a
  string among numbers): that value reads as null and the row's error says which line,
  which field and what was expected. (A row whose id alone is null
  is an error row too; `prepare` makes it.)

Invariants:
- nothing here holds more than one chunk (`chunk_rows` rows) of one file in memory; to check
  that ids are unique, `scan_input` keeps a 64-bit hash of each row's id and its position
  on disk, in buckets read one at a time (memory flat in the number of rows);
- rows come out in file order (sorted names), then row order within a file; a row's
  position in that stream is its default id;
- an output part is visible under its final name only once completely written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pyarrow.types as pat

from nanoserve import InputError
from ray_jobs.input.json_shapes import drop_narrow, widen
from ray_jobs.input.storage import Location, check_bucket, open_lines, resolve, storage_error

INPUT_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}  # JSON Lines only (Parquet compresses inside)
_EXPECTED = ".parquet or JSON Lines (.jsonl, .ndjson, .json; also .gz, .zst)"
DEFAULT_CHUNK_ROWS = 1024
DEFAULT_SHARD_ROWS = 1024  # rows of a shard (`ray_jobs.input.shards`) unless the job says
DEFAULT_ID_COLUMN = "id"  # the id column when the job names none

# The columns every output row gets after `id` and the input's own columns.
RESULT_SCHEMA = pa.schema([
    ("generated_text", pa.string()),
    ("generated_token_ids", pa.list_(pa.int32())),
    ("num_input_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),
    ("finish_reason", pa.string()),  # 'stop', 'length' or 'error'
    ("error", pa.string()),  # null unless the row failed
])
RESULT_COLUMNS = tuple(RESULT_SCHEMA.names)

# Generated or prompt tokens' logprobs (`nanoserve.logprobs.TokenLogprob.as_dict`): per token
# its id, logprob (of the model's raw logits), rank (1: the most likely) and the `top` k most
# likely tokens there, most likely first.
LOGPROB_TOP_TYPE = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()),
                                    ("rank", pa.int32()), ("top", pa.list_(LOGPROB_TOP_TYPE))]))
# The output-control columns, after RESULT_SCHEMA's, each present only when the job can need
# it: `sample_index` when a row may ask for n > 1 samples (one output row per sample),
# `logprobs` / `prompt_logprobs` when a row may ask for them. A worker's table always has all.
CONTROL_SCHEMA = pa.schema([
    ("sample_index", pa.int32()),  # which of the row's n samples (0..n-1)
    ("logprobs", LOGPROBS_TYPE),  # one per generated token; null unless asked
    ("prompt_logprobs", LOGPROBS_TYPE),  # one per prompt token after the first; null unless asked
    # {label: probability} of a row that asked for choice scores; null otherwise
    ("choice_scores", pa.map_(pa.string(), pa.float64())),
    # with a reasoning parser: the think block's text (null where none) and its tokens;
    # generated_text is then the answer only
    ("reasoning", pa.string()),
    ("num_reasoning_tokens", pa.int64()),
])
CONTROL_COLUMNS = tuple(CONTROL_SCHEMA.names)
WORKER_RESULT_SCHEMA = pa.schema(list(RESULT_SCHEMA) + list(CONTROL_SCHEMA))
# Input columns whose values are JSON documents (a JSON schema, OpenAI's response_format): a
# JSONL object there is read as its JSON text, since Arrow would turn objects of different
# keys into one struct with nulls for the keys a row lacks.
JSON_TEXT_COLUMNS = ("response_format", "guided_json")


def result_schema(controls: tuple[str, ...] = ()) -> pa.Schema:
    """RESULT_SCHEMA followed by the output-control columns named in `controls`, in
    CONTROL_SCHEMA's order."""
    return pa.schema(list(RESULT_SCHEMA) + [f for f in CONTROL_SCHEMA if f.name in controls])

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError,
                 UnicodeEncodeError)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's \uD800-\uDFFF


@dataclass(frozen=True, eq=False)
class InputFile:
    """One input file: where it is, its path relative to the input folder (its name when
    the input is this file), its format, and the Hive partition keys of its folders."""

    loc: Location
    rel: str
    kind: str  # 'parquet' or 'jsonl'
    compression: str | None = None  # 'gzip', 'zstd' (JSON Lines only)
    partition: tuple[tuple[str, str], ...] = ()  # (key, value) of `key=value` folders

    @property
    def name(self) -> str:
        return self.loc.name

    def __str__(self) -> str:
        return self.loc.uri

    def __fspath__(self) -> str:  # local files only
        return self.loc.path


@dataclass(frozen=True)
class InputInfo:
    """What `scan_input` learned: the files in read order, the unified schema, the row count,
    and the id column it checked (None when the input has none: ids are positions)."""

    root: str  # the path or URI the user gave
    files: tuple[InputFile, ...]
    schema: pa.Schema
    num_rows: int
    id_column: str | None = None
    input_format: str = "auto"  # 'auto', 'openai' (every line an OpenAI batch request), 'plain'
    openai_rows: int = 0  # lines read as OpenAI batch requests (`ray_jobs.input.openai_requests`)
    file_rows: tuple[int, ...] = ()  # rows per file, in `files`' order
    cuts: tuple[Any, ...] = ()  # per file: its `FileCuts` (JSONL), None (Parquet)
    shard_rows: int = 0  # the rows between two cuts


@dataclass(frozen=True)
class InputChunk:
    """Consecutive rows of one file. `row_errors` maps a row's index in `batch` to why it could
    not be read (it is still a row: the unreadable values are null). `lines`: each row's
    1-based line number in a JSONL file (empty for Parquet)."""

    batch: pa.RecordBatch
    file: InputFile
    row_errors: dict[int, str] = field(default_factory=dict)
    lines: tuple[int, ...] = ()
    openai_rows: int = 0  # of its rows, those read from OpenAI batch request lines


def _file_kind(name: str) -> tuple[str, str | None] | None:
    """('parquet' or 'jsonl', compression) of a file name, or None if it is no input file."""
    low = name.lower()
    compression = None
    for ext, codec in COMPRESSIONS.items():
        if low.endswith(ext):
            low, compression = low[:-len(ext)], codec
            break
    for suffix in INPUT_SUFFIXES:
        if low.endswith(suffix):
            if suffix == ".parquet":
                return None if compression else ("parquet", None)
            return "jsonl", compression
    return None


def _input_file(loc: Location, rel: str) -> InputFile | None:
    kind = _file_kind(loc.name)
    if kind is None:
        return None
    folders = rel.split("/")[:-1]
    partition = tuple(tuple(p.split("=", 1)) for p in folders if "=" in p and p[0] != "=")
    return InputFile(loc, rel, kind[0], kind[1], partition)


def list_input_files(path: str | Path) -> list[InputFile]:
    """The input files of `path` in read order. InputError if there are none usable."""
    root = resolve(path)
    info = root.info()
    if info.type == pafs.FileType.NotFound:
        check_bucket(root)
        raise InputError(f"no such file or folder: {root}")
    if info.type == pafs.FileType.File:
        f = _input_file(root, root.name)
        if f is None:
            suffix = Path(root.name).suffix
            raise InputError(
                f"{root}: unknown input type {suffix or '(no suffix)'!r}; expected {_EXPECTED}")
        return [f]
    if info.type != pafs.FileType.Directory:
        raise InputError(f"{root} is neither a file nor a folder")
    try:
        entries = root.fs.get_file_info(pafs.FileSelector(root.path, recursive=True))
    except (OSError, pa.ArrowException) as e:
        raise storage_error(root.uri, e) from None
    base = root.path.rstrip("/") + "/"
    files = []
    for entry in entries:
        if entry.type != pafs.FileType.File or not entry.path.startswith(base):
            continue
        rel = entry.path[len(base):]
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        f = _input_file(root.child(rel), rel)
        if f is not None:
            files.append(f)
    if not files:
        raise InputError(f"{root}: the folder holds no {_EXPECTED} files")
    return sorted(files, key=lambda f: f.rel.split("/"))


def scan_input(path: str | Path, chunk_rows: int = DEFAULT_CHUNK_ROWS,
               id_column: str | None = None, input_format: str = "auto",
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


# --- ids ---------------------------------------------------------------------------------------


ID_SPILL_ROWS = 1 << 16  # ids held in memory before they go to the buckets on disk (1 MiB)
ID_BUCKETS = 256  # the buckets of spilled ids, by a hash's top byte


class _IdScan:
    """The id column's values over the whole input, checked once the input's schema is
    known: strings or integers, not null in every row, unique. (A row whose id alone is null
    is a row-level problem, left to `prepare`.)

    Memory: flat in the number of rows. Each id that is not null is held as a 64-bit hash
    and its row's position (16 bytes), and every `spill_rows` of them go to disk, into
    `ID_BUCKETS` files by the hash's top byte (a temporary folder, removed by `check`): a
    repeated id has both its rows in one bucket, so `check` reads one bucket at a time
    (1/256 of the ids). Nothing is held while every id so far is null (an input without
    ids: rows are numbered). A repeated hash is confirmed, and named, by reading the ids at
    its rows again (`reread(file)` yields a file's id arrays as `add` was given them)."""

    def __init__(self, name: str, reread: Any = None, spill_rows: int | None = None) -> None:
        self.name = name
        self.reread = reread
        self.spill_rows = spill_rows or ID_SPILL_ROWS
        self.files: list[tuple[InputFile, int]] = []  # (file, position of its first row)
        self.rows = 0  # rows seen
        self.hashes = array("Q")  # ids not null since the last spill: hash, and
        self.positions = array("Q")  # its row's position
        self.spill_dir: str | None = None  # the buckets, once a spill happened
        self._file: InputFile | None = None

    def add(self, file: InputFile, values: pa.Array) -> None:
        if file is not self._file:
            self.files.append((file, self.rows))
            self._file = file
        start, self.rows = self.rows, self.rows + len(values)
        if values.null_count == len(values):
            return
        import numpy as np

        at = np.arange(start, self.rows, dtype=np.uint64)  # [len(values)]
        if values.null_count:
            valid = values.is_valid()
            at, values = at[valid.to_numpy(zero_copy_only=False)], values.filter(valid)
        self.hashes.extend(_id_hash(v) for v in values.to_pylist())
        self.positions.frombytes(at.tobytes())
        if len(self.hashes) >= self.spill_rows:
            self._spill()

    def _held(self) -> Any:
        """The ids held in memory as a [n, 2] uint64 array of (hash, position)."""
        import numpy as np

        pairs = np.empty((len(self.hashes), 2), dtype=np.uint64)
        pairs[:, 0] = np.frombuffer(self.hashes, dtype=np.uint64)
        pairs[:, 1] = np.frombuffer(self.positions, dtype=np.uint64)
        return pairs

    def _spill(self) -> None:
        """Append the held ids to their buckets' files and forget them."""
        import tempfile
        import weakref

        import numpy as np

        if self.spill_dir is None:
            self.spill_dir = tempfile.mkdtemp(prefix="nanoserve-ids-")
            weakref.finalize(self, _remove_tree, self.spill_dir)
        pairs = self._held()
        bucket = (pairs[:, 0] >> np.uint64(56)).astype(np.intp)  # [n]
        order = np.argsort(bucket, kind="stable")
        ends = np.cumsum(np.bincount(bucket, minlength=ID_BUCKETS))
        for k in np.flatnonzero(np.bincount(bucket, minlength=ID_BUCKETS)).tolist():
            lo = int(ends[k - 1]) if k else 0
            with open(os.path.join(self.spill_dir, f"{k:03d}"), "ab") as f:
                f.write(pairs[order[lo:int(ends[k])]].tobytes())
        self.hashes, self.positions = array("Q"), array("Q")

    def _repeats(self) -> tuple[dict[int, list[int]], int]:
        """({hash: its positions, ascending} for up to 64 hashes that repeat, how many
        hashes repeat in all), one bucket at a time."""
        import numpy as np

        if self.spill_dir is not None:
            self._spill()
            buckets = (np.fromfile(os.path.join(self.spill_dir, name), dtype=np.uint64)
                       for name in sorted(os.listdir(self.spill_dir)))
        else:
            buckets = iter([self._held().reshape(-1)])
        groups: dict[int, list[int]] = {}
        repeated = 0
        for flat in buckets:
            pairs = flat.reshape(-1, 2)  # [n, 2]: hash, position
            pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]  # by hash, then position
            h = pairs[:, 0]
            same = h[1:] == h[:-1]
            if not same.any():
                continue
            values = np.unique(h[1:][same])
            repeated += len(values)
            for value in values[:max(0, 64 - len(groups))].tolist():
                lo = int(np.searchsorted(h, np.uint64(value), "left"))
                hi = int(np.searchsorted(h, np.uint64(value), "right"))
                groups[value] = pairs[lo:hi, 1].tolist()
        if self.spill_dir is not None:
            _remove_tree(self.spill_dir)
        return groups, repeated

    def check(self, typ: pa.DataType, custom_ids: bool = False) -> None:
        """`custom_ids`: the ids are OpenAI batch requests' custom_ids (named so)."""
        name = self.name
        if pat.is_null(typ):
            raise InputError(f"column {name!r} (the row ids) is null in every row: fill it in, "
                             f"or drop the column to number rows by position")
        if not (pat.is_integer(typ) or pat.is_string(typ) or pat.is_large_string(typ)):
            raise InputError(f"column {name!r} (the row ids) must hold strings or integers, "
                             f"not {typ}")
        groups, repeated = self._repeats()
        if not groups:
            return
        values = self._values_at({p for ps in groups.values() for p in ps})
        dups = []  # (first position, value, positions) of ids that truly repeat
        for ps in groups.values():
            by_value: dict[Any, list[int]] = {}
            for p in ps:
                by_value.setdefault(values[p], []).append(p)
            dups += [(at[0], v, at) for v, at in by_value.items() if len(at) > 1]
        if not dups:
            return  # 64-bit hashes that collide: the ids differ
        dups.sort(key=lambda d: d[0])
        _, value, at = dups[0]
        others = repeated - len(groups) + len(dups) - 1
        where = " and ".join(self._where(i) for i in at[:2])
        more = f" ({others} other ids repeat too)" if others > 0 else ""
        if custom_ids:
            raise InputError(f"custom_id {value!r} appears {len(at)} times, at {where}{more}; "
                             f"each request needs its own custom_id")
        raise InputError(
            f"column {name!r} (the row ids) holds duplicates: {value!r} appears "
            f"{len(at)} times, at {where}{more}; ids must be unique (output rows are matched "
            f"to input rows by id)"
        )

    def _values_at(self, positions: set[int]) -> dict[int, Any]:
        out = {}
        for k, (file, start) in enumerate(self.files):
            end = self.files[k + 1][1] if k + 1 < len(self.files) else self.rows
            if not any(start <= p < end for p in positions):
                continue
            at = start
            for values in self.reread(file):
                n = len(values)
                for p in positions:
                    if at <= p < at + n:
                        out[p] = values[p - at].as_py()
                at += n
        return out

    def _where(self, position: int) -> str:
        """Where the input's row `position` (0-based over all files) is, in words."""
        for file, start in reversed(self.files):
            if position >= start:
                row = position - start
                if file.kind == "jsonl":
                    return f"{file.name} line {_jsonl_line_of_row(file, row)}"
                return f"{file.name} row {row} (counting from 0)"
        return f"row {position}"


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _id_hash(value: Any) -> int:
    """A 64-bit hash of an id (never 0, which stands for null); an integer and the string of
    its digits differ, an int32 and an int64 of one value do not."""
    if value is None:
        return 0
    data = (b"i" + str(value).encode()) if isinstance(value, int) else b"s" + str(value).encode(
        "utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


def _jsonl_line_of_row(path: InputFile, row: int) -> int:
    """The 1-based line number of the `row`-th (0-based) non-blank line of a JSONL file."""
    with open_lines(path.loc, path.compression) as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                if row == 0:
                    return lineno
                row -= 1
    return 0


# --- JSONL -------------------------------------------------------------------------------------


def _iter_jsonl(path: InputFile, chunk_rows: int, schema: pa.Schema | None,
                id_column: str | None = None, input_format: str = "auto",
                start: tuple[int, int] = (0, 1), limit: int | None = None,
                cuts: FileCuts | None = None, stream: Any = None) -> Iterator[InputChunk]:
    """Parse a JSONL file line by line into chunks (a compressed one decompressed as a
    stream). Blank lines are skipped; a UTF-8 byte order mark at the start is allowed. With
    `schema` None each chunk's types are inferred (the scan); otherwise rows are built in
    `schema`. `id_column` is read strictly (a value of another type is an InputError, not a
    row error). The file's partition keys are added to each row that lacks them. A line
    that is an OpenAI batch request (or, with `input_format` 'openai', any line) becomes the
    row `ray_jobs.input.openai_requests.flatten_request` makes of it.

    A shard (`ray_jobs.input.shards`) reads from `start` (the byte offset in the decompressed
    stream of a row's line, and that line's number) at most `limit` rows; the scan passes
    `cuts` to have the offset and line of every `cuts.every`-th row recorded. `stream`: read
    these lines instead (a block of the file that starts at `start`: `_scan_jsonl`)."""
    from ray_jobs.input.openai_requests import flatten_request, is_request

    rows: list[dict] = []
    openai_rows = 0
    lines: list[int] = []
    row_errors: dict[int, str] = {}
    offset, first_line = start
    taken = 0
    try:
        f = stream if stream is not None else open_lines(path.loc, path.compression)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        if stream is None:
            _skip_bytes(f, offset, path)
        for lineno, raw in enumerate(_lines(f, path), start=first_line):
            at, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            if limit is not None and taken == limit:
                break
            if cuts is not None:
                cuts.seen(at, lineno)
            taken += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                text = raw.decode("utf-8", errors="replace")
                row_errors[len(rows)] = (f"{path.name} line {lineno} is not valid UTF-8 "
                                         f"({e.reason} at byte {e.start})")
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg}, "
                                 f"{_json_column(text, e.pos)}){_json_hint(path)}") from None
            if _SURROGATE_ESCAPE.search(text):
                row, scrubbed = _scrub_surrogates(row)
                if scrubbed:
                    message = (f"{path.name} line {lineno} holds an unpaired surrogate escape "
                               f"(\\ud800-\\udfff alone is not valid Unicode)")
                    i = len(rows)
                    row_errors[i] = f"{row_errors[i]}; {message}" if i in row_errors else message
            if not isinstance(row, dict):
                hint = " (a JSON array file? write one object per line)" if isinstance(
                    row, list) and lineno == 1 else ""
                hint += _json_hint(path)
                raise InputError(f"{path}:{lineno}: each line must be a JSON object, got "
                                 f"{_JSON_NAMES.get(type(row), type(row).__name__)}{hint}")
            if input_format == "openai" or (input_format == "auto" and is_request(row)):
                row, why = flatten_request(row)
                openai_rows += 1
                if why is not None:
                    message = f"{path.name} line {lineno}: {why}"
                    i = len(rows)
                    row_errors[i] = f"{row_errors[i]}; {message}" if i in row_errors else message
            for key, value in path.partition:
                row.setdefault(key, value)
            for key in JSON_TEXT_COLUMNS:
                value = row.get(key)
                if value is not None and not isinstance(value, str):
                    row[key] = json.dumps(value, ensure_ascii=False)
            rows.append(row)
            lines.append(lineno)
            if len(rows) == chunk_rows:
                batch = _rows_to_batch(rows, lines, path, schema, id_column, row_errors)
                yield InputChunk(batch, path, row_errors, tuple(lines), openai_rows)
                rows, lines, row_errors, openai_rows = [], [], {}, 0
    if rows:
        batch = _rows_to_batch(rows, lines, path, schema, id_column, row_errors)
        yield InputChunk(batch, path, row_errors, tuple(lines), openai_rows)


SCAN_BLOCK_BYTES = 4 << 20  # the scan's unit: whole lines, about this many bytes
_FAST_TYPES = (pa.string(), pa.int64(), pa.float64(), pa.bool_(), pa.null())
_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n|\n[ \t\r]+\Z")  # (and a blank first line)
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def _scan_jsonl(path: InputFile, chunk_rows: int, id_name: str, input_format: str,
                cuts: FileCuts) -> Iterator[InputChunk]:
    """The scan's read of a JSONL file: chunks whose columns have the types `_iter_jsonl`
    infers (rows not yet in the job's schema), and `cuts` recorded. Blocks of whole lines
    are parsed by Arrow's JSON reader (C++, no Python object a row) where that gives the
    same answer: every line an object (its first byte `{`), no blank line, no byte order mark, no surrogate
    escape, no OpenAI request (`custom_id`), no partition key, every column a string,
    integer, float, boolean or null. Any other block is read line by line by `_iter_jsonl`,
    which also names a bad line."""
    import numpy as np

    if path.partition or input_format == "openai":
        yield from _iter_jsonl(path, chunk_rows, schema=None, id_column=id_name,
                               input_format=input_format, cuts=cuts)
        return
    try:
        f = open_lines(path.loc, path.compression)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    offset, line, rest = 0, 1, b""
    with f:
        while True:
            try:
                data = f.read(SCAN_BLOCK_BYTES)
            except (OSError, pa.ArrowException, EOFError) as e:
                raise InputError(f"{path}: cannot read ({' '.join(str(e).split())})") from None
            block = rest + data
            end = block.rfind(b"\n") + 1 if data else len(block)
            block, rest = block[:end], block[end:]
            if block:
                ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
                lines = len(ends) + (not block.endswith(b"\n"))
                starts = np.concatenate(([0], ends[:lines - 1] + 1))
                table = None  # a line that does not start with "{" is read line by line
                if (np.frombuffer(block, np.uint8)[starts] == ord("{")).all():
                    table = _arrow_block(block, line == 1, input_format)
                if table is None:
                    yield from _iter_jsonl(path, chunk_rows, schema=None, id_column=id_name,
                                           input_format=input_format, cuts=cuts,
                                           start=(offset, line), stream=io.BytesIO(block))
                else:
                    cuts.seen_all(starts + offset, line)
                    for batch in table.to_batches(chunk_rows):
                        yield InputChunk(batch, path)
                offset, line = offset + len(block), line + lines
            if not data:
                return


def _arrow_block(block: bytes, first: bool, input_format: str) -> pa.Table | None:
    """A block of JSON lines read by Arrow, or None where `_scan_jsonl` reads it line by
    line (see there)."""
    import pyarrow.json as pj

    head = block[:block.find(b"\n") + 1 or len(block)]
    if (first and block.startswith(b"\xef\xbb\xbf")) or not head.strip() or _BLANK_LINE.search(block) \
            or _SURROGATE_ESCAPE_BYTES.search(block) or (
                input_format == "auto" and b'"custom_id"' in block):
        return None
    try:
        table = pj.read_json(io.BytesIO(block), read_options=pj.ReadOptions(
            use_threads=False, block_size=len(block) + 1))
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if not table.num_columns or any(t not in _FAST_TYPES for t in table.schema.types) or any(
            name in JSON_TEXT_COLUMNS for name in table.schema.names):
        return None
    return table.combine_chunks()


def _skip_bytes(f: Any, offset: int, path: InputFile) -> None:
    """Move a fresh line reader to `offset`: a seek where the file allows it, else (a
    compressed or remote stream) by reading and dropping the bytes before it."""
    if not offset:
        return
    if path.loc.local and path.compression is None:
        f.seek(offset)
        return
    left = offset
    while left:
        block = f.read(min(left, 1 << 20))
        if not block:
            raise InputError(f"{path}: shorter than when it was scanned (it changed?)")
        left -= len(block)


class FileCuts:
    """Where a JSONL file's shards start: the byte offset (in the decompressed stream) and
    line number of every `every`-th row, recorded by the scan's one parse pass. Two int64
    arrays: 16 bytes a shard."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.offsets = array("q")
        self.lines = array("q")
        self.rows = 0

    def seen(self, offset: int, line: int) -> None:
        if self.rows % self.every == 0:
            self.offsets.append(offset)
            self.lines.append(line)
        self.rows += 1

    def seen_all(self, offsets: Any, first_line: int) -> None:
        """`seen` for consecutive rows, one a line from `first_line` (numpy int64 offsets)."""
        k = (-self.rows) % self.every
        self.offsets.extend(offsets[k::self.every].tolist())
        self.lines.extend(range(first_line + k, first_line + len(offsets), self.every))
        self.rows += len(offsets)

    def start(self, k: int) -> tuple[int, int]:
        """(offset, line) of the first row of the file's `k`-th shard."""
        return self.offsets[k], self.lines[k]


INPUT_FORMATS = ("auto", "openai", "plain")


def check_input_format(input_format: str, files: list[InputFile]) -> None:
    """InputError for an unknown input format, or 'openai' over a Parquet file."""
    if input_format not in INPUT_FORMATS:
        raise InputError(f"unknown input format {input_format!r}; choose "
                         f"{', '.join(INPUT_FORMATS)}")
    parquet = [f for f in files if f.kind == "parquet"]
    if input_format == "openai" and parquet:
        raise InputError(f"--input-format openai reads JSON Lines of OpenAI batch requests; "
                         f"{parquet[0]} is Parquet")


def _json_column(line: str, pos: int) -> str:
    """Where in its line a JSON error is: its 1-based column (in characters), or the end of
    the line (json counts the line's newline, so an object cut short would say column 1
    of the next line)."""
    text = line.rstrip("\r\n")
    if pos >= len(text):
        return f"at the end of the line, column {len(text) + 1}"
    return f"column {pos + 1}"


def _json_hint(path: InputFile) -> str:
    name = path.name.lower()
    for ext in COMPRESSIONS:
        name = name.removesuffix(ext)
    return " (a .json file is read as JSON Lines: one object a line)" if name.endswith(
        ".json") else ""


def _lines(f: Any, path: InputFile) -> Iterator[bytes]:
    """The lines of an open file; a corrupt compressed stream is an InputError naming it."""
    while True:
        try:
            raw = f.readline()
        except (OSError, pa.ArrowException, EOFError) as e:
            raise InputError(f"{path}: cannot read ({' '.join(str(e).split())})") from None
        if not raw:
            return
        yield raw


def _scrub_surrogates(v: Any) -> tuple[Any, bool]:
    """`v` with every lone surrogate in its strings (keys too) replaced by "?", and
    whether there was one. (json.loads joins valid surrogate pairs, so any left are lone.)"""
    if isinstance(v, str):
        clean = v.encode("utf-8", errors="replace").decode("utf-8")
        return clean, clean != v
    if isinstance(v, list):
        items = [_scrub_surrogates(x) for x in v]
        return [x for x, _ in items], any(c for _, c in items)
    if isinstance(v, dict):
        items = [(_scrub_surrogates(k), _scrub_surrogates(x)) for k, x in v.items()]
        return {k: x for (k, _), (x, _) in items}, any(ck or cx for (_, ck), (_, cx) in items)
    return v, False


def _rows_to_batch(rows: list[dict], lines: list[int], path: InputFile, schema: pa.Schema | None,
                   id_column: str | None, row_errors: dict[int, str]) -> pa.RecordBatch:
    """Build one record batch column by column. A value that does not fit its column adds a
    row error to `row_errors` and reads as null; in `id_column` it is an InputError."""
    if schema is None:
        names = list(dict.fromkeys(k for row in rows for k in row))
        types: list[pa.DataType | None] = [None] * len(names)
    else:
        names, types = schema.names, schema.types
    arrays = []
    for name, typ in zip(names, types):
        values = widen(name, [row.get(name) for row in rows], typ)
        array = _plain_array(values, typ)
        if array is None:
            if name == id_column:
                raise InputError(
                    f"{path} (lines {lines[0]}-{lines[-1]}): column {name!r} (the row ids) "
                    f"holds values of incompatible types; ids must all be strings or all "
                    f"integers"
                )
            array, misfits = _lenient_array(values, typ, name)
            for i, why in misfits.items():
                message = f"{path.name} line {lines[i]}: {why}"
                row_errors[i] = f"{row_errors[i]}; {message}" if i in row_errors else message
        arrays.append(array)
    if not arrays:  # rows without keys: keep the row count
        return pa.RecordBatch.from_struct_array(pa.array([{}] * len(rows), type=pa.struct([])))
    if schema is None:
        return pa.RecordBatch.from_arrays(arrays, names=names)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _plain_array(values: list[Any], typ: pa.DataType | None) -> pa.Array | None:
    """`values` as one Arrow array (of type `typ`, or inferred), or None when they do not
    all fit one type. A string never fits a list type (Arrow would read it as characters),
    nor true/false a number."""
    try:
        array = pa.array(values, type=typ)
    except _ARROW_ERRORS:
        return None
    t = array.type
    if _is_list(t) and any(isinstance(v, str) for v in values):
        return None
    if (pat.is_integer(t) or pat.is_floating(t)) and any(isinstance(v, bool) for v in values):
        return None
    return array


def _lenient_array(values: list[Any], typ: pa.DataType | None, name: str
                   ) -> tuple[pa.Array, dict[int, str]]:
    """`values` as an array of `typ` (None: the type most rows agree on, by the JSON kind of
    their values, ties to the first seen), with every value that does not fit it null.
    Returns the array and, by index, why each misfit does not fit."""
    if typ is None:
        typ = _majority_type(values)
    misfits = {}
    for i, v in enumerate(values):
        why = _misfit(v, typ, name)
        if why is not None:
            misfits[i] = why
    array = pa.array([None if i in misfits else v for i, v in enumerate(values)], type=typ)
    return array, misfits


def _majority_type(values: list[Any]) -> pa.DataType:
    groups: dict[str, list[pa.DataType]] = {}  # JSON kind -> types of its values, first seen first
    for v in values:
        if v is None:
            continue
        try:
            t = pa.array([v]).type
        except _ARROW_ERRORS:  # the value alone has no type (e.g. a list of mixed kinds)
            continue
        groups.setdefault(_coarse_kind(v), []).append(t)
    if not groups:
        return pa.null()
    best = max(groups.values(), key=len)  # max keeps the first of equal lengths
    typ = best[0]
    for t in dict.fromkeys(best[1:]):
        try:
            typ = pa.unify_schemas([pa.schema([("v", typ)]), pa.schema([("v", t)])],
                                   promote_options="permissive").field("v").type
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            continue
    return typ


def _misfit(v: Any, t: pa.DataType, where: str) -> str | None:
    """Why the JSON value `v` does not fit the Arrow type `t` (naming the innermost part
    that does not, e.g. `messages[0].content`), or None if it fits."""
    if v is None:
        return None
    if _is_list(t):
        if not isinstance(v, list):
            return _expected(v, t, where)
        for i, x in enumerate(v):
            why = _misfit(x, t.value_type, f"{where}[{i}]")
            if why is not None:
                return why
        return None
    if pat.is_struct(t):
        if not isinstance(v, dict):
            return _expected(v, t, where)
        for f in t:
            why = _misfit(v.get(f.name), f.type, f"{where}.{f.name}")
            if why is not None:
                return why
        return None
    if pat.is_boolean(t):
        fits = isinstance(v, bool)
    elif pat.is_integer(t):
        fits = isinstance(v, int) and not isinstance(v, bool)
    elif pat.is_floating(t):
        fits = isinstance(v, (int, float)) and not isinstance(v, bool)
    elif pat.is_string(t) or pat.is_large_string(t):
        fits = isinstance(v, str)
    else:
        fits = not pat.is_null(t)
    if fits or pat.is_null(t):
        try:
            pa.array([v], type=None if pat.is_null(t) else t)
        except _ARROW_ERRORS as e:
            return f"{where} cannot be read ({_short(v)}: {e})"
        if fits:
            return None
    return _expected(v, t, where)


def _expected(v: Any, t: pa.DataType, where: str) -> str:
    return f"{where} is {_kind(v)}, but the other rows have {_words(t)} there"


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_list(t: pa.DataType) -> bool:
    return pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t)


def _coarse_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


_JSON_NAMES = {list: "list", str: "string", int: "number", float: "number", bool: "true/false",
               type(None): "null"}
_KIND_NAMES = {bool: ("true/false", "true/false values"), int: ("an integer", "integers"),
               float: ("a number", "numbers"), str: ("a string", "strings"),
               dict: ("an object", "objects"), list: ("a list", "lists"),
               type(None): ("null", "nulls")}


def _kind(v: Any) -> str:
    """The JSON kind of `v` in words: 'a string', 'a list of objects and strings', ..."""
    if isinstance(v, list) and v:
        inner = dict.fromkeys(_KIND_NAMES.get(type(x), ("", type(x).__name__))[1] for x in v)
        return f"a list of {' and '.join(inner)}"
    return _KIND_NAMES.get(type(v), (type(v).__name__, ""))[0]


def _words(t: pa.DataType) -> str:
    """An Arrow type as the JSON values it holds, in plural words."""
    if _is_list(t):
        return f"lists of {_words(t.value_type)}"
    if pat.is_struct(t):
        return "objects {" + ", ".join(f.name for f in t) + "}"
    if pat.is_boolean(t):
        return "true/false values"
    if pat.is_integer(t):
        return "integers"
    if pat.is_floating(t):
        return "numbers"
    if pat.is_string(t) or pat.is_large_string(t):
        return "strings"
    if pat.is_null(t):
        return "nulls"
    return f"values of type {t}"


# --- output --------------------------------------------------------------------------------------


def write_part_atomic(table: pa.Table, path: Path) -> None:
    """Write `table` as the Parquet file `path`: first under a hidden temporary name in the same
    folder (ignored by readers), then renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
