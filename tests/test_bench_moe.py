"""benchmarks/moe.py on the CPU: its --smoke run (a child process, as on the GPU box), the
--fit arithmetic, and its workload (nano-vllm's distribution at 4,096 rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.moe import QWEN3_30B_A3B, QWEN3_235B_A22B, fit_report, weight_bytes
from benchmarks.vs_vllm import nanovllm_workload

REPO = Path(__file__).resolve().parents[1]


def test_fit_arithmetic():
    """Qwen3-30B-A3B is 30.5B parameters (61 GB in bf16); Qwen3-235B-A22B 235B (about
    236 GB in FP8): it does not fit one H200."""
    assert 60e9 < weight_bytes(QWEN3_30B_A3B, False) < 62e9
    assert 30e9 < weight_bytes(QWEN3_30B_A3B, True) < 32e9
    assert 230e9 < weight_bytes(QWEN3_235B_A22B, True) < 240e9
    report = fit_report(141e9)
    assert not report["shapes"]["Qwen3-235B-A22B"]["fp8_fits"]
    assert report["shapes"]["Qwen3-30B-A3B"]["bf16_fits"]
    assert report["largest_fp8"] == "Mixtral-8x7B"
    assert 0 < report["qwen3_235b_fp8_layers_that_fit"] < 94


def test_workload_is_nanovllm_s_distribution_at_4096_rows():
    prompts, max_tokens = nanovllm_workload(4096, QWEN3_30B_A3B["vocab_size"])
    assert len(prompts) == 4096 and all(100 <= len(p) <= 1024 for p in prompts)
    assert all(100 <= m <= 1024 for m in max_tokens)


def test_smoke_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "benchmarks.moe", "--smoke", "--out",
                             str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| bf16 |" in result.stdout
    saved = json.loads((tmp_path / "moe_smoke_bf16.json").read_text())
    assert saved["sides"]["bf16"]["workloads"]["nanovllm"]["output_tokens"] > 0


def test_tuning_script_smoke_writes_the_config_json(tmp_path):
    """The tuner's search, timing and JSON merge, under Triton's interpreter."""
    out = tmp_path / "configs.json"
    out.write_text(json.dumps({"E=1,N=2,K=3,bfloat16": {"1": {}}}))  # kept beside the new one
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1",
           "NANOSERVE_TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.tune_fused_moe", "--smoke",
                             "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads(out.read_text())
    assert set(table) == {"E=1,N=2,K=3,bfloat16", "E=4,N=32,K=64,bfloat16"}
    assert set(table["E=4,N=32,K=64,bfloat16"]) == {"1", "8"}
