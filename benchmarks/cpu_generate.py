"""CPU tokens/s at batch 1: nanoserve against Hugging Face transformers, side by side.

Both load the same GGUF file (SmolLM2-135M-Instruct by default, dequantized to float32) and
generate greedily for the same prompts, a fixed number of new tokens each, with ignore_eos
semantics: nanoserve through `generate_batch` with `SamplingParams(ignore_eos=True)` (the path
`LLM.generate` takes: paged KV cache, static batch of one); transformers through
`LlamaForCausalLM.generate(do_sample=False)` with the EOS ids cleared from its generation
config, so that, like `ignore_eos`, it keeps taking the argmax past an EOS token.
(`min_new_tokens` would instead mask EOS out of the argmax, and the two would part ways
wherever the model wants to stop.)

Runs are interleaved (for each repeat and prompt: nanoserve then transformers, the order
flipped every other run) so that load on a shared machine falls on both sides alike.
Each call is timed whole (prefill plus decode); tokens/s = new tokens / seconds. The table
gives per-prompt medians, the ratio nanoserve / transformers, and whether both produced the
same greedy tokens. One untimed warm-up call per side comes first.

    python benchmarks/cpu_generate.py --threads 1 --repeats 3

`--batch` runs one batch instead: the 35 prompts of `examples/prompts.jsonl` (chat rows
rendered with the model's chat template), `--new-tokens` each, as one batch: nanoserve's
static batch (`generate_batch`: right-padded rows, each at its own positions) and its
continuous scheduler with every row admitted at once (`generate_continuous`: packed
prefill; what `LLM` and a CPU worker of the batch job run), against transformers'
`generate` over the left-padded batch with its attention mask. Each call is timed whole;
tokens/s = rows x new tokens / seconds; "same tokens" counts the rows whose tokens agree
with transformers'.

    python -m benchmarks.cpu_generate --batch --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from benchmarks.common import (
    describe_run,
    load_nanoserve,
    markdown_table,
    median,
    set_threads,
    timed,
)

PLAIN_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined several existing technologies, the screw press, oil-based ink and "
    "movable metal type, into one machine that could print a page in seconds. Its effect on "
    "Europe was",
    'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    """Merge two sorted '
    'lists into one sorted list."""\n',
    "Photosynthesis is the process by which green plants turn light into chemical energy. "
    "In simple terms, the leaves",
]
CHAT_PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"


def build_prompts(tokenizer) -> list[list[int]]:
    """Four prompts of about 20 to 60 tokens: three plain texts and one chat turn."""
    texts = PLAIN_PROMPTS[:2] + [tokenizer.apply_chat_template(CHAT_PROMPT)] + PLAIN_PROMPTS[2:]
    return [tokenizer.encode(t) for t in texts]


def build_batch_prompts(tokenizer, path: pathlib.Path = EXAMPLES) -> list[list[int]]:
    """The rows of `examples/prompts.jsonl` as token ids, as the batch job prepares them: a
    `prompt` encoded with the model's BOS rule, `messages` rendered with the chat template
    (generation prompt added) and encoded without adding special tokens."""
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "messages" in row:
            text = tokenizer.apply_chat_template(row["messages"])
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(row["prompt"]))
    return out


