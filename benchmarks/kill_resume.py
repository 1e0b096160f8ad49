"""A job through a SIGKILLed worker and a SIGKILLed driver, then the same command again:
every input row is in the output exactly once.

The script writes plain JSONL prompts (one `{"prompt": ...}` a line, no id column: a
row's id is its position) and runs the real command in its own session with a private
local Ray of W CPU workers:

    nanoserve batch IN.jsonl -o OUT --model TINY --max-tokens 1 --batch-size B \\
        --num-workers W --address local --no-progress

1. When a quarter of the shards' parts are written, one worker's process (a process of
   the driver's session named `ray::RayBatchWorker...`) is SIGKILLed; the job replaces it
   and runs its shards again. The other workers are stopped (SIGSTOP) until the driver
   says it replaced the dead one, so a fast job cannot end before the driver's kill.
2. When half of them are written, the driver's whole session (the driver and the local
   Ray it started, workers included) is SIGKILLed.
3. The same command runs again: it adopts the parts already written and computes the
   rest.

Checks, each a failure of the script if it does not hold: the rerun exits 0 and the
folder is complete (`_SUCCESS`); the `id` column of every part, read back, is 0..N-1 with
no id missing and none twice; no part written before the driver's kill was written again
(same mtime); the first run said it replaced the killed worker (the driver's session is
killed only after that line, and after more parts are written: the job went on). The model is a tiny random Llama (hidden 64, 2 layers) with the default
model's tokenizer, at one output token.

    python -m benchmarks.kill_resume --rows 1000000 --workers 4      # the 1M run
    python -m benchmarks.kill_resume --smoke                          # 2,000 rows
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, git_commit, load_average, markdown_table
from benchmarks.driver_ceiling import write_prompts

SMOKE_ROWS = 2000
WORKER_TITLE = "ray::RayBatchWorker"
LIMIT_S = 6 * 3600
REPLACED = "; replacing it"  # the driver's line for a worker that died (ray_jobs.dispatch.driver)


@dataclass
class KillResume:
    """What one run through both kills measured."""

    rows: int
    shards: int
    parts_at_worker_kill: int
    parts_at_driver_kill: int
    first_wall_s: float
    rerun_wall_s: float
    ids_read: int  # output rows read back
    missing: int  # ids of 0..rows-1 not in the output
    repeated: int  # output rows beyond the first of their id
    rewritten: int  # parts of the first run written again by the rerun
    replaced: bool  # the first run said it replaced the killed worker
    rerun_log: str


def session_processes(sid: int) -> dict[int, str]:
    """{pid: command line} of the live processes whose session is `sid`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(
                b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
    return found


def parts(out: Path) -> dict[str, int]:
    """{part file name: mtime_ns} of the parts written so far."""
    found = {}
    for p in out.glob("part-*.parquet"):
        try:
            found[p.name] = p.stat().st_mtime_ns
        except FileNotFoundError:  # replaced under us
            continue
    return found


def wait_for_parts(out: Path, n: int, proc: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + LIMIT_S
    while (count := len(parts(out))) < n:
        if proc.poll() is not None:
            raise SystemExit(f"the job ended before {n} parts were written:\n"
                             f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"fewer than {n} parts after {LIMIT_S} s")
        time.sleep(0.05)
    return count


def wait_for_line(log: Path, text: str, proc: subprocess.Popen) -> bool:
    """Wait until the job's log holds `text`; False if the job ends or a minute passes."""
    deadline = time.monotonic() + 60
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_a_worker(sid: int) -> int:
    """SIGKILL one job worker of the session; its pid."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = [pid for pid, cmd in session_processes(sid).items()
                   if cmd.startswith(WORKER_TITLE)]
        if workers:
            os.kill(min(workers), signal.SIGKILL)
            return min(workers)
        time.sleep(0.1)
    raise SystemExit(f"no process named {WORKER_TITLE} in the driver's session")


def pause_workers(sid: int) -> list[int]:
    """SIGSTOP the session's job workers (the live ones: the killed worker's replacement,
    started later, runs); their pids. While they are stopped no part is written, so the
    job cannot finish while the driver notices the killed worker and replaces it."""
    paused = [pid for pid, cmd in session_processes(sid).items()
              if cmd.startswith(WORKER_TITLE)]
    for pid in paused:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    return paused


def resume_workers(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while session_processes(sid):
        if time.monotonic() > deadline:
            raise SystemExit(f"processes outlived the driver's kill: {session_processes(sid)}")
        time.sleep(0.2)


def count_ids(out: Path, rows: int) -> tuple[int, int, int]:
    """(ids read, ids of 0..rows-1 missing, rows beyond the first of their id)."""
    import numpy as np
    import pyarrow.dataset as ds

    ids = ds.dataset(out, format="parquet").to_table(columns=["id"]).column("id")
    values = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64)
    seen = np.bincount(values[(values >= 0) & (values < rows)], minlength=rows)
    return len(values), int((seen == 0).sum()), int(len(values) - (seen > 0).sum())


def run(rows: int, workers: int, batch_size: int, model: str, work: Path) -> KillResume:
    """Write the input, run the job through both kills and the rerun, read it back."""
    path, out = work / "in.jsonl", work / "out"
    write_prompts(path, rows)
    shards = -(-rows // batch_size)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ns-kr-"))  # short: Ray's socket paths
    env = {**os.environ, "TMPDIR": str(ray_tmp), "PYTHONPATH": str(ROOT),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "nanoserve_cli", "batch", str(path), "-o", str(out),
               "--model", model, "--max-tokens", "1", "--batch-size", str(batch_size),
               "--num-workers", str(workers), "--address", "local", "--no-progress"]
    log = work / "first.log"
    try:
        t0 = time.perf_counter()
        with open(log, "w") as f:
            first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            try:
                at_worker = wait_for_parts(out, max(1, shards // 4), first, log)
                kill_a_worker(first.pid)
                paused = pause_workers(first.pid)
                try:
                    replaced = wait_for_line(log, REPLACED, first)
                finally:
                    resume_workers(paused)
                at_driver = wait_for_parts(out, max(at_worker + 1, shards // 2), first, log)
            finally:
                kill_session(first.pid)
                first.wait()
        first_wall = time.perf_counter() - t0
        before = parts(out)
        if (out / "_SUCCESS").exists():
            raise SystemExit("the job finished before the driver's kill: use more rows")
        t0 = time.perf_counter()
        again = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=LIMIT_S)
        rerun_wall = time.perf_counter() - t0
        if again.returncode != 0 or not (out / "_SUCCESS").exists():
            raise SystemExit(f"the rerun failed (exit {again.returncode}):\n"
                             f"{again.stdout[-3000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    after = parts(out)
    rewritten = sum(after.get(name) != mtime for name, mtime in before.items())
    read, missing, repeated = count_ids(out, rows)
    return KillResume(rows, shards, at_worker, at_driver, first_wall, rerun_wall, read,
                      missing, repeated, rewritten, replaced, again.stdout)


def table(r: KillResume) -> str:
    return markdown_table(
        ["input rows", "shards", "parts at the worker's kill", "parts at the driver's kill",
         "first run until killed (s)", "rerun (s)", "output rows", "ids missing",
         "ids twice", "parts rewritten", "worker replaced"],
        [[f"{r.rows:,}", f"{r.shards:,}", f"{r.parts_at_worker_kill:,}",
          f"{r.parts_at_driver_kill:,}", f"{r.first_wall_s:.0f}", f"{r.rerun_wall_s:.0f}",
          f"{r.ids_read:,}", str(r.missing), str(r.repeated), str(r.rewritten),
          "yes" if r.replaced else "no"]])


def main(argv: list[str] | None = None) -> KillResume:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=8192, help="rows a shard")
    p.add_argument("--workers", type=int, default=4, help="CPU workers of the local Ray")
    p.add_argument("--model", default=None, help="default: a tiny random Llama in a temp folder")
    p.add_argument("--keep", type=Path, default=None,
                   help="work in this folder and keep it (the input and the output)")
    p.add_argument("--smoke", action="store_true",
                   help=f"{SMOKE_ROWS:,} rows in shards of 50 on 4 workers")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.batch_size = SMOKE_ROWS, 50
    if args.rows // args.batch_size < 4:
        p.error("give at least 4 shards' rows: the kills land at a quarter and a half of them")

    from nanoserve.testing import save_tiny_llama
    from nanoserve.weights.model_store import DEFAULT_MODEL, resolve_model

    work = args.keep or Path(tempfile.mkdtemp(prefix="ns-kill-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = args.model or str(save_tiny_llama(work / "tiny", resolve_model(DEFAULT_MODEL)))
        result = run(args.rows, args.workers, args.batch_size, model, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"commit: {git_commit()}; {os.cpu_count()}-core {platform.machine()} CPU; "
          f"load average at the end: {load_average()}")
    print(f"nanoserve batch ... --max-tokens 1 --batch-size {args.batch_size} "
          f"--num-workers {args.workers} --address local (private local Ray); a worker "
          f"SIGKILLed at a quarter of the parts, the driver's session at a half, then rerun")
    print(table(result))
    if result.missing or result.repeated or result.rewritten or not result.replaced:
        raise SystemExit("FAILED: rows lost or written twice, parts rewritten, or the killed "
                         "worker not replaced")
    return result


if __name__ == "__main__":
    main()
