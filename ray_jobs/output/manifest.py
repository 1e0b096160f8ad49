"""Stage output: the output folder's manifest, what job wrote it and which shards are done.

`OUTPUT_DIR/_nanoserve_manifest.json` records the job's settings (model identity, input
identity, sampling defaults, the shards' rows and column options) and the ids of the shards
whose parts (`part-<shard id>.parquet`) are written; `OUTPUT_DIR/_SUCCESS` appears only once every
row is written; `OUTPUT_DIR/_nanoserve.lock` is held (flock) by the job writing the folder,
so a second job on it is refused (`hold_output_dir`). These names start with `_`, so
Parquet readers skip them.

A rerun into the same folder resumes: the settings must be equal (else an InputError says
which differ, before any work), shards recorded as done are skipped, and the rest are
written. Identities use content, not paths or mtimes, so the same model fetched into
another cache, or the same input unpacked elsewhere (a Ray job's working dir), still match:
a file is identified by its size and the sha256 of its bytes (files up to 64 MiB) or of its
first and last MiB (larger files, e.g. model weights: cheap for any size).

Invariants: the manifest is replaced atomically (temporary `.` name, then rename), and a
shard is recorded as done only after its part was renamed into place, so a crash at any
point leaves a folder that resumes correctly:
- temporary files (`.`-names) of an interrupted run are removed on resume;
- a part renamed into place but not yet recorded (the run died between the two steps) is
  kept if its footer carries the shard's digest (`PART_DIGEST_KEY`): the driver adopts it
  when it rebuilds a shard with the same id, digest and row count (`adopt_part`), so it is
  not computed again; otherwise it is removed and the shard is redone;
- a part recorded as done but missing from the folder is refused (InputError): its rows
  would be lost silently otherwise;
- in a job with OpenAI output files, a shard's fragments (`_output-NNNNN.jsonl`,
  `_errors-NNNNN.jsonl`, `ray_jobs.output.openai_files`) are written before its part, whose footer
  holds the digest of their bytes (`BESIDE_DIGEST_KEY`): an unrecorded part is adopted only
  with exactly those fragments beside it, so lines of another attempt at the shard never go
  with it. A recorded shard without fragments (written by an earlier version) gets them
  made from its part at the end of the job.
The manifest holds per-shard data only (done ids, as ranges), never per-row data.

On disk, three names are older than the word "shard" and are kept, so that the output of
an earlier version resumes: the manifest's `done_batches` (the done shard ids), its
settings' `batching` section (`batch_size`: the shards' rows), and the parts' footer key
`nanoserve.batch_digest` (the shard's digest).

The output may be a local folder or an object-store prefix (`ray_jobs.input.storage.OutputDir`;
every function here takes either a path or an OutputDir). On an object store there are no
temporary names: each part and the manifest is uploaded whole under its final key (visible
only once complete), and the lock is a lease object written conditionally instead of a flock
(`ray_jobs.input.storage.ObjectLease`); the rules above hold unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nanoserve import InputError
from ray_jobs.input.storage import Location, OutputDir

MANIFEST_NAME = "_nanoserve_manifest.json"
PART_DIGEST_KEY = b"nanoserve.batch_digest"  # in each part's Parquet footer: `Shard.digest()`
# in the footer of a part committed with files beside it (an OpenAI job's fragments of
# output.jsonl / errors.jsonl): `beside_digest` of their bytes
BESIDE_DIGEST_KEY = b"nanoserve.beside_digest"
SUCCESS_NAME = "_SUCCESS"
LOCK_NAME = "_nanoserve.lock"  # held (flock) by the one job writing the folder
REPORT_NAME = "_nanoserve_report.html"  # the last run's job report (`ray_jobs.report.report`)
FORMAT = 1
FULL_HASH_MAX_BYTES = 64 << 20
SAMPLE_BYTES = 1 << 20

_PART_RE = re.compile(r"part-(\d+)\.parquet")
_OURS_RE = re.compile(r"(part-\d+\.parquet|\.part-\d+\.parquet\.tmp-\d+|"
                      rf"{re.escape(MANIFEST_NAME)}|\.{re.escape(MANIFEST_NAME)}\.tmp-\d+|"
                      rf"\.{re.escape(SUCCESS_NAME)}\.tmp-\d+|"
                      rf"{re.escape(SUCCESS_NAME)}|{re.escape(LOCK_NAME)}|"
                      rf"{re.escape(REPORT_NAME)}|\.{re.escape(REPORT_NAME)}\.tmp-\d+|"
                      r"(output|errors)\.jsonl|\.(output|errors)\.jsonl\.tmp-\d+|"
                      r"_(output|errors)-\d+\.jsonl|\._(output|errors)-\d+\.jsonl\.tmp-\d+)")


def part_name(shard_id: int) -> str:
    return f"part-{shard_id:05d}.parquet"


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


def file_fingerprint(path: Path | Location, label: str | None = None) -> dict[str, Any]:
    """{'name', 'size', 'sha256'}: the whole file's hash up to FULL_HASH_MAX_BYTES, else the
    hash of its first and last SAMPLE_BYTES (marked by the key 'sha256_head_tail'). `path`
    may be a `Location` on any filesystem (its bytes as stored, compressed or not)."""
    if isinstance(path, Location):
        size = path.info().size
        opened = path.fs.open_input_file(path.path)
        name = path.name
    else:
        size = path.stat().st_size
        opened = open(path, "rb")
        name = path.name
    h = hashlib.sha256()
    with opened as f:
        if size <= FULL_HASH_MAX_BYTES:
            while data := f.read(1 << 20):
                h.update(data)
            key = "sha256"
        else:
            h.update(f.read(SAMPLE_BYTES))
            f.seek(size - SAMPLE_BYTES)
            h.update(f.read(SAMPLE_BYTES))
            key = "sha256_head_tail"
    return {"name": label or name, "size": size, key: h.hexdigest()}


def model_identity(path: Path) -> list[dict[str, Any]]:
    """Fingerprints of the files that decide a model's outputs: the `.gguf` file, or a
    folder's config, tokenizer and weight files."""
    if path.is_file():
        return [file_fingerprint(path)]
    names = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    files = [path / n for n in names if (path / n).is_file()]
    files += sorted(path.glob("*.safetensors"))
    return [file_fingerprint(f) for f in files]


