"""The CPU engine's threads, set up the same way in every entry point (`nanoserve.cpu_threads`):
OpenMP threads that sleep between operations (OMP_WAIT_POLICY=PASSIVE, set when nanoserve is
imported, before torch), and torch's intra-op threads: the available cores, or a worker's
share. Each check runs in a fresh interpreter: the policy is read once, when torch loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ENTRY_POINTS = """
import json, os, sys
import nanoserve  # before torch, as every entry point imports it
policy = os.environ.get("OMP_WAIT_POLICY")
import torch
from nanoserve.cpu_threads import available_cores
from nanoserve.llm import LLM
from ray_jobs.workers.worker import BatchWorker
model = sys.argv[1]
seen = {"policy": policy, "cores": available_cores()}
LLM(model, device="cpu", kv_cache_bytes=8 << 20)
seen["llm"] = torch.get_num_threads()
torch.set_num_threads(1)
LLM(model, device="cpu", kv_cache_bytes=8 << 20)
seen["llm_after_other_setting"] = torch.get_num_threads()
BatchWorker(model, device="cpu", kv_cache_bytes=8 << 20, num_threads=1)
seen["worker_share_1"] = torch.get_num_threads()
BatchWorker(model, device="cpu", kv_cache_bytes=8 << 20, num_threads=64)
seen["worker_share_64"] = torch.get_num_threads()
print("SEEN=" + json.dumps(seen))
"""


def run_python(code: str, *args: str, env_extra: dict | None = None,
               drop=("OMP_WAIT_POLICY", "OMP_NUM_THREADS")) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"PYTHONPATH": str(REPO), **(env_extra or {})})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_every_entry_point_sets_the_same_threads(tiny_job_model):
    """From an environment without OMP_WAIT_POLICY: importing nanoserve sets PASSIVE before
    torch loads; `LLM` on the CPU uses the available cores whatever torch was set to before,
    and a job's worker its share of them (capped to the cores)."""
    out = run_python(ENTRY_POINTS, str(tiny_job_model))
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(next(ln for ln in out.stdout.splitlines()
                           if ln.startswith("SEEN=")).removeprefix("SEEN="))
    cores = seen["cores"]
    assert seen == {"policy": "PASSIVE", "cores": cores, "llm": cores,
                    "llm_after_other_setting": cores, "worker_share_1": 1,
                    "worker_share_64": cores}
    assert "spin" not in out.stderr


def test_a_users_policy_is_kept_and_torch_first_is_said_once(tiny_job_model):
    """A policy the user set is kept. When torch was imported before nanoserve with no
    policy, this process's threads spin and nothing can change it: the first CPU engine says
    so once on stderr (and the variable still goes to the processes it starts)."""
    code = ("import os, sys\nimport nanoserve\nprint('POLICY', os.environ['OMP_WAIT_POLICY'])\n")
    out = run_python(code, env_extra={"OMP_WAIT_POLICY": "ACTIVE"})
    assert out.returncode == 0 and "POLICY ACTIVE" in out.stdout, out.stderr[-2000:]

    code = ("import os, sys, torch\nfrom nanoserve.llm import LLM\n"
            "LLM(sys.argv[1], device='cpu', kv_cache_bytes=8 << 20)\n"
            "LLM(sys.argv[1], device='cpu', kv_cache_bytes=8 << 20)\n"
            "print('POLICY', os.environ['OMP_WAIT_POLICY'], torch.get_num_threads())\n")
    out = run_python(code, str(tiny_job_model))
    assert out.returncode == 0, out.stderr[-2000:]
    policy, threads = out.stdout.split()[1:3]
    assert policy == "PASSIVE"
    lines = [ln for ln in out.stderr.splitlines() if "spin" in ln]
    expected = ["nanoserve: torch was imported before nanoserve with OMP_WAIT_POLICY unset, "
                "so its CPU threads spin between operations, which is several times slower "
                "on a busy machine: import nanoserve first, or set OMP_WAIT_POLICY=PASSIVE in "
                "the environment"]
    assert lines == ([] if threads == "1" else expected), out.stderr[-2000:]  # 1: no team


def test_generate_says_its_rate_and_threads(tiny_job_model):
    """`nanoserve generate` ends with one line on stderr: tokens, the generation's time and
    rate, the device and its threads (the available cores), and the load's time."""
    code = "import sys\nfrom nanoserve_cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = run_python(code, "generate", "--model", str(tiny_job_model), "--device", "cpu",
                     "--max-tokens", "5", "one two", "three")
    assert out.returncode == 0, out.stderr[-2000:]
    cores = run_python("from nanoserve.cpu_threads import available_cores as a; print(a())")
    last = out.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"nanoserve: (\d+) tokens for 2 prompt\(s\) in \d+\.\d s "
                     r"\(\d+\.\d tokens/s; cpu with (\d+) thread\(s\)\); model loaded in "
                     r"\d+\.\d s", last)
    assert m, last
    printed = [int(n) for n in re.findall(r"^--- (\d+) tokens", out.stdout, re.M)]
    assert len(printed) == 2 and int(m.group(1)) == sum(printed)
    assert int(m.group(2)) == int(cores.stdout)
