"""Where the GPU's time goes in the engine's runs, kernel by kernel, on one GPU.

Three tables, all on the throughput benchmark's workload and model (`benchmarks/gpu_job.py`:
256 rows, prompts and outputs uniform in [100, 1024], Llama-3.2-1B shape, random bf16):

1. Kernel time by kind over one whole `LLM.generate` per scheduler (torch.profiler, CUDA
   activity; kernels inside CUDA graphs are recorded one by one): GEMMs, decode attention,
   prefill attention, K/V stores, norms, rotary, SwiGLU, sampling and the rest, with the
   bytes the decode attention had to read and the bandwidth that makes.
2. The captured decode step per bucket with every row a padding row (context 1): the
   step's floor (weights, LM head and kernel latency), which a drained batch pays per step.
3. The decode attention kernel on rows of mixed context lengths (uniform in [200, 2048], as
   in the middle of a continuous run), rows in their given order against rows ordered
   longest first, and longest first at forced split counts (partitions of 4096 / splits
   tokens); 16 calls (layers) in one CUDA graph, each over its own cache.
4. The kernels of one captured step (padding rows) at buckets 1, 64 and 256.

With `--shape 8b` the engine tables (1, 2 and 4) run the Llama-3.1-8B shape, its random
weights drawn on the GPU (`LLM(load_format="dummy")`); `--skip-micro` leaves out tables 3
and the GEMM table (which use the 1B shape).

    python -m benchmarks.step_profile [--rows 256] [--runs continuous:graph static:graph]
    [--shape 1b|8b] [--skip-micro] [--quantization fp8] [--fp8-gemms]

`--quantization fp8` runs the engine tables with FP8 projections; `--fp8-gemms` adds the
8B shape's decode GEMMs in bf16 against `torch._scaled_mm` (row-wise scales, with and
without fast accumulation, and one scale per tensor).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from benchmarks.gpu_job import LLAMA_1B, LLAMA_8B, make_random_model, make_workload

KINDS = [  # (kind, regular expression over the kernel's name), first match wins
    ("decode attention", r"_paged_decode_kernel"),
    ("split combine", r"_combine_splits"),
    ("paged prefill attention", r"_paged_prefill"),
    ("prefill attention", r"prefill"),
    ("K/V store", r"store_kv|_store"),
    ("RMSNorm (+ add)", r"rms"),
    ("rotary", r"rotary"),
    ("SwiGLU", r"silu"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|sm90|Kernel2|gemv"),
    ("argmax / sampling", r"argmax|reduce|gumbel|topk|sort|softmax|exponential|philox"),
    ("index / copy", r"index|gather|scatter|copy|Copy|elementwise_kernel|fill"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def kernel_times(prof) -> tuple[dict[str, list[float]], dict[str, float]]:
    """{kind: [count, microseconds]} and {kernel name: microseconds} from a profile."""
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        by_kind[kind_of(e.name)][0] += 1
        by_kind[kind_of(e.name)][1] += us
        by_name[e.name] += us
    return by_kind, by_name


def decode_context_bytes(prompts, max_tokens, layers: int, kv_bytes_per_token_layer: int) -> int:
    """Bytes of K/V the decode steps must read at least: each decode step of a row reads
    its whole context once per layer (the step for output token j > 0 sees prompt + j)."""
    tokens = 0
    for p, m in zip(prompts, max_tokens):
        n = len(p)
        tokens += sum(n + j for j in range(1, m))
    return tokens * layers * kv_bytes_per_token_layer


def profile_engine(model_dir: Path, prompts, max_tokens, scheduler: str, step: str,
                   warm, load_format: str = "auto", quantization: str | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    llm = LLM(str(model_dir), device="cuda", decode_step=step, scheduler=scheduler,
              load_format=load_format, quantization=quantization)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(warm[0], [SamplingParams(max_tokens=m, ignore_eos=True) for m in warm[1]])
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    by_kind, by_name = kernel_times(prof)
    if not by_kind:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
        return
    total = sum(v[1] for v in by_kind.values())
    print(f"\n### {scheduler}:{step} ({quantization or 'bf16'} weights): {n_out} output "
          f"tokens in {wall:.2f} s under the profiler "
          f"({n_out / wall:,.0f} tok/s); kernel time {total / 1e6:.2f} s "
          f"({total / 1e6 / wall:.0%} of the wall)\n")
    print("| kind | kernels | ms | share of kernel time |")
    print("|---|---:|---:|---:|")
    for kind, (count, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {count:,} | {us / 1e3:,.1f} | {us / total:.1%} |")
    cfg = llm.config
    need = decode_context_bytes(prompts, max_tokens, cfg.num_hidden_layers,
                                2 * cfg.num_key_value_heads * cfg.head_dim * 2)
    att = by_kind.get("decode attention", [0, 0.0])[1]
    if att:
        print(f"\ndecode attention: {need / 1e9:,.0f} GB of context K/V read at least, "
              f"{need / (att * 1e-6) / 1e12:.2f} TB/s over the kernel's time")
    print("\ntop kernels:")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {us / 1e3:9.1f} ms  {kind_of(name):22s} {name[:110]}")
    if scheduler == "continuous" and step == "graph":
        step_floor(llm)
        step_kernels(llm)
    del llm
    torch.cuda.empty_cache()


def step_floor(llm) -> None:
    """Replay each bucket's graph with padding rows only (context 1, no store)."""
    runner = llm.runner
    runner._inputs[0].fill_(runner.pad)
    runner._inputs[1].zero_()
    runner._inputs[2].fill_(-1)
    runner._inputs[3].fill_(1)
    print("\n| bucket | step floor us (context 1) |")
    print("|---:|---:|")
    for b in runner.buckets:
        g = runner._graphs[b]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"| {b} | {start.elapsed_time(end) / 20 * 1e3:,.0f} |")


