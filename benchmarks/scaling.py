"""Multi-GPU scaling of the batch job: the same workload with one actor per GPU and with
one actor on one GPU.

Workload: N rows (default 4,096) of random token ids, prompt and output lengths uniform in
[100, 1024], ignore_eos, on a Llama-3.2-1B-shaped model with random bf16 weights (the
model and workload of `benchmarks.gpu_job`, cached under --work so several runs share
them). Prints one table row per run, with how busy each GPU was (nvidia-smi, sampled
every 0.5 s over the run).

    python -m benchmarks.scaling --workers 2 1 [--rows 4096] [--work /tmp/nanoserve-scaling]

A count may be repeated (`--workers 2 1 1 2`): the efficiency is then the mean rate of the
N-actor runs over N times the mean rate of the one-actor runs.

An untimed 16-row job runs first, so that Triton's on-disk kernel cache is filled before
either timed run (otherwise the first run alone pays for compiling the kernels). Each
timed run is the whole job's wall time, including Ray start and model load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.gpu_job import LLAMA_1B, make_random_model, make_workload


class GpuSampler:
    """Samples `utilization.gpu` of every GPU until stopped."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.samples: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            for line in out.strip().splitlines():
                idx, util = (int(x) for x in line.split(","))
                self.samples.setdefault(idx, []).append(util)
            self._stop.wait(period_s)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean_busy(self) -> dict[int, float]:
        return {i: sum(s) / len(s) for i, s in sorted(self.samples.items()) if s}


def run_once(workload: Path, model_dir: Path, out_dir: Path, workers: int,
             batch_size: int, scheduler: str = "auto") -> dict:
    from ray_jobs import run_batch_job

    t = time.perf_counter()
    with GpuSampler() as gpus:
        s = run_batch_job(str(workload), str(out_dir), model=str(model_dir), overwrite=True,
                          progress=False, ignore_eos=True, batch_size=batch_size,
                          num_workers=workers, scheduler=scheduler)
    wall = time.perf_counter() - t
    rows = pq.read_table(out_dir, columns=["id"]).num_rows
    return {"workers": workers, "scheduler": scheduler, "rows": s.rows, "rows_read_back": rows,
            "error_rows": s.error_rows, "output_tokens": s.output_tokens, "wall_s": wall,
            "tok_s": s.output_tokens / wall, "gpu_busy_pct": gpus.mean_busy(),
            "timings": s.timings,
            "worker_ready_s": [w.ready_s for w in s.workers],
            "worker_last_result_s": [w.last_result_s for w in s.workers],
            "worker_result_s": [list(w.result_s) for w in s.workers],
            "worker_rows": [w.rows for w in s.workers]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", required=True,
                    help="actor counts to run, one actor per GPU (e.g. 2 1)")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--scheduler", default="auto", choices=("auto", "static", "continuous"),
                    help="each worker's engine (default auto: continuous on a GPU)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/nanoserve-scaling"))
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed 16-row job that fills Triton's kernel cache first")
    ap.add_argument("--shared-ray", action="store_true",
                    help="start Ray once, before the runs, as a running cluster would be: each "
                         "job then joins it (actors and model loads still count) instead of "
                         "starting and stopping its own")
    ap.add_argument("--out", type=Path, default=None, help="append each result as a JSON line")
    args = ap.parse_args()
    ray_dir = None
    if args.shared_ray:
        import torch

        from ray_jobs.dispatch.local_ray import start_local_ray

        ray_dir = start_local_ray(num_gpus=torch.cuda.device_count())
    try:
        results = run_all(args)
    finally:
        if ray_dir is not None:
            from ray_jobs.dispatch.local_ray import stop_local_ray

            stop_local_ray(ray_dir)
    report(results, "shared (started before the runs)" if args.shared_ray else "private per job")


def run_all(args) -> list[dict]:
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "llama-1b-random"
    if not (model_dir / "model.safetensors").exists():
        make_random_model(model_dir, "cuda")
    workload = args.work / f"workload-{args.rows}.parquet"
    if not workload.exists():
        make_workload(workload, args.rows, LLAMA_1B["vocab_size"])
    if not args.no_warmup:  # compiled kernels are cached on disk: no run pays for them
        small = args.work / "workload-16.parquet"
        make_workload(small, 16, LLAMA_1B["vocab_size"], lo=20, hi=40)
        run_once(small, model_dir, args.work / "out-warmup", 1, 16)
    results = []
    for workers in args.workers:
        results.append(run_once(workload, model_dir, args.work / f"out-{workers}", workers,
                                args.batch_size, args.scheduler))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps({**results[-1], "shared_ray": args.shared_ray}) + "\n")
    return results


def report(results: list[dict], ray_mode: str) -> None:
    print(f"Ray: {ray_mode}")
    print("| workers | scheduler | rows | rows read back | error rows | output tokens | wall s "
          "| output tok/s | GPU busy (mean %) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        busy = ", ".join(f"{i}: {b:.0f}" for i, b in r["gpu_busy_pct"].items())
        print(f"| {r['workers']} | {r['scheduler']} | {r['rows']} | {r['rows_read_back']} | {r['error_rows']} | "
              f"{r['output_tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.0f} | {busy} |")
    for r in results:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["timings"].items())
        ends = ", ".join(f"{t:.1f}" for t in r["worker_last_result_s"] if t is not None)
        print(f"{r['workers']} workers: {phases}; each worker's last result at {ends} s; "
              f"rows per worker {r['worker_rows']}")
        for i, times in enumerate(r["worker_result_s"]):
            print(f"  worker {i} results at (s): " + " ".join(f"{t:.1f}" for t in times))
    base = [r["tok_s"] for r in results if r["workers"] == 1]
    for n in sorted({r["workers"] for r in results} - {1}):
        rates = [r["tok_s"] for r in results if r["workers"] == n]
        if base:
            eff = (sum(rates) / len(rates)) / (n * sum(base) / len(base))
            print(f"scaling efficiency, {n} GPUs: {eff:.3f} (target 0.95; mean of {len(rates)} "
                  f"run(s) against the mean of {len(base)} one-GPU run(s))")

if __name__ == "__main__":
    main()
