"""The `nanoserve` command: `generate` and `fetch-model` (the engine, `nanoserve.cli`) and
`batch` (the Ray job, `ray_jobs.cli`), `embed` (the embedding job, `ray_jobs.embed_cli`).

The command line is the top layer: nanoserve_kernels <- nanoserve (engine) <- ray_jobs (job) <-
nanoserve_cli. It imports both below it; nothing imports it. `python -m nanoserve_cli ARGS`
is `nanoserve ARGS`.
"""

from __future__ import annotations

import argparse

from nanoserve.cli import ENGINE_COMMANDS, SuggestingParser, add_engine_parsers, run_command
from ray_jobs.cli import add_batch_parser, run_batch_cli
from ray_jobs.embed_cli import add_embed_parser, run_embed_cli

COMMANDS = {**ENGINE_COMMANDS, "batch": run_batch_cli, "embed": run_embed_cli}


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="nanoserve",
        description="Offline batch inference for Llama-architecture models on PyTorch, "
                    "Triton and Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_engine_parsers(sub)
    add_batch_parser(sub)
    add_embed_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(COMMANDS[args.command], args, resumable=args.command in ("batch", "embed"))


__all__ = ["build_parser", "main"]
