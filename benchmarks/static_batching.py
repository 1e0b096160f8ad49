"""CPU tokens/s against batch size for static batching, with its padding and early-finish waste.

Workload (seeded): rows of random token ids (drawn from ids >= 100, clear of the special
tokens), prompt lengths uniform in [8, 128], per-row max_tokens uniform in [8, 64], greedy,
`ignore_eos`, so every row makes exactly its max_tokens. For each batch size B the first
`max(B, --min-rows)` rows of one fixed list are cut, in order, into consecutive batches of B
and run through `generate_batch` (one padded prefill, then one token per row per step until
the batch's longest row is done), on one KV pool allocated up front.

Columns: output tokens / seconds over all batches of a point (prefill included); padding
waste = padded prefill slots holding no prompt token; early-finish waste = decode row-steps
spent on rows that had already finished (both from `BatchStats`, summed over the point's
batches). Rows are not sorted by length: this is static batching at its plainest.

    python benchmarks/static_batching.py --threads 1          # about 4 minutes on 2 cores
    python benchmarks/static_batching.py --threads 1 --quick  # batch sizes 1, 4, 16

`--continuous` also runs each point's rows through continuous batching
(`nanoserve.scheduling.scheduler.generate_continuous`, at most B rows running, same pool), right after
the static run, and adds its tokens/s and the ratio to static. Its tokens must equal the
static run's, row for row.
"""

from __future__ import annotations

import argparse
import random

from benchmarks.common import (
    describe_run,
    load_nanoserve,
    markdown_table,
    set_threads,
    timed,
)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
QUICK_BATCH_SIZES = (1, 4, 16)
FIRST_PLAIN_ID = 100  # SmolLM2's special tokens sit below this


def int_range(text: str) -> tuple[int, int]:
    """'8,128' -> (8, 128), both ends included."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def make_workload(num_rows: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int],
                  vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens per row), the same for the same arguments."""
    rng = random.Random(seed)
    prompts, budgets = [], []
    for _ in range(num_rows):
        n = rng.randint(*prompt_len)
        prompts.append([rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(n)])
        budgets.append(rng.randint(*max_tokens))
    return prompts, budgets


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model name or .gguf file (default: %(default)s)")
    ap.add_argument("--batch-sizes", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=None, help=f"comma-separated (default: {','.join(map(str, BATCH_SIZES))})")
    ap.add_argument("--min-rows", type=int, default=16,
                    help="rows per batch size at least this many (default: 16); B rows when larger")
    ap.add_argument("--prompt-len", type=int_range, default=(8, 128),
                    help="prompt length range LO,HI (default: 8,128)")
    ap.add_argument("--max-tokens", type=int_range, default=(8, 64),
                    help="per-row max_tokens range LO,HI (default: 8,64)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--continuous", action="store_true",
                    help="also run continuous batching (at most B rows running) side by side")
    ap.add_argument("--quick", action="store_true",
                    help=f"batch sizes {','.join(map(str, QUICK_BATCH_SIZES))} and --min-rows 4")
    args = ap.parse_args(argv)
    if args.batch_sizes is None:
        args.batch_sizes = QUICK_BATCH_SIZES if args.quick else BATCH_SIZES
    if args.quick:
        args.min_rows = min(args.min_rows, 4)
    if args.min_rows < 1 or any(b < 1 for b in args.batch_sizes):
        ap.error("batch sizes and --min-rows must be >= 1")
    return args


def main(argv=None) -> None:
    import torch

    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.scheduler import generate_continuous
    from nanoserve.static.generate import BatchStats, blocks_for_batch, generate_batch

    args = parse_args(argv)
    threads = set_threads(args.threads)
    print(describe_run(threads))
    model, _, path = load_nanoserve(args.model)
    config = model.config
    plan = {b: max(b, args.min_rows) for b in args.batch_sizes}  # batch size -> rows
    prompts, budgets = make_workload(max(plan.values()), args.prompt_len, args.max_tokens,
                                     config.vocab_size, args.seed)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in budgets]
    block_size = 16
    peak = max(blocks_for_batch([len(p) for p in prompts[i:i + b]], max(budgets[i:i + b]), block_size)
               for b, rows in plan.items() for i in range(0, rows, b))
    pool = KVPool(CacheShape.of(config), peak, block_size, torch.float32, "cpu")
    print(f"model: {path.name}; workload: seed {args.seed}, prompt length uniform in "
          f"{list(args.prompt_len)}, max_tokens uniform in {list(args.max_tokens)}, ignore_eos, "
          f"greedy; KV pool {peak} blocks of {block_size}")

    generate_batch(model, prompts[:2], params[:2], (), pool)  # warm-up, untimed

    table = []
    for b, rows in plan.items():
        stats, seconds, out_tokens, batches = BatchStats(), 0.0, 0, 0
        static_tokens = []
        for i in range(0, rows, b):
            secs, (outs, st) = timed(
                generate_batch, model, prompts[i:i + b], params[i:i + b], (), pool)
            for o, want in zip(outs, budgets[i:i + b]):
                if len(o.token_ids) != want:
                    raise RuntimeError(f"a row made {len(o.token_ids)} tokens, expected {want}")
            static_tokens += [o.token_ids for o in outs]
            stats.add(st)
            seconds += secs
            out_tokens += sum(len(o.token_ids) for o in outs)
            batches += 1
        table.append([b, rows, batches, out_tokens, f"{seconds:.1f}", f"{out_tokens / seconds:.1f}",
                      f"{100 * stats.padding_waste:.1f}", f"{100 * stats.early_finish_waste:.1f}"])
        print(f"batch {b}: {rows} rows, {out_tokens} tokens in {seconds:.1f} s "
              f"({out_tokens / seconds:.1f} tok/s)", flush=True)
        if args.continuous:
            secs, (outs, st) = timed(generate_continuous, model, prompts[:rows], params[:rows],
                                     (), pool, None, b)
            if [o.token_ids for o in outs] != static_tokens:
                raise RuntimeError("continuous batching gave other tokens than static batching")
            table[-1] += [f"{out_tokens / secs:.1f}", f"{seconds / secs:.2f}",
                          f"{100 * st.padding_waste:.1f}", str(st.preemptions)]
            print(f"  continuous, at most {b} running: {secs:.1f} s "
                  f"({out_tokens / secs:.1f} tok/s)", flush=True)

    print()
    headers = ["batch size", "rows", "batches", "output tokens", "seconds", "output tok/s",
               "padding waste %", "early-finish waste %"]
    if args.continuous:
        headers += ["continuous tok/s", "continuous / static", "continuous padding %",
                    "preemptions"]
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()
