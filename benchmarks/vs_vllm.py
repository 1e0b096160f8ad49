"""nanoserve against vLLM 0.26.0 on one GPU: the same token-id workloads through both
engines, back to back, on the same random checkpoint folder.

Workloads (random bf16 weights, greedy, ignore_eos, token ids; every row must return exactly
its max_tokens tokens, checked on both sides):
- nanovllm: nano-vllm's benchmark, as `benchmarks.gpu_job.make_workload` draws it: 256 rows,
  prompt and output lengths uniform in [100, 1024], `random.Random(0)`;
- shared: 3,000 rows over 12 system prompts of 300-1,500 random tokens each (uniform); each
  row is one system prompt (drawn at random) plus 30-150 tokens of its own, output lengths
  uniform in [8, 32]; seed 0; rows in the drawn order (not grouped by system prompt);
- batch4096: a batch job's size: 4,096 rows of nano-vllm's distribution (prompts and outputs
  uniform in [100, 1024]), `random.Random(7)`; its warm-up is its first 256 rows (shifted).

    python3 -m benchmarks.vs_vllm [--shape 1b|8b] [--workloads nanovllm,shared,batch4096]
        [--sides nanoserve,vllm] [--quantization fp8] [--out DIR] [--vllm-site /tmp/vsite]
        [--variants bf16,fp8+fp8kv] [--max-batch-size N] [--load-format dummy] [--smoke]
        [--first-rows N]

--variants: nanoserve's engines, run one after another on every workload (default: one, as
--quantization says): `bf16`, `fp8` (FP8 weights quantized at load), each optionally with
`+fp8kv` (an FP8 KV cache). --max-batch-size: nanoserve's running-row limit (default: the
engine's own, `nanoserve.scheduling.running_rows`). --load-format dummy: neither side reads weights (the
folder holds config.json and a tokenizer; each engine draws random weights on the GPU:
`LLM(load_format="dummy")` in both), so no 16 GB checkpoint is written first.

Each side builds one engine with prefix caching on and runs every workload on it: first an
untimed warm-up with the workload's own lengths and sharing pattern but other tokens (each
id + 1: other system prompts too, so no block of the timed run is cached), then the timed
`generate` of the whole workload. vLLM runs first, in a child process whose PYTHONPATH is
only --vllm-site (vLLM and its dependencies installed there with `pip install --target`),
with VLLM_USE_FLASHINFER_SAMPLER=0, on vLLM's defaults (`LLM(model=DIR,
skip_tokenizer_init=True, enable_prefix_caching=True, gpu_memory_utilization=0.9,
max_model_len=4096)`); it exits and leaves the GPU whole for nanoserve, in this process
(`LLM(..., scheduler="continuous", enable_prefix_caching=True)`). Prints one table: wall
time, output tok/s and nanoserve's rate over vLLM's, plus nanoserve's phases (device
prefill and decode, idle, host) and on `shared` its prefix hit rate and prefill tokens;
`--quantization fp8`: both sides quantize the same bf16 checkpoint's projections to FP8 at
load (`LLM(quantization="fp8")` in each engine; the LM head stays bf16 in both). Results go
to DIR/vs_vllm_<shape>[_fp8].json (with --out, the random model folder is
kept there and reused by later runs).

--smoke: a 2-layer, narrow model (vocabulary 8,192) on the CPU, a few short rows, nanoserve
only: checks the script runs (tests/test_bench_vs_vllm.py).

This module imports only the standard library at the top: the vLLM child runs this file
with vLLM's PYTHONPATH, and must import vllm before torch and never import nanoserve.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = ("nanovllm", "shared", "batch4096")
WARMUP_ROWS = {"batch4096": 256}  # a workload's untimed warm-up: its first rows (else all)
SIDES = ("nanoserve", "vllm")
VOCAB = 128256  # the Llama 3 vocabulary, both shapes


def nanovllm_workload(rows: int = 256, vocab: int = VOCAB, seed: int = 0, lo: int = 100,
                      hi: int = 1024) -> tuple[list[list[int]], list[int]]:
    """Prompt and output lengths uniform in [lo, hi]: the draws of
    `benchmarks.gpu_job.make_workload` (same seed, same order), without the parquet file."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(rows)]
    return prompts, [rng.randint(lo, hi) for _ in range(rows)]


