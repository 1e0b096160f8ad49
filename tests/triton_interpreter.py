"""A test file's Triton kernels under Triton's CPU interpreter: its `test_interp_*` tests run
in a child pytest with `TRITON_INTERPRET=1` set from the start (Triton reads it when it is
imported, so the parent process cannot switch), for tests/test_kernels.py,
tests/test_fused_moe.py and tests/test_lora_kernels.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def interpreted() -> bool:
    """Whether this process runs Triton (its standard library included) in the interpreter."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    from nanoserve_kernels._triton import interpret_requested

    return interpret_requested() and type(tl.max).__name__ == "InterpretedFunction"


def run_interpreted(test_file: str) -> None:
    """Run `test_file`'s `test_interp_*` tests in a child pytest under the interpreter; they
    must all pass, none skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1", NANOSERVE_TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_",
         str(Path(test_file).resolve())],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert re.search(r"\b\d+ passed", report) and "skipped" not in report, report
