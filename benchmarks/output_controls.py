"""GPU: what structured outputs, logprobs and n samples cost, each against the same rows
without them, in one process (continuous batching, captured steps, bf16).

Model: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8 heads) with random bf16
weights and the default model's byte-level BPE tokenizer (49,152 tokens, so its vocabulary
is the model's: a grammar needs real token strings). Three comparisons, each printed as a
table row:
- json: ROWS rows, each constrained to one of four JSON schemas (outputs ~100-300 tokens),
  greedy; against the same prompts unconstrained with each row's max_tokens set to the
  length its constrained run produced (`ignore_eos`), so both runs generate the same
  number of tokens. Also: how many constrained rows parse and validate.
- logprobs: ROWS rows (prompts 100-1,024, outputs 100-300, `ignore_eos`) with logprobs=5
  on every row, against the same rows without; peak device memory of each run.
For json and logprobs, `--repeats N` runs the two sides N times, alternating (each pair's
ratio is printed; the first pair of a process pays its one-time costs); json's pairs 2..N
also run the constrained rows with their masks filled inline rather than on the runner's
fill thread (`ContinuousRunner.fill_in_thread`), checked to give the same tokens.
- n: N_PROMPTS prompts (256-2,048 tokens) x n=8 samples (temperature 0.8, seed), outputs
  64-256 tokens, against the same samples as separate rows (row seed + i), with prefix
  caching on (the engine's default) and off; how many samples have the same tokens.

    python -m benchmarks.output_controls [--rows 4096] [--n-prompts 512] [--repeats 1]
    [--only json|logprobs|n] [--tokenizer PATH/tokenizer.json]  (default: the default model's, from its GGUF)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_job import LLAMA_1B, make_random_model

PROFILE = False
SCHEMAS = [
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 10,
        "items": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 4, "maxLength": 12},
            "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["name", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 10, "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "tags": {"type": "array", "items": {"type": "string", "enum": [
            "drama", "comedy", "action", "horror", "documentary"]}, "minItems": 3, "maxItems": 6},
        "summary": {"type": "string", "minLength": 60, "maxLength": 200}},
     "required": ["title", "year", "tags", "summary"], "additionalProperties": False},
    {"type": "object", "properties": {"people": {"type": "array", "minItems": 4, "maxItems": 8,
        "items": {"type": "object", "properties": {
            "first": {"type": "string", "minLength": 3, "maxLength": 10},
            "last": {"type": "string", "minLength": 3, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{3,8}@[a-z]{3,8}\\.com$"}},
            "required": ["first", "last", "age", "email"], "additionalProperties": False}}},
     "required": ["people"], "additionalProperties": False},
    {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "reasons": {"type": "array", "items": {"type": "string", "minLength": 20,
                                               "maxLength": 60}, "minItems": 3, "maxItems": 5}},
     "required": ["sentiment", "score", "reasons"], "additionalProperties": False},
]


def make_model(folder: Path, tokenizer_json: Path) -> Path:
    config = dict(LLAMA_1B, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    del config["rope_scaling"]
    make_random_model(folder, "cuda", config)
    (folder / "tokenizer.json").write_text(tokenizer_json.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return folder


def timed(llm, prompts, params) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    llm.runner.profile = True
    llm.runner.phase_times()
    t0 = time.perf_counter()
    if PROFILE and len(prompts) > 256:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        outs = prof.runcall(llm.generate, prompts, params)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
    else:
        outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    phases = llm.runner.phase_times()
    llm.runner.profile = False
    tokens = sum(len(o.token_ids) for o in outs)
    host = phases.pop("host")
    steps = max(1, host.pop("steps", 1))
    if len(prompts) > 256:
        print(f"#   host ms per decode step ({steps} steps, {s * 1e3 / steps:.2f} ms wall each): "
              + ", ".join(f"{k} {v * 1e3 / steps:.2f}" for k, v in host.items()), flush=True)
    return {"s": s, "tokens": tokens, "rate": tokens / s, "outs": outs,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "phases": "device prefill {prefill_s:.1f} s + decode {decode_s:.1f} s, host waited "
                      "{host_wait_s:.1f} s".format(**phases)}


def row(name, a, b, note=""):
    ratio = a["rate"] / b["rate"]
    print(f"| {name} | {a['tokens']:,} | {a['s']:.2f} | {a['rate']:,.0f} | {b['rate']:,.0f} | "
          f"{ratio:.2f}x | {a['peak_gib']:.1f} / {b['peak_gib']:.1f} | {note}; with: "
          f"{a['phases']}; without: {b['phases']} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--n-prompts", type=int, default=512)
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--only", choices=["json", "logprobs", "n"], action="append")
    ap.add_argument("--repeats", type=int, default=1,
                    help="json, logprobs: run the two sides this many times, alternating")
    ap.add_argument("--profile", action="store_true",
                    help="print the host's hottest functions (cProfile) of each timed run")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.sampling.structured import StructuredOutputs

    tok = args.tokenizer
    if tok is None:
        from nanoserve.weights.model_store import DEFAULT_MODEL, resolve_model
        from nanoserve.weights.tokenizer import Tokenizer

        tok = Path(tempfile.mkdtemp()) / "tokenizer.json"
        tok.write_text(Tokenizer.from_path(resolve_model(DEFAULT_MODEL)).backend.to_str())
    folder = make_model(Path(tempfile.mkdtemp()) / "model", tok)
    llm = LLM(str(folder), dtype="bfloat16", device="cuda")
    V = llm.config.vocab_size
    rng = random.Random(0)

    def prompts_of(n, lo, hi):
        return [[rng.randrange(3, V) for _ in range(rng.randint(lo, hi))] for _ in range(n)]

    print(f"# output controls, {torch.cuda.get_device_name()}, {args.rows} rows; "
          f"{llm.runner.capture_summary()}")
    print("| workload | output tokens | s | with (tok/s) | without (tok/s) | ratio | "
          "peak GiB with / without | notes |")
    print("|---|---|---|---|---|---|---|---|")
    only = set(args.only or ["json", "logprobs", "n"])

    if "json" in only:
        prompts = prompts_of(args.rows, 100, 1024)
        sos = [StructuredOutputs(json=s) for s in SCHEMAS]
        cons = [SamplingParams(max_tokens=400, structured_outputs=sos[i % len(sos)])
                for i in range(args.rows)]
        t0 = time.perf_counter()
        for so in sos:
            llm.grammars.compile(so)
        compile_s = time.perf_counter() - t0
        timed(llm, prompts[:256], cons[:256])  # warm-up
        c = timed(llm, prompts, cons)
        plain = [SamplingParams(max_tokens=max(1, len(o.token_ids)), ignore_eos=True)
                 for o in c["outs"]]
        timed(llm, prompts[:256], plain[:256])
        u = timed(llm, prompts, plain)
        ratios = [f"{c['rate'] / u['rate']:.2f}x"]
        inline = []  # the same constrained rows with the masks filled inline (no fill thread)
        for _ in range(args.repeats - 1):  # alternating, as logprobs
            llm.runner.fill_in_thread = False
            i = timed(llm, prompts, cons)
            llm.runner.fill_in_thread = True
            c, u = timed(llm, prompts, cons), timed(llm, prompts, plain)
            ratios.append(f"{c['rate'] / u['rate']:.2f}x")
            inline.append(f"{i['rate'] / u['rate']:.2f}x")
            assert [o.token_ids for o in i["outs"]] == [o.token_ids for o in c["outs"]]
        ok = 0
        try:
            import jsonschema
        except ImportError:
            jsonschema = None
        for i, o in enumerate(c["outs"]):
            try:
                value = json.loads(o.text)
                if jsonschema is not None:
                    jsonschema.validate(value, SCHEMAS[i % len(SCHEMAS)])
                ok += 1
            except Exception:  # noqa: BLE001 - counted as not valid
                pass
        lens = sorted(len(o.token_ids) for o in c["outs"])
        row("json schema (4 schemas) vs unconstrained", c, u,
            f"{ok}/{len(lens)} parse+validate; output tokens median {lens[len(lens) // 2]} "
            f"(p10 {lens[len(lens) // 10]}, p90 {lens[9 * len(lens) // 10]}); "
            f"4 schemas compiled in {compile_s:.2f} s; each pair's ratio in order: "
            f"{', '.join(ratios)} (the table shows the last); masks filled inline instead "
            f"of on the fill thread, pairs 2..: {', '.join(inline) or 'not run'}")

    if "logprobs" in only:
        prompts = prompts_of(args.rows, 100, 1024)
        lens = [rng.randint(100, 300) for _ in prompts]
        base = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
        lp = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5) for n in lens]
        timed(llm, prompts[:256], lp[:256])
        pairs = []
        for _ in range(args.repeats):  # alternating, so neither side pays the other's warm-up
            pairs.append((timed(llm, prompts, lp), timed(llm, prompts, base)))
        a, b = pairs[-1]
        same = sum(x.token_ids == y.token_ids for x, y in zip(a["outs"], b["outs"]))
        ratios = ", ".join(f"{x['rate'] / y['rate']:.2f}x" for x, y in pairs)
        row("logprobs=5 every row vs none", a, b,
            f"{same}/{len(prompts)} rows same tokens; each pair's ratio in order: {ratios} "
            f"(the table shows the last)")

    if "n" in only:
        prompts = prompts_of(args.n_prompts, 256, 2048)
        lens = [rng.randint(64, 256) for _ in prompts]
        n = 8
        grouped = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.8, seed=1000 * i,
                                  n=n) for i, m in enumerate(lens)]
        flat_prompts = [p for p in prompts for _ in range(n)]
        flat = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.8, seed=1000 * i + j)
                for i, m in enumerate(lens) for j in range(n)]
        timed(llm, prompts[:32], grouped[:32])
        a = timed(llm, prompts, grouped)
        b = timed(llm, flat_prompts, flat)
        same = sum(x.token_ids == y.token_ids for x, y in zip(a["outs"], b["outs"]))
        row(f"n={n} over {len(prompts)} prompts vs {len(flat)} rows (prefix caching on)", a, b,
            f"{same}/{len(flat)} samples same tokens")
        llm.enable_prefix_caching = False
        c = timed(llm, flat_prompts, flat)
        llm.enable_prefix_caching = True
        row(f"n={n} over {len(prompts)} prompts vs {len(flat)} rows (prefix caching off)", a, c,
            "")


if __name__ == "__main__":
    main()
