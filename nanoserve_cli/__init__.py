"""The `nanoserve` command: `generate` and `fetch-model` (the engine, `nanoserve.cli`) and
`batch`, `embed` (the job's two tasks, `ray_jobs.cli`).

The command line is the top layer: nanoserve_kernels <- nanoserve (engine) <- ray_jobs (job) <-
nanoserve_cli. It imports both below it; nothing imports it. `python -m nanoserve_cli ARGS`
is `nanoserve ARGS`.
"""

from __future__ import annotations

import argparse

from nanoserve import ENGINE_COMMANDS, SuggestingParser, add_engine_parsers, run_command
from ray_jobs.cli import JOB_COMMANDS, add_job_parsers

COMMANDS = {**ENGINE_COMMANDS, **JOB_COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="nanoserve",
        description="Offline batch inference for Llama-architecture models on PyTorch, "
                    "Triton and Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_engine_parsers(sub)
    add_job_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(COMMANDS[args.command], args, resumable=args.command in JOB_COMMANDS)


__all__ = ["build_parser", "main"]
