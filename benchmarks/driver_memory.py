"""The batch job's driver memory against the number of input rows: it must stay flat.

For each size (20k, 100k, 200k rows by default) the script writes a JSONL input of that many
prompts and runs the real command in a child process,

    nanoserve batch IN.jsonl -o OUT --model TINY --max-tokens 1 --batch-size 128 \\
        --address local --no-progress

with a private local Ray. The child is the driver: it runs `nanoserve_cli.main` and, when
the job ends, prints its own peak resident set (`VmHWM`, `benchmarks.common.own_peak_kib`:
the driver process only, not Ray's processes or the worker) and its own CPU seconds (user +
system, `getrusage(RUSAGE_SELF)`). While it runs, the parent samples the child's
/proc/PID/status (VmHWM, the peak so far) with the rows written so far (the manifest's
`rows_done`), which gives the driver's peak at 20k, 100k and 200k rows within the largest run.

The model is a tiny random Llama (hidden 64, 2 layers) that uses the default model's
tokenizer, saved to a temp folder, so the job's cost is the driver's own work (reading,
tokenizing, batching, writing) rather than generation; `--model NAME` runs another one.

`--formats jsonl jsonl.gz jsonl.zst` runs each size once per input format (the same rows,
compressed as a whole file: the job must stream it, never decompress it all in memory).

    python -m benchmarks.driver_memory              # 20k, 100k, 200k rows, .jsonl
    python -m benchmarks.driver_memory --rows 5000  # a quick check
    python -m benchmarks.driver_memory --formats jsonl jsonl.gz
    python -m benchmarks.driver_memory --openai --rows 10000 1000000

`--openai` writes each row as an OpenAI Batch API request line (`{"custom_id", "method",
"url": "/v1/completions", "body": {"model", "prompt", "max_tokens": 1}}`, the same prompts):
the job then also writes `output.jsonl` / `errors.jsonl` in input order.

`--code DIR ...` runs the job's code of other checkouts of the repository (e.g. a `git
worktree` of an earlier commit): each input runs once per checkout, in turn, the child
started in that checkout (its `nanoserve_cli`, `ray_jobs` and `nanoserve`, for the driver
and its Ray workers alike) while this script measures it, so two commits compare side by
side under the same load:

    python -m benchmarks.driver_memory --openai --rows 100000 --code /tmp/before .
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    ROOT,
    cpu_model_name,
    git_commit,
    load_average,
    markdown_table,
    mem_gib,
)

PEAK_PREFIX = "DRIVER_PEAK_KIB="
CPU_PREFIX = "DRIVER_CPU_S="
# The child, the driver: the `nanoserve` command itself, with the code of the checkout it
# starts in (`python -c` there), then this process's peak RSS and CPU seconds.
CHILD = f"""
import resource, sys
from benchmarks.common import own_peak_kib
from nanoserve_cli import main
rc = main(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(f"{PEAK_PREFIX}{{own_peak_kib()}}", flush=True)
print(f"{CPU_PREFIX}{{usage.ru_utime + usage.ru_stime:.2f}}", flush=True)
sys.exit(rc)
"""
WORDS = ("apple", "river", "stone", "cloud", "lantern", "violin", "harbor", "meadow")


FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst")


def write_input(path: Path, rows: int, openai: bool = False) -> None:
    """`rows` prompts of 5 to 40 words, one JSON object a line (an OpenAI batch request
    line with `openai`); compressed as a stream when `path` ends in .gz or .zst."""
    import pyarrow as pa

    codec = {".gz": "gzip", ".zst": "zstd"}.get(path.suffix)
    with (pa.CompressedOutputStream(str(path), codec) if codec else open(path, "wb")) as f:
        for i in range(rows):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(5 + i % 36))
            row = {"id": i, "prompt": f"Row {i}: {words}"}
            if openai:
                row = {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": row["prompt"], "max_tokens": 1}}
            f.write((json.dumps(row) + "\n").encode())


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a live process, in KiB ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(line.split()[1])
    except OSError:
        return {}
    return out


def rows_done(out: Path) -> int:
    try:
        return json.loads((out / "_nanoserve_manifest.json").read_text())["rows_done"]
    except (OSError, ValueError, KeyError):
        return 0


def run_driver(input_path: Path, out: Path, model: str, batch_size: int,
               marks: list[int], code: Path = ROOT) -> dict:
    """Run the job in a child driver with the code of the checkout `code`; return its peak,
    CPU seconds, wall time and the peak seen as the rows written passed each of `marks`."""
    command = [sys.executable, "-c", CHILD, "batch",
               str(input_path), "-o", str(out), "--model", model, "--max-tokens", "1",
               "--batch-size", str(batch_size), "--address", "local", "--no-progress"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(code)}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    child = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    at_mark: dict[int, int] = {}
    last_poll = 0.0
    while child.poll() is None:
        status = status_kib(child.pid)
        if status and time.perf_counter() - last_poll > 0.5:
            last_poll = time.perf_counter()
            done = rows_done(out)
            for m in marks:
                if m not in at_mark and done >= m:
                    at_mark[m] = status["VmHWM"]
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    stdout = child.stdout.read()
    if child.returncode != 0:
        raise SystemExit(f"the job failed (exit {child.returncode}):\n{stdout[-3000:]}")
    lines = stdout.splitlines()
    peak = next(int(ln[len(PEAK_PREFIX):]) for ln in lines if ln.startswith(PEAK_PREFIX))
    cpu = next(float(ln[len(CPU_PREFIX):]) for ln in lines if ln.startswith(CPU_PREFIX))
    for m in marks:  # passed between the last poll and the end: the final peak bounds it
        at_mark.setdefault(m, peak)
    return {"peak_kib": peak, "cpu_s": cpu, "wall_s": wall, "at_mark": at_mark,
            "summary": stdout}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[20_000, 100_000, 200_000])
    p.add_argument("--model", default=None, help="default: a tiny random Llama in a temp folder")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=["jsonl"],
                   help="input file formats, each run at every size (default: jsonl)")
    p.add_argument("--openai", action="store_true",
                   help="OpenAI Batch API request lines (output.jsonl and errors.jsonl too)")
    p.add_argument("--code", type=Path, nargs="+", default=[ROOT],
                   help="checkouts whose job code runs, each in turn (default: this one)")
    args = p.parse_args()
    codes = [(c.resolve(), git_commit(c.resolve())) for c in args.code]

    from nanoserve.testing import save_tiny_llama
    from nanoserve.weights.model_store import DEFAULT_MODEL, resolve_model

    work = Path(tempfile.mkdtemp(prefix="ns-mem-"))
    try:
        model = args.model or str(save_tiny_llama(work / "tiny", resolve_model(DEFAULT_MODEL)))
        largest = max(args.rows)
        marks = sorted(set(args.rows))
        results = {}
        for fmt in args.formats:
            for n in sorted(set(args.rows)):
                path = work / f"in.{fmt}"
                write_input(path, n, args.openai)
                for code, commit in codes:
                    r = results[commit, fmt, n] = run_driver(
                        path, work / f"out-{n}", model, args.batch_size,
                        marks if n == largest else [], code)
                    r["input_mib"] = path.stat().st_size / 2**20
                    if args.openai:
                        r["output_mib"] = (work / f"out-{n}" / "output.jsonl").stat().st_size \
                            / 2**20
                    shutil.rmtree(work / f"out-{n}")
                    print(f"{commit} {fmt} {n} rows: peak {r['peak_kib'] / 1024:.1f} MiB, "
                          f"{r['cpu_s']:.1f} driver CPU s, {r['wall_s']:.0f} s", file=sys.stderr)
                path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import platform

    import pyarrow
    import ray

    print(f"commit: {git_commit()}" + (f"; code of {', '.join(c for _, c in codes)}"
                                        if codes != [(ROOT, git_commit())] else ""))
    print(f"machine: {os.cpu_count()}-core {platform.machine()} CPU ({cpu_model_name()}), "
          f"{mem_gib():.0f} GiB; python {platform.python_version()}, ray {ray.__version__}, "
          f"pyarrow {pyarrow.__version__}")
    print(f"load average at the end (1/5/15 min): {load_average()}")
    if args.openai:
        print("input: OpenAI batch request lines (/v1/completions); output.jsonl sizes (MiB): "
              + ", ".join(f"{c} {n:,} rows {r['output_mib']:.1f}"
                          for (c, _, n), r in results.items()))
    print(f"model: {args.model or 'tiny random Llama (hidden 64, 2 layers, default tokenizer)'}, "
          f"--max-tokens 1, --batch-size {args.batch_size}, one CPU worker, private local Ray")
    print()
    print("Driver peak RSS (VmHWM of the driver process at exit) and CPU seconds per run:")
    print(markdown_table(
        ["code", "input", "input rows", "file size (MiB)", "driver peak RSS (MiB)",
         "driver CPU (s)", "wall time (s)", "rows/s"],
        [[c, f".{fmt}", f"{n:,}", f"{r['input_mib']:.1f}", f"{r['peak_kib'] / 1024:.1f}",
          f"{r['cpu_s']:.1f}", f"{r['wall_s']:.0f}", f"{n / r['wall_s']:.0f}"]
         for (c, fmt, n), r in results.items()]))
    print()
    print(f"Within the {largest:,}-row run, the driver's peak so far (VmHWM) once N rows were "
          f"written:")
    runs = [(c, fmt) for fmt in args.formats for _, c in codes]
    print(markdown_table(["rows written"] + [f"{c} .{fmt} (MiB)" for c, fmt in runs],
                         [[f"{m:,}"] + [f"{results[c, fmt, largest]['at_mark'][m] / 1024:.1f}"
                                        for c, fmt in runs] for m in marks]))


if __name__ == "__main__":
    main()
