"""Kernel benchmark on a CUDA device: paged decode attention bandwidth, prefill and KV store.

Decode, for batch {1, 8, 64, 256} x context {128, 1024, 8192} with a Llama-3.2-1B-like layer
(32 query heads, 8 KV heads, head_dim 64, block size 16, bfloat16, every row at the full
context, blocks shuffled over the pool): achieved bytes/s as a fraction of the device's copy
bandwidth measured in the same run (a 1 GiB device-to-device copy, bytes read + written),
for the Triton kernel, the PyTorch reference, and torch's scaled_dot_product_attention on a
dense cache holding the same data contiguously. Bytes counted: K and V of each row's real
context, plus q and the output. Times are `triton.testing.do_bench` medians (L2 flushed
before each call); the kernel and SDPA are also timed as CUDA-graph replays, which removes
the host's launch cost the way the engine's captured decode step will: one call per replay,
and per call of one graph of 16 consecutive calls, each over its own cache (like a decode
step's 16 layers; distinct copies of the cache, at least 2 and as many as fit in
`COPY_BUDGET`, used in turn, so that consecutive calls never find their cache in L2).
The target (>= 70% of copy bandwidth at batch >= 8 and context >= 1024) is judged on the
16-call graph figure.

Then: prefill kernel time against its reference, and the KV store kernel.
`--fp8-kv` runs only the decode kernel over a bfloat16 cache against the same cache in FP8
(e4m3, scales 0.5 / 2.0; `nanoserve_kernels/kv_quant.py`): time, bandwidth on the bytes each reads,
and the speedup (about a minute); `--head-dim 128` the 8B shape's heads; `--fp8-sweep`
adds the FP8 kernel at forced tilings (tokens per step, warps, stages) against bfloat16.
`--batch-scale` times the decode kernel at the 8B engine's batch-scale shapes (32 query /
8 KV heads, head_dim 128, block 16; 256, 656 and 1,024 rows, each row's context a prompt
and part of an output, both uniform in [100, 1,024], as a decode step of
`benchmarks/vs_vllm.py --workloads batch4096` meets them) over a bfloat16 cache, over
its FP8 copy with the kernel's "e4m3" form (the earlier one) and with its "f16" form (the
default), side by side: per call in a 16-call CUDA graph, TB/s of K/V bytes read, and the
ratios (about two minutes).
`--sweep` adds a tuning sweep of the decode kernel (program order, tile size, warps, stages,
splits) and the host cost of one call;
`default_tiling` and `choose_num_splits` in `nanoserve_kernels/paged_attention.py` encode its findings.

Run from the repository root: `python benchmarks/kernels.py` or `python -m benchmarks.kernels`.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time

import torch
import torch.nn.functional as F

HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 64, 16
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(HEAD_DIM)
BATCHES = (1, 8, 64, 256)
CONTEXTS = (128, 1024, 8192)
GRAPH_CALLS = 16  # calls per graph in the engine-like timing (a decode step's layers)
COPY_BUDGET = 8 * 2**30  # bytes of extra cache copies for the 16-call graph, per cache kind
TARGET = 0.70  # of copy bandwidth, at batch >= 8 and context >= 1024


def bench_ms(fn, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def graphed(fn):
    """`fn` captured in a CUDA graph (after a warm-up call); returns the replay function."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def graphed_calls(fns):
    """All of `fns` captured, in order, in one CUDA graph (after a warm-up call of each);
    returns the replay function and the outputs the graph writes."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for fn in fns]
    torch.cuda.synchronize()
    return graph.replay, outs


def copies_of(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` and clones of them: as many sets as fit in COPY_BUDGET, >= 2, <= GRAPH_CALLS."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = min(GRAPH_CALLS, max(2, 1 + COPY_BUDGET // nbytes))
    return [tensors] + [[t.clone() for t in tensors] for _ in range(count - 1)]


def per_call_us_in_graph(make_call, sets, expected, column) -> tuple[float, float]:
    """Microseconds per call in one graph of GRAPH_CALLS calls, call i over `sets[i % n]`,
    and the largest error of any call's output against `expected` after a replay."""
    fns = [functools.partial(make_call, *sets[i % len(sets)]) for i in range(GRAPH_CALLS)]
    replay, outs = graphed_calls(fns)
    for out in outs:
        out.fill_(float("nan"))
    replay()
    torch.cuda.synchronize()
    errs = torch.stack([(column(out).float() - expected).abs().max() for out in outs])
    return 1e3 * bench_ms(replay) / GRAPH_CALLS, float(errs.max())  # NaN if any output has one


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * 2**30 / (ms * 1e-3)


