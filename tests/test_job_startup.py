"""What a batch job does before its first batch: the driver imports no engine (torch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_the_driver_imports_no_engine():
    """The command line and the job's driver (everything up to sending token ids to the
    workers) load without torch, Triton, gguf or transformers."""
    code = ("import sys, nanoserve_cli, ray_jobs.dispatch.driver, ray_jobs.cli\n"
            "import ray_jobs.report.report\n"
            "from nanoserve.sampling.params import SamplingParams\n"
            "from nanoserve.weights.weights import validate_checkpoint\n"
            "from nanoserve.weights.tokenizer import Tokenizer\n"
            "print(sorted(m for m in ('torch', 'triton', 'gguf', 'transformers') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_engine_on_a_cpu_only_machine_imports_no_triton():
    """Where Triton cannot run (no CUDA GPU, no interpreter asked for), the engine does not
    import it (about 0.4 s of a CPU worker's start), and the kernels' references serve."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the engine imports Triton here")
    code = ("import sys, nanoserve.llm, nanoserve_kernels as kernels\n"
            "assert not kernels.use_triton('cpu')\n"
            "print('triton' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "NANOSERVE_TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
