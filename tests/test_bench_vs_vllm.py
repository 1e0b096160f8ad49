"""benchmarks/vs_vllm.py on the CPU: its workload generators (full size, nothing run), its
nanoserve half in --smoke mode (a child process, as on the GPU box), and the parent/child
plumbing of its vLLM half against a stand-in `vllm` package (no vLLM here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

from benchmarks.vs_vllm import VOCAB, nanovllm_workload, run_vllm, shared_workload

REPO = Path(__file__).resolve().parents[1]


def test_shared_workload_at_full_size():
    prompts, max_tokens, systems = shared_workload()
    assert len(prompts) == len(max_tokens) == 3000
    assert len(systems) == 12 and len({tuple(s) for s in systems}) == 12
    assert all(300 <= len(s) <= 1500 for s in systems)
    assert all(8 <= m <= 32 for m in max_tokens)
    used = []
    for p in prompts:
        heads = [i for i, s in enumerate(systems) if p[:len(s)] == s]
        assert len(heads) == 1
        used.append(heads[0])
        assert 30 <= len(p) - len(systems[heads[0]]) <= 150
        assert all(0 <= t < VOCAB for t in p)
    assert set(used) == set(range(12))
    assert used != sorted(used)  # the drawn order, not grouped by system prompt
    assert shared_workload() == (prompts, max_tokens, systems)  # seed 0, deterministic
    assert shared_workload(seed=1)[2] != systems


def test_nanovllm_workload_is_gpu_jobs(tmp_path):
    from benchmarks.gpu_job import make_workload

    assert nanovllm_workload(32) == make_workload(tmp_path / "w.parquet", 32, VOCAB)
    prompts, max_tokens = nanovllm_workload()
    assert len(prompts) == len(max_tokens) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all(100 <= m <= 1024 for m in max_tokens)


def test_smoke_run_prints_nanoserve_rows(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_vllm", "--smoke", "--sides",
                           "nanoserve", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| shape | workload | side | wall s | output tok/s | ratio to vLLM |" in out
    for name in ("nanovllm", "shared"):
        assert f"| 1b | {name} | nanoserve | " in out, out
    assert "nanoserve on shared: prefix hit rate" in out
    result = json.loads((tmp_path / "vs_vllm_1b_smoke.json").read_text())
    shared = result["sides"]["nanoserve"]["workloads"]["shared"]
    assert shared["cached_tokens"] > 0  # rows share system prompts of full blocks
    config = json.loads((tmp_path / "llama-1b-smoke-random" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]


def test_first_rows_times_only_a_workloads_first_rows(tmp_path):
    """`--first-rows 5` on batch4096's smoke form (12 rows): the run's rows are its first 5,
    and their output tokens are what was timed."""
    from benchmarks.vs_vllm import make_workloads

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_vllm", "--smoke", "--workloads",
                           "batch4096", "--first-rows", "5", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prompts, max_tokens = make_workloads(["batch4096"], True, 8192)["batch4096"]
    assert len(prompts) == 12
    assert f"batch4096: 5 rows, {sum(map(len, prompts[:5]))} prompt tokens" in proc.stdout
    result = json.loads((tmp_path / "vs_vllm_1b_smoke.json").read_text())
    timed = result["sides"]["nanoserve"]["workloads"]["batch4096"]
    assert timed["output_tokens"] == sum(max_tokens[:5])


FAKE_VLLM = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace as NS
    assert not {"torch", "nanoserve", "benchmarks"} & set(sys.modules), "imported before vllm"
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    __version__ = "stand-in"
    SamplingParams = TokensPrompt = dict
    class LLM:
        def __init__(self, **kw):
            with open(os.path.join(os.path.dirname(__file__), "kw.json"), "w") as f:
                json.dump({**kw, "path": sys.path, "PYTHONPATH": os.environ["PYTHONPATH"]}, f)
        def generate(self, prompts, params, use_tqdm=True):
            assert not use_tqdm and len(prompts) == len(params)
            assert all(p["temperature"] == 0 and p["ignore_eos"] and not p["detokenize"]
                       for p in params)
            return [NS(outputs=[NS(token_ids=[1] * p["max_tokens"])]) for p in params]
""")


def test_vllm_child_plumbing_with_a_stand_in(tmp_path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    prompts, max_tokens, _ = shared_workload(5, systems=2, system_len=(3, 5), own_len=(1, 2),
                                             out_len=(2, 3))
    args = Namespace(vocab=VOCAB, gpu_memory_utilization=0.9, vllm_site=str(site),
                     vllm_timeout=120, quantization="fp8", load_format="auto")
    result, error = run_vllm(tmp_path / "model", {"shared": (prompts, max_tokens)}, tmp_path, args)
    assert error == "", error
    assert result["workloads"]["shared"]["output_tokens"] == sum(max_tokens)
    kw = json.loads((site / "vllm" / "kw.json").read_text())
    assert kw["skip_tokenizer_init"] and kw["enable_prefix_caching"]
    assert kw["max_model_len"] == 4096 and kw["model"] == str(tmp_path / "model")
    assert kw["quantization"] == "fp8"  # --quantization reaches vLLM's LLM
    assert kw["PYTHONPATH"] == str(site)
    assert str(REPO) not in kw["path"] and str(REPO / "benchmarks") not in kw["path"]

    # A child that fails: its stderr comes back, the caller still gets an answer
    (site / "vllm" / "__init__.py").write_text("raise RuntimeError('no GPU here')\n")
    result, error = run_vllm(tmp_path / "model", {"shared": (prompts, max_tokens)}, tmp_path, args)
    assert result is None and "no GPU here" in error and "last 40 lines" in error
