"""Throughput of the engine and of the Ray batch job on one GPU.

Workload (DESIGN.md's target): N sequences (default 256) of random token ids, prompt
length uniform in [100, 1024], output length uniform in [100, 1024], ignore_eos, on a
Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64,
vocab 128256, tied) with random bf16 weights. Prints one table: the engine called
directly (`LLM.generate`) and the same rows through `run_batch_job` (one actor per GPU),
plus, when the default model is in the cache, the batch job over examples/prompts.jsonl.

    python -m benchmarks.gpu_job [--rows 256] [--skip-job] [--out FILE] [--smoke]

The engine runs twice, side by side: decode steps launched kernel by kernel ("eager") and
replayed as a CUDA graph ("graph"; "static" with --smoke on the CPU).

The bfloat16 KV cache against the FP8 one, in one call (each engine run once per cache
dtype), e.g. on issue 24's long-output workload on the Llama-3.1-8B shape:

    python -m benchmarks.gpu_job --skip-job --shape 8b --rows 1024 --prompt-len 50 200 \
        --output-len 1000 2000 --engine-runs continuous:graph --kv-cache-dtype auto fp8 \
        --max-batch-size 1024 --warmup-rows 128

(`--max-batch-size`: the engine's most running rows, default 256; with 1,024 the bfloat16
pool runs out and preempts while the FP8 pool holds every row. `--warmup-rows`: a shorter
untimed warm-up.)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


LLAMA_8B = {  # Llama-3.1-8B's shape
    **LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False,
    "rope_scaling": {**LLAMA_1B["rope_scaling"], "factor": 8.0},
}
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}


def make_random_model(folder: Path, device: str, config: dict = LLAMA_1B) -> Path:
    """A checkpoint folder with random bf16 weights and a word-level tokenizer over the
    whole vocabulary (so every id decodes)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    from nanoserve.model.config import ModelConfig
    from nanoserve.weights.weights import expected_shapes

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape in expected_shapes(ModelConfig.from_hf_dict(config)).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
        tensors[name] = t.cpu()
    save_file(tensors, str(folder / "model.safetensors"))
    vocab = {f"<t{i}>": i for i in range(config["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(folder / "tokenizer.json"))
    return folder


def make_workload(path: Path, rows: int, vocab: int, seed: int = 0,
                  lo: int = 100, hi: int = 1024,
                  out_lo: int | None = None, out_hi: int | None = None) -> tuple[list, list]:
    """Prompt lengths uniform in [lo, hi], output lengths in [out_lo, out_hi] (default the
    prompts' range)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(rows)]
    max_tokens = [rng.randint(out_lo or lo, out_hi or hi) for _ in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "prompt_token_ids": prompts,
                             "max_tokens": max_tokens}), path)
    return prompts, max_tokens


def bench_engine(model_dir: Path, prompts, max_tokens, device: str = "cuda",
                 decode_step: str = "auto", scheduler: str = "static",
                 warmup: tuple[list, list] | None = None, kv_cache_dtype: str = "auto",
                 max_batch_size: int = 256) -> dict:
    """warmup: (prompts, max_tokens) run once, untimed, first: the same lengths as the
    workload but other tokens, so every kernel variant is compiled and no prompt block is
    in the prefix cache when the timed run starts."""
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    t = time.perf_counter()
    llm = LLM(str(model_dir), device=device, decode_step=decode_step, scheduler=scheduler,
              kv_cache_dtype=kv_cache_dtype, max_batch_size=max_batch_size)
    load_s = time.perf_counter() - t
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    w_prompts, w_max = warmup or (prompts[:4], max_tokens[:4])
    llm.generate(w_prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in w_max])
    sync()
    largest = [0]
    if llm.runner is not None:
        from benchmarks.fp8 import count_decode_rows

        largest = count_decode_rows(llm.runner)
        llm.runner.phase_times()  # reset
        llm.runner.profile = True
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t
    phases = llm.runner.phase_times() if llm.runner is not None else {}
    if phases:
        busy = phases["prefill_s"] + phases["decode_s"]
        print(f"{scheduler}:{decode_step} ({kv_cache_dtype} KV, {llm.pool.num_tokens} tokens, "
              f"at most {max_batch_size} rows, largest decode batch {largest[0]}, "
              f"{llm.last_stats.preemptions} preemptions): wall {wall:.2f} s; device prefill "
              f"{phases['prefill_s']:.2f} s, decode {phases['decode_s']:.2f} s, idle "
              f"{wall - busy:.2f} s; host waiting for the device {phases['host_wait_s']:.2f} s; "
              f"load {load_s:.1f} s (graphs {llm.runner.capture_s:.1f} s, "
              f"{llm.runner.graph_bytes / 2**20:.0f} MiB)", flush=True)
    n_out = sum(len(o.token_ids) for o in outs)
    assert [len(o.token_ids) for o in outs] == max_tokens
    stats = llm.last_stats
    dtype = str(llm.dtype).removeprefix("torch.")
    kv = str(llm.pool.k[0].dtype).removeprefix("torch.")
    shape = f"{llm.config.num_hidden_layers} x {llm.config.hidden_size} Llama shape"
    if llm.runner is not None:
        del llm.runner.decode  # the counting wrapper (it holds the runner: a cycle)
    del llm
    torch.cuda.empty_cache()
    how = f"{scheduler} scheduler, decode_step={decode_step}, {kv} KV cache"
    return {"what": f"engine LLM.generate, {shape}, random ({dtype}), {how}",
            "rows": len(prompts), "token_ids": [o.token_ids for o in outs],
            "output_tokens": n_out, "wall_s": wall, "tok_s": n_out / wall,
            "padding_waste": stats.padding_waste, "early_finish_waste": stats.early_finish_waste}


def bench_job(input_path: Path, out_dir: Path, model: str, what: str, **options) -> dict:
    from ray_jobs import run_batch_job

    t = time.perf_counter()
    s = run_batch_job(str(input_path), str(out_dir), model=model, overwrite=True,
                      progress=False, **options)
    wall = time.perf_counter() - t
    table = pq.read_table(out_dir)
    assert table.num_rows == s.rows, (table.num_rows, s.rows)
    return {"what": what, "rows": s.rows, "output_tokens": s.output_tokens, "wall_s": wall,
            "tok_s": s.output_tokens / wall, "padding_waste": s.padding_waste,
            "early_finish_waste": None, "error_rows": s.error_rows}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--skip-job", action="store_true", help="only the engine")
    ap.add_argument("--engine-runs", nargs="+", default=None, metavar="SCHEDULER:DECODE_STEP",
                    help="engine runs side by side, e.g. static:graph continuous:eager "
                         "continuous:graph:given-order,fixed-splits (decode steps not ordered "
                         "longest context first; partitions of the decode read sized for the "
                         "longest possible row) "
                         "(default: static:graph continuous:graph; on the CPU the same "
                         "with the uncaptured 'static' step)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                    help="each engine run once per KV cache dtype, side by side (e.g. auto fp8)")
    ap.add_argument("--max-batch-size", type=int, default=256,
                    help="the engine's most rows in one batch (LLM's max_batch_size)")
    ap.add_argument("--warmup-rows", type=int, default=None,
                    help="rows of the untimed warm-up run before each engine run (default: "
                         "as many as the workload; fewer save time on long workloads)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b",
                    help="the random model's shape: Llama-3.2-1B (default) or Llama-3.1-8B")
    ap.add_argument("--prompt-len", nargs=2, type=int, default=[100, 1024], metavar=("LO", "HI"))
    ap.add_argument("--output-len", nargs=2, type=int, default=None, metavar=("LO", "HI"),
                    help="output lengths (default: the prompt lengths' range)")
    ap.add_argument("--out", type=Path, default=None, help="write results JSON here")
    ap.add_argument("--smoke", action="store_true",
                    help="a 2-layer model, 4 short rows, on the CPU: checks the script runs")
    args = ap.parse_args()
    device, config, (lo, hi) = "cuda", SHAPES[args.shape], args.prompt_len
    out_lo, out_hi = args.output_len or (lo, hi)
    if args.smoke:
        device, config, lo, hi = "cpu", {**LLAMA_1B, "num_hidden_layers": 2}, 4, 12
        out_lo, out_hi = lo, hi
        args.rows = 4
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    work = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    model_dir = make_random_model(work / f"llama-{args.shape}-random", device, config)
    prompts, max_tokens = make_workload(work / "workload.parquet", args.rows,
                                        config["vocab_size"], lo=lo, hi=hi, out_lo=out_lo,
                                        out_hi=out_hi)
    # Side by side (default: each kernel launched from Python, then the CUDA-graph step).
    # Same lengths as the workload (same draws of the lengths), other token ids.
    warm_prompts = [[(t + 1) % config["vocab_size"] for t in p] for p in prompts]
    runs = args.engine_runs or (["static:graph", "continuous:graph"] if device == "cuda"
                                else ["static:static", "continuous:static"])
    results = []
    from nanoserve.cache import step_cache
    from nanoserve.scheduling import scheduler as continuous_scheduler
    for run in runs:
        scheduler, decode_step, variant = (run.split(":") + ["", ""])[:3]
        # given-order: decode steps list their rows as they run, not longest first;
        # fixed-splits: the decode read's partitions sized for the longest possible row
        continuous_scheduler.ORDER_LONGEST_FIRST = "given-order" not in variant
        step_cache.EVEN_SPLITS = "fixed-splits" not in variant
        for kv_cache_dtype in args.kv_cache_dtype:
            results.append(bench_engine(model_dir, prompts, max_tokens, device,
                                        decode_step or "auto", scheduler,
                                        (warm_prompts[:args.warmup_rows],
                                         max_tokens[:args.warmup_rows]), kv_cache_dtype,
                                        args.max_batch_size))
            if variant:
                results[-1]["what"] += f", {variant}"
    continuous_scheduler.ORDER_LONGEST_FIRST = True
    step_cache.EVEN_SPLITS = True
    first = results[0]["token_ids"]
    for r in results[1:]:
        same = sum(a == b for a, b in zip(first, r["token_ids"]))
        print(f"rows with the same tokens as the first engine run ({results[0]['what']}) in "
              f"{r['what']}: {same} of {len(prompts)}; rate {r['tok_s'] / results[0]['tok_s']:.2f}x")
    for r in results:
        r.pop("token_ids")
    if not args.skip_job:
        results.append(bench_job(work / "workload.parquet", work / "out-1b", str(model_dir),
                                 f"batch job, 1 actor, Llama-{args.shape} shape, random",
                                 ignore_eos=True,
                                 batch_size=256, num_workers=1))
        from nanoserve.weights.model_store import default_model_path

        if default_model_path().exists():
            results.append(bench_job(Path("examples/prompts.jsonl"), work / "out-smollm2",
                                     "smollm2-135m-instruct", "batch job, 1 actor, examples/prompts.jsonl, SmolLM2",
                                     max_tokens=256, num_workers=1))
    print("\n| run | rows | output tokens | wall s | output tok/s | padding waste | early-finish waste |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['what']} | {r['rows']} | {r['output_tokens']} | {r['wall_s']:.1f} | "
              f"{r['tok_s']:.0f} | {r['padding_waste']:.1%} | {_pct(r['early_finish_waste'])} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