def decode_case(batch: int, ctx: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_row = ctx // BLOCK
    num_blocks = 1 + batch * blocks_per_row  # block 0: padding only
    shape = (num_blocks, BLOCK, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    order = torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1
    tables = order.view(batch, blocks_per_row).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, HQ, HEAD_DIM), generator=gen, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, tables, lens


def decode_bytes(batch: int, ctx: int) -> int:
    elem = torch.finfo(DTYPE).bits // 8
    return elem * (2 * batch * ctx * HKV * HEAD_DIM + 2 * batch * HQ * HEAD_DIM)


def run_decode(copy_bw: float) -> list[dict]:
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            rows.append(decode_row(batch, ctx, copy_bw))
            torch.cuda.empty_cache()
    return rows


def decode_row(batch: int, ctx: int, copy_bw: float) -> dict:
    from nanoserve_kernels.paged_attention import (
        choose_num_splits,
        default_tiling,
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    q, k_cache, v_cache, tables, lens = decode_case(batch, ctx)
    nbytes = decode_bytes(batch, ctx)

    def kernel():
        return paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE)

    def reference():
        return paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, SCALE)

    k_dense = k_cache[tables.long()].reshape(batch, ctx, HKV, HEAD_DIM).transpose(1, 2)
    v_dense = v_cache[tables.long()].reshape(batch, ctx, HKV, HEAD_DIM).transpose(1, 2)
    dense = [k_dense.contiguous(), v_dense.contiguous()]  # [B, Hkv, ctx, D]
    gqa = {"enable_gqa": True}

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None, :], *dense, scale=SCALE, **gqa)

    try:
        sdpa()
    except RuntimeError as exc:  # no GQA support in this torch: repeat the KV heads
        print(f"  sdpa with enable_gqa failed ({exc!r:.60}); repeating KV heads")
        dense = [t.repeat_interleave(HQ // HKV, dim=1) for t in dense]
        gqa = {}

    row = {"batch": batch, "ctx": ctx, "mbytes": nbytes / 1e6}
    row["splits"] = choose_num_splits(batch, HKV, ctx, q.device)
    row["block_n"] = default_tiling(batch * HKV * row["splits"], HEAD_DIM, q.device)[0]
    expected = reference().float()
    row["err"] = float((kernel().float() - expected).abs().max())
    row["sdpa_err"] = float((sdpa()[:, :, 0].float() - expected).abs().max())
    row["kernel_us"] = 1e3 * bench_ms(graphed(kernel))
    row["kernel_plain_us"] = 1e3 * bench_ms(kernel)
    try:
        row["ref_us"] = 1e3 * bench_ms(reference, rep=50)
    except torch.cuda.OutOfMemoryError:
        row["ref_us"] = float("nan")
    try:
        row["sdpa_us"] = 1e3 * bench_ms(graphed(sdpa))
    except RuntimeError:  # capture refused: time plain calls
        row["sdpa_us"] = 1e3 * bench_ms(sdpa)

    # engine-like: 16 calls in one graph, each over its own copy of the cache
    caches = copies_of([k_cache, v_cache])
    row["copies"] = len(caches)

    def paged(k, v):
        return paged_decode_attention(q, k, v, tables, lens, SCALE)

    row["kernel16_us"], row["kernel16_err"] = per_call_us_in_graph(
        paged, caches, expected, lambda out: out
    )
    del caches
    torch.cuda.empty_cache()
    dense_sets = copies_of(dense)

    def sdpa_over(k, v):
        return F.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=SCALE, **gqa)

    try:
        row["sdpa16_us"], _ = per_call_us_in_graph(
            sdpa_over, dense_sets, expected, lambda out: out[:, :, 0]
        )
    except RuntimeError:  # capture refused
        row["sdpa16_us"] = float("nan")
    del dense_sets
    torch.cuda.empty_cache()

    for key in ("kernel", "kernel_plain", "ref", "sdpa", "kernel16", "sdpa16"):
        row[f"{key}_frac"] = nbytes / (row[f"{key}_us"] * 1e-6) / copy_bw
    print(
        f"decode B={batch:4d} ctx={ctx:5d} splits={row['splits']:2d} block_n={row['block_n']:3d} "
        f"kernel {row['kernel_us']:8.1f} us ({row['kernel_frac']:6.1%} of copy) "
        f"16-call graph {row['kernel16_us']:8.1f} us ({row['kernel16_frac']:6.1%}) "
        f"plain {row['kernel_plain_us']:8.1f} us | "
        f"ref {row['ref_us']:9.1f} us ({row['ref_frac']:6.1%}) | sdpa {row['sdpa_us']:8.1f} us "
        f"({row['sdpa_frac']:6.1%}), 16-call graph {row['sdpa16_us']:8.1f} us "
        f"({row['sdpa16_frac']:6.1%}) | max|err| {row['err']:.2e} (16-call graph "
        f"{row['kernel16_err']:.2e}, sdpa {row['sdpa_err']:.2e}) | cache copies {row['copies']}",
        flush=True,
    )
    return row


def run_decode_fp8(copy_bw: float) -> None:
    """The decode kernel (one CUDA-graph replay per call) over a bfloat16 cache and over its
    FP8 copy; bytes counted as in `decode_bytes`, K and V at one byte an element for FP8."""
    print("\n| batch | context | bf16 us | bf16 % copy | fp8 us | fp8 % copy | speedup | "
          "max abs err fp8 vs its reference |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in (8, 64, 256):
        for ctx in (1024, 8192):
            print(fp8_decode_row(batch, ctx, copy_bw), flush=True)
            torch.cuda.empty_cache()


def fp8_tiling_sweep(batch: int, ctx: int, copy_bw: float) -> None:
    """The FP8 cache's decode kernel at forced tilings (tokens per step, warps, stages)
    against the bfloat16 cache's at its defaults: an FP8 step holds half the bytes."""
    from nanoserve_kernels.kv_quant import quantize_reference
    from nanoserve_kernels.paged_attention import paged_decode_attention

    q, k_cache, v_cache, tables, lens = decode_case(batch, ctx)
    k8, v8 = quantize_reference(k_cache, 0.5), quantize_reference(v_cache, 2.0)
    bf16_us = 1e3 * bench_ms(graphed(
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE)))
    fp8_bytes = decode_bytes(batch, ctx) - batch * ctx * HKV * HEAD_DIM * 2
    print(f"\nFP8 tilings, batch {batch}, context {ctx}, head_dim {HEAD_DIM}: bf16 default "
          f"{bf16_us:.1f} us\n| block_n | warps | stages | fp8 us | % copy | vs bf16 |\n"
          "|---|---|---|---|---|---|")
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                def fp8(block_n=block_n, warps=warps, stages=stages):
                    return paged_decode_attention(q, k8, v8, tables, lens, SCALE, k_scale=0.5,
                                                  v_scale=2.0, block_n=block_n,
                                                  num_warps=warps, num_stages=stages)
                try:
                    us = 1e3 * bench_ms(graphed(fp8))
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit
                    print(f"| {block_n} | {warps} | {stages} | - | - | {type(e).__name__} |")
                    continue
                print(f"| {block_n} | {warps} | {stages} | {us:.1f} | "
                      f"{fp8_bytes / (us * 1e-6) / copy_bw:.0%} | {bf16_us / us:.2f}x |",
                      flush=True)
    torch.cuda.empty_cache()


def fp8_decode_row(batch: int, ctx: int, copy_bw: float) -> str:
    from nanoserve_kernels.kv_quant import quantize_reference
    from nanoserve_kernels.paged_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    q, k_cache, v_cache, tables, lens = decode_case(batch, ctx)
    k8, v8 = quantize_reference(k_cache, 0.5), quantize_reference(v_cache, 2.0)
    scales = {"k_scale": 0.5, "v_scale": 2.0}

    def bf16():
        return paged_decode_attention(q, k_cache, v_cache, tables, lens, SCALE)

    def fp8():
        return paged_decode_attention(q, k8, v8, tables, lens, SCALE, **scales)

    bf16_us, fp8_us = 1e3 * bench_ms(graphed(bf16)), 1e3 * bench_ms(graphed(fp8))
    want = paged_decode_attention_reference(q, k8, v8, tables, lens, SCALE, **scales)
    err = float((fp8().float() - want.float()).abs().max())
    bf16_bytes = decode_bytes(batch, ctx)
    fp8_bytes = bf16_bytes - batch * ctx * HKV * HEAD_DIM * 2  # K and V: 1 byte, not 2
    return (f"| {batch} | {ctx} | {bf16_us:.1f} | {bf16_bytes / (bf16_us * 1e-6) / copy_bw:.0%} "
            f"| {fp8_us:.1f} | {fp8_bytes / (fp8_us * 1e-6) / copy_bw:.0%} | "
            f"{bf16_us / fp8_us:.2f}x | {err:.2e} |")


BATCH_SCALE_ROWS = (256, 656, 1024)
# (name, cache, keyword arguments of paged_decode_attention): the engine's decode read
# (even splits, as `nanoserve/cache/step_cache.py` passes them) over each cache and FP8 form
BATCH_SCALE_VARIANTS = (
    ("bf16 cache", "bf16", {}),
    ("fp8, e4m3 form", "fp8", {"fp8_form": "e4m3"}),
    ("fp8, f16 form", "fp8", {"fp8_form": "f16"}),
    ("fp8, f16 form, 2 stages", "fp8", {"fp8_form": "f16", "num_stages": 2}),
)


def batch_scale_contexts(rows: int, seed: int = 7) -> list[int]:
    """Context lengths of `rows` running rows of the batch4096 workload: a prompt and the
    part of an output generated so far (prompt and output uniform in [100, 1,024]), +1 for
    the token the step appends."""
    import random

    rng = random.Random(seed)
    return [rng.randint(100, 1024) + rng.randrange(rng.randint(100, 1024)) + 1
            for _ in range(rows)]


def kv_read_bytes(context_lens, num_kv_heads: int, head_dim: int, bytes_per_entry: int) -> int:
    """Bytes of K and V one decode call reads: each row's own context, both caches."""
    return 2 * sum(context_lens) * num_kv_heads * head_dim * bytes_per_entry


def batch_scale_case(context_lens: list[int], seed: int = 0):
    """q [B, 32, 128] bfloat16, a bfloat16 cache and its FP8 copy (scales 0.5 / 2.0), block
    tables over shuffled blocks (block 0 the padding), the lengths on the device."""
    from nanoserve_kernels.kv_quant import quantize_reference

    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in context_lens]
    num_blocks = 1 + sum(blocks)
    shape = (num_blocks, BLOCK, 8, 128)
    k = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    order = (torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1).tolist()
    tables = torch.zeros((len(context_lens), max(blocks)), dtype=torch.int32)
    for row, n in enumerate(blocks):
        tables[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    q = torch.randn((len(context_lens), 32, 128), generator=gen, device="cuda", dtype=DTYPE)
    caches = {"bf16": (k, v), "fp8": (quantize_reference(k, 0.5), quantize_reference(v, 2.0))}
    return q, caches, tables.cuda(), lens


def run_batch_scale(copy_bw: float, rows_list=BATCH_SCALE_ROWS) -> None:
    """The decode kernel at batch scale, each variant per call in a GRAPH_CALLS-call graph
    over distinct cache copies; TB/s = K/V bytes read / time; error on the first 64 rows
    against the reference over the same cache."""
    from nanoserve_kernels.paged_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    print("\n| rows | mean context | variant | K/V GB | us | TB/s | % copy | vs bf16 time | "
          "vs e4m3 time | max abs err (64 rows) |\n|---|---|---|---|---|---|---|---|---|---|")
    for rows in rows_list:
        lens_list = batch_scale_contexts(rows)
        q, caches, tables, lens = batch_scale_case(lens_list)
        times = {}
        for name, cache, extra in BATCH_SCALE_VARIANTS:
            k, v = caches[cache]
            fp8 = {"k_scale": 0.5, "v_scale": 2.0} if cache == "fp8" else {}
            kwargs = {"max_context_len": max(lens_list), "even_splits": True, **fp8, **extra}
            expected = paged_decode_attention_reference(
                q[:64], k, v, tables[:64], lens[:64], 1 / math.sqrt(128), **fp8).float()
            sets = copies_of([k, v])

            def call(k, v, q=q, tables=tables, lens=lens, kwargs=kwargs):
                return paged_decode_attention(q, k, v, tables, lens, 1 / math.sqrt(128),
                                              **kwargs)

            us, err = per_call_us_in_graph(call, sets, expected, lambda out: out[:64])
            del sets
            torch.cuda.empty_cache()
            nbytes = kv_read_bytes(lens_list, 8, 128, 1 if cache == "fp8" else 2)
            times[name] = us
            e4m3 = times.get("fp8, e4m3 form")
            print(f"| {rows} | {sum(lens_list) / rows:.0f} | {name} | {nbytes / 1e9:.2f} | "
                  f"{us:.1f} | {nbytes / (us * 1e-6) / 1e12:.2f} | "
                  f"{nbytes / (us * 1e-6) / copy_bw:.0%} | {times['bf16 cache'] / us:.2f}x | "
                  f"{'' if e4m3 is None or cache != 'fp8' else f'{e4m3 / us:.2f}x'} | "
                  f"{err:.2e} |", flush=True)
        caches.clear()
        torch.cuda.empty_cache()
    print("\n(\"vs bf16 time\": the bfloat16 cache's time / this variant's, 2.00x = half "
          "the bytes in half the time; \"vs e4m3 time\": the e4m3 form's time / this one's)")


def verdicts(decode: list[dict]) -> list[str]:
    """One line per target cell (batch >= 8, context >= 1024), judged by the 16-call graph."""
    lines = []
    for r in decode:
        if r["batch"] >= 8 and r["ctx"] >= 1024:
            met = r["kernel16_frac"] >= TARGET
            lines.append(
                f"target {r['batch']} x {r['ctx']}: {'met' if met else 'missed'} "
                f"({r['kernel16_frac']:.0%} of copy bandwidth in a {GRAPH_CALLS}-call graph, "
                f"{r['kernel16_us']:.1f} us per call; SDPA dense {r['sdpa16_frac']:.0%})"
            )
    return lines


def run_sweep(copy_bw: float, shapes=None) -> None:
    print(f"\ndecode tuning sweep (per call in a {GRAPH_CALLS}-call CUDA graph, % of copy "
          "bandwidth)", flush=True)
    for batch, ctx in shapes or SWEEP_SHAPES:
        sweep_shape(batch, ctx, copy_bw)
        torch.cuda.empty_cache()
    host_overhead()


SWEEP_SHAPES = ((8, 1024), (8, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192))
# Split counts tried per shape: enough programs to fill the GPU, partitions >= 64 tokens.
SWEEP_SPLITS = {(8, 1024): (2, 4, 8, 16), (8, 8192): (4, 8, 16, 32), (64, 1024): (1, 2, 4)}
SWEEP_TILINGS = ((64, 4), (128, 4), (128, 8))  # (block_n, num_warps)


def sweep_shape(batch: int, ctx: int, copy_bw: float, show: int = 8) -> None:
    """Every (order, splits, block_n, warps, stages) of the sweep for one shape, timed per
    call in a GRAPH_CALLS-call graph over distinct cache copies (the engine's regime), best
    first; a configuration whose output is off the reference by more than 2e-2 is dropped."""
    from nanoserve_kernels.paged_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    q, k_cache, v_cache, tables, lens = decode_case(batch, ctx)
    nbytes = decode_bytes(batch, ctx)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, SCALE).float()
    caches = copies_of([k_cache, v_cache])

    results = []
    for heads_fastest in (False, True):
        for splits in SWEEP_SPLITS.get((batch, ctx), (1,)):
            for block_n, num_warps in SWEEP_TILINGS:
                for num_stages in (2, 3):
                    tuning = {
                        "heads_fastest": heads_fastest,
                        "num_splits": splits,
                        "block_n": block_n,
                        "num_warps": num_warps,
                        "num_stages": num_stages,
                    }
                    name = (
                        f"{'heads' if heads_fastest else 'rows '} splits={splits:2d} "
                        f"block_n={block_n:3d} warps={num_warps} stages={num_stages}"
                    )

                    def call(k, v, tuning=tuning):
                        return paged_decode_attention(q, k, v, tables, lens, SCALE, **tuning)

                    try:
                        us, err = per_call_us_in_graph(call, caches, expected, lambda o: o)
                    except Exception as exc:  # a config that does not compile or fit
                        print(f"  B={batch} ctx={ctx} {name}: {exc!r:.80}", flush=True)
                        continue
                    if not err <= 2e-2:
                        print(f"  B={batch} ctx={ctx} {name}: max|err| {err:.2e}, dropped")
                        continue
                    results.append((us, name))
    del caches
    results.sort()
    for us, name in results[:show]:
        frac = nbytes / (us * 1e-6) / copy_bw
        print(f"  B={batch:4d} ctx={ctx:5d} {name:52s} {us:8.1f} us {frac:6.1%}", flush=True)


