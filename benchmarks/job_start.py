"""Job starts on a busy machine: `--jobs` batch jobs in a row, each in a fresh process as a user
runs it, while `--load` busy processes (a pure-Python loop each) hold the CPU.

Each job is `python -m nanoserve_cli batch INPUT -o OUT --overwrite --max-tokens M
--no-progress --address local` on the default model: the driver starts (and stops) its own
private local Ray, one CPU worker loads the model, and `--rows` rows of
`examples/prompts.jsonl` are answered. The table gives, per job: its exit status, the phases
of its `time:` line (prepare, Ray's start, the workers' load, generation), the command's
wall, whether Ray's start was tried twice (the `trying once more` note), the 1-minute load
average when it started, and the error line of a job that failed. Then the count of jobs
that finished and the spread of Ray's start.

    python -m benchmarks.job_start --jobs 20 --load 4
    python -m benchmarks.job_start --jobs 5 --tree ../wt-before   # another checkout's code

The load processes are this script's children, stopped at its end (also on Ctrl-C). The
other work on the machine (another user's test suite) is not controlled: the load average
column says what the jobs met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import ROOT, cpu_model_name, git_commit, load_average, markdown_table

PHASE_NAMES = {"prepare": "prepare", "Ray": "ray", "workers": "workers",
               "first shard": "first_shard", "generate": "generate", "shutdown": "shutdown",
               "first batch": "first_shard"}  # (the first shard's phase, as older trees say it)


@contextlib.contextmanager
def busy_load(processes: int) -> Iterator[list[int]]:
    """`processes` busy Python loops (each wants a whole core) for the life of the block;
    yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(processes)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def phases(stdout: str) -> dict[str, float]:
    """The job's phases in seconds, from its summary's `time:` line."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("time: ")), "")
    return {PHASE_NAMES[name]: float(secs) for name, secs in
            re.findall(r"([A-Za-z][A-Za-z ]*?) (\d+\.\d+) s", line.removeprefix("time: "))
            if name in PHASE_NAMES}


def write_rows(path: Path, rows: int) -> Path:
    lines = (ROOT / "examples" / "prompts.jsonl").read_text().splitlines()[:rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_job(tree: Path, input_path: Path, out: Path, max_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "nanoserve_cli", "batch", str(input_path), "-o",
                        str(out), "--overwrite", "--max-tokens", str(max_tokens),
                        "--no-progress", "--address", "local"],
                       capture_output=True, text=True, cwd=tree, env=env)
    wall = time.perf_counter() - t
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    return {"rc": p.returncode, "wall_s": wall, "load1": load, **phases(p.stdout),
            "retried": "trying once more" in p.stderr,
            "traceback": "Traceback" in p.stderr,
            "error": errors[-1] if errors else (p.stderr.strip().splitlines() or [""])[-1]
            if p.returncode else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--load", type=int, default=4, help="busy processes (default: 4)")
    ap.add_argument("--rows", type=int, default=8, help="rows of examples/prompts.jsonl")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="the checkout whose code runs the jobs (default: this one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the runs here")
    args = ap.parse_args()

    tree = args.tree.resolve()
    print(f"commit: {git_commit(tree)} ({tree}); machine: {os.cpu_count()}-core "
          f"{cpu_model_name()}; python {sys.version.split()[0]}; "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')}")
    print(f"load average before the load (1/5/15 min): {load_average()}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="ns-job-start-") as tmp, busy_load(args.load):
        input_path = write_rows(Path(tmp) / "in.jsonl", args.rows)
        time.sleep(5)  # the load is running before the first job starts
        for i in range(args.jobs):
            r = run_job(tree, input_path, Path(tmp) / "out", args.max_tokens)
            runs.append({"job": i + 1, **r})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        print(f"load average at the end, load still running (1/5/15 min): {load_average()}")

    def cell(r: dict, key: str) -> str:
        return f"{r[key]:.1f}" if key in r else "-"

    print()
    print(markdown_table(
        ["job", "exit", "prepare (s)", "Ray (s)", "workers (s)", "generation (s)", "wall (s)",
         "Ray tried twice", "load (1 min)", "error"],
        [[r["job"], r["rc"], cell(r, "prepare"), cell(r, "ray"), cell(r, "workers"),
          f"{r.get('first_shard', 0) + r.get('generate', 0):.1f}" if "generate" in r else "-",
          f"{r['wall_s']:.1f}", "yes" if r["retried"] else "", f"{r['load1']:.1f}",
          r["error"][:100]] for r in runs]))
    done = [r for r in runs if r["rc"] == 0]
    ray_s = [r["ray"] for r in done if "ray" in r]
    print()
    print(f"finished: {len(done)}/{len(runs)}; Ray's start tried twice in "
          f"{sum(r['retried'] for r in runs)}; tracebacks: {sum(r['traceback'] for r in runs)}")
    if ray_s:
        print(f"Ray's start (s): median {statistics.median(ray_s):.1f}, min {min(ray_s):.1f}, "
              f"max {max(ray_s):.1f}; job wall median "
              f"{statistics.median(r['wall_s'] for r in done):.1f} s; load average (1 min) "
              f"at the jobs' starts {min(r['load1'] for r in runs):.1f}-"
              f"{max(r['load1'] for r in runs):.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
