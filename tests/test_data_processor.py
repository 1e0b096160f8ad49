"""The Ray Data processor (`ray_jobs.data_processor`) on a local Ray, CPU only.

Oracle: `nanoserve batch` (`run_batch_job`) on the same input file, row for row by id, with
the same model and sampling defaults; bad rows must be error rows with the batch job's
messages, not a failed dataset. The two-actor case runs in its own process with a Ray of
two logical GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from nanoserve.errors import InputError
from ray_jobs import run_batch_job
from ray_jobs.data_processor import build_processor
from ray_jobs.preparation.result_columns import RESULT_COLUMNS

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 4
KV_BYTES = 4 << 20

ROWS = [
    {"id": 0, "prompt": "The capital of France is"},
    {"id": 1, "prompt": "What is 2 + 2?", "top_k": 5, "temperature": 0.7, "seed": 3},
    {"id": 2, "prompt": ""},  # bad: empty prompt
    {"id": 3, "prompt": "Once upon a time", "max_tokens": 2},
    {"id": 4, "prompt_token_ids": [504, 2988, 314]},
    {"id": 5, "prompt": "List three colors:", "temperature": -1.0},  # bad: sampling value
    {"id": 6, "prompt_token_ids": [504, 10 ** 9]},  # bad: outside the vocabulary
    {"id": 7, "prompt": "The weather today is", "temperature": 0.9, "seed": 11},
    {"id": 8, "prompt": "word " * 600},  # bad: longer than the model's context
]
BAD = {2: "empty prompt", 5: "temperature", 6: "vocabulary", 8: "context"}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data-processor") / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def batch_job_rows(prompts, tiny_job_model, ray_session):
    out = prompts.parent / "batch-out"
    run_batch_job(prompts, out, model=str(tiny_job_model), max_tokens=MAX_TOKENS, batch_size=3,
                  kv_cache_bytes=KV_BYTES, progress=False)
    return {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}


def test_processor_rows_equal_the_batch_job(prompts, batch_job_rows, tiny_job_model,
                                           ray_session):
    process = build_processor(str(tiny_job_model), concurrency=1, num_gpus=0, batch_size=2,
                              kv_cache_bytes=KV_BYTES, max_tokens=MAX_TOKENS)
    out = process(ray_session.data.read_json(str(prompts))).take_all()
    assert sorted(r["id"] for r in out) == [r["id"] for r in ROWS]  # each row once
    for row in out:
        want = batch_job_rows[row["id"]]
        got = {k: row[k] for k in RESULT_COLUMNS}
        if got["generated_token_ids"] is not None:
            got["generated_token_ids"] = list(got["generated_token_ids"])
        assert got == {k: want[k] for k in RESULT_COLUMNS}, row["id"]
        source = ROWS[row["id"]]
        assert row.get("prompt") == source.get("prompt")  # input columns pass through
    by_id = {r["id"]: r for r in out}
    for i, fragment in BAD.items():
        assert by_id[i]["finish_reason"] == "error" and fragment in by_id[i]["error"]
    good = [r for r in out if r["id"] not in BAD]
    assert all(r["error"] is None and r["num_generated_tokens"] >= 1 for r in good)


def test_a_row_too_big_for_the_kv_cache_is_an_error_row(tiny_job_model, ray_session):
    """Fails in the engine (not in row preparation): still one error row, the rest answered."""
    rows = [{"prompt": "Hello there"}, {"prompt": "word " * 300}, {"prompt": "Good morning"}]
    process = build_processor(str(tiny_job_model), num_gpus=0, kv_cache_bytes=64 << 10,  # 128 tokens
                              max_tokens=MAX_TOKENS)
    out = process(ray_session.data.from_items(rows)).take_all()
    assert len(out) == 3
    reasons = {r["prompt"][:5]: (r["finish_reason"], r["error"]) for r in out}
    assert reasons["word "][0] == "error" and "KV cache" in reasons["word "][1]
    assert reasons["Hello"][1] is None and reasons["Good "][1] is None


def test_invalid_options_are_refused_before_any_actor(tiny_job_model):
    with pytest.raises(InputError, match="temperature"):
        build_processor(str(tiny_job_model), temperature=-1)
    with pytest.raises(ValueError, match="concurrency"):
        build_processor(str(tiny_job_model), concurrency=0)


TWO_GPU_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys, time

    import ray

    from ray_jobs.data_processor import DatasetGenerator, build_processor
    from ray_jobs.dispatch.local_ray import start_local_ray
    from ray_jobs.workers.worker import ray_gpu_ids

    model, report_dir = sys.argv[1], sys.argv[2]

    class Reporting(DatasetGenerator):
        # Says where each actor runs, then waits (bounded) until both actors are up, so
        # that both hold their GPU at once whichever gets the batches.

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            info = {"gpu_ids": ray_gpu_ids(), "device": str(self.worker.llm.device)}
            with open(os.path.join(report_dir, f"{os.getpid()}.json"), "w") as f:
                json.dump(info, f)
            deadline = time.monotonic() + 120
            while len(os.listdir(report_dir)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)

    import ray_jobs.data_processor as dp
    dp.DatasetGenerator = Reporting  # build_processor's map_batches runs this class
    temp_dir = start_local_ray(num_cpus=2, num_gpus=2)
    try:
        process = build_processor(model, concurrency=2, num_gpus=1, batch_size=2,
                                  kv_cache_bytes=4 << 20, max_tokens=2)
        rows = process(ray.data.from_items([{"prompt": f"Number {i} is"} for i in range(8)],
                                           override_num_blocks=4)).take_all()
        print("ROWS=" + json.dumps([r["error"] for r in rows]))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
""")


def test_two_actors_each_hold_one_logical_gpu(tmp_path, tiny_job_model):
    """A Ray with two logical GPUs (on the CPU): the pool's two actors hold one GPU id each,
    different ones, and run on the CPU (torch sees no CUDA)."""
    proc = subprocess.run([sys.executable, "-c", TWO_GPU_SCRIPT, str(tiny_job_model),
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS="))
    assert json.loads(line.removeprefix("ROWS=")) == [None] * 8  # 8 rows, none an error
    actors = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(actors) == 2
    assert sorted(tuple(a["gpu_ids"]) for a in actors) == [(0,), (1,)]
    assert all(a["device"] == "cpu" for a in actors)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_on_a_real_gpu_every_row_is_answered_by_a_cuda_engine(ray_session, tiny_job_model):
    """One actor holding a real GPU (the session's Ray sees the machine's GPUs): every row
    answered, none an error; the greedy tokens equal the CPU engine's (float32)."""
    assert ray_session.cluster_resources().get("GPU", 0) >= 1
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    rows = [{"id": i, "prompt": f"Number {i} is"} for i in range(8)]
    process = build_processor(str(tiny_job_model), num_gpus=1, batch_size=4, dtype="float32",
                              kv_cache_bytes=KV_BYTES, max_tokens=MAX_TOKENS)
    out = sorted(process(ray_session.data.from_items(rows)).take_all(), key=lambda r: r["id"])
    assert [r["error"] for r in out] == [None] * len(rows)
    cpu = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=KV_BYTES)
    want = cpu.generate([cpu.tokenizer.encode(r["prompt"]) for r in rows],
                        [SamplingParams(max_tokens=MAX_TOKENS)] * len(rows))
    assert [list(r["generated_token_ids"]) for r in out] == [w.token_ids for w in want]
