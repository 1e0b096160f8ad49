"""ray_jobs.dispatch.local_ray: the private Ray's temp folders, and which leftovers are removed;
what it starts, and a start that fails on a busy machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from ray_jobs.dispatch.local_ray import (
    FAULT_AGENT_WAIT,
    OWNER_FILE,
    START_ATTEMPTS_ENV,
    TEMP_PREFIX,
    _owner_line,
    remove_stale_temp_dirs,
)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def make_folder(parent, name, owner: str | None):
    folder = parent / (TEMP_PREFIX + name)
    (folder / "session_latest" / "logs").mkdir(parents=True)
    (folder / "session_latest" / "logs" / "raylet.out").write_text("log")
    if owner is not None:
        (folder / OWNER_FILE).write_text(owner)
    return folder


def test_only_folders_of_gone_owners_are_removed(tmp_path):
    me = os.getpid()
    dead = make_folder(tmp_path, "dead", f"{dead_pid()}")
    reused = make_folder(tmp_path, "reused", f"{me} 1")  # my pid, another process's start time
    mine = make_folder(tmp_path, "mine", _owner_line(me))
    mine_no_start_time = make_folder(tmp_path, "mine2", f"{me}")
    unowned = make_folder(tmp_path, "unowned", None)  # not ours to judge
    garbled = make_folder(tmp_path, "garbled", "not a pid")
    other = tmp_path / "ns-t-other"  # another prefix: never looked at
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{dead_pid()}")

    removed = remove_stale_temp_dirs(str(tmp_path))

    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    for kept in (mine, mine_no_start_time, unowned, garbled, other):
        assert kept.exists(), kept


def test_owner_line_names_this_process():
    pid_text, _, started = _owner_line(os.getpid()).partition(" ")
    assert int(pid_text) == os.getpid()
    if sys.platform == "linux":  # /proc gives the start time; elsewhere the pid alone
        assert started == open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]


def test_private_ray_workers_sleep_between_parallel_regions(tmp_path):
    """A task in a private Ray started from an environment without OMP_WAIT_POLICY sees
    PASSIVE (OpenMP threads that sleep rather than spin: they share the machine's cores with
    the driver and Ray); a value the user set is kept."""
    script = (
        "import os, ray\n"
        "from ray_jobs.dispatch.local_ray import start_local_ray, stop_local_ray\n"
        "d = start_local_ray(num_cpus=1)\n"
        "f = ray.remote(lambda: os.environ.get('OMP_WAIT_POLICY'))\n"
        "print('POLICY', ray.get(f.remote()))\n"
        "stop_local_ray(d)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True,
                             text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"POLICY {expected}" in out.stdout.splitlines(), out.stdout


# Put on PYTHONPATH, this makes Ray's dashboard agent start late: it sleeps before it starts
# (every time, or only the first time while the marker file exists), longer than the 15 s
# that Ray 2.60's raylet waits for it: what a busy machine does to it, made certain.
SLOW_AGENT_SITECUSTOMIZE = """
import os, sys, time
if sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    marker = os.environ.get("NS_TEST_SLOW_AGENT_ONCE")
    if marker is None or os.path.exists(marker):
        if marker is not None:
            os.remove(marker)
        time.sleep(float(os.environ["NS_TEST_SLOW_AGENT_S"]))
"""
AGENT_TIMEOUT = "Ray's dashboard agent did not start within the raylet's time limit"


def slow_agent_env(tmp_path, once: bool, raylet_waits: bool) -> dict[str, str]:
    """The environment of a process whose private Ray has a late dashboard agent;
    `raylet_waits`: started as Ray alone starts (`FAULT_AGENT_WAIT`), the raylet waiting for
    the agent's port files, so the start fails."""
    site = tmp_path / "slow-agent"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_AGENT_SITECUSTOMIZE)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", START_ATTEMPTS_ENV, FAULT_AGENT_WAIT)}
    env.update(PYTHONPATH=os.pathsep.join([str(site), repo]), NS_TEST_SLOW_AGENT_S="20")
    if raylet_waits:
        env[FAULT_AGENT_WAIT] = "1"
    if once:
        marker = tmp_path / "slow-once"
        marker.write_text("")
        env["NS_TEST_SLOW_AGENT_ONCE"] = str(marker)
    return env


