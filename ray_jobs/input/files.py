"""Stage input: the input's files, and the units they are read in.

Input: a `.parquet` file, a JSON Lines file (`.jsonl`, `.ndjson`, or `.json` holding one
object a line; any of them may be compressed: `.gz`, `.zst`), or a folder of them, local or
on any filesystem `ray_jobs.input.storage` resolves (`s3://bucket/prefix/`, `gs://...`). A folder is
read recursively, in the sorted order of the files' paths relative to it; a file or folder
whose name starts with `_` or `.` is skipped (Spark's `_SUCCESS`, `.crc` files), as pyarrow
skips them; suffixes match in any case. A folder named `key=value` (Hive partitioning, as
pandas, polars, DuckDB, Spark and Ray Data write it) adds the string column `key` with
`value` to the rows of every file under it, unless the file has a column of that name.

Here: the listing (`list_input_files`), what one file is (`InputFile`), what the scan
learned of the whole input (`InputInfo`), a chunk of rows read (`InputChunk`), and the
input's defaults and formats. Reading the files is `ray_jobs.input.io` (the scan and the
stream) and `ray_jobs.input.jsonl` (JSON Lines).

Invariants: the files come in read order (sorted by their path relative to the input
folder, a folder's parts compared one by one), so a row's position over the whole input is
the same in every listing; nothing under a name that starts with `_` or `.` is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from nanoserve import InputError
from ray_jobs.input.storage import Location, check_bucket, resolve, storage_error
from ray_jobs.options import JOB

INPUT_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}  # JSON Lines only (Parquet compresses inside)
_EXPECTED = ".parquet or JSON Lines (.jsonl, .ndjson, .json; also .gz, .zst)"
DEFAULT_CHUNK_ROWS = JOB["chunk_rows"].default  # rows read at a time
DEFAULT_SHARD_ROWS = JOB["batch_size"].default  # rows of a shard (`ray_jobs.input.shards`)
DEFAULT_ID_COLUMN = "id"  # the id column when the job names none


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
    # 'auto', 'openai' (every line an OpenAI batch request), 'plain'
    input_format: str = JOB["input_format"].default
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


INPUT_FORMATS = JOB["input_format"].choices


def check_input_format(input_format: str, files: list[InputFile]) -> None:
    """InputError for an unknown input format, or 'openai' over a Parquet file."""
    if input_format not in INPUT_FORMATS:
        raise InputError(f"unknown input format {input_format!r}; choose "
                         f"{', '.join(INPUT_FORMATS)}")
    parquet = [f for f in files if f.kind == "parquet"]
    if input_format == "openai" and parquet:
        raise InputError(f"--input-format openai reads JSON Lines of OpenAI batch requests; "
                         f"{parquet[0]} is Parquet")
