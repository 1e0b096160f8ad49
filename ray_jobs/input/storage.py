"""Stage input: where a job's files live (the input's, and the output's alike). A local path
or a URI (`s3://`, `gs://`, any fsspec protocol), resolved to a `pyarrow.fs` filesystem, and
the output location built on it.

    loc = resolve("s3://bucket/prompts/")      # Location(fs, path, uri)
    out = OutputDir.open("s3://bucket/out/")   # the output folder or prefix of a job

Credentials and endpoints come from each store's own standard chain (for S3: the AWS
environment variables, `AWS_PROFILE` and `~/.aws`, `AWS_ENDPOINT_URL` for an S3-compatible
store, the instance role); nanoserve never reads, prints or records them. URIs are resolved
by `pyarrow.fs.FileSystem.from_uri`; a scheme pyarrow has no filesystem for goes through
fsspec (`pyarrow.fs.FSSpecHandler`) when fsspec has one.

What differs on an object store, and how the output keeps the local folder's guarantees:
- no rename: a part or the manifest is uploaded in one request straight under its final key;
  an object store shows an object only once its upload completed (PutObject, or
  CompleteMultipartUpload), so a reader never sees a part cut short. A driver killed
  mid-upload leaves an invisible incomplete upload (a bucket lifecycle rule removes those);
- no flock: the job writing a prefix holds a lease (`ObjectLease`): the lock object
  `_nanoserve.lock` is created with a conditional write (S3 `If-None-Match: *`), renewed by
  a thread with `If-Match: <its ETag>`, and deleted at the end. A second job finds it and is
  refused; a lock whose lease expired, or whose owner is a dead process on this machine, is
  taken over with `If-Match` on the ETag read, so of two jobs racing for it one wins. A job
  that lost its lease (it was paused past its expiry and another took over) stops before its
  next write (`OutputDir.check_lease`).
Where conditional writes are not available (stores other than S3 here), the lease is
written and read back: it refuses a second job that starts after the first has its lock,
but two jobs that start within the same moment may both go on (documented in
docs/reliability.md).
"""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from nanoserve import InputError, NanoserveError

LEASE_ENV = "NANOSERVE_LOCK_LEASE_S"  # the lease's length in seconds (default LEASE_S)
LEASE_S = 120.0
COPY_BLOCK = 4 << 20  # bytes a streamed copy holds at once (`OutputDir.concatenate`)


def is_uri(target: str | Path) -> bool:
    return isinstance(target, str) and "://" in target and not target.startswith("file://")


@dataclass(frozen=True, eq=False)
class Location:
    """A file or folder: `fs` and the `path` inside it; `uri` is how it is named to users
    (the local path as given, or `scheme://...`)."""

    fs: pafs.FileSystem
    path: str
    uri: str
    local: bool

    def child(self, name: str) -> Location:
        path = f"{self.path.rstrip('/')}/{name}"
        uri = str(Path(self.uri) / name) if self.local else f"{self.uri.rstrip('/')}/{name}"
        return Location(self.fs, path, uri, self.local)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def info(self) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(self.path)
        except (OSError, pa.ArrowException) as e:
            raise storage_error(self.uri, e) from None

    def __str__(self) -> str:
        return self.uri


def resolve(target: str | Path) -> Location:
    """`target` (a local path, `file://`, or a URI) as a Location. InputError for a scheme no
    filesystem serves, or a store that cannot be reached."""
    if not is_uri(target):
        text = str(target)
        if text.startswith("file://"):
            text = text[len("file://"):]
        return Location(pafs.LocalFileSystem(), os.path.abspath(text), str(Path(text)), True)
    uri = str(target)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except pa.ArrowInvalid:
        fs, path = _fsspec(uri)
    except (OSError, pa.ArrowException) as e:
        raise storage_error(uri, e) from None
    return Location(fs, path.rstrip("/"), uri.rstrip("/"), False)


