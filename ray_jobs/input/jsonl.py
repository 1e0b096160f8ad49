"""Stage input: reading a JSON Lines file, line by line or (in the scan) a block at a time.

Compressed files are decompressed as a stream, a block at a time. In JSON Lines, the
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

Here: `_iter_jsonl` (the line-by-line read: every row error named by line and field),
`_scan_jsonl` (the scan's read: blocks of lines through Arrow's JSON reader where it
agrees with the line-by-line read), `FileCuts` (where a file's shards start), and the
wording of a value that does not fit its column.

What is a job-level problem here and what a row-level one (`ray_jobs.input.io` has the rest):
- job level (InputError): a line that is not JSON or not a JSON object (named by file and
  line); an id column whose values are of incompatible types;
- row level: a line that is not valid UTF-8 (decoded with replacement characters so its
  other fields still read) or that escapes an unpaired surrogate; a value that does not fit
  its column's type, the type most of the column's values have (e.g. one `messages` that
  is a string among lists of objects, one `temperature` that is a string among numbers):
  that value reads as null and the row's error says which line, which field and what was
  expected.

Invariants: nothing here holds more than one chunk (`chunk_rows` rows) of one file, or one
scan block (`SCAN_BLOCK_BYTES`), in memory; rows come out in line order, blank lines
skipped; the block read and the line read give the same rows in the same types.
"""

from __future__ import annotations

import io
import json
import re
from array import array
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from nanoserve import InputError
from ray_jobs.input.files import COMPRESSIONS, InputChunk, InputFile
from ray_jobs.input.json_shapes import widen
from ray_jobs.input.storage import open_lines
from ray_jobs.options import JOB

# Input columns whose values are JSON documents (a JSON schema, OpenAI's response_format): a
# JSONL object there is read as its JSON text, since Arrow would turn objects of different
# keys into one struct with nulls for the keys a row lacks.
JSON_TEXT_COLUMNS = ("response_format", "guided_json")

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError,
                 UnicodeEncodeError)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's \uD800-\uDFFF


def _jsonl_line_of_row(path: InputFile, row: int) -> int:
    """The 1-based line number of the `row`-th (0-based) non-blank line of a JSONL file."""
    with open_lines(path.loc, path.compression) as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                if row == 0:
                    return lineno
                row -= 1
    return 0


def _iter_jsonl(path: InputFile, chunk_rows: int, schema: pa.Schema | None,
                id_column: str | None = None,
                input_format: str = JOB["input_format"].default,
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