def shared_workload(rows: int = 3000, vocab: int = VOCAB, seed: int = 0, systems: int = 12,
                    system_len: tuple[int, int] = (300, 1500), own_len: tuple[int, int] = (30, 150),
                    out_len: tuple[int, int] = (8, 32)
                    ) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """(prompts, max_tokens, system prompts): each row one of `systems` system prompts (of
    lengths uniform in system_len), drawn at random, plus own_len tokens of its own; output
    lengths uniform in out_len. The rows stay in the order drawn."""
    rng = random.Random(seed)
    sys_prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*system_len))]
                   for _ in range(systems)]
    prompts, max_tokens = [], []
    for _ in range(rows):
        head = sys_prompts[rng.randrange(systems)]
        prompts.append(head + [rng.randrange(vocab) for _ in range(rng.randint(*own_len))])
        max_tokens.append(rng.randint(*out_len))
    return prompts, max_tokens, sys_prompts


def make_workloads(names: list[str], smoke: bool, vocab: int = VOCAB) -> dict[str, tuple]:
    """name -> (prompts, max_tokens); --smoke: a few short rows (shared prefixes of 1-2
    blocks of 16 tokens, so the prefix cache is hit on the CPU too)."""
    out = {}
    for name in names:
        if name == "nanovllm":
            out[name] = nanovllm_workload(4, vocab, lo=4, hi=12) if smoke else nanovllm_workload(vocab=vocab)
        elif name == "batch4096":
            out[name] = (nanovllm_workload(12, vocab, seed=7, lo=4, hi=12) if smoke
                         else nanovllm_workload(4096, vocab, seed=7))
        else:
            w = (shared_workload(8, vocab, systems=3, system_len=(16, 40), own_len=(2, 6),
                                 out_len=(2, 4)) if smoke else shared_workload(vocab=vocab))
            out[name] = w[:2]
    return out


def warmup_of(prompts: list[list[int]], vocab: int = VOCAB, shift: int = 1
              ) -> list[list[int]]:
    """The same lengths and sharing pattern, other tokens (each id + shift): shared system
    prompts become other shared system prompts, and no block of the timed run is cached."""
    return [[(t + shift) % vocab for t in p] for p in prompts]


def warmup_rows_of(name: str, prompts: list, max_tokens: list, vocab: int = VOCAB,
                   rows: int | None = None) -> tuple[list, list]:
    """The warm-up's rows of workload `name`: `warmup_of` its first `rows` rows (default
    WARMUP_ROWS', else all) and their max_tokens."""
    n = rows or WARMUP_ROWS.get(name, len(prompts))
    return warmup_of(prompts[:n], vocab), max_tokens[:n]


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --- the random checkpoint folder --------------------------------------------------------------


def vllm_ready_config(config: dict) -> dict:
    """make_random_model's config.json plus what vLLM reads and the shape dicts leave out:
    the checkpoint dtype (vLLM's dtype="auto" otherwise treats the model as float32)."""
    return {**config, "torch_dtype": config.get("torch_dtype", "bfloat16"),
            "dtype": config.get("dtype", "bfloat16")}


def model_folder(folder: Path, device: str, config: dict) -> Path:
    """make_random_model's folder with its config.json patched for vLLM; reused when a
    complete folder of the same config is already there (the 8B checkpoint is 16 GB)."""
    want = vllm_ready_config(config)
    done = folder / ".complete"
    try:
        if done.exists() and json.loads((folder / "config.json").read_text()) == want:
            print(f"reusing the random model in {folder}", flush=True)
            return folder
    except (OSError, ValueError):
        pass
    import torch

    from benchmarks.gpu_job import make_random_model

    done.unlink(missing_ok=True)
    t = time.perf_counter()
    make_random_model(folder, device, config)
    (folder / "config.json").write_text(json.dumps(want, indent=1))
    done.write_text("")
    if device == "cuda":
        torch.cuda.empty_cache()  # the weights were drawn on the GPU
    print(f"random model written to {folder} in {time.perf_counter() - t:.0f} s", flush=True)
    return folder


