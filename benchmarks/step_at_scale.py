"""A decode step at batch scale, kernel by kernel: R rows of C context tokens each, through
the engine's captured step, for each weight/cache variant.

Two `LLM.generate` calls of the same R rows (prompts of C random tokens, prefix caching
off) are profiled, one for 2 output tokens and one for 2 + S: the kernels the second runs
beyond the first are each row's S more tokens at contexts C + 1 .. C + S, printed per S
(as "a step"). The rows join in admissions of up to 8,192 prompt tokens, so those tokens
run in decode steps of mixed sizes, not S steps of R rows: the GEMMs' share depends on
that grouping and is only indicative; the decode attention's total does not (the same
bytes however the rows are grouped), and its bandwidth is the figure to read. Where the
attention's time goes at the context lengths of a batch job (`benchmarks/vs_vllm.py
--workloads batch4096`), which the 256-row profile (`benchmarks/step_profile.py`) does not
reach.

    python3 -m benchmarks.step_at_scale [--shape 8b] [--rows 768] [--context 700]
        [--steps 10] [--variants bf16,fp8+fp8kv]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from pathlib import Path
from tempfile import mkdtemp

import torch

from benchmarks.common import markdown_table
from benchmarks.gpu_job import SHAPES
from benchmarks.step_profile import kind_of
from benchmarks.vs_vllm import config_folder, variant_options


def _profiled(llm, prompts, max_tokens: int) -> tuple[float, dict[str, float]]:
    """(wall seconds, {kernel name: microseconds}) of one generate."""
    from torch.profiler import ProfilerActivity, profile

    from nanoserve.sampling.params import SamplingParams

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    names: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += e.time_range.elapsed_us()
    return wall, names


def measure(model_dir: Path, variant: str, rows: int, context: int, steps: int, vocab: int
            ) -> None:
    from nanoserve.llm import LLM

    quantization, kv = variant_options(variant)
    llm = LLM(str(model_dir), device="cuda", load_format="dummy", quantization=quantization,
              kv_cache_dtype=kv, max_batch_size=rows, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(rows)]
    _profiled(llm, prompts, 2 + steps)  # warm-up: every graph and kernel met once
    wall_a, short = _profiled(llm, prompts, 2)
    wall_b, long = _profiled(llm, prompts, 2 + steps)
    per = {n: (long.get(n, 0.0) - short.get(n, 0.0)) / steps for n in long}
    by_kind: dict[str, float] = defaultdict(float)
    for n, us in per.items():
        by_kind[kind_of(n)] += us
    total = sum(by_kind.values())
    step_ms = (wall_b - wall_a) / steps * 1e3
    cfg = llm.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * (
        1 if kv == "fp8" else 2)
    kv_bytes = rows * (context + 1 + steps / 2) * per_token
    att_us = by_kind.get("decode attention", 0.0) + by_kind.get("split combine", 0.0)
    print(f"\n### {variant}: {rows} rows at context ~{context + steps // 2}, KV pool "
          f"{llm.pool.num_tokens:,} tokens: a decode step {step_ms:.2f} ms of wall, "
          f"{total / 1e3:.2f} ms of kernels; attention reads {kv_bytes / 1e9:.1f} GB a step "
          f"({kv_bytes / (att_us * 1e-6) / 1e12:.2f} TB/s over its kernels)\n")
    print(markdown_table(["kind", "us a step", "share"],
                         [[k, f"{us:,.0f}", f"{us / total:.1%}"]
                          for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])]))
    pre: dict[str, float] = defaultdict(float)
    for n, us in short.items():
        pre[kind_of(n)] += us
    tokens = rows * context
    print(f"\nthe 2-token call (the prefill of {tokens:,} tokens, one decode step): "
          f"{wall_a:.2f} s, {tokens / wall_a:,.0f} prompt tok/s; kernels, ms: "
          + ", ".join(f"{k} {us / 1e3:,.0f}" for k, us in sorted(pre.items(), key=lambda kv: -kv[1])))
    print("\ntop kernels, us a step:")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {us:9.1f}  {kind_of(name):20s} {name[:120]}")
    del llm
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--rows", type=int, default=768)
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", default="bf16,fp8+fp8kv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.step_at_scale measures a GPU: no CUDA device here")
    config = SHAPES[args.shape]
    folder = config_folder(Path(mkdtemp(prefix="nanoserve-step-")) / "model", config)
    for v in args.variants.split(","):
        measure(folder, v, args.rows, args.context, args.steps, config["vocab_size"])


if __name__ == "__main__":
    main()
