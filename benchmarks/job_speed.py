"""The batch job against its own engine on the same rows, and where the job's fixed cost goes.

Workload: `benchmarks/gpu_job.py`'s (random token-id prompts and output lengths uniform in
[100, 1024], `ignore_eos`, the Llama-3.2-1B shape with random bf16 weights), `--rows` of them.
Parts, in this order (`--parts`, default all), each printing its own table:

- `engine`: `LLM.generate` on the rows after an untimed full-size warm-up on the same
  lengths with other token ids (steady state: no compile, no prefix-cache hit);
- `job`: `run_batch_job` on the same rows with **default options** (`ignore_eos` only),
  a private local Ray started by the job: output tok/s over the job's whole wall and over its
  generate phase alone (from the first shard sent to the last result), each against the
  engine's; its phases; its workers' start by part (imports, weights, KV pool, graphs), and
  how full their engines were (busy fraction, rows a decode step);
- `first`: a fresh process loads the engine and runs `--first-rows` rows twice, other token
  ids each time; the first run's rate against the second's (one-time costs);
- `ray`: Ray's own start in fresh processes (import, `start_local_ray`, one actor with a GPU
  answering, stop), as the job starts it and in variants, `--ray-repeats` times.

The fixed cost is everything before the first shard starts generating: the job's prepare,
Ray and workers phases (`JobSummary.timings`).

    python -m benchmarks.job_speed [--rows 4096] [--first-rows 1024] [--parts engine job first ray]
    python -m benchmarks.job_speed --smoke     # a 2-layer model, a few rows, on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import git_commit, markdown_table
from benchmarks.gpu_job import LLAMA_1B, make_random_model, make_workload

RAY_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import ray
from ray_jobs.dispatch.local_ray import start_local_ray, stop_local_ray
t1 = time.perf_counter()
temp = start_local_ray(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
gpus = 1 if ray.cluster_resources().get("GPU") else 0
@ray.remote(num_gpus=gpus, num_cpus=0 if gpus else 1)
class Probe:  # imports what the job's worker imports before it loads the model
    def __init__(self):
        import torch
        from nanoserve.llm import LLM
    def pid(self):
        return os.getpid()
ray.get(Probe.remote().pid.remote())
t3 = time.perf_counter()
stop_local_ray(temp)
t4 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "start": t2 - t1, "actor": t3 - t2, "stop": t4 - t3}))
"""


# Ray's start as the job does it, and variants: (name, start_local_ray kwargs, environment)
RAY_VARIANTS = [("as the job", {}, {}),
                ("workers preload torch", {}, {"RAY_preload_python_modules": "torch,numpy"}),
                ("workers prestarted with the raylet, preload torch", {},
                 {"RAY_preload_python_modules": "torch,numpy", "RAY_enable_worker_prestart": "1"})]


def run_ray_part(repeats: int) -> list[dict]:
    out = []
    for i in range(repeats):
        for name, kwargs, env in RAY_VARIANTS:
            p = subprocess.run([sys.executable, "-c", RAY_CHILD, json.dumps(kwargs)],
                               capture_output=True, text=True, check=False,
                               env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                                   [str(Path.cwd()), os.environ.get("PYTHONPATH", "")])})
            if p.returncode:
                raise SystemExit(f"ray child failed: {p.stderr[-2000:]}")
            out.append({"run": f"{name} #{i + 1}", **json.loads(p.stdout.strip().splitlines()[-1])})
    return out


def engine_rate(model_dir: Path, prompts, max_tokens, device: str, warm: bool = True) -> dict:
    """The engine's steady state: a warm-up on the same lengths, other tokens, then the run."""
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    t = time.perf_counter()
    llm = LLM(str(model_dir), device=device)
    load = time.perf_counter() - t
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if warm:
        vocab = llm.config.vocab_size
        llm.generate([[(x + 1) % vocab for x in p] for p in prompts], params)
        sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"wall_s": wall, "tokens": n, "tok_s": n / wall, "load_s": load}


def first_run_child(model_dir: str, workload: str, rows: int, device: str) -> dict:
    """In this (fresh) process: load (prefill graphs captured at load), then the first
    `rows` rows twice, with other token ids each time (no prefix-cache hit)."""
    import pyarrow.parquet as pq

    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    t = pq.read_table(workload).slice(0, rows).to_pylist()
    prompts = [r["prompt_token_ids"] for r in t]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True) for r in t]
    t0 = time.perf_counter()
    llm = LLM(model_dir, device=device)
    load = time.perf_counter() - t0
    runner = llm.runner
    at_load = runner.capture_summary()["prefill_graphs"] if runner is not None else 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = []
    vocab = llm.config.vocab_size
    for shift in (1, 2):
        prompts = [[(x + shift) % vocab for x in p] for p in prompts]
        before = runner.prefill_capture_s if runner is not None else 0.0
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync()
        wall = time.perf_counter() - t1
        runs.append({"wall_s": wall, "tok_s": sum(len(o.token_ids) for o in outs) / wall,
                     "capture_s": (runner.prefill_capture_s - before) if runner else 0.0})
    return {"load_s": load, "load_parts": llm.load_timings, "prefill_graphs": at_load,
            "runs": runs}


