"""The default model's prepared copy (`nanoserve.weights.model_store.prepared_default_model`): its
loads equal the GGUF file's, and a prepared folder that is stale, corrupt or truncated is not
used. The real default model throughout; the corruption tests work on a copy of it in a
private cache folder (`$NANOSERVE_CACHE`), never on the user's cache that other processes read."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import tokenizers
import torch

from nanoserve.model.config import ModelConfig
from nanoserve.weights import gguf_file, model_store
from nanoserve.weights.model_store import (
    CONFIG_FILE,
    MANIFEST_FILE,
    TENSORS_FILE,
    TOKENIZER_FILE,
    VERIFIED_FILE,
    default_model_path,
    prepared_default_model,
    prepared_dir,
)
from nanoserve.weights.tokenizer import Tokenizer
from nanoserve.weights.weights import _checked, load_checkpoint, validate_checkpoint

TEXTS = [
    "The capital of France is",
    "  12 apples and 3.5 pears\n\tcost 1,000 yen",
    "<|im_start|>user\nHello<|im_end|>\n",
    "机器学习 est très bien ",
]


def gguf_load(path):
    """The load without the prepared copy: the GGUF file parsed and dequantized."""
    config, tensors = gguf_file.read_gguf(path)
    return config, _checked(config, tensors, str(path))


def assert_same_tensors(got, want):
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def assert_same_tokenizer(got: Tokenizer, want: Tokenizer):
    assert got.backend.to_str() == want.backend.to_str()
    assert (got.bos_token_id, got.eos_token_ids, got.pad_token_id) == \
           (want.bos_token_id, want.eos_token_ids, want.pad_token_id)
    assert got.chat_template == want.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    assert got.apply_chat_template(messages) == want.apply_chat_template(messages)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text)


@pytest.fixture(scope="module")
def gguf_reference(smollm2_gguf_path):
    """Config, tensors and tokenizer loaded from the GGUF file itself."""
    config, tensors = gguf_load(smollm2_gguf_path)
    return config, tensors, Tokenizer.from_gguf(smollm2_gguf_path)


def test_prepared_loads_equal_gguf_loads(smollm2_gguf_path, gguf_reference, monkeypatch):
    """Config, every tensor (bit for bit, same dtype and order) and the tokenizer: the
    prepared copy gives what the GGUF file gives, without parsing or dequantizing it."""
    config, tensors, tokenizer = gguf_reference
    validate_checkpoint(smollm2_gguf_path)  # writes the prepared copy if it is missing
    prepared = prepared_default_model(smollm2_gguf_path)
    assert prepared is not None and prepared.folder == prepared_dir(smollm2_gguf_path)

    def not_read(*args, **kwargs):
        raise AssertionError("the GGUF file was read although its prepared copy is valid")

    monkeypatch.setattr(gguf_file, "read_gguf", not_read)
    monkeypatch.setattr(gguf_file, "open_gguf", not_read)
    got_config, got_tensors = load_checkpoint(smollm2_gguf_path)
    assert got_config == config
    assert validate_checkpoint(smollm2_gguf_path) == config
    assert_same_tensors(got_tensors, tensors)
    assert_same_tokenizer(Tokenizer.from_path(smollm2_gguf_path), tokenizer)


def test_only_the_default_model_is_prepared(tmp_path, smollm2_gguf_path):
    """Another path to a GGUF file (even a hard link to the same bytes) is loaded from the
    file and leaves nothing beside it."""
    other = tmp_path / "other.gguf"
    try:
        os.link(smollm2_gguf_path, other)
    except OSError:
        shutil.copyfile(smollm2_gguf_path, other)
    assert prepared_default_model(other) is None
    validate_checkpoint(other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.gguf"]


# --- a private copy of the default model: stale and corrupt prepared folders -----------------


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory, smollm2_gguf_path):
    """$NANOSERVE_CACHE pointed at a fresh folder holding a copy of the default model's
    GGUF file (same bytes, same modification time), for the tests below."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(model_store.CACHE_ENV, str(root))
        target = default_model_path()
        target.parent.mkdir(parents=True)
        shutil.copy2(smollm2_gguf_path, target)
        yield target


def manifest_of(gguf):
    return json.loads((prepared_dir(gguf) / MANIFEST_FILE).read_text())


