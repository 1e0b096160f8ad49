"""benchmarks/lora.py on the CPU: its --smoke run (a child process, as on the GPU box), its
adapters (PEFT folders the engine's reader accepts for the shape), and its workload (nano-vllm's
distribution at 4,096 rows, every adapter in every stretch of 8 rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.lora import TARGETS, adapter_names, row_adapters, write_adapters
from benchmarks.vs_vllm import nanovllm_workload
from nanoserve.model.config import ModelConfig
from nanoserve.weights.lora_weights import check_adapter

REPO = Path(__file__).resolve().parents[1]
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256}


def test_adapters_are_peft_folders_the_reader_accepts(tmp_path):
    folders = write_adapters(tmp_path, TINY, 2, 4, "cpu")
    assert list(folders) == adapter_names(2) == ["ft0", "ft1"]
    config = ModelConfig.from_hf_dict(TINY)
    for folder in folders.values():
        adapter = check_adapter(folder, config)
        assert adapter.rank == 4 and adapter.targets == TARGETS and adapter.scale == 2.0
    before = (folders["ft0"] / "adapter_model.safetensors").stat().st_mtime_ns
    write_adapters(tmp_path, TINY, 2, 4, "cpu")  # complete folders are reused
    assert (folders["ft0"] / "adapter_model.safetensors").stat().st_mtime_ns == before


def test_workload_spreads_4096_rows_over_8_adapters():
    prompts, max_tokens = nanovllm_workload(4096, 128256)
    assert len(prompts) == 4096 and all(100 <= len(p) <= 1024 for p in prompts)
    lora = row_adapters(4096, adapter_names(8))
    assert {lora.count(n) for n in adapter_names(8)} == {512}
    assert all(len(set(lora[i:i + 8])) == 8 for i in range(0, 4096, 8))


def test_smoke_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.lora", "--smoke", "--out",
                             str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| base |" in result.stdout and "| lora |" in result.stdout
    saved = json.loads((tmp_path / "lora_smoke_base_lora.json").read_text())
    assert saved["sides"]["lora"]["output_tokens"] == saved["sides"]["base"]["output_tokens"] > 0
    assert saved["sides"]["lora"]["adapter_loads"] == 3
