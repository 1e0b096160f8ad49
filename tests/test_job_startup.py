"""What a batch job does before its first batch: the driver imports no engine (torch)."""

from __future__ import annotations

import subprocess
import sys


def test_the_driver_imports_no_engine():
    """The command line and the job's driver (everything up to sending token ids to the
    workers) load without torch, Triton, gguf or transformers."""
    code = ("import sys, nanoserve_cli, ray_jobs.driver, ray_jobs.cli, ray_jobs.report\n"
            "from nanoserve.sampling import SamplingParams\n"
            "from nanoserve.weights import validate_checkpoint\n"
            "from nanoserve.tokenizer import Tokenizer\n"
            "print(sorted(m for m in ('torch', 'triton', 'gguf', 'transformers') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