def attention_balance(batch: int, splits=(None,), lo: int = 200, hi: int = 2048,
                      seed: int = 0) -> None:
    """Rows in their given order and longest first (default split choice), then longest
    first at each forced split count in `splits`."""
    from benchmarks.kernels import bench_ms, graphed_calls
    from nanoserve_kernels.paged_attention import paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv, d, block = 32, 8, 64, 16
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen, device="cuda", dtype=torch.int32)
    width = -(-hi // block)
    num_blocks = 1 + batch * width
    tables = (torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1).view(
        batch, width).to(torch.int32)
    q = torch.randn((batch, hq, d), generator=gen, device="cuda", dtype=torch.bfloat16)
    layers = 16
    shape = (num_blocks, block, hkv, d)
    caches = [tuple(torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2)) for _ in range(layers)]
    nbytes = int(lens.sum()) * hkv * d * 2 * 2
    order = torch.argsort(lens, descending=True)
    sorted_args = (q[order], tables[order], lens[order])
    variants = [("given order", (q, tables, lens), None, False),
                ("longest first", sorted_args, None, False)]
    variants += [("longest first, even splits", sorted_args, n, True) for n in splits]
    for name, (qq, tt, ll), n, even in variants:
        fns = [lambda k=k, v=v, qq=qq, tt=tt, ll=ll, n=n, even=even: paged_decode_attention(
            qq, k, v, tt, ll, d ** -0.5, max_context_len=4096, num_splits=n, even_splits=even)
            for k, v in caches]
        replay, _ = graphed_calls(fns)
        us = 1e3 * bench_ms(replay) / layers
        print(f"| {batch} | {lo}-{hi} | {name} | {n or 'default'} | {us:,.1f} | "
              f"{nbytes / (us * 1e-6) / 1e12:.2f} |", flush=True)
    del caches
    torch.cuda.empty_cache()


def gemm_table(ms=(1, 8, 16, 32, 64, 96, 128, 192, 256)) -> None:
    """The decode step's GEMMs (1B shape) per batch size, under cuBLAS and cuBLASLt: 16
    calls in one CUDA graph, each over its own weight (as the layers are)."""
    from benchmarks.kernels import bench_ms, graphed_calls

    shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
              "down": (2048, 8192)}
    weights = {k: [torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(16)] for k, (n, kk) in shapes.items()}
    default = torch.backends.cuda.preferred_blas_library()
    print("\n| GEMM | batch | library | us per call | weight TB/s |")
    print("|---|---:|---|---:|---:|")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, ws in weights.items():
            for m in ms:
                x = torch.randn(m, ws[0].shape[1], device="cuda", dtype=torch.bfloat16)
                fns = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws]
                replay, _ = graphed_calls(fns)
                us = 1e3 * bench_ms(replay) / len(ws)
                nbytes = ws[0].numel() * 2
                print(f"| {name} | {m} | {lib} | {us:.1f} | {nbytes / (us * 1e-6) / 1e12:.2f} |",
                      flush=True)
    torch.backends.cuda.preferred_blas_library(default)
    del weights
    torch.cuda.empty_cache()


