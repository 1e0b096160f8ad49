"""The engine's subcommands of the `nanoserve` command: `generate` and `fetch-model`, and
`run_command`, which turns a user error into one line and an exit status.

The `nanoserve` command itself (these plus `batch`, the Ray job) is `nanoserve_cli`: the
command line sits above the job, which sits above this engine, so nothing here imports
`ray_jobs`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from nanoserve.errors import NanoserveError
from nanoserve.model_store import DEFAULT_MODEL


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a few prompts and print the results",
                       description="Complete prompts given as arguments or read from a file "
                                   "(one prompt per line) and print each completion.")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model name ({DEFAULT_MODEL}), Hugging Face folder, or .gguf file "
                        f"(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")


def _run_generate(args) -> int:
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams

    prompts = list(args.prompts)
    if args.file is not None:
        try:
            prompts += [line for line in args.file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise NanoserveError(f"cannot read {args.file}: {e.strerror}") from None
    if not prompts:
        raise NanoserveError("no prompts: give them as arguments or with --file")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise NanoserveError(str(e)) from None
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    tok = llm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
             for p in prompts]
    ids = [tok.encode(t) for t in texts]
    for i, (p, out) in enumerate(zip(prompts, llm.generate(ids, params))):
        print(f"=== [{i}] {p}")
        print(out.text)
        print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
    return 0


def _run_fetch_model(args) -> int:
    from nanoserve.model_store import fetch_default_model

    path = fetch_default_model(force=args.force)
    print(path)
    return 0


def add_engine_parsers(sub: argparse._SubParsersAction) -> None:
    """Add `generate` and `fetch-model` to the `nanoserve` command's subparsers."""
    _add_generate_parser(sub)
    f = sub.add_parser("fetch-model", help=f"fetch the default model ({DEFAULT_MODEL}) into the cache",
                       description="Download the default model once into $NANOSERVE_CACHE "
                                   "(default ~/.cache/nanoserve) and print its path.")
    f.add_argument("--force", action="store_true", help="fetch again even if cached")


ENGINE_COMMANDS = {"generate": _run_generate, "fetch-model": _run_fetch_model}


def run_command(run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                resumable: bool = False) -> int:
    """`run(args)`'s exit status; a NanoserveError is `error: <message>` on stderr and 2,
    Ctrl-C is 130 (with a hint to rerun when the command resumes)."""
    try:
        return run(args)
    except NanoserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resume = " (rerun the same command to resume)" if resumable else ""
        print(f"interrupted{resume}", file=sys.stderr)
        return 130


