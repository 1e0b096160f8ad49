"""`nanoserve batch INPUT -o OUTPUT_DIR [options]` and `nanoserve embed INPUT -o OUTPUT_DIR
[options]`: the job's command line, one subcommand per task (generation, embedding).

Entry point of the job pipeline (docs/modules.md).

`nanoserve_cli` (the `nanoserve` command) calls `add_job_parsers(subparsers)` and runs the
chosen subcommand's `JOB_COMMANDS[name](args)`; the argument groups both subcommands have
(input and output, columns, execution, cluster, reruns) are written once here, and each
task adds its own (sampling, structured output, OpenAI files, the KV cache; embedding).
This module also runs alone: `python -m ray_jobs.cli INPUT -o OUTPUT_DIR ...` is
`nanoserve batch` (same flags).

Exit status: 0 when the job completed (error rows included); 2 with one line
`error: <message>` for a job-level problem (found before any worker loads the model).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from nanoserve import DEFAULT_MODEL, LIST_FLAGS, InputError, check_model_name

BATCH_DESCRIPTION = """\
Generate a completion for every row of a Parquet or JSON Lines file (or a folder tree of
them) on a Ray worker pool, and write the results as Parquet parts into OUTPUT_DIR. INPUT and
OUTPUT_DIR may be local paths or object-store URIs (s3://bucket/prefix/, gs://...). A part
holds --batch-size consecutive input rows of one file, in input order, and the parts are
numbered in input order (workers write them in any order): read them in name order, sort by
'id' (positions when the input has none) or join on it for the input's order.

Each row needs a prompt: a 'prompt' (text), 'messages' (chat, [{role, content}, ...],
rendered with the model's chat template) or 'prompt_token_ids' column; a row uses the
first of these that it has. Optional columns: 'id' (else the row's 0-based position);
per-row 'max_tokens', 'temperature', 'top_p', 'top_k', 'seed', 'stop' (strings),
'ignore_eos', 'n' (samples, 1-128),
'logprobs' and 'prompt_logprobs' (0-20 alternatives); and a structured output:
'response_format' (OpenAI's {"type": "json_schema", "json_schema": {"name", "schema"}} or
{"type": "json_object"}), 'guided_json' (a JSON schema, object or JSON text),
'guided_regex', 'guided_choice' (a list of strings) or 'guided_grammar' (EBNF). Per-row
values override the flags below (a column named close to one of these, 'max_token', is data
passed through: a warning says so). A row asking for n samples gives n output rows, keyed on
(id, sample_index); 'logprobs' / 'prompt_logprobs' output columns hold
list<struct<token_id, logprob, rank, top: list<struct<token_id, logprob>>>>.

Images (a vision-language model: Qwen2.5-VL): content parts in 'messages'
({"type": "image_url", "image_url": {"url": ...}} with a data: URL, a local path or an
object-store URI; nothing is fetched from the web), or an 'image' column beside 'prompt'
(bytes, a path or URI, or a list of them: the row becomes one user turn, its images before
its text). The workers read and decode them; a missing, broken or oversized image makes its
row an error row. The output repeats an 'image' column of paths, not one of bytes.

OpenAI Batch API files: a JSON Lines line {"custom_id", "method": "POST", "url":
"/v1/chat/completions" (image_url parts too) or "/v1/completions", "body": {...}} is read
as one request (its
custom_id is the row id; duplicates are refused; a body field nanoserve does not apply is an
error naming it), and when the job completes OUTPUT_DIR/output.jsonl and errors.jsonl hold
OpenAI's batch output lines, in input order (--output-format openai writes them for any
input).

A rerun into the same OUTPUT_DIR resumes where the last run stopped; Ctrl-C stops a job with
its summary and report. Each run that computes something writes a self-contained HTML
report, OUTPUT_DIR/_nanoserve_report.html (the whole job's rows, earlier runs' included;
throughput over time, per-worker progress, batch fill and waste, error rows by cause,
settings and phases), and prints its path."""

EMBED_DESCRIPTION = """\
Embed every row of a Parquet or JSON Lines file (or a folder tree of them) on a Ray worker
pool: each row's text ('prompt' or 'text' column, or --prompt-column) or token ids
('prompt_token_ids') becomes one vector. OUTPUT_DIR gets Parquet parts with 'id', the input
columns, 'embedding' (fixed_size_list<float32>[dim], or float16), 'num_input_tokens' and
'error' (null unless the row failed: an empty text, chat messages, ...).

Pooling, normalisation and the input limit come from the flags, else from the model folder's
sentence-transformers files (modules.json, 1_Pooling/config.json, sentence_bert_config.json),
else: last-token pooling, L2-normalised, the model's context. Rows are embedded by a prefill
alone, packed by tokens, nothing cached after the batch. A rerun into the same OUTPUT_DIR
resumes where the last run stopped; a rerun with other settings is refused."""


def add_job_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add `batch` and `embed` to the `nanoserve` command's subparsers."""
    add_batch_parser(subparsers)
    add_embed_parser(subparsers)


def add_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "batch", help="run a batch job over a Parquet/JSONL dataset on Ray",
        description=BATCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_batch_arguments(p)
    return p


def add_embed_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "embed", help="embed every row of a Parquet/JSONL dataset on Ray",
        description=EMBED_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_embed_arguments(p)
    return p


def _add_input_output(p: argparse.ArgumentParser, output_help: str) -> None:
    p.add_argument("input", help="a .parquet or JSON Lines file (.jsonl, .json, also .gz or .zst), "
                   "or a folder of them (read recursively); a local path or a URI: s3://, "
                   "gs://, ... (credentials from the store's usual environment and config)")
    p.add_argument("-o", "--output", "--output-dir", dest="output_dir", required=True,
                   metavar="OUTPUT_DIR", help=output_help)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name, Hugging Face folder, or .gguf file (default: %(default)s)")


def _add_columns(p: argparse.ArgumentParser, prompt_help: str) -> None:
    c = p.add_argument_group("columns")
    c.add_argument("--prompt-column", default=None, metavar="NAME", help=prompt_help)
    c.add_argument("--id-column", default=None, metavar="NAME",
                   help="the column holding row ids (default: 'id' if present, else positions)")


def _add_execution(p: argparse.ArgumentParser, batch_size: int, max_batch_tokens: int | None,
                   max_batch_tokens_help: str) -> argparse._ArgumentGroup:
    """The execution group with the flags both tasks have; the task adds its own to it."""
    r = p.add_argument_group("execution")
    r.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16")
    r.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"rows per batch, and so per part (default: {batch_size})")
    r.add_argument("--max-batch-tokens", type=int, default=max_batch_tokens,
                   help=max_batch_tokens_help)
    return r


def _add_cluster_and_reruns(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("cluster")
    w.add_argument("--num-workers", default=None, metavar="N|MIN-MAX|auto",
                   help="workers: N (capped to the cluster's GPUs, else CPUs); MIN-MAX or auto "
                        "(= 1-): GPU workers, starting with the GPUs present (waiting up to "
                        "--worker-start-timeout for MIN) and adding one for each GPU that joins, "
                        "up to MAX (default: one per GPU of the cluster; 1 without GPUs)")
    w.add_argument("--worker-start-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for the cluster's first GPUs (MIN-MAX, auto) and for a "
                        "worker to be placed and load the model (default: 600)")
    w.add_argument("--address", default=None,
                   help="Ray address (default: RAY_ADDRESS, a running cluster, else a "
                        "private local Ray; 'local' forces the latter)")
    o = p.add_argument_group("reruns")
    o.add_argument("--overwrite", action="store_true",
                   help="replace an existing output instead of resuming it")
    o.add_argument("--retry-errors", action="store_true",
                   help="when resuming, compute again the batches of earlier runs that hold "
                        "error rows (e.g. a row whose worker died); the other written batches "
                        "are kept")
    o.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it counts rows as the workers' engines finish them)")


def _job_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the flags both subcommands have, as `run_job`'s keyword arguments."""
    return {"model": args.model, "prompt_column": args.prompt_column,
            "id_column": args.id_column, "dtype": args.dtype, "batch_size": args.batch_size,
            "max_batch_tokens": args.max_batch_tokens, "num_workers": args.num_workers,
            "worker_start_timeout_s": args.worker_start_timeout, "address": args.address,
            "overwrite": args.overwrite, "retry_errors": args.retry_errors,
            "progress": args.progress}


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    _add_input_output(p, "folder or object-store prefix (s3://bucket/out) for the Parquet "
                         "parts and the manifest (and output.jsonl / errors.jsonl for OpenAI "
                         "batch files)")
    s = p.add_argument_group("sampling (defaults; per-row columns override them)")
    s.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    s.add_argument("--top-k", type=int, default=0, help="0: no cut (default: 0)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed of every row")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    s.add_argument("--n", type=int, default=1, metavar="N",
                   help="samples per row, 1-128: one output row each (column 'sample_index'), "
                        "sample i drawing with seed + i; greedy rows (temperature 0) give n "
                        "equal samples (default: 1)")
    s.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="per generated token: its logprob and rank and the K (0-20) most likely "
                        "tokens, in the output column 'logprobs' (default: none)")
    s.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="the same for each prompt token after the first, in the column "
                        "'prompt_logprobs' (default: none)")
    g = p.add_argument_group(
        "structured output (the job's default, at most one; per-row columns override it; a "
        "row cut short by --max-tokens ends with finish_reason 'length' and may not parse)")
    g.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="a JSON schema file: a row's text is JSON valid under it")
    g.add_argument("--regex", default=None, metavar="REGEX",
                   help="a row's whole text matches this regular expression")
    g.add_argument("--choice", action="append", default=[], metavar="TEXT",
                   help="a row's text is one of these: the flag once for each choice, "
                        "--choice A --choice B (as in nanoserve generate)")
    p.once_per_value = LIST_FLAGS  # `--choice A B in.jsonl`: refused, not B read as INPUT
    g.add_argument("--choice-scores", action="store_true",
                   help="with --choice: each row's probability of every label in the column "
                        "'choice_scores' (from forward passes, not sampling); its text the "
                        "most likely label")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='options for the chat template, e.g. \'{"enable_thinking": false}\' '
                        "(a row's 'chat_template_kwargs' column updates them; a key the "
                        "model's template never reads is a warning)")
    p.add_argument("--reasoning-parser", choices=("auto", "none", "qwen3", "deepseek_r1"),
                   default="auto",
                   help="split the think block from the answer: columns 'reasoning' and "
                        "'num_reasoning_tokens', 'generated_text' the answer only; a "
                        "structured output applies after the block (default auto: picked "
                        "from the model family where certain, stated in the summary)")
    p.add_argument("--max-thinking-tokens", type=int, default=None, metavar="N",
                   help="with a reasoning parser: at N tokens of thinking the engine closes "
                        "the think block and the answer follows (a row's "
                        "'max_thinking_tokens' column overrides it)")
    _add_columns(p, "the column holding the prompt (text, messages or token ids)")
    o = p.add_argument_group("OpenAI batch files")
    o.add_argument("--input-format", choices=("auto", "openai", "plain"), default="auto",
                   help="auto: JSONL lines with custom_id and body are OpenAI batch requests; "
                        "openai: every line must be one (a line that is not is an error row); "
                        "plain: no line is (default: auto)")
    o.add_argument("--output-format", choices=("auto", "parquet", "openai"), default="auto",
                   help="openai: also OUTPUT_DIR/output.jsonl and errors.jsonl in OpenAI's "
                        "batch output shape, in input order, once the job completes; parquet: "
                        "the parts only; auto: openai when the input holds OpenAI batch "
                        "requests (default: auto)")
    r = _add_execution(p, 64, None, "a static engine's cap on rows x max(prompt + "
                                    "max_tokens) in one of its batches (default: none)")
    r.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: each worker quantizes the model's projections to FP8 at load "
                        "(GPUs of compute capability 8.9+; FP8 checkpoints need no flag)")
    r.add_argument("--kv-cache-fraction", type=float, default=0.5,
                   help="share of each GPU's free memory for the KV block pool (default: 0.5)")
    r.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="exact KV pool size per worker in GiB, instead of the fraction "
                        "(default on the CPU: 1)")
    r.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                   help="auto (the model's dtype) or fp8: keys and values stored as float8 e4m3 "
                        "with per-layer scales, twice the tokens per byte; GPUs of compute "
                        "capability 8.9 or newer (default: auto)")
    r.add_argument("--max-running-rows", type=int, default=None, metavar="N",
                   help="the most rows each worker's engine decodes at once (default: on a "
                        "GPU as many as its KV pool holds at 512 tokens a row, 256 to 1,024; "
                        "256 on the CPU). A worker is sent three times that many rows")
    r.add_argument("--scheduler", choices=("auto", "static", "continuous"), default="auto",
                   help="the engine's batching in each worker: continuous (rows join as others "
                        "finish, and the next batch's rows as this batch's finish; decode steps "
                        "replayed as CUDA graphs on a GPU), static (each batch runs to its "
                        "longest row), or auto: continuous (default: auto)")
    r.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every row's whole prompt, even a prefix that an earlier row's "
                        "KV blocks already hold (default: shared prefixes are computed and "
                        "stored once per worker)")
    _add_cluster_and_reruns(p)


