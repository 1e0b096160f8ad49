"""Mutation check: the tests named here must fail when the code they guard is broken.

    python tests/mutations.py                # every mutation (GPU ones only on a GPU)
    python tests/mutations.py --list         # the list, nothing run
    python tests/mutations.py --only embed-plain-cut --baseline

Each mutation replaces one exact stretch of text in one file (found exactly once, else the
list is stale and the script says so) in a fresh copy of the repository, then runs the
test that is meant to catch it with pytest in that copy (its code first on PYTHONPATH,
Ray's workers included). A mutation is caught when that test fails; it survives when the
test passes. `--baseline` also runs each test on the unmutated copy first, which must
pass (else the test, not the mutation, is broken). Mutations marked GPU run only where
torch sees a CUDA device, and are reported as skipped elsewhere. Exit status: 0 when
every mutation run was caught, 1 when one survived or a run went wrong.

Not part of `pytest tests` (the file's name does not start with `test_`): it runs the
named tests once per mutation and takes minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str  # exact text, found exactly once in `file`
    new: str
    test: str  # pytest node id, relative to the repository root
    gpu: bool = False
    why: str = ""


MUTATIONS = [
    # OpenAI Batch files (tests/test_openai_batch.py)
    Mutation("openai-chat-top-logprobs-zero", "ray_jobs/output/openai_files.py",
             'top.append({"token": t_text, "logprob": t["logprob"], "bytes": t_raw})',
             'top.append({"token": t_text, "logprob": 0.0, "bytes": t_raw})',
             "tests/test_openai_batch.py::test_output_lines_parse_as_openai_types_and_equal_the_engine",
             why="chat top_logprobs values not the engine's"),
    Mutation("openai-completion-top-logprobs-empty", "ray_jobs/output/openai_files.py",
             '"top_logprobs": [{self.text(t["token_id"])[0]: t["logprob"]\n'
             '                                  for t in e["top"] or ()} for e in entries],',
             '"top_logprobs": [{} for e in entries],',
             "tests/test_openai_batch.py::test_output_lines_parse_as_openai_types_and_equal_the_engine",
             why="completion top_logprobs dicts emptied"),
    Mutation("openai-text-offset-zero", "ray_jobs/output/openai_files.py",
             "offsets.append(at)", "offsets.append(0)",
             "tests/test_openai_batch.py::test_output_lines_parse_as_openai_types_and_equal_the_engine",
             why="every text_offset 0"),
    Mutation("openai-default-temperature-greedy", "ray_jobs/input/openai_requests.py",
             'OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}', "OPENAI_DEFAULTS = {}",
             "tests/test_openai_batch.py::test_request_lines_are_recognised_and_mapped",
             why="a request without temperature runs greedy (nanoserve's default, not OpenAI's 1)"),
    # embeddings (tests/test_embed.py)
    Mutation("embed-plain-cut", "nanoserve/embed.py",
             "        if suffix and ids[-len(suffix):] == suffix and len(suffix) < self.limit:\n"
             "            return ids[:self.limit - len(suffix)] + suffix, True\n", "",
             "tests/test_embed.py::test_truncation_keeps_the_closing_token",
             why="truncation cuts the closing token off"),
    Mutation("embed-mean-count", "nanoserve/embed.py",
             "return sums / lens[:, None].float()", "return sums / (lens[:, None].float() + 1)",
             "tests/test_embed.py::test_llm_embed_matches_transformers",
             why="mean pooling divides by one token too many (hidden by L2 normalisation)"),
    # the FP8 KV cache on the CPU (tests/test_fp8_kv.py)
    Mutation("fp8-step-read-without-scales", "nanoserve/cache/step_cache.py",
             "even_splits=EVEN_SPLITS, **self.pool.scales(layer))", "even_splits=EVEN_SPLITS)",
             "tests/test_fp8_kv.py::test_continuous_batching_over_an_fp8_pool",
             why="a continuous decode step reads the FP8 pool without its layer's scales"),
    # the continuous runner's padded prefill lengths (tests/test_scheduler.py)
    Mutation("prefill-length-rule", "nanoserve/scheduling/fixed_prefill.py",
             "step = 64 if n <= 1024 else 128 if n <= 4096 else 256",
             "step = 64 if n <= 1024 else 128 if n <= 4096 else 256 if n <= 8192 else 128",
             "tests/test_scheduler.py::test_prefill_length_rounds_up_to_few_shapes",
             why="past 8,192 tokens lengths round to 128, not 256 (the 56 shapes below unchanged)"),
    # reasoning: the budget's forced tokens, the first mask, the prompt's think tags
    # (tests/test_reasoning.py)
    Mutation("reasoning-newline-after-line-end", "nanoserve/sampling/reasoning.py",
             "        elif (self.num_reasoning == self.budget - 1 and p.newline_id is not None\n"
             "              and not (self.last is not None and p.ends_line(self.last))):\n",
             "        elif self.num_reasoning == self.budget - 1 and p.newline_id is not None:\n",
             "tests/test_reasoning.py::test_no_newline_is_forced_after_a_line_end",
             why="a newline is forced even when the block's last token already ends a line"),
    Mutation("reasoning-first-mask-without-think", "nanoserve/sampling/reasoning.py",
             "            if self.phase == MAY_OPEN:\n"
             "                word, value = _bit(self.parser.open_id)\n"
             "                row[word] = int(row[word]) | value\n", "",
             "tests/test_reasoning.py::test_first_mask_holds_think_beside_the_grammar",
             why="a qwen3 row's first mask no longer allows <think> beside the grammar's tokens"),
    Mutation("reasoning-first-think-tag", "nanoserve/sampling/reasoning.py",
             "for t in reversed(prompt_ids):", "for t in prompt_ids:",
             "tests/test_reasoning.py::test_empty_think_block_in_the_prompt_starts_the_answer",
             why="the prompt's first think tag is read instead of its last"),
    Mutation("cli-max-thinking-tokens-dropped", "ray_jobs/cli.py",
             "max_thinking_tokens=args.max_thinking_tokens,", "max_thinking_tokens=None,",
             "tests/test_reasoning.py::test_cli_reasoning_flags_reach_the_rows",
             why="--max-thinking-tokens never reaches the job"),
    Mutation("cli-chat-template-kwargs-dropped", "ray_jobs/cli.py",
             "        chat_template_kwargs=args.chat_template_kwargs,\n", "",
             "tests/test_reasoning.py::test_cli_reasoning_flags_reach_the_rows",
             why="--chat-template-kwargs never reaches the job"),
    Mutation("ray-data-chat-template-kwargs-ignored", "ray_jobs/data_processor.py",
             "grammars=llm.grammars, chat_template_kwargs=self.chat_template_kwargs,",
             "grammars=llm.grammars,",
             "tests/test_reasoning.py::test_openai_body_and_ray_data_take_the_budget",
             why="the Ray Data stage renders chat rows without its chat_template_kwargs"),
    # label scores (tests/test_choice_scores.py, tests/test_choice_scores_job.py)
    Mutation("choice-scores-fork-not-copied", "nanoserve/sampling/choice_scores.py",
             "            pool.copy_blocks(pairs)\n", "",
             "tests/test_choice_scores.py::test_label_logprobs_over_a_pool_of_stale_blocks",
             why="a multi-token label's fork reads a partly filled last block never copied"),
    Mutation("choice-scores-blocks-round-down", "nanoserve/sampling/choice_scores.py",
             "return -(-n // bs)", "return n // bs",
             "tests/test_choice_scores.py::test_a_ten_block_pool_scores_in_groups",
             why="a group's block count rounds down, so a group may not fit the pool"),
    Mutation("scored-row-one-token", "ray_jobs/workers/worker.py",
             '"num_generated_tokens": len(label_ids[best]),', '"num_generated_tokens": 1,',
             "tests/test_choice_scores_job.py::test_job_rows_carry_label_probabilities",
             why="a scored row counts one generated token whatever its label's length"),
    # MoE configs (tests/test_moe_families.py)
    Mutation("moe-norm-topk-default-flipped", "nanoserve/model/families.py",
             '"moe_intermediate_size": 768, "norm_topk_prob": False,',
             '"moe_intermediate_size": 768, "norm_topk_prob": True,',
             "tests/test_moe_families.py::test_norm_topk_prob_left_out_of_the_config",
             why="Qwen3-MoE / Qwen2-MoE renormalise top-k weights when config.json is silent"),
    # Qwen2.5-VL and the prefix cache (tests/test_vl_generate.py)
    Mutation("vl-cache-hit-inside-image", "nanoserve/scheduling/scheduler.py",
             "from bisect import bisect_left", "from bisect import bisect_right as bisect_left",
             "tests/test_vl_generate.py::test_cache_hit_ending_inside_an_image",
             why="after a cache hit that ends inside an image, its first uncached token loses "
                 "its embedding"),
    # the driver's input scan and the worker's depth (tests/test_bad_input.py, test_dispatch.py)
    Mutation("ids-held-after-spill-unchecked", "ray_jobs/input/ids.py",
             "        if self.spill_dir is not None:\n            self._spill()\n            buckets",
             "        if self.spill_dir is not None:\n            buckets",
             "tests/test_bad_input.py::test_duplicate_ids_held_in_memory_after_a_spill",
             why="ids still in memory after a spill never reach the buckets that are checked"),
    Mutation("pool-rows-held-one-shard-over", "ray_jobs/dispatch/pool.py",
             "self.rows_in_flight < self.max_rows_held)",
             "self.rows_in_flight <= self.max_rows_held)",
             "tests/test_dispatch.py::test_a_worker_is_fed_up_to_three_times_its_engine_rows",
             why="a worker holding its maximum of rows is sent one shard more"),
    # the workers' Parquet reads (tests/test_shards.py)
    Mutation("read-shard-parquet-no-skip", "ray_jobs/input/shards.py",
             "skip, left = shard.start_row - (first or 0), shard.num_rows",
             "skip, left = 0, shard.num_rows",
             "tests/test_shards.py::test_parquet_shards_read_their_rows_across_row_groups",
             why="a Parquet shard that starts inside a row group reads from the group's start"),
    # GPU only: the FP8 KV cache's kernels (tests/test_fp8_kv_gpu.py)
    Mutation("fp8-decode-drops-last-16", "nanoserve_kernels/paged_attention.py",
             "end = tl.where(split == num_splits - 1, context_len, end)",
             "end = tl.where(split == num_splits - 1,\n"
             "                   tl.where(context_len > 512, context_len - 16, context_len), end)",
             "tests/test_fp8_kv_gpu.py::test_fp8_decode_kernel_matches_reference", gpu=True,
             why="the decode kernel leaves out the last 16 cached tokens of rows over 512"),
    Mutation("fp8-decode-query-one-term", "nanoserve_kernels/paged_attention.py",
             "lo = (rest / s_lo[:, None]).to(tl.float8e4nv)",
             "lo = (rest * 0.0).to(tl.float8e4nv)",
             "tests/test_fp8_kv_gpu.py::test_fp8_decode_kernel_matches_reference", gpu=True,
             why="the FP8 products' query in one e4m3 term instead of two"),
    Mutation("fp8-decode-f16-columns-swapped", "nanoserve_kernels/paged_attention.py",
             '"cvt.rn.f16x2.e4m3x2 $0, e16; cvt.rn.f16x2.e4m3x2 $1, o16; }"',
             '"cvt.rn.f16x2.e4m3x2 $1, e16; cvt.rn.f16x2.e4m3x2 $0, o16; }"',
             "tests/test_fp8_kv_gpu.py::test_fp8_decode_kernel_matches_reference", gpu=True,
             why="the f16 form's PTX widening swaps V's even and odd columns"),
    # A cache hit's prefill under a sliding window (the paged prefill's three forms)
    Mutation("paged-prefill-reference-no-window", "nanoserve_kernels/paged_prefill.py",
             "hidden = (pos[None, :] > query_pos[:, None]) | (pos[None, :] <= query_pos[:, None] - window)",
             "hidden = pos[None, :] > query_pos[:, None]",
             "tests/test_kernels.py::test_paged_prefill_reference_window_matches_transformers_mask",
             why="the reference's cache-hit prefill attends past the window"),
    Mutation("paged-prefill-cpu-no-window", "nanoserve_kernels/cpu_attention.py",
             "allowed = ((kj <= last) & (kj > last - window)) | (kj == last.clamp(min=0))",
             "allowed = (kj <= last) | (kj == last.clamp(min=0))",
             "tests/test_families.py::test_prefix_cache_hits_equal_transformers",
             why="the CPU's cache-hit prefill attends past a windowed model's window"),
    Mutation("paged-prefill-kernel-no-window", "nanoserve_kernels/paged_prefill.py",
             "        visible = visible & (t[None, :] > query_pos[:, None] - window)\n", "",
             "tests/test_kernels.py::test_kernels_under_the_triton_interpreter",
             why="the Triton cache-hit prefill attends past the window (under the interpreter)"),
    # LoRA adapters (tests/test_lora.py, tests/test_lora_kernels.py)
    Mutation("lora-prefix-cache-not-keyed", "nanoserve/scheduling/scheduler.py",
             "hash_blocks(tokens, block_size, prefix_root(self.lora))",
             "hash_blocks(tokens, block_size)",
             "tests/test_lora.py::test_the_prefix_cache_is_keyed_by_adapter",
             why="a block computed under one adapter served to another"),
    Mutation("lora-rslora-scale-ignored", "nanoserve/weights/lora_weights.py",
             "return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)",
             "return self.alpha / self.rank",
             "tests/test_lora.py::test_a_mixed_batch_equals_peft_per_row_and_each_row_alone",
             why="rsLoRA's alpha / sqrt(r) read as alpha / r"),
    Mutation("lora-row-slots-never-set", "nanoserve/scheduling/scheduler.py",
             "        self.runner.set_lora_slots([r.slot for r in placed], "
             "[r.lora_slot for r in placed])\n", "",
             "tests/test_lora.py::test_a_mixed_batch_equals_peft_per_row_and_each_row_alone",
             why="rows never get their adapter's slot: every row runs the base model"),
    Mutation("lora-kernel-tile-overruns-its-slot", "nanoserve_kernels/lora.py",
             "    mask = offs < end\n", "    mask = offs < end + 1\n",
             "tests/test_lora_kernels.py::test_lora_kernels_under_the_triton_interpreter",
             why="a tile takes the next slot's first token (under the interpreter)"),
    # GPU only: FP8 GEMMs (tests/test_fp8_gpu.py)
    Mutation("fp8-static-input-scale-off", "nanoserve/weights/fp8.py",
             "xq = _cast(x2 / self.input_scale)", "xq = _cast(x2 / (self.input_scale * 1.03))",
             "tests/test_fp8_gpu.py::test_fp8_gemm_model_close_to_its_bf16_twin", gpu=True,
             why="static-scale activations quantized 3% off the scale they are multiplied back by"),
]

_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info",
                                 "demo-output", ".ruff_cache", "build", "dist")


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def check_list(mutations: list[Mutation]) -> list[str]:
    """Problems with the list itself: a text not found exactly once, a test file missing."""
    problems = []
    for m in mutations:
        path = REPO / m.file
        count = path.read_text().count(m.old) if path.is_file() else 0
        if count != 1:
            problems.append(f"{m.name}: its text is found {count} times in {m.file} (want 1)")
        test_file = REPO / m.test.split("::")[0]
        if not test_file.is_file():
            problems.append(f"{m.name}: no test file {test_file.relative_to(REPO)}")
    return problems


def run_test(copy: Path, test: str, timeout: float) -> tuple[str, str]:
    """('passed' | 'failed' | 'error', the run's last lines) of `test` in `copy`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(copy)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               test], cwd=copy, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "error", f"timed out after {timeout:.0f} s"
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 and re.search(r"\d+ passed", summary) and "skipped" not in summary:
        return "passed", tail
    if proc.returncode == 1 and re.search(r"\d+ failed", summary):
        return "failed", tail
    return "error", tail  # collection errors, no test run, skips only, pytest itself failing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the mutations and stop")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run this mutation (repeatable)")
    ap.add_argument("--baseline", action="store_true",
                    help="first run each test unmutated: it must pass")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    args = ap.parse_args()

    mutations = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutation(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutations:
            print(f"{m.name}{' (GPU)' if m.gpu else ''}: {m.file}: {m.why}\n    -> {m.test}")
        return 0
    problems = check_list(mutations)
    if problems:
        print("the mutation list is stale:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2

    gpu = has_gpu()
    results: list[tuple[Mutation, str, float]] = []
    for m in mutations:
        if m.gpu and not gpu:
            results.append((m, "skipped (needs a GPU)", 0.0))
            print(f"[skip] {m.name}: needs a GPU ({m.test})", flush=True)
            continue
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="nanoserve-mutation-") as tmp:
            copy = Path(tmp) / "repo"
            shutil.copytree(REPO, copy, ignore=_IGNORE)
            if args.baseline:
                outcome, tail = run_test(copy, m.test, args.timeout)
                if outcome != "passed":
                    results.append((m, f"error: the unmutated test did not pass ({outcome})",
                                    time.monotonic() - start))
                    print(f"[error] {m.name}: unmutated {m.test}: {outcome}\n{tail}", flush=True)
                    continue
            path = copy / m.file
            path.write_text(path.read_text().replace(m.old, m.new, 1))
            outcome, tail = run_test(copy, m.test, args.timeout)
        seconds = time.monotonic() - start
        verdict = {"failed": "caught", "passed": "SURVIVED"}.get(outcome, f"error ({outcome})")
        results.append((m, verdict, seconds))
        print(f"[{verdict}] {m.name} ({seconds:.0f} s): {m.test}", flush=True)
        if verdict != "caught":
            print(tail, flush=True)

    print("\n| mutation | file | test | result | s |\n|---|---|---|---|---|")
    for m, verdict, seconds in results:
        print(f"| {m.name} | {m.file} | {m.test.split('::')[-1]} | {verdict} | {seconds:.0f} |")
    run = [v for _, v, _ in results if not v.startswith("skipped")]
    caught = sum(v == "caught" for v in run)
    skipped = len(results) - len(run)
    print(f"\n{caught} of {len(run)} caught" + (f", {skipped} skipped (GPU)" if skipped else ""))
    return 0 if caught == len(run) else 1


if __name__ == "__main__":
    sys.exit(main())