def _fsspec(uri: str) -> tuple[pafs.FileSystem, str]:
    scheme = uri.split("://", 1)[0]
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
    except ImportError as e:
        raise InputError(f"{uri}: no filesystem for {scheme}:// ({e}; install the fsspec "
                         f"package for it)") from None
    except ValueError as e:
        raise InputError(f"{uri}: no filesystem for {scheme}:// ({e})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def storage_error(uri: str, e: BaseException) -> InputError:
    """One line for a store's error: access refused, no such bucket, or its own first line.
    (pyarrow's and boto's messages name the operation and key, never a secret.)"""
    text = " ".join(str(e).split())
    low = text.lower()
    if any(k in low for k in ("access_denied", "accessdenied", "invalidaccesskeyid", "forbidden",
                              "signaturedoesnotmatch", "403", "expiredtoken",
                              "unable to locate credentials", "no credentials")):
        return InputError(f"{uri}: access denied by the store ({_short(text)}); check the "
                          f"credentials (AWS_ACCESS_KEY_ID/AWS_PROFILE/role, or the store's own)")
    if "nosuchbucket" in low or "no_such_bucket" in low or "bucket does not exist" in low:
        return InputError(f"{uri}: the bucket does not exist")
    return InputError(f"{uri}: {_short(text) or type(e).__name__}")


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_bucket(loc: Location) -> None:
    """InputError when `loc` is on an object store whose bucket does not exist (else the
    first write would fail with the store's own words)."""
    if loc.local or "://" not in loc.uri:
        return
    bucket = loc.path.split("/", 1)[0]
    try:
        kind = loc.fs.get_file_info(bucket).type
    except (OSError, pa.ArrowException) as e:
        raise storage_error(loc.uri, e) from None
    if kind == pafs.FileType.NotFound:
        raise InputError(f"{loc.uri}: the bucket {bucket!r} does not exist")
    if kind == pafs.FileType.File:
        raise InputError(f"{loc.uri}: {bucket!r} is not a bucket")


# --- the output folder or prefix ---------------------------------------------------------------


class OutputDir:
    """A job's output folder (local) or prefix (object store): list, read, write and delete
    the files directly in it, by name. Writes are whole: a local file goes to a `.`-named
    temporary then is renamed; on an object store the object is uploaded under its final
    key in one request, visible only once complete. While a lease is held (`ObjectLease`),
    every write first checks it is still ours."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.lease: ObjectLease | LeaseView | None = None

    @classmethod
    def open(cls, target: str | Path | OutputDir) -> OutputDir:
        return target if isinstance(target, OutputDir) else cls(resolve(target))

    def __getstate__(self) -> dict[str, Any]:
        """The copy a worker gets (its parts are written there): the lease stays with the
        driver that holds it (a thread, a store client); the copy checks it by reading the
        lock object before each write (`LeaseView`)."""
        lease = self.lease
        if isinstance(lease, ObjectLease):
            lease = LeaseView(self / LOCK_NAME, lease.owner, str(self))
        return {"loc": self.loc, "lease": lease}

    @property
    def local(self) -> bool:
        return self.loc.local

    @property
    def path(self) -> Path:
        """The local folder (only for a local output)."""
        return Path(self.loc.path)

    def __str__(self) -> str:
        return self.loc.uri

    def __truediv__(self, name: str) -> Location:
        return self.loc.child(name)

    def ensure(self) -> None:
        """Make the folder (local), or check the bucket exists (object store); InputError if
        the output names a file."""
        if self.loc.info().type == pafs.FileType.File:
            raise InputError(f"output {self} exists and is not a folder")
        if self.local:
            Path(self.loc.path).mkdir(parents=True, exist_ok=True)
        else:
            check_bucket(self.loc)

    def names(self) -> list[str]:
        """The names directly in the folder, sorted (a sub-folder or sub-prefix included)."""
        try:
            infos = self.loc.fs.get_file_info(
                pafs.FileSelector(self.loc.path, recursive=False, allow_not_found=True))
        except (OSError, pa.ArrowException) as e:
            raise storage_error(str(self), e) from None
        return sorted(i.base_name for i in infos)

    def exists(self, name: str) -> bool:
        return (self / name).info().type == pafs.FileType.File

    def read_bytes(self, name: str) -> bytes | None:
        """The file's bytes, or None if there is none."""
        loc = self / name
        try:
            with loc.fs.open_input_stream(loc.path) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowException) as e:
            if loc.info().type == pafs.FileType.NotFound:
                return None
            raise storage_error(loc.uri, e) from None

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace the file `name` with `data` as a whole."""
        self.write_blocks(name, [data])

    def concatenate(self, name: str, sources: Iterable[str]) -> None:
        """Replace the file `name` with the bytes of the files `sources`, in order: a
        streamed copy, COPY_BLOCK bytes at a time (memory flat in their sizes), written
        whole as `write_blocks` writes."""
        self.write_blocks(name, (block for source in sources for block in self._blocks(source)))

    def _blocks(self, name: str) -> Iterator[bytes]:
        loc = self / name
        try:
            with loc.fs.open_input_stream(loc.path) as f:
                while block := f.read(COPY_BLOCK):
                    yield block
        except (OSError, pa.ArrowException) as e:
            raise storage_error(loc.uri, e) from None

    def write_blocks(self, name: str, blocks: Iterable[bytes]) -> None:
        """Replace the file `name` with `blocks` joined, as a whole: locally a `.`-named
        temporary file renamed into place once synced; on an object store one upload
        stream, visible once complete (an error raised while writing closes the stream,
        which may leave a partial object: whoever wrote it is then not done, and its rerun
        writes the file again)."""
        self.check_lease()
        loc = self / name
        if self.local:
            tmp = Path(self.loc.path) / f".{name}.tmp-{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    for block in blocks:
                        f.write(block)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, loc.path)
            finally:
                tmp.unlink(missing_ok=True)
            return
        try:
            with loc.fs.open_output_stream(loc.path) as f:
                for block in blocks:
                    f.write(block)
        except (OSError, pa.ArrowException) as e:
            raise storage_error(loc.uri, e) from None

    def write_parquet(self, name: str, table: pa.Table) -> None:
        """`table` as the Parquet file `name`, visible only once complete."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        self.write_bytes(name, sink.getvalue().to_pybytes())

    def delete(self, name: str) -> None:
        """Remove `name` if it is there."""
        self.check_lease()
        loc = self / name
        try:
            loc.fs.delete_file(loc.path)
        except FileNotFoundError:
            pass
        except (OSError, pa.ArrowException) as e:
            if loc.info().type != pafs.FileType.NotFound:
                raise storage_error(loc.uri, e) from None

    def parquet_schema(self, name: str) -> pa.Schema | None:
        """A part's schema (with its footer metadata); None if unreadable or missing."""
        loc = self / name
        try:
            return pq.read_schema(loc.path, filesystem=loc.fs)
        except (OSError, pa.ArrowException):
            return None

    def read_parquet(self, name: str, columns: list[str] | None = None) -> pa.Table:
        """A part's rows (`columns` of them; None: all)."""
        loc = self / name
        try:
            return pq.read_table(loc.path, columns=columns, filesystem=loc.fs)
        except (OSError, pa.ArrowException) as e:
            raise storage_error(loc.uri, e) from None

    def parquet_num_rows(self, name: str) -> int:
        loc = self / name
        return pq.read_metadata(loc.path, filesystem=loc.fs).num_rows

    def parquet_column(self, name: str, column: str) -> pa.ChunkedArray:
        loc = self / name
        return pq.read_table(loc.path, columns=[column], filesystem=loc.fs).column(column)

    def check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the (object-store) output for one job: see `ObjectLease`."""
        self.ensure()
        lease = ObjectLease(self)
        lease.acquire()
        self.lease = lease
        try:
            yield
        finally:
            self.lease = None
            lease.release()


# --- the lock of an object-store output: a lease written conditionally -------------------------

LOCK_NAME = "_nanoserve.lock"


class LockHeld(Exception):
    """A conditional write lost: the object exists, or is not the version expected."""


@dataclass(frozen=True)
class _Version:
    body: bytes
    tag: str  # ETag (S3) or the body itself (no conditional writes)


class _S3Conditional:
    """Conditional writes on S3 through boto3 (pyarrow has none), with the same credential
    and endpoint chain (boto3 reads AWS_ENDPOINT_URL, AWS_PROFILE, ~/.aws, roles)."""

    conditional = True

    def __init__(self, loc: Location) -> None:
        import boto3
        from botocore.exceptions import ClientError

        self.ClientError = ClientError
        region = getattr(loc.fs, "region", None) or None
        self.client = boto3.client("s3", region_name=region)
        self.bucket, _, self.key = loc.path.partition("/")

    def _failed(self, e: Exception) -> bool:
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)

    def read(self) -> _Version | None:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return _Version(r["Body"].read(), r["ETag"])

    def create(self, body: bytes) -> _Version:
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                       IfNoneMatch="*")
        except self.ClientError as e:
            if self._failed(e):
                raise LockHeld() from None
            raise
        return _Version(body, r["ETag"])

    def replace(self, old: _Version, body: bytes) -> _Version:
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                       IfMatch=old.tag)
        except self.ClientError as e:
            if self._failed(e) or e.response.get("Error", {}).get("Code") == "NoSuchKey":
                raise LockHeld() from None
            raise
        return _Version(body, r["ETag"])

    def delete(self, old: _Version) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=old.tag)
        except self.ClientError as e:
            if not self._failed(e):
                raise


class _Unconditional:
    """Stores without conditional writes here: write, then read back (best effort)."""

    conditional = False

    def __init__(self, loc: Location) -> None:
        self.loc = loc

    def read(self) -> _Version | None:
        try:
            with self.loc.fs.open_input_stream(self.loc.path) as f:
                body = f.read()
        except FileNotFoundError:
            return None
        except OSError:
            if self.loc.info().type == pafs.FileType.NotFound:
                return None
            raise
        return _Version(body, body.decode(errors="replace"))

    def _put(self, body: bytes) -> _Version:
        with self.loc.fs.open_output_stream(self.loc.path) as f:
            f.write(body)
        now = self.read()
        if now is None or now.body != body:
            raise LockHeld()
        return now

    def create(self, body: bytes) -> _Version:
        if self.read() is not None:
            raise LockHeld()
        return self._put(body)

    def replace(self, old: _Version, body: bytes) -> _Version:
        now = self.read()
        if now is None or now.body != old.body:
            raise LockHeld()
        return self._put(body)

    def delete(self, old: _Version) -> None:
        now = self.read()
        if now is not None and now.body == old.body:
            self.loc.fs.delete_file(self.loc.path)


def _backend(loc: Location) -> _S3Conditional | _Unconditional:
    if isinstance(loc.fs, pafs.S3FileSystem):
        return _S3Conditional(loc)
    return _Unconditional(loc)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_alive(pid: int, started: str | None) -> bool:
    """Whether process `pid` of this machine still runs and is the one that started at
    `started` (its `process_start_time`; None or "": any process of that pid). Another
    user's process counts as alive. The lease lock's stale holder, and the private Ray's
    leftover folders (`ray_jobs.dispatch.local_ray`), are told by it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    now = process_start_time(pid)
    return not (started and now and now != started)


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[19] if len(fields) > 19 else None  # field 22 of the whole line