def _add_embed_arguments(p: argparse.ArgumentParser) -> None:
    _add_input_output(p, "folder or object-store prefix (s3://bucket/out) for the Parquet "
                         "parts and the manifest")
    e = p.add_argument_group("embedding (default: what the model folder says)")
    e.add_argument("--pooling", choices=("last", "mean", "cls"), default=None,
                   help="the row's last token (Qwen3-Embedding), the mean of its tokens, or "
                        "its first token (default: the folder's, else last)")
    e.add_argument("--normalize", dest="normalize", action="store_true", default=None,
                   help="scale each vector to unit L2 norm (default: the folder's, else on)")
    e.add_argument("--no-normalize", dest="normalize", action="store_false")
    e.add_argument("--dimensions", type=int, default=None, metavar="D",
                   help="keep the first D values (Matryoshka), before normalising")
    e.add_argument("--instruction", default=None, metavar="TEXT",
                   help="a query instruction, as Qwen3-Embedding documents it: each text "
                        "becomes 'Instruct: TEXT\\nQuery:<text>'")
    e.add_argument("--max-input-tokens", type=int, default=None, metavar="N",
                   help="the input limit (default: sentence_bert_config.json's max_seq_length, "
                        "else the model's context); longer inputs are cut to it and counted")
    e.add_argument("--no-truncate", dest="truncate", action="store_false",
                   help="make inputs above the limit error rows instead of cutting them")
    e.add_argument("--float16", dest="embedding_dtype", action="store_const", const="float16",
                   default="float32", help="store the vectors as float16 (default: float32)")
    _add_columns(p, "the column holding the text or token ids")
    _add_execution(p, 1024, 65536, "tokens per batch, at most (rows x longest row; default: "
                                   "65536)")
    _add_cluster_and_reruns(p)


