"""Dataset I/O for the batch job: input files read as a stream of Arrow record batches, and
output parts written atomically.

Input: a `.parquet` file, a `.jsonl` file, or a folder of them (top level, sorted by name;
names starting with `_` or `.` are skipped, as pyarrow skips them). `scan_input` checks every
file before the job starts (Parquet: the footer; JSONL: one streaming parse pass) and returns
the one Arrow schema all rows are read with; `iter_chunks` then streams the rows in that
schema, a bounded number at a time.

Invariants:
- nothing here holds more than one chunk (`chunk_rows` rows) of one file in memory;
- rows come out in file order (sorted names), then row order within a file; a row's
  position in that stream is its default id;
- a JSONL line that is not a JSON object is an `InputError` naming the file and line (the
  whole job stops before any work); a line that is not valid UTF-8 becomes a row whose
  read error is reported with the chunk, so it turns into an `error` output row;
- an output part is visible under its final name only once completely written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nanoserve.errors import InputError

INPUT_SUFFIXES = (".parquet", ".jsonl")
DEFAULT_CHUNK_ROWS = 1024

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


@dataclass(frozen=True)
class InputInfo:
    """What `scan_input` learned: the files in read order, the unified schema, the row count."""

    root: Path  # the path the user gave
    files: tuple[Path, ...]
    schema: pa.Schema
    num_rows: int


@dataclass(frozen=True)
class InputChunk:
    """Consecutive rows of one file. `row_errors` maps a row's index in `batch` to why it could
    not be read (it is still a row: its other columns are null or best-effort)."""

    batch: pa.RecordBatch
    file: Path
    row_errors: dict[int, str] = field(default_factory=dict)


def list_input_files(path: str | Path) -> list[Path]:
    """The input files of `path` in read order. InputError if there are none usable."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"no such file or folder: {path}")
    if path.is_file():
        if path.suffix not in INPUT_SUFFIXES:
            raise InputError(
                f"{path}: unknown input type {path.suffix or '(no suffix)'!r}; "
                f"expected {' or '.join(INPUT_SUFFIXES)}"
            )
        return [path]
    files = sorted(
        p for p in path.iterdir()
        if p.is_file() and p.suffix in INPUT_SUFFIXES and not p.name.startswith(("_", "."))
    )
    if not files:
        raise InputError(f"{path}: the folder holds no {' or '.join(INPUT_SUFFIXES)} files")
    return files


def scan_input(path: str | Path, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> InputInfo:
    """Check every input file and unify their schemas (nulls and ints widen; a column of
    incompatible types across rows or files is an InputError). JSONL files are parsed once
    here, streaming; Parquet files only have their footers read."""
    files = list_input_files(path)
    schemas: list[pa.Schema] = []
    num_rows = 0
    for f in files:
        if f.suffix == ".parquet":
            meta = _parquet_file(f).metadata
            schemas.append(meta.schema.to_arrow_schema().remove_metadata())
            num_rows += meta.num_rows
        else:
            for chunk in _iter_jsonl(f, chunk_rows, schema=None):
                schemas.append(chunk.batch.schema)
                num_rows += chunk.batch.num_rows
    schemas = [s for s in schemas if len(s)] or [pa.schema([])]
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise InputError(f"{path}: the input's columns do not agree in type: {e}") from None
    if num_rows == 0:
        raise InputError(f"{path}: the input has no rows")
    return InputInfo(root=Path(path), files=tuple(files), schema=schema, num_rows=num_rows)


def iter_chunks(info: InputInfo, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[InputChunk]:
    """Every row of the input, in read order, as chunks of at most `chunk_rows` rows in
    `info.schema` (columns a file lacks are null)."""
    for f in info.files:
        if f.suffix == ".parquet":
            for batch in _parquet_file(f).iter_batches(batch_size=chunk_rows):
                if batch.num_rows:
                    yield InputChunk(conform(batch, info.schema), f)
        else:
            yield from _iter_jsonl(f, chunk_rows, schema=info.schema)


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


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None


def _iter_jsonl(path: Path, chunk_rows: int, schema: pa.Schema | None) -> Iterator[InputChunk]:
    """Parse a JSONL file line by line into chunks. Blank lines are skipped. With `schema`
    None each chunk's types are inferred (the scan); otherwise rows are built in `schema`."""
    rows: list[dict] = []
    lines: list[int] = []
    row_errors: dict[int, str] = {}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                text = raw.decode("utf-8", errors="replace")
                row_errors[len(rows)] = f"{path.name} line {lineno} is not valid UTF-8 ({e.reason})"
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InputError(
                    f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
            lines.append(lineno)
            if len(rows) == chunk_rows:
                yield InputChunk(_rows_to_batch(rows, lines, path, schema), path, row_errors)
                rows, lines, row_errors = [], [], {}
    if rows:
        yield InputChunk(_rows_to_batch(rows, lines, path, schema), path, row_errors)


def _rows_to_batch(rows: list[dict], lines: list[int], path: Path,
                   schema: pa.Schema | None) -> pa.RecordBatch:
    """Build one record batch column by column, so a type clash names its column and lines."""
    if schema is None:
        names = list(dict.fromkeys(k for row in rows for k in row))
        types: list[pa.DataType | None] = [None] * len(names)
    else:
        names, types = schema.names, schema.types
    arrays = []
    for name, typ in zip(names, types):
        values = [row.get(name) for row in rows]
        try:
            arrays.append(pa.array(values, type=typ))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise InputError(
                f"{path} (lines {lines[0]}-{lines[-1]}): column {name!r} holds values of "
                f"incompatible types ({e})"
            ) from None
    if not arrays:  # rows without keys: keep the row count
        return pa.RecordBatch.from_struct_array(pa.array([{}] * len(rows), type=pa.struct([])))
    if schema is None:
        return pa.RecordBatch.from_arrays(arrays, names=names)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


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
