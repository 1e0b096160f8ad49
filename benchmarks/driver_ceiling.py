"""The driver's ceiling: its CPU seconds per million rows and its peak memory, with an
engine that answers at once, so the job's cost is the driver's own work.

For each size (1M and 10M rows by default) the script writes plain JSONL prompts (one
`{"prompt": ...}` a line, no id column: ids are positions) and runs the real command in
a child process, which is the driver:

    nanoserve batch IN.jsonl -o OUT --model TINY --max-tokens 1 --batch-size B \\
        --num-workers W --address local --no-progress

with a private local Ray of W CPU workers. When the job ends the child prints its own CPU
time (utime + stime of the driver process, `getrusage(RUSAGE_SELF)`: Ray's processes and
the workers are other processes) and its peak resident set (`VmHWM`, see `benchmarks.common.own_peak_kib`). The model is a
tiny random Llama (hidden 64, 2 layers) with the default model's tokenizer, at one output
token: the "engine that answers instantly" of the question asked.

    python -m benchmarks.driver_ceiling                       # 1M and 10M rows
    python -m benchmarks.driver_ceiling --rows 100000 1000000
    python -m benchmarks.driver_ceiling --smoke               # 2,000 rows: the script works
    python -m benchmarks.driver_ceiling --ids --scan-only     # the scan alone, ids checked

The table gives per size: wall time, rows/s, driver CPU s, driver CPU s per million rows,
driver peak RSS; and the peak of the largest size over the smallest's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, git_commit, load_average, markdown_table, own_peak_kib

CHILD_FLAG = "--as-driver"
SCAN_FLAG = "--scan-only"
RESULT_PREFIX = "DRIVER_RESULT="
WORDS = ("apple", "river", "stone", "cloud", "lantern", "violin", "harbor", "meadow")
SMOKE_ROWS = 2000


def write_prompts(path: Path, rows: int, ids: bool = False) -> None:
    """`rows` plain prompts of 5 to 20 words, one JSON object a line; `ids`: with a string
    `id` column (`"r-<i>"`)."""
    with open(path, "w") as f:
        for i in range(rows):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(5 + i % 16))
            row = {"id": f"r-{i}"} if ids else {}
            f.write(json.dumps({**row, "prompt": f"Row {i}: {words}"}) + "\n")


def as_driver(argv: list[str]) -> int:
    """The child: the `nanoserve` command itself (or, after `SCAN_FLAG`, only the driver's
    scan of the input: `ray_jobs.input.io.scan_input`, the ids' check included), then this
    process's CPU and peak RSS."""
    if argv[0] == SCAN_FLAG:
        from ray_jobs.input.io import scan_input

        scan_input(argv[1], shard_rows=int(argv[2]))
        rc = 0
    else:
        from nanoserve_cli import main

        rc = main(argv)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(RESULT_PREFIX + json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime,
                                      "peak_kib": own_peak_kib()}), flush=True)
    return rc


def run_driver(input_path: Path, out: Path, model: str, batch_size: int,
               workers: int, scan_only: bool = False) -> dict:
    command = [sys.executable, "-m", "benchmarks.driver_ceiling", CHILD_FLAG, "batch",
               str(input_path), "-o", str(out), "--model", model, "--max-tokens", "1",
               "--batch-size", str(batch_size), "--num-workers", str(workers),
               "--address", "local", "--no-progress"]
    if scan_only:
        command[4:] = [SCAN_FLAG, str(input_path), str(batch_size)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"the job failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_PREFIX))
    return {**json.loads(line[len(RESULT_PREFIX):]), "wall_s": wall}


def table(results: dict[int, dict]) -> str:
    rows = [[f"{n:,}", f"{r['wall_s']:.0f}", f"{n / r['wall_s']:,.0f}", f"{r['cpu_s']:.1f}",
             f"{r['cpu_s'] / n * 1e6:.1f}", f"{r['peak_kib'] / 1024:.0f}"]
            for n, r in sorted(results.items())]
    return markdown_table(["input rows", "wall (s)", "rows/s", "driver CPU (s)",
                           "driver CPU s / 1M rows", "driver peak RSS (MiB)"], rows)


def main(argv: list[str] | None = None) -> dict[int, dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == CHILD_FLAG:
        sys.exit(as_driver(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--batch-size", type=int, default=8192, help="rows a shard")
    p.add_argument("--workers", type=int, default=2, help="CPU workers of the local Ray")
    p.add_argument("--model", default=None, help="default: a tiny random Llama in a temp folder")
    p.add_argument("--ids", action="store_true", help="the input has a string id column")
    p.add_argument("--scan-only", action="store_true",
                   help="the driver's scan of the input alone (ids checked), no job")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS:,} rows, one worker")
    args = p.parse_args(argv)
    if args.smoke:
        args.rows, args.workers, args.batch_size = [SMOKE_ROWS], 1, 1000

    from nanoserve.testing import save_tiny_llama
    from nanoserve.weights.model_store import DEFAULT_MODEL, resolve_model

    work = Path(tempfile.mkdtemp(prefix="ns-ceiling-"))
    results: dict[int, dict] = {}
    try:
        model = args.model or str(save_tiny_llama(work / "tiny", resolve_model(DEFAULT_MODEL)))
        for n in sorted(set(args.rows)):
            path = work / "in.jsonl"
            write_prompts(path, n, args.ids)
            results[n] = run_driver(path, work / "out", model, args.batch_size, args.workers,
                                    args.scan_only)
            path.unlink()
            shutil.rmtree(work / "out", ignore_errors=True)
            print(f"{n:,} rows: {results[n]['cpu_s']:.1f} driver CPU s, "
                  f"{results[n]['peak_kib'] / 1024:.0f} MiB peak, {results[n]['wall_s']:.0f} s",
                  file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"commit: {git_commit()}; {os.cpu_count()}-core {platform.machine()} CPU; "
          f"load average at the end: {load_average()}")
    if args.scan_only:
        print(f"the driver's scan alone (ray_jobs.input.io.scan_input, shards of {args.batch_size} "
              f"rows){', ids checked' if args.ids else ''}")
    else:
        print(f"nanoserve batch ... --max-tokens 1 --batch-size {args.batch_size} "
              f"--num-workers {args.workers} --address local (private local Ray)"
              f"{'; a string id column' if args.ids else ''}")
    print(table(results))
    if len(results) > 1:
        low, high = min(results), max(results)
        print(f"driver peak RSS {high:,} rows / {low:,} rows: "
              f"{results[high]['peak_kib'] / results[low]['peak_kib']:.2f}")
    return results


if __name__ == "__main__":
    main()