class ObjectLease:
    """The lock of an object-store output: `_nanoserve.lock`, a JSON lease
    {owner, host, boot_id, pid, pid_start, expires} that only its owner renews.

    Invariants: at most one job holds an unexpired lease at a time (every change of the lock
    object is conditional on the version read, so of two jobs racing, one wins); the holder
    renews it every `lease_s / 4` s, and `check()` refuses to write once the lease is lost
    (another owner's version seen) or would have expired (no renewal for `lease_s` minus
    a margin): a job paused past its lease never writes over its successor's work. A lease
    is stale, and taken over, when it has expired, or when its owner is a process of this
    machine (same boot) that is gone: a driver SIGKILLed and rerun on one machine resumes at
    once; on another machine the rerun waits out the lease."""

    def __init__(self, out: OutputDir, lease_s: float | None = None) -> None:
        self.out = out
        self.loc = out / LOCK_NAME
        self.lease_s = float(os.environ.get(LEASE_ENV, LEASE_S)) if lease_s is None else lease_s
        self.backend = _backend(self.loc)
        self.owner = uuid.uuid4().hex
        self.version: _Version | None = None
        self.valid_until = 0.0  # monotonic: no write after this unless renewed
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        pid = os.getpid()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(),
                           "boot_id": _boot_id(), "pid": pid, "pid_start": process_start_time(pid),
                           "expires": time.time() + self.lease_s}).encode()

    def _stale(self, holder: dict[str, Any]) -> bool:
        if float(holder.get("expires", 0)) < time.time():
            return True
        same_machine = holder.get("boot_id") and holder.get("boot_id") == _boot_id() and \
            holder.get("host") == socket.gethostname()
        return bool(same_machine) and not process_alive(int(holder.get("pid", 0)),
                                                        holder.get("pid_start"))

    def acquire(self) -> None:
        """Take the lock, or InputError naming its holder."""
        try:
            for _ in range(3):  # a race lost on a stale lock: look again
                start = time.monotonic()
                try:
                    self.version = self.backend.create(self._body())
                    break
                except LockHeld:
                    pass
                held = self.backend.read()
                if held is None:
                    continue
                holder = _parse(held.body)
                if not self._stale(holder):
                    raise InputError(
                        f"another nanoserve job (pid {holder.get('pid', '?')} on "
                        f"{holder.get('host', '?')}) is writing to output {self.out}; wait for "
                        f"it to end, or choose another folder (its lease on {LOCK_NAME} runs "
                        f"{max(0, int(float(holder.get('expires', 0)) - time.time()))} s more "
                        f"unless renewed)")
                try:
                    self.version = self.backend.replace(held, self._body())
                    break
                except LockHeld:
                    continue
            else:
                raise InputError(f"output {self.out}: could not take the lock {LOCK_NAME}: "
                                 f"other jobs keep changing it")
        except (OSError, pa.ArrowException) as e:
            raise storage_error(str(self.loc), e) from None
        except Exception as e:  # botocore's errors (no credentials, endpoint unreachable)
            if type(e).__module__.startswith(("botocore", "boto3")):
                raise storage_error(str(self.loc), e) from None
            raise
        self.valid_until = start + self.lease_s
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name="nanoserve-lease")
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self.renew()

    def renew(self) -> None:
        start = time.monotonic()
        with self._lock:
            if self.lost or self.version is None:
                return
            try:
                self.version = self.backend.replace(self.version, self._body())
                self.valid_until = start + self.lease_s
            except LockHeld:
                self.lost = "another job took over its lock"
            except Exception:  # a network error: try again at the next tick
                pass

    def check(self) -> None:
        """NanoserveError if this job may no longer write (lease lost or about to expire)."""
        margin = min(10.0, self.lease_s / 4)
        if self.lost is None and time.monotonic() > self.valid_until - margin:
            self.renew()
            if self.lost is None and time.monotonic() > self.valid_until - margin:
                self.lost = "its lease could not be renewed in time"
        if self.lost:
            raise NanoserveError(f"output {self.out}: this job lost the lock ({self.lost}); "
                                 f"it stopped writing (rerun it to resume)")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.version is not None and not self.lost:
                try:
                    self.backend.delete(self.version)
                except Exception:  # the lease expires by itself
                    pass
            self.version = None