def input_identity(root: Path, files: list[Path] | tuple[Path, ...]) -> list[dict[str, Any]]:
    """Fingerprints of the input files, named relative to the input folder. `files` may be
    `ray_jobs.input.files.InputFile`s (any filesystem; named by their `rel`)."""
    if files and not isinstance(files[0], Path):
        return [file_fingerprint(f.loc, f.rel) for f in files]
    base = root if root.is_dir() else root.parent
    return [file_fingerprint(f, str(f.relative_to(base))) for f in files]


@dataclass
class Manifest:
    settings: dict[str, Any]  # JSON-ready; a resume needs them equal
    done: set[int] = field(default_factory=set)  # shard ids whose parts are written
    rows_done: int = 0
    complete: bool = False

    def record(self, shard_id: int, num_rows: int) -> None:
        self.done.add(shard_id)
        self.rows_done += num_rows

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "settings": self.settings, "complete": self.complete,
                "rows_done": self.rows_done, "done_batches": _to_ranges(self.done)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        done = {i for a, b in d["done_batches"] for i in range(a, b + 1)}
        return cls(_without_legacy(d["settings"]), done, int(d["rows_done"]),
                   bool(d["complete"]))

    def save(self, folder: Path | OutputDir) -> None:
        text = json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"
        OutputDir.open(folder).write_bytes(MANIFEST_NAME, text.encode())

    @classmethod
    def load(cls, folder: Path | OutputDir) -> Manifest | None:
        folder = OutputDir.open(folder)
        path = folder / MANIFEST_NAME
        data = folder.read_bytes(MANIFEST_NAME)
        if data is None:
            return None
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
            return cls.from_json(d)
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path} is not a readable nanoserve manifest ({e}); "
                             f"use --overwrite to start the job afresh") from None