PROCS_AND_TASK = (
    "import json, time, ray, psutil\n"
    "from ray_jobs.dispatch.local_ray import start_local_ray, stop_local_ray\n"
    "t = time.perf_counter()\n"
    "d = start_local_ray(num_cpus=1)\n"
    "print('START_S', time.perf_counter() - t)\n"
    "procs = [' '.join(p.cmdline()) for p in psutil.Process().children(recursive=True)]\n"
    "print('PROCS=' + json.dumps(procs))\n"
    "print('TASK', ray.get(ray.remote(lambda: 7).remote()))\n"
    "stop_local_ray(d)\n"
)


def test_a_late_agent_does_not_hold_up_or_fail_the_start(tmp_path):
    """Ray's dashboard agent starts later than the raylet's 15 s limit (it sleeps 20 s): the
    start does not wait for it and does not fail, and tasks run. The private Ray runs only
    what a job needs: no autoscaler monitor, no worker before a task asks for one."""
    env = slow_agent_env(tmp_path, once=False, raylet_waits=False)
    out = subprocess.run([sys.executable, "-c", PROCS_AND_TASK], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TASK 7" in out.stdout.splitlines()
    assert "trying once more" not in out.stderr
    start_s = float(next(ln for ln in out.stdout.splitlines()
                         if ln.startswith("START_S")).split()[1])
    assert start_s < 20, start_s  # the agent was still asleep when the start returned
    procs = json.loads(next(ln for ln in out.stdout.splitlines()
                            if ln.startswith("PROCS=")).removeprefix("PROCS="))
    assert any("dashboard/agent.py" in p or "DashboardAgent" in p for p in procs), procs
    assert any("raylet" in p for p in procs), procs
    assert not [p for p in procs if "monitor.py" in p and "log_monitor" not in p], procs
    workers = [p for p in procs if "ray::IDLE" in p
               or ("default_worker.py" in p and "--raylet_socket_name" not in p)]  # not the raylet
    assert workers == [], procs


@pytest.mark.slow  # a start that fails takes Ray's 30 s wait for the raylet
def test_a_start_that_times_out_is_tried_again_with_a_note(tmp_path):
    """Started as Ray alone starts (the raylet waits for its agents), the dashboard agent
    misses the raylet's limit once: that start is stopped, said in one line, and tried
    again, and the second start serves tasks."""
    env = slow_agent_env(tmp_path, once=True, raylet_waits=True)
    out = subprocess.run([sys.executable, "-c", PROCS_AND_TASK], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TASK 7" in out.stdout.splitlines()
    notes = [ln for ln in out.stderr.splitlines() if ln.startswith("nanoserve:")]
    assert len(notes) == 1, out.stderr[-3000:]
    assert notes[0].startswith(f"nanoserve: Ray's local start failed ({AGENT_TIMEOUT}")
    assert notes[0].endswith("); trying once more")
    assert not os.path.exists(env["NS_TEST_SLOW_AGENT_ONCE"])  # the first agent was the slow one


@pytest.mark.slow
def test_a_start_that_keeps_failing_is_one_error_line(tmp_path, tiny_job_model):
    """When every start fails (started as Ray alone starts, the agent always late; here one
    attempt: NANOSERVE_RAY_START_ATTEMPTS=1), the job
    exits 2 with one `error:` line naming what timed out, where Ray's logs are and what to
    try; no traceback, nothing written, nothing of that Ray left running."""
    import psutil

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello"}\n')
    env = {**slow_agent_env(tmp_path, once=False, raylet_waits=True), START_ATTEMPTS_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-m", "nanoserve_cli", "batch", str(inp), "-o", str(tmp_path / "out"),
         "--model", str(tiny_job_model), "--address", "local", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and out.stderr.strip().splitlines()[-1] == errors[0], out.stderr
    m = re.fullmatch(
        rf"error: could not start a local Ray \({re.escape(AGENT_TIMEOUT)}(; the machine is "
        r"busy: load average [\d.]+ on \d+ CPU\(s\))?; 1 attempt\(s\), logs in (\S+)\): run "
        r"the job again when the machine is less busy, or start Ray once with `ray start "
        r"--head` \(jobs on this machine join a running Ray instead of starting their own\)"
        r"(; Ray's modules have no bytecode here, so each of its processes compiles them as it "
        r"starts: `\S+ -m compileall -q \S+/ray` once makes its start lighter)?", errors[0])
    assert m, errors[0]
    logs = m.group(2)
    assert os.path.isfile(os.path.join(logs, "raylet.out"))
    assert not list((tmp_path / "out").glob("part-*"))
    temp_dir = logs.split("/session_latest")[0]
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if any(temp_dir in part for part in p.info["cmdline"] or ())]
    assert left == []
    shutil.rmtree(temp_dir, ignore_errors=True)
