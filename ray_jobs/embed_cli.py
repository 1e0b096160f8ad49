"""`nanoserve embed INPUT -o OUTPUT_DIR [options]`: the embedding job's command line
(`ray_jobs.task_embed`). Exit status as `nanoserve batch`: 0 when the job completed (error
rows included); 2 with one line `error: <message>` for a job-level problem.

Entry point of the job pipeline (docs/modules.md).
"""

from __future__ import annotations

import argparse
import sys

from nanoserve.model_store import DEFAULT_MODEL

DESCRIPTION = """\
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


def add_embed_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "embed", help="embed every row of a Parquet/JSONL dataset on Ray",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="a .parquet or JSON Lines file, or a folder of them; a local "
                   "path or a URI (s3://, gs://, ...)")
    p.add_argument("-o", "--output", "--output-dir", dest="output_dir", required=True,
                   metavar="OUTPUT_DIR", help="folder or object-store prefix for the parts")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name, Hugging Face folder, or .gguf file (default: %(default)s)")
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
    c = p.add_argument_group("columns")
    c.add_argument("--prompt-column", default=None, metavar="NAME",
                   help="the column holding the text or token ids")
    c.add_argument("--id-column", default=None, metavar="NAME",
                   help="the column holding row ids (default: 'id' if present, else positions)")
    r = p.add_argument_group("execution")
    r.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16")
    r.add_argument("--num-workers", default=None, metavar="N|MIN-MAX|auto",
                   help="workers, as for nanoserve batch (default: one per GPU; 1 without)")
    r.add_argument("--worker-start-timeout", type=float, default=600.0, metavar="SECONDS")
    r.add_argument("--batch-size", type=int, default=1024, help="rows per batch, at most "
                   "(default: 1024)")
    r.add_argument("--max-batch-tokens", type=int, default=65536,
                   help="tokens per batch, at most (rows x longest row; default: 65536)")
    r.add_argument("--address", default=None, help="Ray address (as for nanoserve batch)")
    r.add_argument("--overwrite", action="store_true",
                   help="replace an existing output instead of resuming it")
    r.add_argument("--retry-errors", action="store_true",
                   help="when resuming, compute again the batches that hold error rows")
    r.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


def run_embed_cli(args: argparse.Namespace) -> int:
    """Run the embedding job; print the summary on stdout. NanoserveError propagates (one
    line, exit status 2, from `nanoserve.cli.run_command`)."""
    from ray_jobs.driver import run_embed_job

    summary = run_embed_job(
        args.input, args.output_dir, model=args.model, pooling=args.pooling,
        normalize=args.normalize, dimensions=args.dimensions, instruction=args.instruction,
        max_input_tokens=args.max_input_tokens, truncate=args.truncate,
        embedding_dtype=args.embedding_dtype, prompt_column=args.prompt_column,
        id_column=args.id_column, dtype=args.dtype, num_workers=args.num_workers,
        worker_start_timeout_s=args.worker_start_timeout, batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens, address=args.address,
        overwrite=args.overwrite, retry_errors=args.retry_errors, progress=args.progress)
    print(summary.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ray_jobs.embed_cli ARGS` is `nanoserve embed ARGS`."""
    from nanoserve.cli import SuggestingParser, run_command

    parser = SuggestingParser(prog="nanoserve embed", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(run_embed_cli, args, resumable=True)


if __name__ == "__main__":
    sys.exit(main())