def run_batch_cli(args: argparse.Namespace) -> int:
    """Run the generation job; print the summary on stdout. NanoserveError propagates to the
    caller (`nanoserve.cli.run_command` turns it into `error: ...` and exit status 2). The
    sampling options are checked first, so a typo is refused before the model's files are
    read, and the model's name before the job's own imports."""
    from nanoserve import SamplingParams

    try:
        SamplingParams(**{"max_tokens": args.max_tokens, "temperature": args.temperature,
                        "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
                        "stop": tuple(args.stop), "ignore_eos": args.ignore_eos,
                        "n": args.n, "logprobs": args.logprobs,
                        "prompt_logprobs": args.prompt_logprobs})
    except ValueError as e:
        raise InputError(f"invalid sampling options: {e}") from None
    if args.kv_cache_memory is not None and args.kv_cache_memory <= 0:
        raise InputError(f"--kv-cache-memory must be > 0 GiB, got {args.kv_cache_memory}")
    json_schema = None if args.json_schema is None else read_json_schema(args.json_schema)
    check_model_name(args.model)
    from ray_jobs.dispatch.driver import run_job

    summary = run_job(
        args.input, args.output_dir, task="generate", **_job_options(args),
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        quantization=args.quantization, scheduler=args.scheduler,
        prefix_caching=args.prefix_caching, n=args.n, logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs, json_schema=json_schema, regex=args.regex,
        choice=tuple(args.choice), choice_scores=args.choice_scores,
        reasoning_parser=args.reasoning_parser, max_thinking_tokens=args.max_thinking_tokens,
        chat_template_kwargs=args.chat_template_kwargs,
        input_format=args.input_format, output_format=args.output_format,
        kv_cache_fraction=args.kv_cache_fraction, kv_cache_dtype=args.kv_cache_dtype,
        max_running_rows=args.max_running_rows,
        kv_cache_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30),
    )
    print(summary.format())
    return 0


