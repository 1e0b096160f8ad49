"""FP8 weights against bf16 on one GPU: output tokens per second of `LLM.generate` on
nano-vllm's workload (256 rows of random token ids, `random.seed(0)`, prompt and output
lengths uniform in [100, 1024], ignore_eos, greedy; the workload of benchmarks/gpu_job.py),
for a Llama-shaped model with random weights drawn on the GPU (`LLM(load_format="dummy")`:
no checkpoint file; FP8 projections drawn and quantized one matrix at a time):

- 1b: Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, head_dim 64, tied);
- 8b: Llama-3.1-8B (hidden 4096, 32 layers, 32/8 heads, head_dim 128, intermediate 14336);
- 70b: Llama-3.1-70B (hidden 8192, 80 layers, 64/8 heads, head_dim 128, intermediate
  28672): FP8 only, its bf16 weights (141 GB) do not fit one H200.
All vocab 128256. Runs: bf16; fp8; fp8-unfused (fp8 with each activation quantized by a
launch of its own before its projection, as before the norms and silu-and-mul quantized
their outputs: `nanoserve.weights.fp8.fuse_activation_quant` skipped); fp8+kv (fp8 with an FP8 KV
cache, `kv_cache_dtype="fp8"`). The runs go one after the other in one process, each with a warm-up
pass over the same lengths (other token ids) first. Prints one Markdown table: rate, ratio
to bf16, the memory split (weights / KV pool / CUDA graphs), the pool's tokens, the largest
decode batch, and the device's prefill and decode seconds.

    python3 -m benchmarks.fp8 --shape 8b [--rows 256] [--runs bf16 fp8] [--kv-cache-gib G]
    python3 -m benchmarks.fp8 --smoke      # 2 layers, 4 short rows, CPU: the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import markdown_table
from benchmarks.gpu_job import LLAMA_1B, make_workload

LLAMA_8B = {
    **LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64}
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B, "70b": LLAMA_70B}
GIB = 2**30


def model_folder(folder: Path, config: dict) -> Path:
    """config.json and a word-level tokenizer over the whole vocabulary: all that
    `load_format="dummy"` reads."""
    from tokenizers import Tokenizer, models

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {f"<t{i}>": i for i in range(config["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="<t0>")).save(str(folder / "tokenizer.json"))
    return folder


def run_one(folder: Path, weights: str, prompts, max_tokens, device: str,
            kv_cache_bytes: int | None) -> dict:
    """One engine over the workload: a warm-up pass, then the timed one."""
    import nanoserve.weights.dummy_weights as dummy
    from nanoserve.errors import NanoserveError
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    quantization = "fp8" if weights.startswith("fp8") else None
    kv_cache_dtype = "fp8" if weights.endswith("+kv") else "auto"
    fuse = dummy.fuse_activation_quant
    if weights == "fp8-unfused":  # before the graphs are captured at load
        dummy.fuse_activation_quant = lambda model: model
    t = time.perf_counter()
    try:
        llm = LLM(str(folder), device=device, load_format="dummy", quantization=quantization,
                  kv_cache_bytes=kv_cache_bytes, kv_cache_dtype=kv_cache_dtype)
    except NanoserveError as e:
        return {"weights": weights, "refused": str(e)}
    finally:
        dummy.fuse_activation_quant = fuse
    load_s = time.perf_counter() - t
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    largest = count_decode_rows(llm.runner)
    vocab = llm.config.vocab_size
    warm = [[(tok + 1) % vocab for tok in p] for p in prompts]  # same lengths, other ids
    llm.generate(warm, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
    sync()
    largest[0] = 0
    llm.runner.profile = device == "cuda"
    llm.runner.phase_times()  # reset
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t
    phases = llm.runner.phase_times()
    assert [len(o.token_ids) for o in outs] == max_tokens
    n_out = sum(max_tokens)
    model_bytes = sum(t.numel() * t.element_size()
                      for t in (*llm.model.parameters(), *llm.model.buffers()))
    pool = llm.pool
    kv_tokens = pool.num_blocks * pool.block_size
    kv_bytes = sum(t.numel() * t.element_size() for t in (*pool.k, *pool.v)) \
        if hasattr(pool, "k") else None
    result = {"weights": weights, "tok_s": n_out / wall, "wall_s": wall, "load_s": load_s,
              "output_tokens": n_out, "weights_gib": model_bytes / GIB,
              "kv_gib": None if kv_bytes is None else kv_bytes / GIB, "kv_tokens": kv_tokens,
              "graphs_gib": llm.runner.graph_bytes / GIB, "largest_batch": largest[0],
              "prefill_s": phases.get("prefill_s"), "decode_s": phases.get("decode_s"),
              "peak_gib": torch.cuda.max_memory_allocated() / GIB if device == "cuda" else None}
    print(json.dumps(result), flush=True)
    del llm.runner.decode  # the counting wrapper (it holds the runner: a cycle)
    del llm, outs
    gc.collect()  # the next run's KV pool is sized from the memory this one frees
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def count_decode_rows(runner) -> list[int]:
    """Wrap this runner's decode step to keep the most rows one step carried: [max]."""
    largest = [0]
    decode = runner.decode

    def counted(slots, *args, **kwargs):
        largest[0] = max(largest[0], len(slots))
        return decode(slots, *args, **kwargs)

    runner.decode = counted
    return largest