def flip_byte(path, offset):
    """Change one byte in place, keeping the file's size and modification time."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_first_load_writes_the_folder_whole(private_cache, gguf_reference, capsys):
    config, tensors, _ = gguf_reference
    assert not prepared_dir(private_cache).exists()
    assert prepared_default_model(private_cache) is None  # opening alone writes nothing
    got_config, got_tensors = load_checkpoint(private_cache)
    assert got_config == config
    assert_same_tensors(got_tensors, tensors)
    folder = prepared_dir(private_cache)
    manifest = manifest_of(private_cache)
    names = {p.name for p in folder.iterdir()}
    assert names - {VERIFIED_FILE} == {MANIFEST_FILE, *manifest["files"]}
    assert manifest["source"]["sha256"] == model_store.DEFAULT_MODEL_SHA256
    # no temporary folder left beside it (the lock file stays)
    assert sorted(p.name for p in private_cache.parent.iterdir()) == sorted(
        [private_cache.name, folder.name, folder.name + ".lock"])
    assert capsys.readouterr().err == ""


def test_corrupt_tensor_file_is_not_used(private_cache, gguf_reference, capsys):
    """One byte of tensor data changed (size and mtime kept): the load notices, says so,
    loads from the GGUF file (equal to it, so the bad byte was not used) and the folder is
    written again."""
    _, tensors, _ = gguf_reference
    validate_checkpoint(private_cache)  # the folder exists and is valid
    path = prepared_dir(private_cache) / TENSORS_FILE
    flip_byte(path, path.stat().st_size // 2)
    _, got = load_checkpoint(private_cache)
    assert_same_tensors(got, tensors)
    assert "not using the prepared model" in capsys.readouterr().err
    validate_checkpoint(private_cache)  # written again
    again = prepared_default_model(private_cache)
    assert_same_tensors(_checked(ModelConfig.from_hf_dict(again.read_json(CONFIG_FILE)),
                                 again.tensors(), "prepared"), tensors)


def test_a_checked_tensor_file_is_trusted_until_it_is_written(private_cache, gguf_reference,
                                                               monkeypatch, capsys):
    """Once the tensor file matched its sha256s, loads of the same unchanged file skip the
    hashing; a byte changed in place (size and modification time kept) is hashed again and
    not used."""
    _, tensors, _ = gguf_reference
    validate_checkpoint(private_cache)
    load_checkpoint(private_cache)  # hashed (or already trusted), and recorded
    folder = prepared_dir(private_cache)
    assert (folder / VERIFIED_FILE).exists()
    hashed = []
    real = model_store._chunk_sha256
    monkeypatch.setattr(model_store, "_chunk_sha256",
                        lambda data, chunk: hashed.append(chunk) or real(data, chunk))
    _, got = load_checkpoint(private_cache)
    assert hashed == [] and capsys.readouterr().err == ""
    assert_same_tensors(got, tensors)
    path = folder / TENSORS_FILE
    flip_byte(path, path.stat().st_size // 3)
    _, got = load_checkpoint(private_cache)
    assert len(hashed) == 1  # hashed again, and the bad byte found
    assert "not using the prepared model" in capsys.readouterr().err
    assert_same_tensors(got, tensors)


def test_corrupt_tokenizer_file_is_not_used(private_cache, gguf_reference, capsys):
    _, _, tokenizer = gguf_reference
    validate_checkpoint(private_cache)
    path = prepared_dir(private_cache) / TOKENIZER_FILE
    text = path.read_text()
    i = text.index('"vocab"') + 20  # inside the vocabulary, same length
    flip_byte(path, i)
    assert_same_tokenizer(Tokenizer.from_path(private_cache), tokenizer)
    assert "not using the prepared model" in capsys.readouterr().err
    assert_same_tokenizer(Tokenizer.from_path(private_cache), tokenizer)  # from the rewrite


@pytest.mark.parametrize("damage", ["truncated", "gguf-touched", "other-conversion",
                                    "no-manifest"])
def test_stale_or_incomplete_folder_is_written_again(private_cache, gguf_reference, damage):
    """A folder whose tensor file is shorter than recorded, whose GGUF file changed since
    (its modification time), that another version of the conversion code wrote, or that
    has no manifest (an interrupted write) is not used: it is written again, and loads
    equal the GGUF file's."""
    config, tensors, _ = gguf_reference
    validate_checkpoint(private_cache)
    folder = prepared_dir(private_cache)
    before = manifest_of(private_cache)
    if damage == "truncated":
        with open(folder / TENSORS_FILE, "r+b") as f:
            f.truncate((folder / TENSORS_FILE).stat().st_size - 4096)
    elif damage == "gguf-touched":
        st = private_cache.stat()
        os.utime(private_cache, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    elif damage == "other-conversion":
        (folder / MANIFEST_FILE).write_text(json.dumps({**before, "conversion": "0" * 64}))
    else:
        (folder / MANIFEST_FILE).unlink()
    assert model_store._open_prepared(private_cache, folder) is None
    got_config, got = load_checkpoint(private_cache)
    assert got_config == config
    assert_same_tensors(got, tensors)
    after = manifest_of(private_cache)
    assert after["files"] == before["files"]  # the same contents, written again
    assert after["source"] == {**model_store._source_stamp(private_cache),
                               "sha256": model_store.DEFAULT_MODEL_SHA256}
    assert model_store._open_prepared(private_cache, folder) is not None


def test_fused_projections_are_read_as_views_and_multiplied_in_place(smollm2_gguf_path,
                                                                     gguf_reference,
                                                                     monkeypatch):
    """The prepared copy stores each layer's q/k/v (and gate/up) as one tensor: loaded, the
    parts are views of it, and the model's fused GEMM weight is that tensor itself (no
    copy); from separately stored parts (the GGUF load) it is a copy of equal values."""
    from nanoserve.model.model import build_model

    # The cache the default model was fetched into (`private_cache` above moves it).
    monkeypatch.setenv(model_store.CACHE_ENV, str(smollm2_gguf_path.parents[2]))

    config, want, _ = gguf_reference
    _, got = load_checkpoint(smollm2_gguf_path)
    for layer in (0, config.num_hidden_layers - 1):
        p = f"model.layers.{layer}."
        for parts, whole in ((("q_proj", "k_proj", "v_proj"), "self_attn"),
                             (("gate_proj", "up_proj"), "mlp")):
            names = [f"{p}{whole}.{n}.weight" for n in parts]
            ptrs = [got[n].data_ptr() for n in names]
            sizes = [got[n].numel() * got[n].element_size() for n in names]
            assert ptrs[1:] == [a + b for a, b in zip(ptrs, sizes)][:-1]  # back to back
    model = build_model(config, got)
    gguf_model = build_model(config, want)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        mine, theirs = model.model.layers[layer], gguf_model.model.layers[layer]
        assert mine.self_attn.qkv[0].data_ptr() == got[p + "self_attn.q_proj.weight"].data_ptr()
        assert mine.mlp.gate_up[0].data_ptr() == got[p + "mlp.gate_proj.weight"].data_ptr()
        assert theirs.self_attn.qkv[0].data_ptr() != want[p + "self_attn.q_proj.weight"].data_ptr()
        assert torch.equal(mine.self_attn.qkv[0], theirs.self_attn.qkv[0])
        assert torch.equal(mine.mlp.gate_up[0], theirs.mlp.gate_up[0])


def test_prepared_tokenizer_is_parsed_on_first_use(private_cache, gguf_reference, monkeypatch):
    """Loading reads the special ids now and parses the backend's JSON only when text is
    first encoded or decoded (a worker given token ids never does)."""
    _, _, tokenizer = gguf_reference
    validate_checkpoint(private_cache)
    parsed = []
    real = tokenizers.Tokenizer.from_str
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str",
                        staticmethod(lambda text: parsed.append(1) or real(text)))
    got = Tokenizer.from_path(private_cache)
    assert parsed == [] and got.eos_token_ids == tokenizer.eos_token_ids
    assert_same_tokenizer(got, tokenizer)
    assert parsed == [1]


