"""FP8 through the command line and the batch job, on the CPU: a job over an FP8 checkpoint
equals the engine (dequantized weights there) and the dequantized twin, its manifest records
no quantization unless asked (so manifests written before FP8 still resume), and `--quantization fp8` is refused in one line where there is no FP8 GPU."""

from __future__ import annotations

import json

import pytest

from nanoserve.errors import NanoserveError
from nanoserve.testing import assert_rows_match_engine, save_fp8_checkpoint, save_tiny_byte_llama
from nanoserve_cli import main as nanoserve_main

PROMPTS = ["hello world", "fp8 weights", "a longer prompt about the weather", "x"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def fp8_byte_llama(tmp_path_factory):
    """A tiny byte-level Llama (own tokenizer) as a block-wise FP8 checkpoint."""
    root = tmp_path_factory.mktemp("fp8-byte-llama")
    save_tiny_byte_llama(root / "float")
    return save_fp8_checkpoint(root / "float", root / "fp8", "fp8-block", root / "twin")


def test_batch_job_over_an_fp8_checkpoint_equals_the_engine(tmp_path, ray_session,
                                                             fp8_byte_llama):
    from nanoserve.llm import LLM
    from ray_jobs import run_batch_job

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    run_batch_job(path, out, model=str(fp8_byte_llama), max_tokens=MAX_TOKENS, batch_size=2,
                  progress=False)
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    llm = LLM(str(fp8_byte_llama), device="cpu")
    assert_rows_match_engine(llm, PROMPTS, rows, MAX_TOKENS)
    twin = LLM(str(fp8_byte_llama.parent / "twin"), device="cpu")  # dequantized: the same
    assert_rows_match_engine(twin, PROMPTS, rows, MAX_TOKENS)
    model = json.loads((out / "_nanoserve_manifest.json").read_text())["settings"]["model"]
    assert model["dtype"] == "auto" and "quantization" not in model  # earlier jobs resume


def test_generate_refuses_fp8_compute_on_the_cpu_in_one_line(capsys, fp8_byte_llama):
    rc = nanoserve_main(["generate", "--model", str(fp8_byte_llama), "--device", "cpu",
                         "--quantization", "fp8", "hello"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "compute capability 8.9" in err[0], err


def test_batch_refuses_fp8_compute_without_gpus_in_one_line(tmp_path, capsys, ray_session,
                                                            fp8_byte_llama):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    rc = nanoserve_main(["batch", str(path), "-o", str(tmp_path / "out"), "--model",
                         str(fp8_byte_llama), "--quantization", "fp8", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "needs FP8 compute" in err[0], err


def test_job_options_refuse_an_unknown_quantization():
    from ray_jobs.workers.options import JobOptions

    with pytest.raises(NanoserveError, match="unknown quantization 'int4'; choose fp8"):
        JobOptions(quantization="int4")
