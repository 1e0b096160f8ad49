"""benchmarks/admission.py on the CPU (--smoke): every policy of the sweep runs, each row
gives exactly its max_tokens tokens, and those tokens are the ones the row gets run alone
under every policy (the benchmark's own check in --smoke, which this test asserts ran); the
table has a row per workload and policy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_prints_a_row_per_workload_and_policy(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.admission", "--smoke", "--repeats",
                           "1", "--workloads", "shared,many", "--policies", "32/32/0,2/2/0",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens: under every policy each row equals itself run alone (48 rows)" in proc.stdout
    for workload in ("shared", "many"):
        for policy in ("32/32/0", "2/2/0"):
            assert f"| {workload} | {policy} | " in proc.stdout, proc.stdout
    from nanoserve.scheduling import scheduler
    default = (scheduler.ADMIT_SHARE, scheduler.ADMIT_FULL_SHARE, scheduler.ADMIT_WAIT_STEPS)
    assert f"default policy {'/'.join(map(str, default))}" in proc.stdout
