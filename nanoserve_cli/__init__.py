"""The `nanoserve` command: `generate` and `fetch-model` (the engine, `nanoserve.cli`) and
`batch` (the Ray job, `ray_jobs.cli`).

The command line is the top layer: kernels <- nanoserve (engine) <- ray_jobs (job) <-
nanoserve_cli. It imports both below it; nothing imports it. `python -m nanoserve_cli ARGS`
is `nanoserve ARGS`.
"""

from __future__ import annotations

import argparse

from nanoserve.cli import ENGINE_COMMANDS, add_engine_parsers, run_command
from ray_jobs.cli import add_batch_parser, run_batch_cli

COMMANDS = {**ENGINE_COMMANDS, "batch": run_batch_cli}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoserve",
        description="Offline batch inference for Llama-architecture models on PyTorch, "
                    "Triton and Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_engine_parsers(sub)
    add_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(COMMANDS[args.command], args, resumable=args.command == "batch")


__all__ = ["build_parser", "main"]