def load_transformers(path: pathlib.Path):
    """transformers' LlamaForCausalLM from the same GGUF file, float32, eval mode."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                             dtype=torch.float32, local_files_only=True)
    return model.eval()


def nanoserve_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.static.generate import generate_batch

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs, _ = generate_batch(model, [prompt], [params], eos_token_ids=())
    return outs[0].token_ids


def nanoserve_generate_batch(model, prompts: list[list[int]], new_tokens: int,
                             scheduler: str = "static") -> list[list[int]]:
    """One batch through the static scheduler (`generate_batch`) or the continuous one
    (`generate_continuous`, every row admitted at once: what `LLM` runs on the CPU)."""
    from nanoserve.sampling.params import SamplingParams

    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
    if scheduler == "static":
        from nanoserve.static.generate import generate_batch

        outs, _ = generate_batch(model, prompts, params, eos_token_ids=())
    else:
        from nanoserve.scheduling.scheduler import generate_continuous

        outs, _ = generate_continuous(model, prompts, params, eos_token_ids=(),
                                      max_batch_size=len(prompts))
    return [o.token_ids for o in outs]


def transformers_generate_batch(model, prompts: list[list[int]], new_tokens: int,
                                pad_token_id: int) -> list[list[int]]:
    """One left-padded batch (transformers' way for decoder-only generation)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens)
    return out[:, width:].tolist()


def transformers_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def clear_eos(model, pad_token_id: int) -> None:
    """Make the model's generation config EOS-free: exactly `max_new_tokens` tokens, argmax
    each step. (`generate` fills any setting left None from `model.generation_config`, so the
    EOS ids must be cleared there, not in a config passed per call.)"""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_token_id


def same_tokens(a: list[int], b: list[int]) -> str:
    if a == b:
        return "yes"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"no (from token {first})"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model name or .gguf file (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per call (default: 64)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed calls per prompt and side (default: 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--batch", action="store_true",
                    help="one batch of the 35 prompts of examples/prompts.jsonl")
    args = ap.parse_args(argv)
    if args.new_tokens < 1 or args.repeats < 1:
        ap.error("--new-tokens and --repeats must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    print(describe_run(threads))
    secs_ns, (ns_model, tokenizer, path) = timed(lambda: load_nanoserve(args.model))
    secs_hf, hf_model = timed(lambda: load_transformers(path))
    print(f"model: {path.name}; load seconds: nanoserve {secs_ns:.1f}, transformers {secs_hf:.1f}")
    clear_eos(hf_model, tokenizer.eos_token_ids[0])
    if args.batch:
        run_batch(args, ns_model, hf_model, tokenizer)
        return
    prompts = build_prompts(tokenizer)
    n = args.new_tokens
    sides = {
        "nanoserve": lambda p: nanoserve_generate(ns_model, p, n),
        "transformers": lambda p: transformers_generate(hf_model, p, n),
    }
    for run in sides.values():  # warm-up, untimed
        run(prompts[0])

    rates = {s: [[] for _ in prompts] for s in sides}  # tokens/s per side, prompt, repeat
    tokens = {s: [None] * len(prompts) for s in sides}
    stable = True
    for r in range(args.repeats):
        for i, p in enumerate(prompts):
            order = list(sides) if (r + i) % 2 == 0 else list(reversed(sides))
            for side in order:
                secs, out = timed(sides[side], p)
                if len(out) != n:
                    raise RuntimeError(f"{side} made {len(out)} tokens for prompt {i}, expected {n}")
                rates[side][i].append(n / secs)
                stable &= tokens[side][i] in (None, out)
                tokens[side][i] = out
            print(f"repeat {r + 1}/{args.repeats} prompt {i}: "
                  + ", ".join(f"{s} {rates[s][i][-1]:.1f} tok/s" for s in sides), flush=True)

    rows = []
    for i, p in enumerate(prompts):
        a, b = median(rates["nanoserve"][i]), median(rates["transformers"][i])
        rows.append([i, len(p), f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}",
                     same_tokens(tokens["nanoserve"][i], tokens["transformers"][i])])
    all_a = median([x for xs in rates["nanoserve"] for x in xs])
    all_b = median([x for xs in rates["transformers"] for x in xs])
    n_same = sum(tokens["nanoserve"][i] == tokens["transformers"][i] for i in range(len(prompts)))
    rows.append(["all", "-", f"{all_a:.1f}", f"{all_b:.1f}", f"{all_a / all_b:.2f}",
                 f"{n_same}/{len(prompts)}"])
    paired = median([x / y for xa, xb in zip(rates["nanoserve"], rates["transformers"])
                     for x, y in zip(xa, xb)])
    print()
    print(f"batch 1, {n} new tokens (ignore_eos), greedy, float32, {args.repeats} repeats "
          f"per prompt and side, interleaved; median tokens/s")
    print(markdown_table(["prompt", "prompt tokens", "nanoserve tok/s", "transformers tok/s",
                          "ratio", "same tokens"], rows))
    print(f"median of paired ratios (same prompt, same repeat): {paired:.2f}")
    if not stable:
        print("warning: a side's greedy tokens changed between repeats of the same prompt")


def run_batch(args, ns_model, hf_model, tokenizer) -> None:
    """The `--batch` table: each side on one batch of the example prompts, interleaved."""
    prompts = build_batch_prompts(tokenizer)
    n, rows = args.new_tokens, len(prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_ids[0]
    sides = {
        "nanoserve static": lambda: nanoserve_generate_batch(ns_model, prompts, n),
        "transformers": lambda: transformers_generate_batch(hf_model, prompts, n, pad),
    }
    if has_continuous():
        sides["nanoserve continuous"] = lambda: nanoserve_generate_batch(ns_model, prompts, n,
                                                                         "continuous")
    for run in sides.values():  # warm-up, untimed
        run()
    rates: dict[str, list[float]] = {s: [] for s in sides}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))  # reversed every other
        for side in order:
            secs, out = timed(sides[side])
            if any(len(o) != n for o in out):
                raise RuntimeError(f"{side} made a row of other than {n} tokens")
            rates[side].append(rows * n / secs)
            tokens[side] = out
        print(f"repeat {r + 1}/{args.repeats}: "
              + ", ".join(f"{s} {rates[s][-1]:.1f} tok/s" for s in sides), flush=True)
    hf = median(rates["transformers"])
    table = [["transformers", f"{hf:.1f}", "1.00", "1.00", "-"]]
    for side in (s for s in sides if s != "transformers"):
        a = median(rates[side])
        same = sum(x == y for x, y in zip(tokens[side], tokens["transformers"]))
        paired = median([x / y for x, y in zip(rates[side], rates["transformers"])])
        table.append([side, f"{a:.1f}", f"{a / hf:.2f}", f"{paired:.2f}", f"{same}/{rows}"])
    print()
    print(f"one batch of {rows} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens), {n} new tokens each (ignore_eos), greedy, float32, {args.repeats} "
          f"repeats per side, interleaved; median tokens/s; ratios to transformers (paired: "
          f"the median of the ratios within each repeat)")
    print(markdown_table(["side", "tok/s", "ratio", "paired ratio", "same tokens"], table))


def has_continuous() -> bool:
    """Whether this checkout has the continuous scheduler (a side by side run may time an
    older one)."""
    try:
        import nanoserve.scheduling.scheduler  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