# Settings an earlier version recorded that never changed the output rows, dropped when its
# manifest is read (so its output resumes): the rows sorted together for a static engine
# (`window_rows`), which a shard's rows are, whatever it said.
LEGACY_SETTINGS = (("batching", "window_rows"),)


def _without_legacy(settings: dict[str, Any]) -> dict[str, Any]:
    for section, key in LEGACY_SETTINGS:
        if isinstance(settings.get(section), dict):
            settings[section].pop(key, None)
    return settings


def settings_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the settings that differ between two JSON-ready dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += settings_differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


@contextlib.contextmanager
def hold_output_dir(folder: Path | OutputDir) -> Iterator[None]:
    """Create `folder` if needed and hold it for one job. An object-store prefix is held
    by a lease object (`OutputDir.hold`, see `ray_jobs.input.storage.ObjectLease`). A local
    folder: an exclusive `flock` on
    `folder/_nanoserve.lock`, or InputError naming the process that holds it. Two jobs
    writing one folder would delete each other's temporary files and record each other's
    shards. The kernel drops the lock when the holder exits, however it dies (SIGKILL
    included), so a killed job never leaves the folder locked. The holder removes the file
    when it lets go (a job done, refused, failed or interrupted leaves no `_nanoserve.lock`
    behind; a SIGKILLed one leaves it unlocked, and the next job takes it). A lock taken on
    a file its holder removed in the meantime is let go and taken again on the new file, so
    two jobs never hold two files of one name. Where `fcntl` is missing (not POSIX) nothing
    is locked."""
    out = OutputDir.open(folder)
    if not out.local:
        with out.hold():
            yield
        return
    folder = Path(out.loc.uri)  # the local path as the user gave it
    if folder.exists() and not folder.is_dir():
        raise InputError(f"output {folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = folder / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InputError(
                f"another nanoserve job (pid {holder}) is writing to output folder {folder}; "
                f"wait for it to end, or choose another folder"
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it as it let go: take the lock on the new file
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # still locked: a job that opens it now takes the new file
        os.close(fd)  # releases the lock


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def open_output_dir(folder: Path | OutputDir, settings: dict[str, Any],
                    overwrite: bool) -> Manifest:
    """Make `folder` ready for the job and return its manifest: fresh (empty folder, or
    `overwrite`), or the earlier run's one when resuming. Refuses (InputError) a folder with
    files nanoserve did not write, or the output of a job with other settings."""
    settings = json.loads(json.dumps(settings))  # the form it has once saved and loaded
    folder = OutputDir.open(folder)
    folder.ensure()
    entries = folder.names()
    foreign = [n for n in entries if not _OURS_RE.fullmatch(n)]
    if foreign:
        raise InputError(
            f"output folder {folder} holds files nanoserve did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); choose an empty or new folder"
        )
    for name in entries:  # temporary files of an interrupted run
        if name.startswith("."):
            folder.delete(name)
    old = None if overwrite else Manifest.load(folder)
    parts = [n for n in entries if _PART_RE.fullmatch(n)]
    if old is None:
        if parts and not overwrite:
            raise InputError(f"output folder {folder} holds parts but no {MANIFEST_NAME}; "
                             f"use --overwrite to replace them")
        for name in entries:
            if name != LOCK_NAME:  # another job waits on this very file: keep its inode
                folder.delete(name)
        manifest = Manifest(settings)
        manifest.save(folder)
        return manifest
    diffs = settings_differences(old.settings, settings)
    if diffs:
        raise InputError(
            f"output folder {folder} holds the output of a job with other settings "
            f"({', '.join(diffs)} differ); use --overwrite to replace it, or another folder"
        )
    on_disk = {_part_id(n) for n in parts}
    missing = sorted(old.done - on_disk)
    if missing:
        raise InputError(
            f"output folder {folder} lacks {len(missing)} part(s) recorded as written "
            f"({', '.join(part_name(i) for i in missing[:3])}{', ...' if len(missing) > 3 else ''})"
            f"; use --overwrite to start the job afresh"
        )
    for i in on_disk - old.done:  # renamed into place after the last manifest update
        if part_digest(folder, part_name(i)) is None:
            folder.delete(part_name(i))
    return old


def part_digest(folder: Path | OutputDir, name: str | None = None,
                key: bytes = PART_DIGEST_KEY) -> str | None:
    """The shard's digest in a part's footer (`folder/name`, or the file `folder`), or its
    other footer value `key`; None if it has none or cannot be read."""
    if name is None:
        folder, name = Path(folder).parent, Path(folder).name
    schema = OutputDir.open(folder).parquet_schema(name)
    value = (schema.metadata or {}).get(key) if schema is not None else None
    return value.decode() if value is not None else None


def beside_digest(blobs: list[bytes]) -> str:
    """A short hash of the bytes of the files committed with a part (`BESIDE_DIGEST_KEY`)."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(hashlib.sha256(blob).digest())
    return h.hexdigest()[:16]


def adopt_part(folder: Path | OutputDir, manifest: Manifest, shard_id: int, digest: str,
               num_rows: int | None = None, beside: tuple[str, ...] = ()) -> bool:
    """Record an unrecorded part already in the folder as done, if it holds exactly this
    shard (same digest, and row count when given); then it is not computed
    again. `beside`: the files committed with the part (an OpenAI job's fragments, written
    before it): the part is adopted only when they are there and hold the bytes its footer
    names (`BESIDE_DIGEST_KEY`), so fragments of another attempt at the shard (a retry
    killed between its fragments and its part) never go with it."""
    folder = OutputDir.open(folder)
    name = part_name(shard_id)
    if shard_id in manifest.done or part_digest(folder, name) != digest:
        return False
    if beside:
        blobs = [folder.read_bytes(n) for n in beside]
        if None in blobs or part_digest(folder, name, BESIDE_DIGEST_KEY) != beside_digest(blobs):
            return False
    found = folder.parquet_num_rows(name)
    if num_rows is not None and found != num_rows:
        return False
    manifest.record(shard_id, found)
    manifest.save(folder)
    return True


def reopen_shards_with_errors(folder: Path | OutputDir, manifest: Manifest) -> set[int]:
    """For `--retry-errors`: the shards whose parts in the folder hold an `error` row
    (recorded ones, and parts an interrupted run renamed into place without recording),
    taken out of the manifest (done ids, row count, completeness; `_SUCCESS` removed) so the
    run computes them again rather than keeping or adopting them. Their parts stay until the
    new parts replace them: a run killed before that adopts them again on the next start
    (same digest), as if never retried."""
    folder = OutputDir.open(folder)
    retry: set[int] = set()
    rows = 0
    for name in folder.names():
        m = _PART_RE.fullmatch(name)
        if m is None:
            continue
        errors = folder.parquet_column(name, "error")
        if errors.null_count < len(errors):
            shard_id = int(m.group(1))
            retry.add(shard_id)
            if shard_id in manifest.done:
                rows += len(errors)
    if retry:
        manifest.done -= retry
        manifest.rows_done -= rows
        manifest.complete = False
        folder.delete(SUCCESS_NAME)
        manifest.save(folder)
    return retry


def mark_complete(folder: Path | OutputDir, manifest: Manifest) -> None:
    """Mark the job done: parts not recorded (none, when every shard was written) are
    removed first, so the folder holds exactly the recorded rows."""
    folder = OutputDir.open(folder)
    for name in folder.names():
        m = _PART_RE.fullmatch(name)
        if m and int(m.group(1)) not in manifest.done:
            folder.delete(name)
    manifest.complete = True
    manifest.save(folder)
    folder.write_bytes(SUCCESS_NAME, b"")


def _part_id(name: str) -> int:
    return int(_PART_RE.fullmatch(name).group(1))


def _to_ranges(ids: set[int]) -> list[list[int]]:
    """{0, 1, 2, 5} -> [[0, 2], [5, 5]]: compact even for many shards."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out
