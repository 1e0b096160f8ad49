"""Tile configs of the fused MoE kernel (nanoserve_kernels/fused_moe.py), tuned per shape on
the GPU and written to nanoserve_kernels/fused_moe_configs.json (committed: the engine reads
it at run time; shapes not in it get `default_config`).

For each token count M of `SIZES`, every config of the search space runs the whole fused
call (routing, alignment, both GEMMs) on random inputs with M tokens; the fastest (median
of CUDA-event timings) is kept, and the table printed with the default config's time beside.

    python3 -m benchmarks.tune_fused_moe [--shape qwen3-30b-a3b] [--dtype bfloat16|fp8]
        [--sizes 1,16,256,4096] [--quick] [--out nanoserve_kernels/fused_moe_configs.json]
    python3 -m benchmarks.tune_fused_moe --smoke   # a tiny shape, two configs, on the CPU

--smoke runs under Triton's interpreter when TRITON_INTERPRET=1 is set (tests/
test_bench_moe.py), else the search without timing anything real: it checks the plumbing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

SHAPES = {  # name -> (experts, expert inner width I, hidden d, top k)
    "qwen3-30b-a3b": (128, 768, 2048, 8),
    "qwen3-235b-a22b": (128, 1536, 4096, 8),
    "mixtral-8x7b": (8, 14336, 4096, 2),
}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def search_space(fp8_block: bool, quick: bool = False) -> list[dict[str, int]]:
    """Every config tried; `quick`: without the narrowest column tile and two pipeline stages
    (about half as many compiles: a tuning run that fits one short GPU call)."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
            (16, 32, 64, 128), (64, 128) if quick else (32, 64, 128), (64, 128), (4, 8),
            (3, 4) if quick else (2, 3, 4)):
        if fp8_block and bk != 128:
            continue
        if bm * bn >= 128 * 128 and warps == 4:
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                    "num_stages": stages})
    return out


def time_call(fn, device: str, reps: int) -> float:
    """Median seconds of `fn()` over reps runs (after one warm-up)."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def tune(shape: tuple[int, int, int, int], dtype: str, sizes: list[int], device: str,
         space: list[dict[str, int]], reps: int) -> dict[str, dict[str, int]]:
    import torch

    from nanoserve.weights.fp8 import quantize_per_channel
    from nanoserve_kernels.fused_moe import fused_moe
    from nanoserve_kernels.fused_moe_configs import default_config

    experts, inner, hidden, top_k = shape
    g = torch.Generator(device).manual_seed(0)
    act = torch.bfloat16 if device == "cuda" else torch.float32
    w13 = torch.randn(experts, 2 * inner, hidden, generator=g, device=device, dtype=act) * 0.02
    w2 = torch.randn(experts, hidden, inner, generator=g, device=device, dtype=act) * 0.02
    scales = {}
    if dtype == "fp8":  # per channel: one expert at a time
        q13 = torch.empty(w13.shape, dtype=torch.float8_e4m3fn, device=device)
        q2 = torch.empty(w2.shape, dtype=torch.float8_e4m3fn, device=device)
        s13 = torch.empty(w13.shape[:2], device=device)
        s2 = torch.empty(w2.shape[:2], device=device)
        for e in range(experts):
            q13[e], s = quantize_per_channel(w13[e])
            s13[e] = s[:, 0]
            q2[e], s = quantize_per_channel(w2[e])
            s2[e] = s[:, 0]
        w13, w2, scales = q13, q2, {"w13_scale": s13, "w2_scale": s2}
    best = {}
    print("| M | best config | us | default us |")
    print("|---|---|---|---|")
    for m in sizes:
        x = torch.randn(m, hidden, generator=g, device=device, dtype=act)
        logits = torch.randn(m, experts, generator=g, device=device)
        timings = []
        for config in space + [default_config(m)]:
            def run(config=config, x=x, logits=logits):
                return fused_moe(x, logits, w13, w2, top_k, True, config=config, **scales)
            try:
                timings.append((time_call(run, device, reps), config))
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses is skipped
                print(f"M={m} {config}: {type(e).__name__}")
        default_s = timings[-1][0]
        seconds, config = min(timings[:-1] or timings, key=lambda t: t[0])
        best[str(m)] = config
        print(f"| {m} | {config} | {seconds * 1e6:.1f} | {default_s * 1e6:.1f} |", flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--dtype", choices=("bfloat16", "fp8"), default="bfloat16")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON to merge into (default: the committed one)")
    ap.add_argument("--quick", action="store_true", help="a smaller search space (search_space)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import torch

    from nanoserve_kernels.fused_moe_configs import CONFIG_FILE, shape_key

    sizes = [int(s) for s in args.sizes.split(",") if s]
    shape, device, space, reps = (SHAPES.get(args.shape), "cuda",
                                  search_space(False, args.quick), args.reps)
    if args.smoke:
        shape, device, sizes, reps = (4, 32, 64, 2), "cpu", [1, 8], 1
        space = [{"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
                 {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}]
        args.dtype = "bfloat16"
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    best = tune(shape, args.dtype, sizes, device, space, reps)
    out = args.out or CONFIG_FILE
    table = json.loads(out.read_text()) if out.is_file() else {}
    table[shape_key(shape[0], shape[1], shape[2], args.dtype)] = best
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