def test_prepared_tokenizer_text_that_does_not_parse_is_rebuilt(private_cache, gguf_reference,
                                                                capsys):
    """Backend text whose sha256 matches but which the library cannot parse (a changed
    library): the first use rebuilds the backend from the GGUF file, says so, and the
    folder is written again."""
    _, _, tokenizer = gguf_reference
    validate_checkpoint(private_cache)
    folder = prepared_dir(private_cache)
    bad = b'{"version": "1.0", "model": "not a tokenizer"}'
    (folder / TOKENIZER_FILE).write_bytes(bad)
    manifest = manifest_of(private_cache)
    manifest["files"][TOKENIZER_FILE].update(size=len(bad), sha256=hashlib.sha256(bad).hexdigest())
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    got = Tokenizer.from_path(private_cache)
    assert capsys.readouterr().err == ""  # nothing parsed yet
    assert_same_tokenizer(got, tokenizer)
    assert "not using the prepared model" in capsys.readouterr().err
    validate_checkpoint(private_cache)  # written again
    assert_same_tokenizer(Tokenizer.from_path(private_cache), tokenizer)


def test_prepared_tokenizer_first_use_from_several_threads(private_cache, gguf_reference,
                                                           capsys):
    """Threads that meet the first use together each get the right ids, and nothing is taken
    for a broken prepared file."""
    import threading

    _, _, tokenizer = gguf_reference
    validate_checkpoint(private_cache)
    got = Tokenizer.from_path(private_cache)
    text = "Row 7: the quick brown fox jumps"
    barrier, results = threading.Barrier(4), []

    def encode():
        barrier.wait()
        results.append(got.encode(text))

    threads = [threading.Thread(target=encode) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tokenizer.encode(text)] * 4
    assert "not using the prepared model" not in capsys.readouterr().err
