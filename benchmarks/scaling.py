"""Multi-GPU scaling of the batch job: the same workload with one actor per GPU and with
one actor on one GPU.

Workload: N rows (default 4,096) of random token ids, prompt and output lengths uniform in
[100, 1024], ignore_eos, on a Llama-3.2-1B-shaped model with random bf16 weights (the
model and workload of `benchmarks.gpu_job`, cached under --work so several runs share
them). Prints one table row per run, with how busy each GPU was (nvidia-smi, sampled
every 0.5 s over the run).

    python -m benchmarks.scaling --workers 2 [--rows 4096] [--work /tmp/nanoserve-scaling]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, required=True, help="actors, one per GPU")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--work", type=Path, default=Path("/tmp/nanoserve-scaling"))
    ap.add_argument("--out", type=Path, default=None, help="append the result as a JSON line")
    args = ap.parse_args()
    from ray_jobs import run_batch_job

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "llama-1b-random"
    if not (model_dir / "model.safetensors").exists():
        make_random_model(model_dir, "cuda")
    workload = args.work / f"workload-{args.rows}.parquet"
    if not workload.exists():
        make_workload(workload, args.rows, LLAMA_1B["vocab_size"])
    out_dir = args.work / f"out-{args.workers}"
    t = time.perf_counter()
    with GpuSampler() as gpus:
        s = run_batch_job(str(workload), str(out_dir), model=str(model_dir), overwrite=True,
                          progress=False, ignore_eos=True, batch_size=256,
                          num_workers=args.workers)
    wall = time.perf_counter() - t
    rows = pq.read_table(out_dir, columns=["id"]).num_rows
    busy = gpus.mean_busy()
    result = {"workers": args.workers, "rows": s.rows, "rows_read_back": rows,
              "error_rows": s.error_rows, "output_tokens": s.output_tokens, "wall_s": wall,
              "tok_s": s.output_tokens / wall, "gpu_busy_pct": busy}
    print("| workers | rows | output tokens | wall s | output tok/s | GPU busy (mean %) |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.workers} | {s.rows} | {s.output_tokens} | {wall:.1f} | "
          f"{result['tok_s']:.0f} | {', '.join(f'{i}: {b:.0f}' for i, b in busy.items())} |")
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
