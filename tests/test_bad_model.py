"""Corrupt, truncated or mismatched model files given to `nanoserve batch --model`.

Each must end the job with exit status 2 and one stderr line `error: ...` naming the model,
found on the driver (headers only) before Ray is joined or started: the `no_ray` fixture
fails the test if the job gets that far. `test_intact_copies_pass_the_driver_checks` shows
the unbroken copies do get that far, so each case fails for its own defect alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from nanoserve_cli import main as nanoserve_main


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hello world"}\n')
    return path


def run_with_model(capsys, prompts: Path, model: Path) -> tuple[int, list[str]]:
    rc = nanoserve_main(["batch", str(prompts), "-o", str(prompts.parent / "out"),
                         "--model", str(model), "--no-progress"])
    return rc, capsys.readouterr().err.strip().splitlines()


def assert_refused(rc, err, prompts: Path, *fragments):
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    assert not (prompts.parent / "out").exists()


# --- GGUF files --------------------------------------------------------------------------------


def gguf_copy(src: Path, dst: Path, keep: int | None = None, drop_tail: int = 0) -> Path:
    """The first `keep` bytes of `src` (all when None) minus its last `drop_tail` bytes."""
    with open(src, "rb") as f:
        data = f.read(keep) if keep is not None else f.read()
    dst.write_bytes(data[:len(data) - drop_tail] if drop_tail else data)
    return dst


@pytest.mark.parametrize("keep", [0, 100, 1 << 20], ids=["empty", "cut-in-header",
                                                         "cut-in-metadata"])
def test_truncated_gguf_header(tmp_path, capsys, no_ray, prompts, smollm2_gguf_path, keep):
    bad = gguf_copy(smollm2_gguf_path, tmp_path / "cut.gguf", keep=keep)
    rc, err = run_with_model(capsys, prompts, bad)
    assert_refused(rc, err, prompts, "cut.gguf")


def test_gguf_missing_its_last_bytes(tmp_path, capsys, no_ray, prompts, smollm2_gguf_path):
    """An interrupted download: every header intact, the last tensor's data short."""
    bad = gguf_copy(smollm2_gguf_path, tmp_path / "short.gguf", drop_tail=4096)
    rc, err = run_with_model(capsys, prompts, bad)
    assert_refused(rc, err, prompts, "short.gguf")


@pytest.mark.parametrize("head", [b"", b"GGUF"], ids=["random", "magic-then-random"])
def test_garbage_gguf(tmp_path, capsys, no_ray, prompts, head):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(head + os.urandom(1 << 16))
    rc, err = run_with_model(capsys, prompts, bad)
    assert_refused(rc, err, prompts, "garbage.gguf", "not a readable GGUF file")


def test_weights_file_of_an_unknown_kind(tmp_path, capsys, no_ray, prompts):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(os.urandom(1024))
    rc, err = run_with_model(capsys, prompts, bad)
    assert_refused(rc, err, prompts, "weights.bin")


# --- Hugging Face folders ----------------------------------------------------------------------


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer.json whose ids all fit the model's vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture
def hf_folder(tmp_path, tiny_model_dir):
    """A copy of the tiny random Llama saved by transformers, plus a tokenizer.json."""
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    write_tokenizer(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    return folder


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_intact_copies_pass_the_driver_checks(tmp_path, capsys, no_ray, prompts, hf_folder):
    """The control: unbroken, the folder passes every driver check and the job goes on to
    start Ray."""
    with pytest.raises(AssertionError, match="before Ray is started"):
        run_with_model(capsys, prompts, hf_folder)


def test_tensor_of_the_wrong_shape(capsys, no_ray, prompts, hf_folder):
    def edit(t):
        t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:-1]

    edit_tensors(hf_folder, edit)
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, "model.layers.1.mlp.up_proj.weight", "has shape [159, 96]",
                   "expected [160, 96]")


def test_missing_tensor(capsys, no_ray, prompts, hf_folder):
    edit_tensors(hf_folder, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, "model.layers.0.self_attn.k_proj.weight", "missing")


def test_config_of_an_unknown_architecture(capsys, no_ray, prompts, hf_folder):
    edit_config(hf_folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, str(hf_folder), "unsupported architecture 'GPT2LMHeadModel'")


def test_config_that_disagrees_with_the_weights(capsys, no_ray, prompts, hf_folder):
    edit_config(hf_folder, intermediate_size=192)
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, "model.layers.0.mlp.gate_proj.weight", "expected [192, 96]")


def test_config_that_is_not_json(capsys, no_ray, prompts, hf_folder):
    (hf_folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, "config.json", "not valid JSON")


def test_missing_tokenizer_json(capsys, no_ray, prompts, hf_folder):
    (hf_folder / "tokenizer.json").unlink()
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, str(hf_folder), "no tokenizer.json")


def test_tokenizer_json_that_is_garbage(capsys, no_ray, prompts, hf_folder):
    (hf_folder / "tokenizer.json").write_text('{"model": 3}')
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, "tokenizer.json", "could not be loaded")


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_unreadable_safetensors(capsys, no_ray, prompts, hf_folder, how):
    weights = hf_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if how == "truncated" else os.urandom(len(data)))
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, "model.safetensors", "not a readable safetensors file")


def test_folder_without_weights(capsys, no_ray, prompts, hf_folder):
    (hf_folder / "model.safetensors").unlink()
    rc, err = run_with_model(capsys, prompts, hf_folder)
    assert_refused(rc, err, prompts, str(hf_folder), "no model.safetensors")
