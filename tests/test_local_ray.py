"""ray_jobs.dispatch.local_ray: the private Ray's temp folders, and which leftovers are removed."""

from __future__ import annotations

import os
import subprocess
import sys

from ray_jobs.dispatch.local_ray import OWNER_FILE, TEMP_PREFIX, _owner_line, remove_stale_temp_dirs


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
