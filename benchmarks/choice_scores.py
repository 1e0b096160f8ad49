"""Label scores against one constrained token: ROWS classification rows x 4 labels scored
with `LLM.choice_scores` (forward passes over prompt + each label), against the same rows
generating one token under a choice constraint over the same labels (greedy), in one
process, on the default model (SmolLM2-135M-Instruct). Prints a table and the ratio of
rows/s (scores over constrained), the headline `choice-scores-over-constrained-1tok`.

    python -m benchmarks.choice_scores [--rows 10000] [--repeats 2] [--device auto]
    python -m benchmarks.choice_scores --smoke      # 16 rows on the CPU, a minute
"""

from __future__ import annotations

import argparse
import random
import time

LABELS = ["positive", "negative", "neutral", "mixed feelings"]
WORDS = ("the film plot actors music long slow brilliant dull scene ending story camera "
         "dialogue moving funny sad cast script pace visual score theatre night").split()


def make_prompts(rows: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Review {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))
            + ". Sentiment (positive, negative, neutral or mixed feelings):"
            for i in range(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None)
    ap.add_argument("--smoke", action="store_true", help="16 rows on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.repeats, args.device = 16, 1, "cpu"

    from benchmarks.common import git_commit, markdown_table
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams
    from nanoserve.structured import StructuredOutputs

    kwargs = {"device": args.device}
    if args.model:
        kwargs["model"] = args.model
    if args.device == "cpu":
        kwargs["kv_cache_bytes"] = 256 << 20
    llm = LLM(**kwargs)
    prompts = [llm.tokenizer.encode(p) for p in make_prompts(args.rows)]
    constrained = SamplingParams(max_tokens=1, temperature=0.0,
                                 structured_outputs=StructuredOutputs(choice=tuple(LABELS)))

    def sync() -> None:
        if llm.device.type == "cuda":
            import torch

            torch.cuda.synchronize()

    results: dict[str, list[float]] = {"constrained-1tok": [], "choice-scores": []}
    agree = None
    for _ in range(args.repeats):  # alternating; the first pair pays one-time costs
        sync()
        t = time.perf_counter()
        gen = llm.generate(prompts, constrained)
        sync()
        results["constrained-1tok"].append(args.rows / (time.perf_counter() - t))
        t = time.perf_counter()
        scores = llm.choice_scores(prompts, LABELS)
        sync()
        results["choice-scores"].append(args.rows / (time.perf_counter() - t))
        best = [max(s, key=s.get) for s in scores]
        # rows whose one constrained token starts the most likely label
        agree = sum(b.startswith(g.text) and g.text != "" for b, g in zip(best, gen))
    table = [[name, f"{max(v):,.1f}", ", ".join(f"{x:,.1f}" for x in v)]
             for name, v in results.items()]
    print(f"commit {git_commit()}; device {llm.device}; rows {args.rows}; labels {LABELS}")
    print(markdown_table(["run", "rows/s (best)", "rows/s (each repeat)"], table))
    ratio = max(results["choice-scores"]) / max(results["constrained-1tok"])
    print(f"rows whose constrained token begins the top-scored label: {agree}/{args.rows}")
    print(f"- choice-scores-over-constrained-1tok: {ratio:.2f}")


if __name__ == "__main__":
    main()
