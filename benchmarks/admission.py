"""When a running batch admits new rows (`nanoserve.scheduling.scheduler`: once max_batch_size /
ADMIT_SHARE row slots are free and ADMIT_WAIT_STEPS decode steps ran since its last
admission, or at once when max_batch_size / ADMIT_FULL_SHARE are free), on the workloads of
`benchmarks.vs_vllm` (3,000 short rows over shared system prompts, where rows end every
step and admission's host work decides; nano-vllm's 256 long rows) and `many`: 1,024 rows of
nano-vllm's lengths, four times the row slots, where rows end one by one. One engine, one
process, the policies interleaved.

    python3 -m benchmarks.admission [--policies 32/32/0,32/4/4,4/4/0] [--repeats 2]
        [--workloads shared,nanovllm,many] [--profile] [--smoke]

--smoke (a tiny model on the CPU) also checks the tokens: under every policy each row's
greedy tokens equal the row's own run alone (a policy changes when rows join, never what
they generate); a difference exits non-zero.

A policy is ADMIT_SHARE/ADMIT_FULL_SHARE/ADMIT_WAIT_STEPS: 32/32/0 admits as soon as 8 of
256 slots are free; 4/4/0 once 64 are.

Each timed run uses its own token shift (every id + k), so no block of one run is in the
prefix cache for the next; each workload is warmed up once first, untimed. Prints per run:
wall time, output tok/s, prefills and decode steps, the device's busy time and
the host's admission time (the runner's phase timers: CUDA events, no sync added), then a
table of medians. --profile: one more run of the shared workload at the first policy under
cProfile, the host's top functions by own time (the profiler slows the host: shares only).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from pathlib import Path

import torch

import nanoserve.scheduling.scheduler as scheduler
from benchmarks.gpu_job import LLAMA_1B
from benchmarks.vs_vllm import (
    VOCAB,
    model_folder,
    nanovllm_workload,
    shared_workload,
    timed_generate,
    warmup_of,
)


def _set(policy: tuple[int, int, int]) -> None:
    scheduler.ADMIT_SHARE, scheduler.ADMIT_FULL_SHARE, scheduler.ADMIT_WAIT_STEPS = policy


def _name(policy: tuple[int, int, int]) -> str:
    return "/".join(map(str, policy))


def timed_run(llm, prompts, max_tokens, device: str) -> dict:
    r = timed_generate(llm, prompts, max_tokens, device)
    ph = r.get("phases") or {"prefill_n": 0, "decode_n": 0, "host": {}}
    return {**r, "prefills": ph["prefill_n"], "decodes": ph["decode_n"],
            "busy_s": r.get("busy_s", 0.0), "admit_s": ph["host"].get("admit", 0.0)}


def check_tokens(llm, workloads, policies, vocab: int, shift: int) -> None:
    """Each workload's rows (greedy, ignore_eos) under every policy against each row run
    alone: the same token ids, or SystemExit naming the first difference."""
    from nanoserve.sampling.params import SamplingParams

    for name, (prompts, max_tokens) in workloads.items():
        prompts = warmup_of(prompts, vocab, shift)
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
        alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
        for policy in policies:
            _set(policy)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            bad = next((i for i, (a, b) in enumerate(zip(got, alone)) if a != b), None)
            if bad is not None:
                raise SystemExit(f"{name} policy {_name(policy)}: row {bad} gave {got[bad]}, "
                                 f"alone {alone[bad]}")
    print(f"tokens: under every policy each row equals itself run alone "
          f"({sum(len(w[0]) for w in workloads.values())} rows)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="32/32/0,32/4/4,4/4/0",
                    help="ADMIT_SHARE/ADMIT_FULL_SHARE/ADMIT_WAIT_STEPS, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="shared,nanovllm,many")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("/tmp/nanoserve-admission"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model and workload on the CPU")
    args = ap.parse_args()
    policies = [tuple(int(x) for x in p.split("/")) for p in args.policies.split(",")]
    device, config = "cuda", LLAMA_1B
    if args.smoke:
        device = "cpu"
        config = {**LLAMA_1B, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                  "vocab_size": 8192}
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    vocab = config.get("vocab_size", VOCAB)
    model_dir = model_folder(args.out / ("llama-1b-random" + ("-smoke" if args.smoke else "")),
                             device, config)
    workloads = {}
    for name in args.workloads.split(","):
        if name == "shared":
            w = (shared_workload(24, vocab, systems=3, system_len=(40, 80), own_len=(4, 12),
                                 out_len=(2, 6)) if args.smoke else shared_workload(vocab=vocab))
            workloads[name] = w[:2]
        elif name == "nanovllm":
            workloads[name] = (nanovllm_workload(8, vocab, lo=4, hi=16) if args.smoke
                               else nanovllm_workload(vocab=vocab))
        else:
            workloads[name] = (nanovllm_workload(24, vocab, lo=4, hi=16) if args.smoke
                               else nanovllm_workload(1024, vocab=vocab))

    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams

    llm = LLM(str(model_dir), device=device, scheduler="continuous", enable_prefix_caching=True)
    default = (scheduler.ADMIT_SHARE, scheduler.ADMIT_FULL_SHARE, scheduler.ADMIT_WAIT_STEPS)
    print(f"max_batch_size {llm.max_batch_size}; default policy {_name(default)}", flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    shift = 1
    for name, (prompts, max_tokens) in workloads.items():
        llm.generate(warmup_of(prompts, vocab, shift),
                     [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
        shift += 1
        for rep in range(args.repeats):
            for policy in policies:
                _set(policy)
                r = timed_run(llm, warmup_of(prompts, vocab, shift), max_tokens, device)
                shift += 1
                results.setdefault((name, _name(policy)), []).append(r)
                print(f"{name} policy {_name(policy)} rep {rep}: "
                      f"{r['wall_s']:.2f} s, {r['tok_s']:.0f} tok/s, {r['prefills']} prefills, "
                      f"{r['decodes']} decode steps, device busy {r['busy_s']:.2f} s, host "
                      f"admission {r['admit_s']:.2f} s", flush=True)
    _set(default)
    if args.smoke:
        check_tokens(llm, workloads, policies, vocab, shift)
        shift += 1

    print("\n| workload | policy | wall s | output tok/s | prefills "
          "| decode steps | device busy s | host admission s |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, policy), runs in results.items():
        def med(k, runs=runs):
            return statistics.median(r[k] for r in runs)
        print(f"| {name} | {policy} | {med('wall_s'):.2f} | "
              f"{med('tok_s'):.0f} | {med('prefills'):.0f} | {med('decodes'):.0f} | "
              f"{med('busy_s'):.2f} | {med('admit_s'):.2f} |")

    if args.profile and "shared" in workloads:
        prompts, max_tokens = workloads["shared"]
        _set(policies[0])
        prof = cProfile.Profile()
        prof.enable()
        timed_run(llm, warmup_of(prompts, vocab, shift), max_tokens, device)
        prof.disable()
        _set(default)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(f"\nshared, policy {_name(policies[0])}, under cProfile:\n{s.getvalue()}")


if __name__ == "__main__":
    main()
