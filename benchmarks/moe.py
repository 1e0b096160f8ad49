"""Mixture-of-experts on one GPU: the Qwen3-30B-A3B shape (random bf16 weights drawn on the
device: `load_format="dummy"` on both sides, no checkpoint on disk) on 4,096 rows of
nano-vllm's distribution (prompt and output lengths uniform in [100, 1024], seed 0; greedy,
ignore_eos, token ids), through `benchmarks.vs_vllm`'s machinery: vLLM 0.26.0 in its
defaults first (and, run `vllm-fp8`, with `quantization="fp8"`), in a child process with
only --vllm-site on its PYTHONPATH, then nanoserve
in bf16 and nanoserve with FP8 experts and projections quantized at load
(`quantization="fp8"`), in this process, one engine after the other.

    python3 -m benchmarks.moe [--runs vllm,vllm-fp8,bf16,fp8] [--rows 4096] [--warmup-rows 512]
        [--out DIR] [--vllm-site /tmp/vsite]
    python3 -m benchmarks.moe --fit [--try-load]
    python3 -m benchmarks.moe --smoke

Each engine first runs an untimed warm-up over the first --warmup-rows rows (other token
ids, same lengths). Writes DIR/moe_qwen3_30b_a3b_<runs>.json and prints one table (wall
time, output tok/s, each run's rate over vLLM's and over ours in bf16) over every run whose
results are in DIR: runs too long for one command can go in separate calls with the same
--out (`--runs vllm`, then `--runs bf16`, then `--runs fp8`).

--fit: for each MoE shape in `FIT_SHAPES`, the weight bytes in bf16 and in FP8 (experts and
attention projections e4m3 with one float32 scale per row; embeddings, norms, routers and
the LM head bf16), against the GPU's 141 GB (an H200; `torch.cuda.mem_get_info` when a GPU
is there), with at least `KV_RESERVE` of it left for the KV cache; names the largest shape
that fits. With --try-load (on a GPU) it also builds the Qwen3-235B-A22B shape in FP8
(`LLM(load_format="dummy", quantization="fp8")`) and reports whether it loads.
--smoke: a 2-layer, narrow Qwen3-MoE shape on the CPU, a few short rows, ours in bf16
only (tests/test_bench_moe.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.vs_vllm import config_folder, nanovllm_workload, run_nanoserve, run_vllm

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "use_sliding_window": False, "sliding_window": None,
}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
                   "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                   "num_attention_heads": 64}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
}
MIXTRAL_8X22B = {**MIXTRAL_8X7B, "hidden_size": 6144, "intermediate_size": 16384,
                 "num_hidden_layers": 56, "num_attention_heads": 48, "vocab_size": 32768,
                 "max_position_embeddings": 65536}
FIT_SHAPES = {"Qwen3-30B-A3B": QWEN3_30B_A3B, "Mixtral-8x7B": MIXTRAL_8X7B,
              "Mixtral-8x22B": MIXTRAL_8X22B, "Qwen3-235B-A22B": QWEN3_235B_A22B}
H200_BYTES = 141e9
KV_RESERVE = 0.10  # of the GPU's memory left for the KV cache and activations, at least
RUNS = ("vllm", "vllm-fp8", "bf16", "fp8")  # vllm-fp8: vLLM with quantization="fp8"
SMOKE = {**QWEN3_30B_A3B, "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256,
         "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2}


def weight_bytes(config: dict, fp8: bool) -> int:
    """The checkpoint's weight bytes: bf16 everywhere, or (fp8) every decoder projection and
    expert matrix in e4m3 with a float32 scale per output row (nanoserve's FP8 layout)."""
    from nanoserve.model.config import ModelConfig
    from nanoserve.weights.weights import expected_shapes

    total = 0
    for name, shape in expected_shapes(ModelConfig.from_hf_dict(config)).items():
        n = 1
        for s in shape:
            n *= s
        quantized = fp8 and (name.endswith(("_proj.weight", "gate_up_proj", "down_proj")))
        total += n + 4 * n // shape[-1] if quantized else 2 * n
    return total


def fit_report(gpu_bytes: float) -> dict:
    rows = {}
    usable = gpu_bytes * (1 - KV_RESERVE)
    print(f"\n| shape | bf16 GB | fits | FP8 GB | fits |  (GPU {gpu_bytes / 1e9:.0f} GB, "
          f"{KV_RESERVE:.0%} kept for the KV cache)")
    print("|---|---|---|---|---|")
    for name, config in FIT_SHAPES.items():
        b16, b8 = weight_bytes(config, False), weight_bytes(config, True)
        rows[name] = {"bf16_bytes": b16, "fp8_bytes": b8, "bf16_fits": b16 <= usable,
                      "fp8_fits": b8 <= usable}
        print(f"| {name} | {b16 / 1e9:.1f} | {'yes' if b16 <= usable else 'no'} | "
              f"{b8 / 1e9:.1f} | {'yes' if b8 <= usable else 'no'} |")
    fitting = [(r["fp8_bytes"], n) for n, r in rows.items() if r["fp8_fits"]]
    largest = max(fitting)[1] if fitting else None
    big = QWEN3_235B_A22B
    one = {**big, "num_hidden_layers": 1}
    per_layer = weight_bytes({**big, "num_hidden_layers": 2}, True) - weight_bytes(one, True)
    layers = int((usable - (weight_bytes(one, True) - per_layer)) // per_layer)
    print(f"largest MoE shape that fits (FP8): {largest}; of Qwen3-235B-A22B's "
          f"{big['num_hidden_layers']} layers, {layers} would ({per_layer / 1e9:.2f} GB each)")
    return {"gpu_bytes": gpu_bytes, "kv_reserve": KV_RESERVE, "shapes": rows,
            "largest_fp8": largest, "qwen3_235b_fp8_layers_that_fit": layers}


def try_load(config: dict, work: Path) -> dict:
    """Build `config` in FP8 from random weights on the GPU; whether it fit."""
    import torch

    from nanoserve.llm import LLM

    folder = config_folder(work / "qwen3-235b-a22b-dummy", config)
    t = time.perf_counter()
    try:
        llm = LLM(str(folder), device="cuda", load_format="dummy", quantization="fp8")
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        line = str(e).splitlines()[0]
        print(f"Qwen3-235B-A22B in FP8: does not load ({line})", flush=True)
        return {"loads": False, "error": line, "seconds": time.perf_counter() - t}
    free, _ = torch.cuda.mem_get_info()
    print(f"Qwen3-235B-A22B in FP8: loads, {free / 2**30:.1f} GiB left", flush=True)
    del llm
    return {"loads": True, "free_after_gib": free / 2**30}


def print_table(sides: dict) -> None:
    def rate(run):
        return ((sides.get(run) or {}).get("workloads", {}).get("nanovllm") or {}).get("tok_s")

    def over(r, base):
        return f"{r / rate(base):.2f}x" if rate(base) else "n/a"

    print("\n| run | wall s | output tok/s | vs vLLM | vs vLLM fp8 | vs ours bf16 |")
    print("|---|---|---|---|---|---|")
    for run in RUNS:
        r = (sides.get(run) or {}).get("workloads", {}).get("nanovllm")
        if r is None:
            continue
        print(f"| {run} | {r['wall_s']:.2f} | {r['tok_s']:.0f} | {over(r['tok_s'], 'vllm')} | "
              f"{over(r['tok_s'], 'vllm-fp8')} | {over(r['tok_s'], 'bf16')} |")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated, of: " + ", ".join(RUNS))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--warmup-rows", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's")
    ap.add_argument("--vllm-timeout", type=float, default=3000)
    ap.add_argument("--fit", action="store_true", help="which MoE shapes fit one GPU")
    ap.add_argument("--try-load", action="store_true",
                    help="with --fit: build Qwen3-235B-A22B in FP8 on the GPU")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, ours bf16")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="nanoserve-moe-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    if args.fit:
        gpu = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else H200_BYTES
        result = fit_report(float(gpu))
        if args.try_load:
            if not torch.cuda.is_available():
                raise SystemExit("--try-load needs a CUDA GPU")
            result["qwen3_235b_a22b_fp8"] = try_load(QWEN3_235B_A22B, work)
        (work / "moe_fit.json").write_text(json.dumps(result, indent=2))
        return
    runs = [r for r in args.runs.split(",") if r]
    for r in runs:
        if r not in RUNS:
            ap.error(f"unknown run {r!r}; choose from {', '.join(RUNS)}")
    device, config, rows, lo, hi = "cuda", QWEN3_30B_A3B, args.rows, 100, 1024
    if args.smoke:
        device, config, rows, lo, hi = "cpu", SMOKE, 4, 4, 12
        runs = ["bf16"]
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    args.vocab, args.quantization, args.load_format = config["vocab_size"], None, "dummy"
    if args.smoke:
        args.warmup_rows = 2
    model_dir = config_folder(work / "qwen3-30b-a3b-dummy", config)
    workloads = {"nanovllm": nanovllm_workload(rows, args.vocab, lo=lo, hi=hi)}
    prompts, max_tokens = workloads["nanovllm"]
    print(f"{len(prompts)} rows, {sum(map(len, prompts))} prompt tokens, {sum(max_tokens)} "
          f"output tokens", flush=True)
    result = {"shape": "qwen3-30b-a3b" if not args.smoke else "smoke", "rows": rows,
              "device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "sides": {}}
    for run in ("vllm", "vllm-fp8"):  # first: its child exits and leaves the GPU whole
        if run in runs:
            args.quantization = "fp8" if run == "vllm-fp8" else None
            result["sides"][run], error = run_vllm(model_dir, workloads, work, args)
            args.quantization = None
            if error:
                result[f"{run}_error"] = error
                print(error, flush=True)
    for run in ("bf16", "fp8"):
        if run in runs:
            result["sides"][run] = run_nanoserve(
                model_dir, workloads, device, args.vocab, "fp8" if run == "fp8" else None,
                load_format="dummy", warmup_rows=args.warmup_rows)
    stem = f"moe_{result['shape'].replace('-', '_')}"
    path = work / f"{stem}_{'_'.join(runs).replace('-', '_')}.json"
    path.write_text(json.dumps(result, indent=2))
    sides = {}
    for earlier in sorted(work.glob(f"{stem}_*.json"), key=lambda p: p.stat().st_mtime):
        sides.update(json.loads(earlier.read_text())["sides"])  # the latest of each run
    print_table(sides)
    print(f"results: {path}", flush=True)


if __name__ == "__main__":
    main()
