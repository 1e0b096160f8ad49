"""The batch job's fixed cost: where the seconds of a tiny job go, with 1 and 2 workers.

A tiny job (8 rows, 4 new tokens each) on a tiny random Llama (hidden 64, 2 layers, the
default model's tokenizer) costs almost nothing to generate, so its wall time is the
fixed cost every job pays: starting Ray, starting the actors and loading the model, the
first batch, stopping the actors and Ray. Each run is `run_batch_job`, the driver's real
code path, and the phases are the ones it reports (`JobSummary.timings`), plus when each
worker was ready (`WorkerReport.ready_s`).

Two modes:
- `gpu` (default): a private local Ray with N logical GPUs (`start_local_ray(num_gpus=N)`,
  what the driver itself calls), so the actors are placed as on a GPU machine
  (`num_gpus=1` each) and run on the CPU; this script times Ray's start and shutdown
  around the job, which joins that Ray;
- `cpu`: the driver starts and stops its own private Ray (`address="local"`) and runs
  CPU actors (`num_cpus=1` each).

An untimed job runs first (imports, page cache). Runs alternate between the worker
counts, `--repeats` times each; the table shows every run, then the medians.

    python -m benchmarks.startup [--workers 1 2] [--repeats 3] [--mode gpu|cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_model_name, git_commit, markdown_table
from nanoserve.testing import save_tiny_llama


def write_input(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Row {i}: the quick brown fox jumps"}) + "\n"
                            for i in range(rows)))
    return path


def run_once(mode: str, workers: int, input_path: Path, out: Path, model: Path,
             max_tokens: int) -> dict:
    """One job; seconds per phase (Ray's start and stop included), and when the last
    worker was ready."""
    from ray_jobs import run_batch_job
    from ray_jobs.local_ray import start_local_ray, stop_local_ray

    options = {"model": str(model), "max_tokens": max_tokens, "batch_size": 2,
               "num_workers": workers, "kv_cache_bytes": 32 << 20, "progress": False,
               "overwrite": True}
    t0 = time.perf_counter()
    temp_dir = None
    if mode == "gpu":
        temp_dir = start_local_ray(num_cpus=max(2, workers), num_gpus=workers)
    else:
        options["address"] = "local"
    ray_start = time.perf_counter() - t0
    try:
        summary = run_batch_job(input_path, out, **options)
    finally:
        t1 = time.perf_counter()
        if temp_dir is not None:
            stop_local_ray(temp_dir)
        ray_stop = time.perf_counter() - t1
    total = time.perf_counter() - t0
    if len(summary.workers) != workers or summary.rows != summary.num_batches * 2:
        raise SystemExit(f"unexpected job: {summary}")
    phases = dict(summary.timings)
    if mode == "gpu":  # Ray was started and stopped here, around the job
        phases["ray"] = phases.get("ray", 0.0) + ray_start
        phases["shutdown"] = phases.get("shutdown", 0.0) + ray_stop
    ready = [w.ready_s for w in summary.workers if w.ready_s is not None]
    before_workers = phases["prepare"] + summary.timings.get("ray", 0.0)
    return {"n": workers, **phases, "first_ready": min(ready) - before_workers,
            "last_ready": max(ready) - before_workers, "total": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--mode", choices=("gpu", "cpu"), default="gpu",
                    help="gpu: logical GPUs, num_gpus=1 actors; cpu: num_cpus=1 actors")
    args = ap.parse_args()

    from nanoserve.model_store import DEFAULT_MODEL, resolve_model

    with tempfile.TemporaryDirectory(prefix="ns-startup-") as tmp:
        work = Path(tmp)
        model = save_tiny_llama(work / "model", resolve_model(DEFAULT_MODEL))
        input_path = write_input(work / "in.jsonl", args.rows)
        run_once(args.mode, 1, input_path, work / "out-warmup", model, args.max_tokens)
        runs = []
        for _ in range(args.repeats):
            for n in args.workers:
                runs.append(run_once(args.mode, n, input_path, work / f"out-{n}", model,
                                     args.max_tokens))
    headers = ["workers", "Ray start", "prepare", "first worker ready", "last worker ready",
               "first batch", "generate", "shutdown", "total"]

    def row(label: str, r: dict) -> list:
        return [label, *(f"{r[k]:.2f}" for k in ("ray", "prepare", "first_ready", "last_ready",
                                                 "first_batch", "generate", "shutdown",
                                                 "total"))]

    print(f"mode {args.mode}, {args.rows} rows, {args.max_tokens} new tokens; "
          f"{cpu_model_name()}; commit {git_commit()}")
    print("seconds; a worker's ready time counts from Ray ready; the driver sends the "
          "first batch once the last one is ready")
    print(markdown_table(headers, [row(str(r["n"]), r) for r in runs]))
    print()
    medians = []
    for n in args.workers:
        mine = [r for r in runs if r["n"] == n]
        medians.append(row(f"{n} (median)", {k: statistics.median(r[k] for r in mine)
                                             for k in mine[0] if k != "n"}))
    print(markdown_table(headers, medians))


if __name__ == "__main__":
    main()
