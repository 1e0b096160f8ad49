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

from nanoserve import (
    ENGINE,
    LIST_FLAGS,
    SAMPLING,
    STRUCTURED,
    InputError,
    add_option,
    check_model_name,
)
from ray_jobs.options import JOB

BATCH_DESCRIPTION = """\
Generate a completion for every row of a Parquet or JSON Lines file (or a folder tree of
them) on a Ray worker pool, and write the results as Parquet parts into OUTPUT_DIR. INPUT and
OUTPUT_DIR may be local paths or object-store URIs (s3://bucket/prefix/, gs://...). The input
is cut into shards of --batch-size consecutive rows of one file; a worker writes each shard's
rows as one part, in input order, and the parts are numbered in input order (workers write
them in any order): read them in name order, sort by 'id' (positions when the input has
none) or join on it for the input's order.

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
throughput over time, per-worker progress, shard fill and waste, error rows by cause,
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


CLASSIFY_DESCRIPTION = """\
Classify every row of a Parquet or JSON Lines file (or a folder tree of them) on a Ray
worker pool with a checkpoint that has a sequence-classification head: an encoder
(BertForSequenceClassification, XLMRobertaForSequenceClassification,
ModernBertForSequenceClassification) or a decoder (LlamaForSequenceClassification,
Qwen3ForSequenceClassification, ... of every decoder family: classifiers and reward
models; a causal LM without a head is refused): each row's text ('prompt' or 'text' column,
or --prompt-column) through the head. OUTPUT_DIR gets Parquet parts with 'id', the input
columns, then
  label             the most probable label (config.json's id2label) of a single-label
                    head; null for a multi-label head (read probs) and for regression
  probs             map label -> probability: softmax (single-label) or each label's
                    sigmoid (multi-label, problem_type multi_label_classification); null
                    for regression
  score             a one-output regression (reward) head's raw value; null otherwise
  num_input_tokens, error (null unless the row failed: a missing or empty text, ...)
Rows longer than --max-input-tokens (default: the model's positions) are cut to it and
counted. A rerun into the same OUTPUT_DIR resumes where the last run stopped; a rerun with
other settings (another task, another limit) is refused."""

SCORE_DESCRIPTION = """\
Score every text pair of a Parquet or JSON Lines file (or a folder tree of them) on a Ray
worker pool with a cross-encoder: a checkpoint with a sequence-classification head of one
output or two labels (an encoder: BERT, XLM-RoBERTa, ModernBERT; or a decoder's
*ForSequenceClassification), or a causal LM (*ForCausalLM) as a Qwen3-Reranker-style
reranker: the pair in its prompt (--instruction), the score P(yes) against P(no) at the
prompt's end. Each row's columns 'text_1' and 'text_2' (else 'query' and 'document') are
read as one pair. OUTPUT_DIR gets Parquet parts with 'id', the input columns, then 'score'
(a one-output head's raw logit, as sentence-transformers' CrossEncoder.predict with an
identity activation; a two-label head's probability of label 1; a reranker's P(yes)),
'num_input_tokens' and 'error' (null unless the row failed: a missing or empty text of the
pair, ...). Pairs longer than --max-input-tokens (default: the model's positions) are cut,
the longer text first (a reranker's document), and counted. A rerun into the same
OUTPUT_DIR resumes where the last run stopped; a rerun with other settings is refused."""


def add_job_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Add `batch`, `embed`, `classify` and `score` to the `nanoserve` command's
    subparsers."""
    add_batch_parser(subparsers)
    add_embed_parser(subparsers)
    add_encoder_parser(subparsers, "classify", "classify every row of a Parquet/JSONL dataset "
                       "with a classifier (encoder or decoder) on Ray", CLASSIFY_DESCRIPTION)
    add_encoder_parser(subparsers, "score", "score every text pair of a Parquet/JSONL "
                       "dataset with a cross-encoder or a reranker LM on Ray", SCORE_DESCRIPTION)


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


def add_encoder_parser(subparsers: argparse._SubParsersAction, name: str, summary: str,
                       description: str) -> argparse.ArgumentParser:
    """`nanoserve classify` or `nanoserve score`: the job's shared flags, the input limit
    (and score's reranker instruction)."""
    p = subparsers.add_parser(name, help=summary, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="a .parquet or JSON Lines file (.jsonl, .json, also .gz or "
                   ".zst), or a folder of them (read recursively); a local path or a URI: "
                   "s3://, gs://, ...")
    p.add_argument("-o", "--output", "--output-dir", dest="output_dir", required=True,
                   metavar="OUTPUT_DIR", help="folder or object-store prefix "
                   "(s3://bucket/out) for the Parquet parts and the manifest")
    p.add_argument(ENGINE["model"].flag, dest="model", required=True, metavar="FOLDER",
                   help="a checkpoint folder with a sequence-classification head, encoder or "
                        "decoder (config.json, safetensors, tokenizer.json)"
                        + ("; or a causal LM, as a reranker" if name == "score" else ""))
    e = p.add_argument_group("input limit")
    for option in ("max_input_tokens", "truncate"):
        add_option(e, JOB[option], name)
    if name == "score":
        add_option(p.add_argument_group("reranker (a causal LM)"), JOB["instruction"], name)
    _add_columns(p, name)
    _add_execution(p, name)
    _add_cluster_and_reruns(p, name)
    return p


def _add_input_output(p: argparse.ArgumentParser, output_help: str, entry: str) -> None:
    p.add_argument("input", help="a .parquet or JSON Lines file (.jsonl, .json, also .gz or .zst), "
                   "or a folder of them (read recursively); a local path or a URI: s3://, "
                   "gs://, ... (credentials from the store's usual environment and config)")
    p.add_argument("-o", "--output", "--output-dir", dest="output_dir", required=True,
                   metavar="OUTPUT_DIR", help=output_help)
    add_option(p, ENGINE["model"], entry)


def _add_columns(p: argparse.ArgumentParser, entry: str) -> None:
    """The columns group: the prompt column (not the score task's: it reads a pair) and the
    id column."""
    c = p.add_argument_group("columns")
    if entry == "score":
        p.set_defaults(prompt_column=JOB["prompt_column"].default)
    else:
        add_option(c, JOB["prompt_column"], entry)
    add_option(c, JOB["id_column"], entry)


def _add_execution(p: argparse.ArgumentParser, entry: str) -> argparse._ArgumentGroup:
    """The execution group with the flags every task has (the dtype, the shards' rows and
    the batches' tokens, with `entry`'s defaults); the task adds its own to it."""
    r = p.add_argument_group("execution")
    add_option(r, ENGINE["dtype"], entry)
    for option in ("batch_size", "max_batch_tokens"):
        add_option(r, JOB[option], entry)
    return r


# The flags every task has: `run_job`'s keyword arguments of the same names (`_job_options`).
SHARED = ("model", "prompt_column", "id_column", "dtype", "batch_size", "max_batch_tokens",
          "num_workers", "worker_start_timeout_s", "address", "overwrite", "retry_errors",
          "progress")


def _add_cluster_and_reruns(p: argparse.ArgumentParser, entry: str) -> None:
    w = p.add_argument_group("cluster")
    for option in ("num_workers", "worker_start_timeout_s", "address"):
        add_option(w, JOB[option], entry)
    o = p.add_argument_group("reruns")
    for option in ("overwrite", "retry_errors", "progress"):
        add_option(o, JOB[option], entry)


def _job_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of the flags every subcommand has, as `run_job`'s keyword arguments."""
    return {name: getattr(args, name) for name in SHARED}


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    _add_input_output(p, "folder or object-store prefix (s3://bucket/out) for the Parquet "
                         "parts and the manifest (and output.jsonl / errors.jsonl for OpenAI "
                         "batch files)", "batch")
    s = p.add_argument_group("sampling (defaults; per-row columns override them)")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                 "n", "logprobs", "prompt_logprobs"):
        add_option(s, SAMPLING[name], "batch")
    g = p.add_argument_group(
        "structured output (the job's default, at most one; per-row columns override it; a "
        "row cut short by --max-tokens ends with finish_reason 'length' and may not parse)")
    for name in ("json_schema", "regex", "choice"):
        add_option(g, STRUCTURED[name], "batch")
    p.once_per_value = LIST_FLAGS  # `--choice A B in.jsonl`: refused, not B read as INPUT
    add_option(g, STRUCTURED["choice_scores"], "batch")
    add_option(p, JOB["chat_template_kwargs"], "batch")
    add_option(p, ENGINE["reasoning_parser"], "batch")
    add_option(p, SAMPLING["max_thinking_tokens"], "batch")
    _add_columns(p, "batch")
    o = p.add_argument_group("OpenAI batch files")
    for name in ("input_format", "output_format"):
        add_option(o, JOB[name], "batch")
    r = _add_execution(p, "batch")
    add_option(r, ENGINE["quantization"], "batch")
    add_option(r, ENGINE["kv_cache_fraction"], "batch")
    add_option(r, JOB["kv_cache_memory"], "batch")
    for name in ("kv_cache_dtype", "max_running_rows", "scheduler", "prefix_caching",
                 "lora"):
        add_option(r, ENGINE[name], "batch")
    _add_cluster_and_reruns(p, "batch")


def _add_embed_arguments(p: argparse.ArgumentParser) -> None:
    _add_input_output(p, "folder or object-store prefix (s3://bucket/out) for the Parquet "
                         "parts and the manifest", "embed")
    e = p.add_argument_group("embedding (default: what the model folder says)")
    add_option(e, JOB["pooling"], "embed")
    normalize = JOB["normalize"]  # either way, or the folder's: two switches
    e.add_argument("--normalize", dest="normalize", action="store_true",
                   default=normalize.default, help=normalize.help)
    e.add_argument("--no-normalize", dest="normalize", action="store_false",
                   default=normalize.default)
    for name in ("dimensions", "instruction", "max_input_tokens", "truncate"):
        add_option(e, JOB[name], "embed")
    dtype = JOB["embedding_dtype"]  # float32 unless this switch says float16
    e.add_argument("--float16", dest="embedding_dtype", action="store_const", const="float16",
                   default=dtype.default, help=dtype.help)
    _add_columns(p, "embed")
    _add_execution(p, "embed")
    _add_cluster_and_reruns(p, "embed")


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
    memory = JOB["kv_cache_memory"]
    if problem := memory.problem(args.kv_cache_memory, memory.flag):
        raise InputError(problem)
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
        max_running_rows=args.max_running_rows, lora=tuple(args.lora),
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


def run_encoder_cli(args: argparse.Namespace) -> int:
    """Run the classification or the score job (`args.command`); print the summary."""
    from ray_jobs.dispatch.driver import run_job

    own = {"instruction": args.instruction} if args.command == "score" else {}
    summary = run_job(args.input, args.output_dir, task=args.command, **_job_options(args),
                      max_input_tokens=args.max_input_tokens, truncate=args.truncate, **own)
    print(summary.format())
    return 0


JOB_COMMANDS = {"batch": run_batch_cli, "embed": run_embed_cli, "classify": run_encoder_cli,
                "score": run_encoder_cli}


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