def fp8_gemm_table(ms=(1, 16, 64, 128, 192, 256, 512)) -> None:
    """The decode step's GEMMs at the 8B shape per batch size: bf16 `linear` against
    `torch._scaled_mm` over e4m3 operands with row-wise scales (per token x per output
    channel) and with one scale per tensor (the engine's `Fp8Linear`, its scales applied
    after), each also with `use_fast_accum`. 8 calls in one CUDA graph, each over its own
    weight; the activations come quantized (the norms before the projections write them)."""
    from benchmarks.kernels import bench_ms, graphed_calls

    fp8 = torch.float8_e4m3fn
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    print("\n| GEMM (8B) | batch | bf16 us | fp8 row-wise us | row-wise, fast accum us | "
          "fp8 per tensor us | per tensor, fast accum us | bf16 / per tensor | "
          "weight TB/s per tensor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        qs = [w.to(fp8) for w in ws]
        w_scale = torch.rand(1, n, device="cuda") + 0.5
        one = torch.ones((), device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, x_scale = x.to(fp8), torch.rand(m, 1, device="cuda") + 0.5
            mm = partial(torch._scaled_mm, xq, out_dtype=torch.bfloat16)
            variants = {
                "bf16": [partial(torch.nn.functional.linear, x, w) for w in ws],
                "row": [partial(mm, q.t(), scale_a=x_scale, scale_b=w_scale) for q in qs],
                "fast": [partial(mm, q.t(), scale_a=x_scale, scale_b=w_scale,
                                 use_fast_accum=True) for q in qs],
                "tensor": [partial(mm, q.t(), scale_a=one, scale_b=one) for q in qs],
                "tensor_fast": [partial(mm, q.t(), scale_a=one, scale_b=one, use_fast_accum=True)
                                for q in qs],
            }
            us = {}
            for v, fns in variants.items():
                try:
                    replay, _ = graphed_calls(fns)
                    us[v] = 1e3 * bench_ms(replay) / len(fns)
                except RuntimeError as e:  # a variant this torch does not offer
                    print(f"  {name} {m} {v}: {str(e).splitlines()[0][:100]}")
                    us[v] = float("nan")
            print(f"| {name} | {m} | {us['bf16']:.1f} | {us['row']:.1f} | {us['fast']:.1f} | "
                  f"{us['tensor']:.1f} | {us['tensor_fast']:.1f} | "
                  f"{us['bf16'] / us['tensor']:.2f}x | "
                  f"{n * k / (us['tensor'] * 1e-6) / 1e12:.2f} |", flush=True)
        del ws, qs
        torch.cuda.empty_cache()


def step_kernels(llm, buckets=(1, 64, 256), replays: int = 5) -> None:
    """Per-kernel device time of one captured step (padding rows, context 1) per bucket."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.runner
    runner._inputs[0].fill_(runner.pad)
    runner._inputs[1].zero_()
    runner._inputs[2].fill_(-1)
    runner._inputs[3].fill_(1)
    for b in buckets:
        g = runner._graphs[b]
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                g.replay()
            torch.cuda.synchronize()
        by_kind, by_name = kernel_times(prof)
        count = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                count[e.name] = count.get(e.name, 0) + 1
        total = sum(by_name.values()) / replays
        print(f"\nbucket {b}: {sum(count.values()) // replays} kernels, {total:,.0f} us of "
              "kernel time per step")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:16]:
            k = count[name] // replays
            print(f"  {k:4d} x {us / replays / k:7.1f} us = {us / replays:7.1f} us  "
                  f"{kind_of(name):18s} {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--runs", nargs="+", default=["continuous:graph", "static:graph"],
                    metavar="SCHEDULER:DECODE_STEP")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-micro", action="store_true",
                    help="leave out the attention-balance and GEMM tables")
    ap.add_argument("--shape", choices=["1b", "8b"], default="1b")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="the engine tables with FP8 projections (quantized at load)")
    ap.add_argument("--fp8-gemms", action="store_true",
                    help="also the 8B shape's decode GEMMs in bf16 against FP8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if not args.skip_micro:
        print("| batch | contexts | rows | splits | us per call | TB/s |")
        print("|---:|---|---|---:|---:|---:|")
        for batch in (8, 16, 32, 64, 96, 128, 192, 256):
            attention_balance(batch, (1, 2, 3, 4, 6, 8, 12, 16))
        for batch in (4, 16, 32):  # the drained tail: few rows, long contexts
            attention_balance(batch, (2, 4, 8, 12, 16), lo=1200)
        gemm_table()
    if args.fp8_gemms:
        fp8_gemm_table()
    if args.skip_engine:
        return
    work = Path(tempfile.mkdtemp(prefix="nanoserve-profile-"))
    if args.shape == "1b":
        model_dir, load_format = make_random_model(work / "llama-1b-random", "cuda"), "auto"
    else:
        from benchmarks.fp8 import model_folder

        model_dir, load_format = model_folder(work / "llama-8b-dummy", LLAMA_8B), "dummy"
    vocab = LLAMA_1B["vocab_size"]  # the same in both shapes
    prompts, max_tokens = make_workload(work / "workload.parquet", args.rows, vocab)
    warm = ([[(t + 1) % vocab for t in p] for p in prompts], max_tokens)
    for run in args.runs:
        scheduler, _, step = run.partition(":")
        profile_engine(model_dir, prompts, max_tokens, scheduler, step or "auto", warm,
                       load_format, args.quantization)


if __name__ == "__main__":
    main()