def host_overhead(calls: int = 2000) -> None:
    """Host microseconds per decode call and per step of it (no device sync inside the loop)."""
    from nanoserve_kernels.kv_args import check_decode_args
    from nanoserve_kernels.paged_attention import paged_decode_attention

    q, k_cache, v_cache, tables, lens = decode_case(1, 128)

    def per_call_us(fn) -> float:
        fn()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - started
        torch.cuda.synchronize()
        return 1e6 * elapsed / calls

    steps = {
        "check_decode_args": lambda: check_decode_args(q, k_cache, v_cache, tables, lens),
        "torch.empty (output)": lambda: torch.empty_like(q),
        "decode call, 1 split": lambda: paged_decode_attention(
            q, k_cache, v_cache, tables, lens, SCALE, num_splits=1
        ),
        "decode call, 2 splits": lambda: paged_decode_attention(
            q, k_cache, v_cache, tables, lens, SCALE, num_splits=2
        ),
    }
    print("\ndecode host cost per call (batch 1 x 128, no sync):", flush=True)
    for name, fn in steps.items():
        print(f"  {name:28s} {per_call_us(fn):7.1f} us", flush=True)
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(per_call_us, steps["decode call, 1 split"])
    print(f"\nwhere the host time of {calls} one-split calls goes (cProfile, by own time):")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)