@dataclass(frozen=True)
class LeaseView:
    """A worker's check of its driver's lease: the lock object still names the driver's
    lease (`owner`) and has not expired; one read of the lock object a write."""

    loc: Location
    owner: str
    out: str

    def check(self) -> None:
        try:
            with self.loc.fs.open_input_stream(self.loc.path) as f:
                holder = _parse(f.read())
        except (OSError, pa.ArrowException):
            holder = {}
        if holder.get("owner") != self.owner or float(holder.get("expires", 0)) < time.time():
            raise NanoserveError(f"output {self.out}: this job lost the lock (another job "
                                 f"took it over, or its lease expired); it stopped writing "
                                 f"(rerun it to resume)")


def _parse(body: bytes) -> dict[str, Any]:
    try:
        d = json.loads(body)
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}


# --- reading input files through a filesystem --------------------------------------------------


def open_lines(loc: Location, compression: str | None) -> io.BufferedIOBase:
    """A binary line reader over `loc`, decompressed as a stream (gzip, zstd) when asked."""
    if loc.local and compression is None:
        return open(loc.path, "rb")
    try:
        stream = loc.fs.open_input_stream(loc.path, compression=compression)
    except (OSError, pa.ArrowException) as e:
        raise storage_error(loc.uri, e) from None
    return io.BufferedReader(stream, 1 << 20)