def table(results: list[dict], shape: str, device: str) -> str:
    base = next((r["tok_s"] for r in results if r["weights"] == "bf16" and "tok_s" in r), None)
    rows = []
    for r in results:
        if "refused" in r:
            rows.append([r["weights"], "refused: " + r["refused"], *[""] * 9])
            continue
        kv = "n/a" if r["kv_gib"] is None else f"{r['kv_gib']:.1f}"
        rows.append([r["weights"], f"{r['tok_s']:,.0f}",
                     "" if base is None else f"{r['tok_s'] / base:.2f}x",
                     f"{r['weights_gib']:.1f}", kv, f"{r['kv_tokens']:,}",
                     f"{r['graphs_gib']:.2f}", str(r["largest_batch"]),
                     "" if r["prefill_s"] is None else f"{r['prefill_s']:.1f}",
                     "" if r["decode_s"] is None else f"{r['decode_s']:.1f}",
                     f"{r['wall_s']:.1f}"])
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    head = (f"Llama-{shape} shape, random weights, nano-vllm workload, one {name}, "
            f"torch {torch.__version__}\n\n")
    return head + markdown_table(
        ["weights", "output tok/s", "vs bf16", "weights GiB", "KV GiB", "KV tokens",
         "graphs GiB", "largest batch", "prefill s", "decode s", "wall s"], rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--runs", nargs="+", choices=("bf16", "fp8", "fp8-unfused", "fp8+kv"),
                    default=None,
                    help="default: bf16 fp8 (70b: fp8 only)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="the KV pool's size for every run (default: 80%% of the memory "
                         "free after the weights, so FP8 runs get a larger pool)")
    ap.add_argument("--smoke", action="store_true",
                    help="2 layers of the 1b shape, 4 short rows, on the CPU (fp8 is refused "
                         "there): checks the script runs")
    args = ap.parse_args(argv)
    config, device, lo, hi = SHAPES[args.shape], "cuda", 100, 1024
    if args.smoke:
        config, device, lo, hi = {**LLAMA_1B, "num_hidden_layers": 2}, "cpu", 4, 12
        args.rows, args.shape = 4, "1b (2 layers)"
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    runs = args.runs or (["fp8"] if args.shape == "70b" else ["bf16", "fp8"])
    work = Path(tempfile.mkdtemp(prefix="nanoserve-fp8-bench-"))
    folder = model_folder(work / "model", config)
    prompts, max_tokens = make_workload(work / "workload.parquet", args.rows,
                                        config["vocab_size"], lo=lo, hi=hi)
    kv = None if args.kv_cache_gib is None else int(args.kv_cache_gib * GIB)
    if args.smoke and kv is None:
        kv = 64 << 20
    results = [run_one(folder, w, prompts, max_tokens, device, kv) for w in runs]
    print(table(results, args.shape, device))


if __name__ == "__main__":
    main()
