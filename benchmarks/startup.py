"""The batch job's fixed cost: where the seconds of a tiny job go, with 1 and 2 workers.

A tiny job (8 rows, 4 new tokens each) on a tiny random Llama (hidden 64, 2 layers, the
default model's tokenizer) costs almost nothing to generate, so its wall time is the
fixed cost every job pays: starting Ray, starting the actors and loading the model, the
first shard, stopping the actors and Ray. Each run is `run_batch_job`, the driver's real
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

A third mode, `demo`, times what a first-time user runs, on the CPU, as commands in fresh
processes, for this source tree and (with `--before DIR`) another checkout of the
repository side by side (e.g. a `git worktree` of an earlier commit), runs alternating
between the trees:
- the demo job: `python -m nanoserve_cli batch examples/prompts.jsonl -o OUT --overwrite
  --max-tokens 4` on the default model (fetched already): the process's wall time, the
  job's own phases (its `time:` line) and the time outside them (interpreter start,
  imports, the report and exit); the two trees' rows are compared token for token;
- `nanoserve generate`: `python -m nanoserve_cli generate PROMPT --max-tokens 4`'s wall
  time, and the same steps timed one by one in another process (imports, `LLM()`, encode
  and generate).
Each tree's code comes first on PYTHONPATH in its processes; with two trees each has its
own model cache (the default model's file linked into it), since a prepared model folder is
written again by code that converts differently. An untimed run of each command and tree
comes first; the tables show medians over `--repeats` runs and the ratio
this tree / the other.

    python -m benchmarks.startup --mode demo --before ../wt-before --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, cpu_model_name, git_commit, load_average, markdown_table


def write_input(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"Row {i}: the quick brown fox jumps"}) + "\n"
                            for i in range(rows)))
    return path


def run_once(mode: str, workers: int, input_path: Path, out: Path, model: Path,
             max_tokens: int) -> dict:
    """One job; seconds per phase (Ray's start and stop included), and when the last
    worker was ready."""
    from ray_jobs import run_batch_job
    from ray_jobs.dispatch.local_ray import start_local_ray, stop_local_ray

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
    if len(summary.workers) != workers or summary.rows != summary.num_shards * 2:
        raise SystemExit(f"unexpected job: {summary}")
    phases = dict(summary.timings)
    if mode == "gpu":  # Ray was started and stopped here, around the job
        phases["ray"] = phases.get("ray", 0.0) + ray_start
        phases["shutdown"] = phases.get("shutdown", 0.0) + ray_stop
    ready = [w.ready_s for w in summary.workers if w.ready_s is not None]
    before_workers = phases["prepare"] + summary.timings.get("ray", 0.0)
    return {"n": workers, **phases, "first_ready": min(ready) - before_workers,
            "last_ready": max(ready) - before_workers, "total": total}


# --- demo mode: the demo job and `nanoserve generate`, this tree against another --------------

DEMO_PHASES = ("prepare", "Ray", "workers", "first shard", "generate", "shutdown")
GENERATE_PROMPT = "The capital of France is"
# `nanoserve generate`'s steps (nanoserve/cli.py), timed one by one in a fresh process.
GENERATE_STEPS = """
import json, sys, time
t0 = time.perf_counter()
import nanoserve_cli
from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams
t1 = time.perf_counter()
llm = LLM("smollm2-135m-instruct", device="cpu")
t2 = time.perf_counter()
out = llm.generate([llm.tokenizer.encode(sys.argv[1])], SamplingParams(max_tokens=4))[0]
print(out.text)
t3 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "generate": t3 - t2}))
"""


def run_tree(tree: Path, args: list[str], cache: Path | None = None) -> tuple[float, str]:
    """Run `python ARGS` in `tree` with its code first on the path (and `cache` as its
    model cache): (wall seconds, stdout and stderr). A failed command stops the benchmark."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if cache is not None:
        env["NANOSERVE_CACHE"] = str(cache)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} in {tree} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return wall, proc.stdout + proc.stderr


def demo_job(tree: Path, out: Path, cache: Path | None = None) -> dict:
    """One demo job in a fresh process: its wall time, the job's phases and rows."""
    wall, text = run_tree(tree, ["-m", "nanoserve_cli", "batch", "examples/prompts.jsonl",
                                 "-o", str(out), "--overwrite", "--max-tokens", "4"], cache)
    times = re.search(r"^time: (.*)$", text, re.M)
    job = re.search(r"^wall time: ([0-9.]+) s", text, re.M)
    if times is None or job is None or not re.search(r"^rows: 35 \((0 error rows|.*error 0)\)", text, re.M):
        raise SystemExit(f"unexpected output of the demo job in {tree}:\n{text[-3000:]}")
    phases = {name: float(v) for name, v in re.findall(r"([A-Za-z ]+?) ([0-9.]+) s(?:,|$)",
                                                         times.group(1))}
    # (an older tree calls the first shard's phase "first batch")
    phases = {k.strip().replace("first batch", "first shard"): v for k, v in phases.items()}
    return {"wall": wall, "job": float(job.group(1)), **phases,
            "outside": wall - float(job.group(1))}


def demo_rows(out: Path) -> dict:
    import pyarrow.parquet as pq

    table = pq.read_table(out, columns=["id", "generated_token_ids"])
    return dict(zip(table["id"].to_pylist(), table["generated_token_ids"].to_pylist()))


def generate_steps(tree: Path, cache: Path | None = None) -> dict:
    wall, text = run_tree(tree, ["-c", GENERATE_STEPS, GENERATE_PROMPT], cache)
    return {**json.loads(text.strip().splitlines()[-1]), "wall": wall}