def run_first_part(model_dir: Path, workload: Path, rows: int, device: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "benchmarks.job_speed", "--child-first",
                        str(model_dir), str(workload), str(rows), device],
                       capture_output=True, text=True, check=False)
    if p.returncode:
        raise SystemExit(f"first-run child failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_job_part(model_dir: Path, workload: Path, out_dir: Path) -> tuple[dict, object]:
    from ray_jobs import run_batch_job

    t = time.perf_counter()
    s = run_batch_job(str(workload), str(out_dir), model=str(model_dir), ignore_eos=True,
                      overwrite=True, progress=False)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "tokens": s.output_tokens, "tok_s": s.output_tokens / wall}, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--first-rows", type=int, default=1024)
    ap.add_argument("--parts", nargs="+", default=["engine", "job", "first", "ray"],
                    choices=["engine", "job", "first", "ray"])
    ap.add_argument("--ray-repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU")
    ap.add_argument("--child-first", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_first:
        model, workload, rows, device = args.child_first
        print(json.dumps(first_run_child(model, workload, int(rows), device)))
        return
    device, config, lo, hi = "cuda", LLAMA_1B, 100, 1024
    if args.smoke:
        device, config, lo, hi = "cpu", {**LLAMA_1B, "num_hidden_layers": 2}, 4, 12
        args.rows, args.first_rows = min(args.rows, 16), min(args.first_rows, 8)
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    print(f"commit {git_commit()}, {args.rows} rows, parts {' '.join(args.parts)}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="nanoserve-job-speed-"))
    model_dir = make_random_model(work / "model", device, config)
    prompts, max_tokens = make_workload(work / "workload.parquet", args.rows,
                                        config["vocab_size"], lo=lo, hi=hi)
    engine = job = None
    if "engine" in args.parts:
        engine = engine_rate(model_dir, prompts, max_tokens, device)
        print(f"engine: {engine['tok_s']:,.0f} tok/s ({engine['wall_s']:.1f} s, "
              f"load {engine['load_s']:.1f} s)", flush=True)
    if "job" in args.parts:
        job, s = run_job_part(model_dir, work / "workload.parquet", work / "out")
        ph = s.timings
        fixed = ph.get("prepare", 0) + ph.get("ray", 0) + ph.get("workers", 0)
        gen_s = ph.get("first_shard", 0) + ph.get("generate", 0)
        rows = [["job, default options, whole wall", f"{job['tok_s']:,.0f}",
                 f"{job['wall_s']:.1f}"],
                ["job, generate phase (first shard sent to last result)",
                 f"{s.output_tokens / gen_s:,.0f}", f"{gen_s:.1f}"]]
        if engine:
            rows.insert(0, ["engine, steady state", f"{engine['tok_s']:,.0f}",
                            f"{engine['wall_s']:.1f}"])
            rows[1].append(f"{job['tok_s'] / engine['tok_s']:.2f}x")
            rows[2].append(f"{s.output_tokens / gen_s / engine['tok_s']:.2f}x")
            rows[0].append("1.00x")
        print(markdown_table(["run", "output tok/s", "wall s", "of the engine"][:len(rows[0])],
                             rows))
        print("\njob phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in ph.items())
              + f"; fixed cost (prepare + Ray + workers) {fixed:.2f} s")
        for w in s.workers:
            print(f"worker {w.index}: ready at {w.ready_s:.2f} s; start "
                  + ", ".join(f"{k} {v:.2f}" for k, v in w.load_s.items())
                  + f"; engine busy {w.busy_fraction or 0:.1%} of {w.up_s:.1f} s; "
                  f"{w.rows_per_step or 0:.0f} rows a decode step of {w.max_rows}")
        print(s.format(), flush=True)
    if "first" in args.parts:
        r = run_first_part(model_dir, work / "workload.parquet", args.first_rows, device)
        a, b = r["runs"]
        print(f"\nfresh process, {args.first_rows} rows twice:")
        print(markdown_table(
            ["load s", "prefill graphs at load", "first tok/s", "second tok/s",
             "first / second", "captures in the runs s"],
            [[f"{r['load_s']:.2f}", r["prefill_graphs"], f"{a['tok_s']:,.0f}",
              f"{b['tok_s']:,.0f}", f"{a['tok_s'] / b['tok_s']:.3f}",
              f"{a['capture_s']:.2f} / {b['capture_s']:.2f}"]]))
        print("load parts:", {k: round(v, 2) for k, v in r["load_parts"].items()})
    if "ray" in args.parts:
        res = run_ray_part(args.ray_repeats)
        print("\nRay alone (fresh process each):")
        print(markdown_table(["run", "import s", "start s", "first actor (imports torch, nanoserve) s", "stop s"],
                             [[r["run"], f"{r['import']:.2f}", f"{r['start']:.2f}",
                               f"{r['actor']:.2f}", f"{r['stop']:.2f}"] for r in res]))


if __name__ == "__main__":
    main()