def run_embed_cli(args: argparse.Namespace) -> int:
    """Run the embedding job; print the summary on stdout (errors as `run_batch_cli`)."""
    check_model_name(args.model)
    from ray_jobs.dispatch.driver import run_job

    summary = run_job(
        args.input, args.output_dir, task="embed", **_job_options(args), pooling=args.pooling,
        normalize=args.normalize, dimensions=args.dimensions, instruction=args.instruction,
        max_input_tokens=args.max_input_tokens, truncate=args.truncate,
        embedding_dtype=args.embedding_dtype)
    print(summary.format())
    return 0


JOB_COMMANDS = {"batch": run_batch_cli, "embed": run_embed_cli}


def read_json_schema(path: Path) -> str:
    """The text of a `--json-schema FILE`; InputError (one line naming the file) when it
    cannot be read, is not JSON, or is not a usable schema's shape (whether it compiles is
    checked with the model's tokenizer, before any worker starts)."""
    from nanoserve import StructuredOutputs

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else f"not UTF-8 text ({e.reason})"
        raise InputError(f"--json-schema {path}: cannot read it ({reason})") from None
    try:
        json.loads(text)
    except ValueError as e:
        raise InputError(f"--json-schema {path}: not valid JSON ({e})") from None
    problems = StructuredOutputs(json=text).problems()
    if problems:
        raise InputError(f"--json-schema {path}: {problems[0]}")
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m ray_jobs.cli ARGS` is `nanoserve batch ARGS`."""
    from nanoserve import SuggestingParser, run_command

    parser = SuggestingParser(prog="nanoserve batch", description=BATCH_DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_batch_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(run_batch_cli, args, resumable=True)


if __name__ == "__main__":
    sys.exit(main())