def config_folder(folder: Path, config: dict) -> Path:
    """A folder of config.json (patched for vLLM) and a word-level tokenizer over the whole
    vocabulary, no weights: for `load_format="dummy"` in both engines."""
    from tokenizers import Tokenizer, models

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(vllm_ready_config(config), indent=1))
    vocab = {f"<t{i}>": i for i in range(config["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(folder / "tokenizer.json"))
    return folder


# --- nanoserve, in this process ----------------------------------------------------------------


def variant_options(variant: str) -> tuple[str | None, str]:
    """`bf16`, `fp8`, `bf16+fp8kv`, `fp8+fp8kv` -> (quantization, kv_cache_dtype)."""
    weights, _, kv = variant.partition("+")
    if weights not in ("bf16", "fp8") or kv not in ("", "fp8kv"):
        raise ValueError(f"unknown variant {variant!r}: bf16 or fp8, optionally +fp8kv")
    return (None if weights == "bf16" else "fp8"), ("fp8" if kv else "auto")


def run_nanoserve(model_dir: Path, workloads: dict, device: str, vocab: int,
                  quantization: str | None = None, kv_cache_dtype: str = "auto",
                  max_batch_size: int | None = None, load_format: str = "auto",
                  warmup_rows: int | None = None) -> dict:
    """warmup_rows: the untimed warm-up's rows, the first ones (None: `WARMUP_ROWS`' or all)."""
    import torch

    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t = time.perf_counter()
    llm = LLM(str(model_dir), device=device, scheduler="continuous", enable_prefix_caching=True,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype,
              max_batch_size=max_batch_size, load_format=load_format)
    sync()
    side = {"load_s": time.perf_counter() - t, "kv_pool_tokens": llm.pool.num_tokens,
            "max_batch_size": llm.max_batch_size, "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype, "workloads": {}}
    print(f"nanoserve: KV pool {llm.pool.num_tokens:,} tokens ({kv_cache_dtype}), at most "
          f"{llm.max_batch_size} rows running", flush=True)
    if llm.runner is not None:
        side["steps"] = llm.runner.capture_summary()
        print(f"nanoserve loaded in {side['load_s']:.1f} s: {side['steps']}", flush=True)
    for name, (prompts, max_tokens) in workloads.items():
        warm, warm_max = warmup_rows_of(name, prompts, max_tokens, vocab, warmup_rows)
        llm.generate(warm, [SamplingParams(max_tokens=m, ignore_eos=True) for m in warm_max])
        r = timed_generate(llm, prompts, max_tokens, device, name)
        ph = r.get("phases")
        if ph is not None:
            host = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ph["host"].items()))
            print(f"nanoserve {name} phases: device prefill {ph['prefill_s']:.2f} s in "
                  f"{ph['prefill_n']} steps, decode {ph['decode_s']:.2f} s in {ph['decode_n']} "
                  f"steps, device idle {r['wall_s'] - r['busy_s']:.2f} s; host waiting "
                  f"{ph['host_wait_s']:.2f} s{'; host ' + host if host else ''}", flush=True)
        st = llm.last_stats
        side["workloads"][name] = {
            **r, "prompt_tokens": sum(map(len, prompts)),
            "prefill_computed": st.prefill_real_tokens, "cached_tokens": st.cached_tokens,
            "prefix_hit_rate": st.prefix_hit_rate, "preemptions": st.preemptions,
            "rows_per_step": st.decode_row_steps / max(1, st.decode_steps)}
        print(f"nanoserve {name}: {r['wall_s']:.2f} s, {r['tok_s']:.0f} output tok/s; "
              f"{st.decode_row_steps / max(1, st.decode_steps):.0f} rows a decode step on "
              f"average, {st.preemptions} preemptions", flush=True)
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        side["gpu_free_after_gib"] = free / 2**30
        print(f"nanoserve freed: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the GPU",
              flush=True)
    return side


def timed_generate(llm, prompts: list[list[int]], max_tokens: list[int], device: str,
                   name: str = "") -> dict:
    """One timed `generate` (greedy, ignore_eos) that must give every row exactly its
    max_tokens: wall_s, output_tokens, tok_s and, on a GPU, the runner's phase timers
    (`phases`: CUDA events around each step, no sync added) and busy_s."""
    import torch

    from nanoserve.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runner = llm.runner if device == "cuda" else None
    sync()
    if runner is not None:
        runner.phase_times()  # reset
        runner.profile = True
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t
    lens = [len(o.token_ids) for o in outs]
    if lens != list(max_tokens):
        raise SystemExit(f"nanoserve, {name}: rows did not give exactly their max_tokens")
    out = {"wall_s": wall, "output_tokens": sum(lens), "tok_s": sum(lens) / wall}
    if runner is not None:
        runner.profile = False
        ph = runner.phase_times()
        out.update(phases=ph, busy_s=ph["prefill_s"] + ph["decode_s"])
    return out


# --- vLLM, in a child process ------------------------------------------------------------------


def launch_vllm_child(script: Path, spec: dict, work: Path, stem: str,
                      args) -> tuple[int | str, dict | None, str]:
    """Run `script --vllm-child` under vLLM's environment (`args.vllm_site` alone on the
    path, in its own session, killed with its engine-core process after
    `args.vllm_timeout` s) with `spec` written to WORK/STEM.json; (its exit code or how it
    was killed, the result it wrote or None, the tail of its stderr, else stdout)."""
    spec_path, result_path = work / f"{stem}.json", work / f"{stem}_result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    # Keep the rest of the environment (NCCL_NVLS_ENABLE=0 and the like); only vLLM's site
    # on the path: neither nanoserve's repository nor its wheels.
    env = {**os.environ, "PYTHONPATH": args.vllm_site, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    out_log, err_log = work / f"{stem}.stdout", work / f"{stem}.stderr"
    # -P: not even the script's folder (benchmarks/, with its kernels.py) on sys.path
    cmd = [sys.executable, "-P", str(script.resolve()), "--vllm-child",
           "--vllm-spec", str(spec_path), "--vllm-result", str(result_path)]
    print(f"vLLM child: PYTHONPATH={args.vllm_site} {' '.join(cmd)} (logs in {work})", flush=True)
    with open(out_log, "w") as so, open(err_log, "w") as se:
        proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=so, stderr=se,
                                start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=args.vllm_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its engine-core process
            proc.wait()
            rc = f"killed after {args.vllm_timeout} s"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    return rc, result, _tail(err_log) or _tail(out_log)


def run_vllm(model_dir: Path, workloads: dict, work: Path, args) -> tuple[dict | None, str]:
    """Runs this file with --vllm-child under vLLM's environment; (results or None, error)."""
    need = max(len(p) + m for prompts, max_tokens in workloads.values()
               for p, m in zip(prompts, max_tokens))
    spec = {"model": str(model_dir), "vocab": args.vocab,
            "max_model_len": max(4096, -(-need // 256) * 256),
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "quantization": args.quantization,
            "load_format": getattr(args, "load_format", "auto"),
            "workloads": {n: {"prompts": p, "max_tokens": m,
                              "warmup_rows": (getattr(args, "warmup_rows", None)
                                              or WARMUP_ROWS.get(n, len(p)))}
                          for n, (p, m) in workloads.items()}}
    rc, result, tail = launch_vllm_child(Path(__file__), spec, work, "vllm_workload", args)
    if rc == 0 and result and set(result["workloads"]) == set(workloads):
        return result, ""
    return result, f"vLLM child failed (exit {rc}); last 40 lines of its stderr:\n{tail}"


def vllm_child(spec_path: Path, result_path: Path) -> None:
    """In the child: vLLM first (no torch, no nanoserve before it)."""
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm import TokensPrompt
    except ImportError:
        from vllm.inputs import TokensPrompt

    spec = json.loads(spec_path.read_text())
    t = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enable_prefix_caching=True,
              gpu_memory_utilization=spec["gpu_memory_utilization"],
              max_model_len=spec["max_model_len"], quantization=spec.get("quantization"),
              load_format=spec.get("load_format") or "auto")
    result = {"vllm_version": vllm.__version__, "load_s": time.perf_counter() - t,
              "max_model_len": spec["max_model_len"], "workloads": {}}
    try:  # what vLLM chose by default, for the record
        cfg = llm.llm_engine.vllm_config
        result.update(dtype=str(cfg.model_config.dtype),
                      max_num_seqs=cfg.scheduler_config.max_num_seqs,
                      max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                      kv_blocks=cfg.cache_config.num_gpu_blocks,
                      block_size=cfg.cache_config.block_size)
    except Exception as e:  # noqa: BLE001 - only the record is lost
        result["config_error"] = repr(e)

    def generate(engine, prompts, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
                  for m in max_tokens]
        return engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)

    for name, w in spec["workloads"].items():
        prompts, max_tokens = w["prompts"], w["max_tokens"]
        n = w.get("warmup_rows", len(prompts))
        generate(llm, warmup_of(prompts[:n], spec["vocab"]), max_tokens[:n])
        # generate returns finished outputs: the engine core has no work left in flight
        t = time.perf_counter()
        outs = generate(llm, prompts, max_tokens)
        wall = time.perf_counter() - t
        lens = [len(o.outputs[0].token_ids) for o in outs]
        bad = sum(n != m for n, m in zip(lens, max_tokens)) + abs(len(lens) - len(max_tokens))
        if bad:
            raise SystemExit(f"vLLM, {name}: {bad} rows did not give exactly max_tokens tokens")
        n_out = sum(lens)
        result["workloads"][name] = {"wall_s": wall, "output_tokens": n_out,
                                     "tok_s": n_out / wall,
                                     "prompt_tokens": sum(map(len, prompts))}
        print(f"vLLM {name}: {wall:.2f} s, {n_out / wall:.0f} output tok/s", flush=True)
        result_path.write_text(json.dumps(result, indent=1))  # what is done survives a crash
    del llm
    gc.collect()


# --- the table ---------------------------------------------------------------------------------


def print_table(shape: str, names: list[str], sides: dict) -> None:
    """One row per workload and side (vLLM, then each nanoserve variant in its run order),
    with its rate over vLLM's and over the first nanoserve side's."""
    ours = [s for s in sides if s != "vllm" and sides[s]]
    print("\n| shape | workload | side | wall s | output tok/s | ratio to vLLM "
          f"| ratio to {ours[0] if ours else 'nanoserve'} |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        ref = (sides.get("vllm") or {}).get("workloads", {}).get(name)
        first = (sides.get(ours[0]) or {}).get("workloads", {}).get(name) if ours else None
        for side in [s for s in ("vllm", *ours) if sides.get(s)]:
            r = sides[side].get("workloads", {}).get(name)
            if r is None:
                continue
            ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ref else "n/a"
            ratio2 = f"{r['tok_s'] / first['tok_s']:.2f}x" if first and side != "vllm" else ""
            print(f"| {shape} | {name} | {side} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | "
                  f"{ratio} | {ratio2} |")
    for side in ours:
        ns = sides[side].get("workloads", {}).get("shared")
        if ns:
            print(f"\n{side} on shared: prefix hit rate {ns['prefix_hit_rate']:.1%}; prefill "
                  f"computed {ns['prefill_computed']} of {ns['prompt_tokens']} prompt tokens "
                  f"({ns['prefill_computed'] / ns['prompt_tokens']:.1%})")
    for side in ("vllm", *ours):
        if sides.get(side):
            print(f"{side}: engine load {sides[side]['load_s']:.1f} s")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b",
                    help="the random model's shape: Llama-3.2-1B (default) or Llama-3.1-8B")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma-separated, of: " + ", ".join(WORKLOADS))
    ap.add_argument("--sides", default=None,
                    help="comma-separated, of: nanoserve, vllm (default both; --smoke: nanoserve)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the model, the vLLM child's files and the results JSON "
                         "(default: a new temporary folder)")
    ap.add_argument("--vllm-site", default="/tmp/vsite",
                    help="the vLLM child's whole PYTHONPATH (a `pip install --target` folder)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="both sides: FP8 projections quantized at load (default: bf16)")
    ap.add_argument("--variants", default=None,
                    help="nanoserve's engines, comma-separated, run one after another: bf16 or "
                         "fp8, each optionally +fp8kv (default: one, as --quantization says)")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="nanoserve's running-row limit (default: the engine's own)")
    ap.add_argument("--first-rows", type=int, default=None,
                    help="time only each workload's first N rows, for an A/B inside one call "
                         "(the warm-up: the first of those, as for the whole workload)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: no checkpoint written or read; both engines draw random weights")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's")
    ap.add_argument("--vllm-timeout", type=float, default=1500,
                    help="seconds before the vLLM child is killed")
    ap.add_argument("--smoke", action="store_true",
                    help="a 2-layer narrow model (8,192 ids), a few short rows, on the CPU, "
                         "nanoserve only")
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_child:
        vllm_child(args.vllm_spec, args.vllm_result)
        return
    if args.first_rows is not None and args.first_rows < 1:
        ap.error(f"--first-rows must be at least 1, got {args.first_rows}")
    names = [n for n in args.workloads.split(",") if n]
    sides = [s for s in (args.sides or ("nanoserve" if args.smoke else ",".join(SIDES))).split(",") if s]
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"unknown workload {n!r}; choose from {', '.join(WORKLOADS)}")
    for s in sides:
        if s not in SIDES:
            ap.error(f"unknown side {s!r}; choose from {', '.join(SIDES)}")
    if args.smoke and "vllm" in sides:
        ap.error("--smoke runs nanoserve alone (on the CPU)")
    if args.smoke and args.quantization:
        ap.error("--smoke runs on the CPU, which has no FP8 compute: leave out --quantization")
    variants = [v for v in (args.variants or ("fp8" if args.quantization else "bf16")).split(",")
                if v]
    try:
        options = {v: variant_options(v) for v in variants}
    except ValueError as e:
        ap.error(str(e))
    if args.smoke and any(q or kv != "auto" for q, kv in options.values()):
        ap.error("--smoke runs on the CPU, which has no FP8 compute: --variants bf16")

    import torch

    from benchmarks.gpu_job import SHAPES

    device, config = "cuda", SHAPES[args.shape]
    if args.smoke:
        device = "cpu"
        config = {**config, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                  "vocab_size": 8192}  # the CPU's step time is mostly the LM head
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    args.vocab = config["vocab_size"]
    work = args.out or Path(tempfile.mkdtemp(prefix="nanoserve-vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    name = f"llama-{args.shape}{'-smoke' if args.smoke else ''}-random"
    if args.load_format == "dummy":
        model_dir = config_folder(work / f"{name}-config", config)
    else:
        model_dir = model_folder(work / name, device, config)
    workloads = make_workloads(names, args.smoke, args.vocab)
    if args.first_rows:  # an A/B inside one call; the headline figures time whole workloads
        workloads = {n: (p[:args.first_rows], m[:args.first_rows])
                     for n, (p, m) in workloads.items()}
    for n, (p, m) in workloads.items():
        print(f"{n}: {len(p)} rows, {sum(map(len, p))} prompt tokens, {sum(m)} output tokens",
              flush=True)

    results: dict = {"shape": args.shape, "quantization": args.quantization,
                     "smoke": args.smoke, "device": device,
                     "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                     "torch": torch.__version__, "model": str(model_dir), "sides": {}}
    error = ""
    if "vllm" in sides:  # first: its child exits and leaves the GPU whole for nanoserve
        results["sides"]["vllm"], error = run_vllm(model_dir, workloads, work, args)
        if error:
            results["vllm_error"] = error
            print(error, flush=True)
    if "nanoserve" in sides:
        for v in variants:
            key = "nanoserve" if len(variants) == 1 else f"nanoserve {v}"
            results["sides"][key] = run_nanoserve(model_dir, workloads, device, args.vocab,
                                                  *options[v], args.max_batch_size,
                                                  args.load_format)
    label = args.shape + (f" {args.quantization}" if args.quantization else "")
    print_table(label, names, results["sides"])
    suffix = (f"_{args.quantization}" if args.quantization else "") + ("_smoke" if args.smoke else "")
    path = work / f"vs_vllm_{args.shape}{suffix}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}", flush=True)


if __name__ == "__main__":
    main()
