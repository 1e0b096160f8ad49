"""Stage input: the job's shards, the descriptors the driver hands out instead of rows.

The driver lists the input once (`ray_jobs.input.io.scan_input`: files, schema, row counts, and
for a JSONL file where every `shard_rows`-th row starts) and cuts it into shards: up to
`shard_rows` consecutive rows of one file, named by where they are (a Parquet file's row
range; a JSONL file's byte offset and line number, in the decompressed stream) and by the
position of their first row in the whole input (the default id of each row is its
position). A shard is a few dozen bytes whatever its rows; a worker reads its rows itself
(`read_shard`), from local disk or object storage, so the driver never holds them.

Invariants: the shards are a function of the input and `shard_rows` only (ids count up
from 0 in input order), so a rerun of the same job rebuilds the same shards (what resuming
relies on); every row is in exactly one shard; a shard's rows are in input order, so parts
written in shard order are the input in order. `iter_shards` yields them lazily: the
driver's memory does not grow with the number of shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from ray_jobs.input.files import InputChunk, InputFile, InputInfo
from ray_jobs.input.io import _conform_or_fail, _parquet_file, _with_partition_columns
from ray_jobs.input.jsonl import _iter_jsonl


@dataclass(frozen=True)
class Shard:
    """Rows [start_row, start_row + num_rows) of input file `file` (an index into the job's
    files); `first_position`: the first row's position in the whole input; JSONL: `offset`
    and `line` of the first row (byte offset in the decompressed stream, 1-based line)."""

    shard_id: int
    file: int
    start_row: int
    num_rows: int
    first_position: int
    offset: int = 0
    line: int = 1

    def digest(self) -> str:
        """A short hash of which rows the shard holds: a part written for another cut of the
        input under the same id is told apart by it (`ray_jobs.output.manifest.adopt_part`)."""
        text = f"{self.file}:{self.start_row}:{self.num_rows}:{self.first_position}:{self.offset}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class InputSpec:
    """What a worker needs to read any shard: the files, the schema every row is read in,
    the id column and the input format (a part of `InputInfo` without the scan's bulk)."""

    files: tuple[InputFile, ...]
    schema: pa.Schema
    id_column: str | None
    input_format: str
    chunk_rows: int

    @classmethod
    def of(cls, info: InputInfo, chunk_rows: int) -> InputSpec:
        return cls(info.files, info.schema, info.id_column, info.input_format, chunk_rows)


def iter_shards(info: InputInfo) -> Iterator[Shard]:
    """The input's shards in input order (see the module docstring)."""
    every = info.shard_rows
    shard_id = position = 0
    for index, rows in enumerate(info.file_rows):
        cuts = info.cuts[index]
        for k, start in enumerate(range(0, rows, every)):
            n = min(every, rows - start)
            offset, line = cuts.start(k) if cuts is not None else (0, 1)
            yield Shard(shard_id, index, start, n, position, offset, line)
            shard_id += 1
            position += n


def num_shards(info: InputInfo) -> int:
    return sum(-(-rows // info.shard_rows) for rows in info.file_rows)


def read_shard(spec: InputSpec, shard: Shard) -> Iterator[InputChunk]:
    """The shard's rows, in order, as chunks of at most `spec.chunk_rows` rows in
    `spec.schema` (as `ray_jobs.input.io.iter_chunks` reads them)."""
    f = spec.files[shard.file]
    if f.kind != "parquet":
        yield from _iter_jsonl(f, spec.chunk_rows, schema=spec.schema,
                               id_column=spec.id_column, input_format=spec.input_format,
                               start=(shard.offset, shard.line), limit=shard.num_rows)
        return
    pfile = _parquet_file(f)
    meta = pfile.metadata
    end = shard.start_row + shard.num_rows
    row_groups, first, at = [], None, 0  # the row groups that hold the shard's rows
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if at < end and at + n > shard.start_row:
            row_groups.append(g)
            first = at if first is None else first
        at += n
    skip, left = shard.start_row - (first or 0), shard.num_rows
    for batch in pfile.iter_batches(batch_size=spec.chunk_rows, row_groups=row_groups):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        batch = batch.slice(skip, left)
        skip, left = 0, left - batch.num_rows
        if batch.num_rows:
            batch = _with_partition_columns(batch, f)
            yield InputChunk(_conform_or_fail(batch, spec.schema, f), f)
        if not left:
            return
