"""Label scores against one constrained token: ROWS classification rows x 4 labels scored
with `LLM.choice_scores` (one packed prefill of each prompt, then the labels' later tokens
over its blocks: `nanoserve.sampling.choice_scores.label_logprobs`), against the same rows generating
one token under a choice constraint over the same labels (greedy, max_tokens=1), in one
process. Prints a table and the ratio of rows/s (scores over constrained), the headline
`choice-scores-over-constrained-1tok` (target on the GPU: >= 0.8). The first `--check` rows'
scores are recomputed through another path, each prompt + label prefilled whole with prompt
logprobs (`LLM.generate`), and the largest difference of log-probabilities is printed
(`check_error`), so a fast path that scores wrongly shows beside its speed.

    python -m benchmarks.choice_scores --shape 1b      # the GPU: Llama-3.2-1B shape, random
                                                       # bf16 weights, 10,000 rows, no download
    python -m benchmarks.choice_scores                 # the default model (SmolLM2-135M)
    python -m benchmarks.choice_scores --smoke [--shape 1b]   # 16 rows on the CPU

`--shape 1b` builds its checkpoint folder from a config.json alone (`LLM(load_format=
"dummy")`: weights drawn on the device) and a byte-level tokenizer made on the spot
(`nanoserve.testing.save_byte_tokenizer`): nothing is fetched, so it runs on a machine
without network. With `--smoke` the shape is shrunk (2 layers, hidden 256) for the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

LABELS = ["positive", "negative", "neutral", "mixed feelings"]
WORDS = ("the film plot actors music long slow brilliant dull scene ending story camera "
         "dialogue moving funny sad cast script pace visual score theatre night").split()


def make_prompts(rows: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Review {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))
            + ". Sentiment (positive, negative, neutral or mixed feelings):"
            for i in range(rows)]


def random_checkpoint(shape: str, smoke: bool) -> Path:
    """A folder with the shape's config.json and a byte-level tokenizer (no weights: the
    engine draws them, `load_format="dummy"`)."""
    from benchmarks.gpu_job import SHAPES
    from nanoserve.testing import save_byte_tokenizer

    config = dict(SHAPES[shape])
    if smoke:  # the CPU: a small model of the same family
        config.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=8192)
    config.update(bos_token_id=256, eos_token_id=257)  # the byte tokenizer's <s>, </s>
    folder = Path(tempfile.mkdtemp(prefix=f"nanoserve-choice-scores-{shape}-"))
    (folder / "config.json").write_text(json.dumps(config))
    return save_byte_tokenizer(folder)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    ap.add_argument("--shape", choices=("1b", "8b"), default=None,
                    help="random weights of this shape (benchmarks.gpu_job.SHAPES), "
                         "nothing downloaded")
    ap.add_argument("--smoke", action="store_true", help="16 rows on the CPU")
    ap.add_argument("--check", type=int, default=8, metavar="ROWS",
                    help="recompute this many rows' scores through prompt logprobs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats, args.device = 16, 1, "cpu"
    if args.shape and args.model:
        ap.error("give --shape or --model, not both")

    from benchmarks.common import git_commit, markdown_table
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.sampling.structured import StructuredOutputs

    kwargs = {"device": args.device}
    if args.shape:
        kwargs.update(model=str(random_checkpoint(args.shape, args.smoke)),
                      load_format="dummy")
    elif args.model:
        kwargs["model"] = args.model
    if args.device == "cpu":
        kwargs["kv_cache_bytes"] = 256 << 20
    t = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"loaded in {time.perf_counter() - t:.1f} s", flush=True)
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
    tokens = sum(map(len, prompts))
    print(f"commit {git_commit()}; device {llm.device}; model {args.shape or args.model or 'default'}"
          f"; rows {args.rows} ({tokens / args.rows:.0f} prompt tokens a row); labels {LABELS}")
    print(markdown_table(["run", "rows/s (best)", "rows/s (each repeat)"], table))
    ratio = max(results["choice-scores"]) / max(results["constrained-1tok"])
    print(f"rows whose constrained token begins the top-scored label: {agree}/{args.rows}")
    error = check_scores(llm, prompts[:args.check], scores[:args.check])
    print(f"rows whose scores were recomputed through prompt logprobs: {min(args.check, args.rows)}"
          f", largest difference of log-probabilities {error:.2e}")
    print(f"- choice-scores-over-constrained-1tok: {ratio:.2f}")
    return {"ratio": ratio, "agree": agree, "check_error": error,
            "rows": len(scores), "constrained": [g.text for g in gen]}


def check_scores(llm, prompts: list[list[int]], scores: list[dict[str, float]]) -> float:
    """The largest |difference| between the log of `scores` and the labels' normalised
    log-probabilities from each prompt + label prefilled whole with prompt logprobs (the sum
    of the label tokens'). In logs: a rare label's error shows, where its probability is
    ~0 either way."""
    import math

    from nanoserve.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    label_ids = [llm.tokenizer.encode(lb, add_special_tokens=False) for lb in LABELS]
    worst = 0.0
    for prompt, got in zip(prompts, scores):
        outs = llm.generate([list(prompt) + ids for ids in label_ids], params)
        sums = [sum(e.logprob for e in out.prompt_logprobs[len(prompt) - 1:])
                for out in outs]
        top = max(sums)
        norm = top + math.log(sum(math.exp(x - top) for x in sums))
        for label, x in zip(LABELS, sums):
            worst = max(worst, abs(math.log(max(got[label], 1e-300)) - (x - norm)))
    return worst

if __name__ == "__main__":
    main()
