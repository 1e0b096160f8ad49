"""Stage input: the check that an input's ids are unique, in memory flat in its rows.

The id column (`id`, or the one named) must hold strings or integers, not be null in every
row, and never repeat an id (output rows are matched to input rows by id); a repeat is an
InputError naming an example and where it is. (A row whose id alone is null is a row-level
problem, left to `prepare`.)

Invariants: each id that is not null is held as a 64-bit hash and its row's position, and
spilled to buckets on disk (by the hash's top byte) every `ID_SPILL_ROWS` of them, the
buckets read back one at a time: memory flat in the number of rows; nothing is held for an
input without ids; a repeated hash is confirmed by reading the ids again (hashes that
collide are no repeat).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from nanoserve import InputError
from ray_jobs.input.files import InputFile
from ray_jobs.input.jsonl import _jsonl_line_of_row

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