def run_prefill() -> list[dict]:
    from nanoserve_kernels.prefill_attention import prefill_attention, prefill_attention_reference

    rows = []
    for num_prompts in (4, 16):
        gen = torch.Generator().manual_seed(num_prompts)
        lengths = torch.randint(100, 1025, (num_prompts,), generator=gen).tolist()
        n = sum(lengths)
        q = torch.randn((n, HQ, HEAD_DIM), device="cuda", dtype=DTYPE)
        k = torch.randn((n, HKV, HEAD_DIM), device="cuda", dtype=DTYPE)
        v = torch.randn((n, HKV, HEAD_DIM), device="cuda", dtype=DTYPE)
        cu = torch.tensor(
            [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
        )
        max_len = max(lengths)

        def kernel(q=q, k=k, v=v, cu=cu, max_len=max_len):
            return prefill_attention(q, k, v, cu, max_len, SCALE)

        def reference(q=q, k=k, v=v, cu=cu, max_len=max_len):
            return prefill_attention_reference(q, k, v, cu, max_len, SCALE)

        err = float((kernel().float() - reference().float()).abs().max())
        kernel_us = 1e3 * bench_ms(kernel)
        ref_us = 1e3 * bench_ms(reference, rep=50)
        flops = sum(4 * HQ * HEAD_DIM * length * (length + 1) / 2 for length in lengths)
        row = {
            "prompts": num_prompts,
            "tokens": n,
            "kernel_us": kernel_us,
            "ref_us": ref_us,
            "tflops": flops / (kernel_us * 1e-6) / 1e12,
            "err": err,
        }
        rows.append(row)
        print(
            f"prefill {num_prompts:3d} prompts {n:6d} tokens: kernel {kernel_us:8.1f} us "
            f"({row['tflops']:.1f} TFLOP/s causal) | reference {ref_us:9.1f} us "
            f"| speed-up {ref_us / kernel_us:5.1f}x | max|err| {err:.2e}",
            flush=True,
        )
    return rows


def run_store(copy_bw: float) -> dict:
    from nanoserve_kernels.kv_store import store_kv, store_kv_reference

    n, num_blocks = 16384, 4096
    k = torch.randn((n, HKV, HEAD_DIM), device="cuda", dtype=DTYPE)
    v = torch.randn((n, HKV, HEAD_DIM), device="cuda", dtype=DTYPE)
    k_cache = torch.zeros((num_blocks, BLOCK, HKV, HEAD_DIM), device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:n]
    nbytes = 2 * 2 * k.numel() * k.element_size() + slots.numel() * 8
    kernel_us = 1e3 * bench_ms(lambda: store_kv(k, v, k_cache, v_cache, slots))
    ref_us = 1e3 * bench_ms(lambda: store_kv_reference(k, v, k_cache, v_cache, slots))
    frac = nbytes / (kernel_us * 1e-6) / copy_bw
    print(
        f"store_kv {n} tokens: kernel {kernel_us:.1f} us ({frac:.1%} of copy) | "
        f"reference {ref_us:.1f} us",
        flush=True,
    )
    return {"tokens": n, "kernel_us": kernel_us, "ref_us": ref_us, "frac": frac}


def markdown(copy_bw: float, decode: list[dict], prefill: list[dict], store: dict) -> str:
    lines = [
        f"Copy bandwidth (1 GiB device-to-device, read + write): {copy_bw / 1e12:.2f} TB/s",
        "",
        "| batch | context | KV+q+out MB | splits | block_n | kernel us (graph) | kernel % copy | "
        f"kernel us ({GRAPH_CALLS}-call graph) | kernel % copy ({GRAPH_CALLS}-call graph) | "
        "kernel us (plain call) | reference us | reference % copy | SDPA dense us | "
        f"SDPA % copy | SDPA us ({GRAPH_CALLS}-call graph) | SDPA % copy ({GRAPH_CALLS}-call "
        "graph) | max abs err vs ref |",
        "|" + "---:|" * 17,
    ]
    for r in decode:
        errs = [r["err"], r["kernel16_err"]]
        err = float("nan") if any(math.isnan(e) for e in errs) else max(errs)
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['mbytes']:.1f} | {r['splits']} | {r['block_n']} | "
            f"{r['kernel_us']:.1f} | {r['kernel_frac']:.0%} | {r['kernel16_us']:.1f} | "
            f"{r['kernel16_frac']:.0%} | {r['kernel_plain_us']:.1f} | "
            f"{r['ref_us']:.1f} | {r['ref_frac']:.1%} | {r['sdpa_us']:.1f} | "
            f"{r['sdpa_frac']:.0%} | {r['sdpa16_us']:.1f} | {r['sdpa16_frac']:.0%} | {err:.1e} |"
        )
    lines += ["", *verdicts(decode)]
    lines += [
        "",
        "| prefill prompts | tokens | kernel us | TFLOP/s (causal) | reference us | speed-up | max abs err |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in prefill:
        lines.append(
            f"| {r['prompts']} | {r['tokens']} | {r['kernel_us']:.1f} | {r['tflops']:.1f} | "
            f"{r['ref_us']:.1f} | {r['ref_us'] / r['kernel_us']:.1f}x | {r['err']:.1e} |"
        )
    lines += [
        "",
        f"store_kv, {store['tokens']} tokens: kernel {store['kernel_us']:.1f} us "
        f"({store['frac']:.0%} of copy bandwidth), reference {store['ref_us']:.1f} us",
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also run a decode tuning sweep")
    parser.add_argument("--fp8-kv", action="store_true",
                        help="only the decode kernel over an FP8 cache against bfloat16")
    parser.add_argument("--fp8-sweep", action="store_true",
                        help="with --fp8-kv: the FP8 kernel at forced tilings")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM,
                        help="with --fp8-kv: head_dim (128: the 8B shape)")
    parser.add_argument("--heads", type=int, default=HQ, help="with --fp8-kv: query heads")
    parser.add_argument("--sweep-shapes", default=None, metavar="BxCTX,...",
                        help="sweep only these shapes, e.g. 8x1024,64x1024 (default: six shapes)")
    parser.add_argument("--batch-scale", action="store_true",
                        help="only the decode kernel at the 8B engine's batch-scale shapes: "
                             "bf16 cache, FP8 cache in the e4m3 and f16 forms")
    parser.add_argument("--rows", type=int, nargs="+", default=list(BATCH_SCALE_ROWS),
                        help="with --batch-scale: running rows (default 256 656 1024)")
    args = parser.parse_args(argv)
    if any(r < 64 for r in args.rows):
        parser.error(f"--rows takes at least 64 rows each (the error check reads 64), got {args.rows}")
    args.shapes = None
    if args.sweep_shapes:
        try:
            shapes = [tuple(int(x) for x in item.split("x")) for item in args.sweep_shapes.split(",")]
            if any(len(shape) != 2 for shape in shapes):
                raise ValueError
        except ValueError:
            parser.error(f"--sweep-shapes takes BxCTX pairs like 8x1024,64x1024, got {args.sweep_shapes!r}")
        args.shapes = shapes
    return args


def main() -> int:
    global HQ, HEAD_DIM
    args = parse_args()
    shapes = args.shapes
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    started = time.time()
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"triton {triton.__version__}",
        flush=True,
    )
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if args.batch_scale:
        run_batch_scale(copy_bw, args.rows)
        return 0
    if args.fp8_kv:
        HQ, HEAD_DIM = args.heads, args.head_dim
        run_decode_fp8(copy_bw)
        if args.fp8_sweep:
            for batch, ctx in ((256, 1024), (256, 2048), (64, 2048)):
                fp8_tiling_sweep(batch, ctx, copy_bw)
        return 0
    decode = run_decode(copy_bw)
    prefill = run_prefill()
    store = run_store(copy_bw)
    print("\n" + markdown(copy_bw, decode, prefill, store), flush=True)
    if args.sweep or shapes:
        run_sweep(copy_bw, shapes)
    print(f"\n(benchmark took {time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