def tree_caches(trees: dict[str, Path], tmp: Path) -> dict[str, Path]:
    """One model cache per tree, the default model's GGUF file linked (or copied) into it.
    The prepared folder beside that file is keyed on the conversion code
    (`nanoserve.weights.model_store.conversion_key`), so two trees that differ there and share a
    cache would each write it again on every run (15-18 s of the demo job's "prepare")."""
    from nanoserve.weights.model_store import cache_root, fetch_default_model

    source = fetch_default_model()
    caches = {}
    for name in trees:
        cache = tmp / f"cache-{name}"
        target = cache / source.relative_to(cache_root())
        target.parent.mkdir(parents=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        caches[name] = cache
    return caches


def generate_command(tree: Path, cache: Path | None = None) -> float:
    return run_tree(tree, ["-m", "nanoserve_cli", "generate", GENERATE_PROMPT,
                           "--max-tokens", "4"], cache)[0]


def demo_main(args: argparse.Namespace) -> None:
    trees = {"this": ROOT}
    if args.before is not None:
        trees = {"before": Path(args.before).resolve(), "this": ROOT}
    labels = {name: f"{name} ({_commit(tree)})" for name, tree in trees.items()}
    print(f"demo mode; {cpu_model_name()}, {os.cpu_count()} cores; load average at start "
          f"{load_average()}; trees: {', '.join(f'{labels[n]} {t}' for n, t in trees.items())}")
    jobs: dict[str, list[dict]] = {n: [] for n in trees}
    steps: dict[str, list[dict]] = {n: [] for n in trees}
    commands: dict[str, list[float]] = {n: [] for n in trees}
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ns-startup-demo-") as tmp:
        # Each tree its own model cache when there are two (the user's when one).
        caches = tree_caches(trees, Path(tmp)) if len(trees) > 1 else {"this": None}
        for name, tree in trees.items():  # untimed: page cache, bytecode, prepared model
            demo_job(tree, Path(tmp) / f"warm-{name}", caches[name])
            generate_command(tree, caches[name])
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                out = Path(tmp) / f"out-{name}"
                jobs[name].append(demo_job(trees[name], out, caches[name]))
                rows[name] = demo_rows(out)
                steps[name].append(generate_steps(trees[name], caches[name]))
                commands[name].append(generate_command(trees[name], caches[name]))
                print(f"repeat {r + 1}/{args.repeats} {name}: demo job "
                      f"{jobs[name][-1]['wall']:.1f} s, generate {commands[name][-1]:.1f} s",
                      flush=True)
    print(f"load average at the end {load_average()}")

    def med(xs: list[dict], key: str) -> float:
        return statistics.median(x.get(key, 0.0) for x in xs)

    keys = ["wall", "outside", *DEMO_PHASES]
    headers = ["tree", "command wall", "outside the job", *DEMO_PHASES]
    table = [[labels[n], *(f"{med(jobs[n], k):.1f}" for k in keys)] for n in trees]
    if "before" in trees:
        table.append(["this / before", *(_ratio(med(jobs["this"], k), med(jobs["before"], k))
                                         for k in keys)])
    print()
    print(f"demo job (35 rows, --max-tokens 4, default model, CPU): seconds, median of "
          f"{args.repeats}")
    print(markdown_table(headers, table))
    if "before" in trees:
        same = sum(rows["this"].get(i) == t for i, t in rows["before"].items())
        print(f"rows with the same tokens in both trees: {same}/{len(rows['before'])}")

    keys = ["imports", "load", "generate", "wall"]
    table = [[labels[n], f"{statistics.median(commands[n]):.1f}",
              *(f"{med(steps[n], k):.1f}" for k in keys)] for n in trees]
    if "before" in trees:
        table.append(["this / before",
                      _ratio(statistics.median(commands["this"]),
                             statistics.median(commands["before"])),
                      *(_ratio(med(steps["this"], k), med(steps["before"], k)) for k in keys)])
    print()
    print(f"nanoserve generate (one prompt, --max-tokens 4, CPU): seconds, median of "
          f"{args.repeats}; the command, then its steps timed one by one in another process")
    print(markdown_table(["tree", "command wall", "imports", "LLM() load", "encode + generate",
                          "steps' process wall"], table))


def _commit(tree: Path) -> str:
    """The tree's short commit, with '+changes' when it differs from it."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--mode", choices=("gpu", "cpu", "demo"), default="gpu",
                    help="gpu: logical GPUs, num_gpus=1 actors; cpu: num_cpus=1 actors; "
                         "demo: the demo job and nanoserve generate, as commands")
    ap.add_argument("--before", default=None, metavar="DIR",
                    help="demo mode: another checkout to time side by side with this one")
    args = ap.parse_args()
    if args.mode == "demo":
        demo_main(args)
        return

    from nanoserve.testing import save_tiny_llama
    from nanoserve.weights.model_store import DEFAULT_MODEL, resolve_model

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
               "first shard", "generate", "shutdown", "total"]

    def row(label: str, r: dict) -> list:
        return [label, *(f"{r[k]:.2f}" for k in ("ray", "prepare", "first_ready", "last_ready",
                                                 "first_shard", "generate", "shutdown",
                                                 "total"))]

    print(f"mode {args.mode}, {args.rows} rows, {args.max_tokens} new tokens; "
          f"{cpu_model_name()}; commit {git_commit()}")
    print("seconds; a worker's ready time counts from Ray ready; the driver sends the "
          "first shard once the last one is ready")
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
