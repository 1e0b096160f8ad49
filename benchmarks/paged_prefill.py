"""Paged prefill attention on a CUDA device: the prefill after a prefix-cache hit.

Workload of issue 14's benchmark, one attention layer of the Llama-3.2-1B shape (32 query
heads, 8 KV heads, head_dim 64, block size 16, bfloat16): rows of a 1,000-token cached
prefix (its blocks shared by every row) plus 20-200 new tokens each, for {16, 64, 256} rows.
For each: the Triton kernel's time (`triton.testing.do_bench` median) and its causal
TFLOP/s counted over the new tokens' visible keys; the PyTorch reference's time; the time of
the ragged prefill kernel over every row's whole prompt (what the same layer costs with
caching off); and the kernel's max |error| against the reference. `--sweep` times the
kernel's tile knobs (block_m, block_n, num_warps, num_stages) at 64 rows and prints the best.

Run from the repository root: `python benchmarks/paged_prefill.py`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys

import torch

HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 64, 16
PREFIX = 1000
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def bench_ms(fn, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def case(num_rows: int, seed: int = 0):
    """The kernel's arguments, and the packed whole prompts for the ragged prefill kernel."""
    gen = torch.Generator().manual_seed(seed)
    new = torch.randint(20, 201, (num_rows,), generator=gen).tolist()
    prefix_blocks = PREFIX // BLOCK  # 62 full blocks shared; the prefix's tail is recomputed
    cached = prefix_blocks * BLOCK
    own = [-(-(cached + n) // BLOCK) - prefix_blocks for n in new]
    num_blocks = 1 + prefix_blocks + sum(own)
    shape = (num_blocks, BLOCK, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(DTYPE).cuda()
    v_cache = torch.randn(shape, generator=gen).to(DTYPE).cuda()
    tables = torch.zeros((num_rows, prefix_blocks + max(own)), dtype=torch.int32)
    nxt = 1 + prefix_blocks
    for row, count in enumerate(own):
        tables[row, :prefix_blocks] = torch.arange(1, 1 + prefix_blocks)
        tables[row, prefix_blocks : prefix_blocks + count] = torch.arange(nxt, nxt + count)
        nxt += count
    q = torch.randn((sum(new), HQ, HEAD_DIM), generator=gen).to(DTYPE).cuda()
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32).cuda()
    lens = torch.tensor([cached + n for n in new], dtype=torch.int32).cuda()
    whole = [cached + n for n in new]
    full = [torch.randn((sum(whole), h, HEAD_DIM), generator=gen).to(DTYPE).cuda()
            for h in (HQ, HKV, HKV)]  # fmt: skip
    full_cu = torch.tensor([0, *torch.tensor(whole).cumsum(0).tolist()], dtype=torch.int32).cuda()
    flops = sum(4 * HQ * HEAD_DIM * n * (cached + (n + 1) / 2) for n in new)
    args = (q, k_cache, v_cache, tables.cuda(), cu, lens, max(new), SCALE)
    return args, (*full, full_cu, max(whole), SCALE), flops


def run(rows_list=(16, 64, 256)) -> None:
    from nanoserve_kernels.paged_prefill import (
        paged_prefill_attention,
        paged_prefill_attention_reference,
    )
    from nanoserve_kernels.prefill_attention import prefill_attention

    print("| rows | new tokens | kernel us | TFLOP/s | reference us | whole-prompt prefill us "
          "| max abs err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for num_rows in rows_list:
        args, full_args, flops = case(num_rows)
        out = paged_prefill_attention(*args)
        ref = paged_prefill_attention_reference(*args)
        err = float((out.float() - ref.float()).abs().max())
        kernel_us = 1e3 * bench_ms(functools.partial(paged_prefill_attention, *args))
        ref_us = 1e3 * bench_ms(functools.partial(paged_prefill_attention_reference, *args), 20)
        whole_us = 1e3 * bench_ms(functools.partial(prefill_attention, *full_args))
        print(f"| {num_rows} | {args[0].shape[0]} | {kernel_us:.1f} | "
              f"{flops / (kernel_us * 1e-6) / 1e12:.1f} | {ref_us:.0f} | {whole_us:.1f} "
              f"| {err:.2e} |", flush=True)  # fmt: skip


def sweep(num_rows: int = 64) -> None:
    from nanoserve_kernels.paged_prefill import paged_prefill_attention

    args, _, flops = case(num_rows)
    results = []
    knobs = itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (2, 3))
    for block_m, block_n, warps, stages in knobs:
        call = functools.partial(
            paged_prefill_attention, *args, block_m=block_m, block_n=block_n, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        try:
            us = 1e3 * bench_ms(call, rep=50)
        except Exception as exc:  # a tile that does not fit the device: report and go on
            print(f"block_m {block_m} block_n {block_n} warps {warps} stages {stages}: {exc}")
            continue
        results.append((us, block_m, block_n, warps, stages))
    for us, block_m, block_n, warps, stages in sorted(results)[:8]:
        print(f"{us:8.1f} us  {flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s  block_m {block_m} "
              f"block_n {block_n} warps {warps} stages {stages}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the tile knobs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/paged_prefill.py needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    run()
    if args.sweep:
        sweep()
    return 0


if __name__ == "__main__":
    sys.exit(main())
