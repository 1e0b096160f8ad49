"""Prefix caching on one GPU: the engine with caching on and off, side by side.

Workloads (Llama-3.2-1B shape, random bf16 weights, greedy, ignore_eos):
- shared: N rows (default 4,096), each a fixed 1,000-token prefix plus 20-200 random
  tokens, max_tokens 128;
- none: `benchmarks.gpu_job`'s workload (256 rows, prompts and outputs of 100-1,024
  random tokens), where no two rows share a block: caching must cost nothing there.

    python -m benchmarks.prefix_caching [--rows 4096] [--smoke]

Prints, per workload and setting: wall time, output tok/s, prompt tokens, prefill tokens
computed (and their share of the prompt tokens), the prefix hit rate, and the ratio of the
two settings' rates. Both settings give every row the same tokens (checked).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_job import LLAMA_1B, make_random_model


def shared_workload(rows: int, vocab: int, prefix_len: int = 1000, seed: int = 0,
                    max_tokens: int = 128):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(rng.randint(20, 200))]
               for _ in range(rows)]
    return prompts, [max_tokens] * rows


def random_workload(rows: int, vocab: int, seed: int = 0, lo: int = 100, hi: int = 1024):
    rng = random.Random(seed)  # as benchmarks.gpu_job.make_workload draws them
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(rows)]
    return prompts, [rng.randint(lo, hi) for _ in range(rows)]


def run(model_dir: Path, prompts, max_tokens, caching: bool, device: str) -> dict:
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    llm = LLM(str(model_dir), device=device, scheduler="continuous",
              enable_prefix_caching=caching)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    llm.generate([[7] * 40], [SamplingParams(max_tokens=4)])  # warm-up (a prefix no row has)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t
    st = llm.last_stats
    result = {"caching": caching, "wall_s": wall,
              "output_tokens": sum(len(o.token_ids) for o in outs),
              "prompt_tokens": sum(map(len, prompts)), "computed": st.prefill_real_tokens,
              "hit_rate": st.prefix_hit_rate, "tokens": [o.token_ids for o in outs]}
    result["tok_s"] = result["output_tokens"] / wall
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="2 layers, few rows, on the CPU")
    args = ap.parse_args()
    device, config = "cuda", LLAMA_1B
    if args.smoke:
        device, config = "cpu", {**LLAMA_1B, "num_hidden_layers": 2}
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    work = Path(tempfile.mkdtemp(prefix="nanoserve-prefix-"))
    model_dir = make_random_model(work / "llama-1b-random", device, config)
    vocab = config["vocab_size"]
    if args.smoke:
        workloads = {"shared": shared_workload(6, vocab, 64, max_tokens=4),
                     "none": random_workload(4, vocab, lo=4, hi=12)}
    else:
        workloads = {"shared": shared_workload(args.rows, vocab),
                     "none": random_workload(256, vocab)}
    print("| workload | caching | wall s | output tok/s | prompt tokens | prefill computed "
          "| computed / prompt | hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (prompts, max_tokens) in workloads.items():
        runs = [run(model_dir, prompts, max_tokens, c, device) for c in (False, True)]
        same = sum(a == b for a, b in zip(runs[0].pop("tokens"), runs[1].pop("tokens")))
        for r in runs:
            print(f"| {name} | {'on' if r['caching'] else 'off'} | {r['wall_s']:.2f} | "
                  f"{r['tok_s']:.0f} | {r['prompt_tokens']} | {r['computed']} | "
                  f"{r['computed'] / r['prompt_tokens']:.1%} | {r['hit_rate']:.1%} |", flush=True)
        print(f"| {name} | on / off | | {runs[1]['tok_s'] / runs[0]['tok_s']:.2f}x | | | | "
              f"same tokens: {same} of {len(prompts)} rows |", flush=True)


if __name__ == "__main__":
    main()
