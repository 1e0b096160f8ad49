"""`ray job submit` against a real Ray head started here: the way the job runs on a cluster.

The head is started with `ray start --head --block` in its own process group, on 127.0.0.1
only (single-machine mode) with its dashboard (job submission goes through it), a private
temp dir, and token authentication off. It is stopped through that process and its group
only (never `ray stop`, which would stop every Ray on the machine), also when the test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from ray_jobs.output.manifest import SUCCESS_NAME

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
STARTUP_LIMIT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_dashboard(url: str, head: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with status {head.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the Ray dashboard at {url} did not come up in {STARTUP_LIMIT_S} s")


@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.1 with a dashboard; yields (dashboard url, env for clients)."""
    temp_dir = tempfile.mkdtemp(prefix="ns-head-")  # short: socket paths stay < 108 chars
    # Single-machine mode keeps every Ray process on 127.0.0.1 (see start_local_ray).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    dash_port = free_port()
    log = open(Path(temp_dir) / "head.log", "w")
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={free_port()}", f"--temp-dir={temp_dir}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash_port}", "--disable-usage-stats",
         # Ports with fixed defaults (the job agent's 52365, the client server's 10001, ...)
         # may be held by another Ray on this machine, e.g. the tests' session Ray.
         f"--dashboard-agent-listen-port={free_port()}",
         f"--dashboard-agent-grpc-port={free_port()}",
         f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
         f"--ray-client-server-port={free_port()}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{dash_port}"
        wait_for_dashboard(url, head)
        yield url, env
    finally:
        _stop_group(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_group(head: subprocess.Popen) -> None:
    """SIGTERM to the `ray start --block` process (it stops the Ray processes it started),
    then SIGKILL to whatever is left of its process group."""
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(timeout=30)


def submit_job(url: str, env: dict, entrypoint: list[str]) -> subprocess.CompletedProcess:
    """`ray job submit`, waiting for the job to end. Right after startup the head may have
    no job agent yet ('No available agent'): no job was created then, so submit again."""
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while True:
        proc = subprocess.run(
            [str(RAY), "job", "submit", "--address", url, "--working-dir", str(REPO), "--",
             *entrypoint],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=540,
        )
        if "No available agent" not in proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(2)


def test_ray_job_submit_runs_the_batch_command(ray_head, tmp_path, smollm2_gguf_path):
    url, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": "x", "prompt": "The sun rises in the"},
            {"id": "y", "messages": [{"role": "user", "content": "Say hello."}]},
            {"id": "z", "prompt": ""}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    submit = submit_job(url, env, [sys.executable, "-m", "nanoserve_cli", "batch", str(prompts),
                                   "-o", str(out), "--max-tokens", "4", "--no-progress"])
    logs = submit.stdout[-4000:] + submit.stderr[-4000:]
    assert submit.returncode == 0, logs
    assert "succeeded" in submit.stdout, logs
    assert re.search(r"^rows: 3 \(stop \d+, length \d+, error 1\)$", submit.stdout, re.M), logs
    table = ds.dataset(out).to_table()
    assert sorted(table["id"].to_pylist()) == ["x", "y", "z"]
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert by_id["z"]["finish_reason"] == "error"
    assert 1 <= by_id["x"]["num_generated_tokens"] <= 4
    assert (out / SUCCESS_NAME).exists()
