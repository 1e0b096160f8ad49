"""The engine's subcommands of the `nanoserve` command: `generate` and `fetch-model`, and
`run_command`, which turns a user error into one line and an exit status.

The `nanoserve` command itself (these plus `batch`, the Ray job) is `nanoserve_cli`: the
command line sits above the job, which sits above this engine, so nothing here imports
`ray_jobs`."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from nanoserve.errors import NanoserveError
from nanoserve.options import DEFAULT_MODEL, ENGINE, SAMPLING, STRUCTURED, add_option


class SuggestingParser(argparse.ArgumentParser):
    """argparse's parser, whose errors say what was probably meant: an unknown flag is
    named with the closest known one (`--max-tokns`: did you mean `--max-tokens`?), and so
    is an invalid choice (a subcommand, a `--scheduler` value). An unknown flag after a
    subcommand is that subcommand's error, with its usage (argparse alone reports it at the
    top level, with the top-level usage). Subparsers are of this class too."""

    # Flags given once per value (`--choice A --choice B`) where a word after the value would
    # be taken as a positional argument without an error (`generate --choice yes no Q`: 'no'
    # a prompt): given once and followed by a word, they are refused (`list_flag_slip`).
    once_per_value: tuple[str, ...] = ()

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        ns, extras = super().parse_known_args(args, namespace)
        if (slip := list_flag_slip(self._argv, self.once_per_value)) is not None:
            self.error(slip)
        return ns, extras

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            target = self
            for action in self._actions:  # the subcommand the extras came with
                if isinstance(action, argparse._SubParsersAction):
                    target = action.choices.get(getattr(ns, action.dest, None), target)
            target.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def error(self, message: str) -> NoReturn:
        unknown = self._unknown_flags()
        slip = list_flag_slip(getattr(self, "_argv", ()), LIST_FLAGS)
        if slip is not None and "--choice" in self._flags():  # the old form `--choice A B`
            message = slip
        elif message.startswith("unrecognized arguments: "):
            message += self._flag_hint(message.split(": ", 1)[1].split())
        elif unknown:  # e.g. the required arguments are missing: the flag is the likelier slip
            message = (f"unrecognized arguments: {' '.join(unknown)}{self._flag_hint(unknown)}; "
                       f"and {message}")
        elif m := re.search(r"invalid choice: '?([^'\s]*)'? \(choose from (.*)\)", message):
            choices = [c.strip().strip("'") for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean '{close[0]}'?)"
        super().error(message)

    def _flags(self) -> list[str]:
        return [o for a in self._actions for o in a.option_strings]

    def _unknown_flags(self) -> list[str]:
        if any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
            return []  # a subcommand's flags are its own parser's to judge
        flags = self._flags()
        out = []
        for arg in getattr(self, "_argv", ()):
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if (arg.startswith("-") and len(arg) > 1 and not re.fullmatch(r"-\d.*", arg)
                    and name not in flags
                    and not (name.startswith("--") and any(f.startswith(name) for f in flags))):
                out.append(arg)
        return out

    def _flag_hint(self, args: list[str]) -> str:
        """' (did you mean --x?)' for the first unknown flag with a close known one, else a
        pointer to --help."""
        flags = [f for f in self._flags() if f.startswith("--")]
        for arg in args:
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return f" (see '{self.prog} --help')"


LIST_FLAGS = ("--choice",)  # given once per value, in `batch` and `generate` alike


def list_flag_slip(argv: list[str], flags: tuple[str, ...]) -> str | None:
    """The message for a list flag of `flags` given once with several words after it
    (`--choice A B`, the form that took a list), or None. Each such flag takes one value
    and is repeated; the words after its value are other arguments (an input, a prompt)."""
    argv = list(argv)
    if "--" in argv:
        argv = argv[:argv.index("--")]
    for flag in flags:
        at = [i for i, a in enumerate(argv) if a == flag]
        if len(at) == 1 and at[0] + 2 < len(argv) and not argv[at[0] + 2].startswith("-"):
            value, word = argv[at[0] + 1], argv[at[0] + 2]
            return (f"{flag} takes one value: give the flag once for each ({flag} {value} "
                    f"{flag} {word}); '{word}' after {flag} {value} would be read as another "
                    f"argument")
    return None


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a few prompts and print the results",
                       description="Complete prompts given as arguments or read from a file "
                                   "(one prompt per line) and print each completion.")
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--file", type=Path, help="a text file with one prompt per line")
    add_option(p, ENGINE["model"], "generate")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        add_option(p, SAMPLING[name], "generate")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_option(p, SAMPLING["n"], "generate")
    add_option(p, SAMPLING["logprobs"], "generate")
    s = p.add_argument_group("structured output (at most one; a completion cut short by "
                             "--max-tokens ends with finish_reason=length and may not parse)")
    for name in ("json_schema", "regex", "choice"):
        add_option(s, STRUCTURED[name], "generate")
    p.once_per_value = LIST_FLAGS  # a word after `--choice yes` would be a prompt
    add_option(p, ENGINE["dtype"], "generate")
    add_option(p, ENGINE["quantization"], "generate")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    for name in ("kv_cache_dtype", "max_running_rows"):
        add_option(p, ENGINE[name], "generate")
    add_option(p, ENGINE["lora"], "generate")


def _run_generate(args) -> int:
    """Every check that needs no model comes before the engine's imports (torch: seconds on
    a busy machine), so a mistake is said at once. On stderr at the end: the tokens, the
    generation's time and rate, and the load's."""
    import time

    from nanoserve.sampling.params import SamplingParams
    from nanoserve.weights.model_store import check_model_name

    prompts = list(args.prompts)
    if args.file is not None:
        try:
            prompts += [line for line in args.file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise NanoserveError(f"cannot read {args.file}: {e.strerror}") from None
    if not prompts:
        raise NanoserveError("no prompts: give them as arguments or with --file")
    for name in ("dtype", "max_running_rows", "lora"):  # the checks argparse does not make
        if (problem := ENGINE[name].problem(getattr(args, name), ENGINE[name].flag)):
            raise NanoserveError(problem)
    structured = _structured_output(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, n=args.n,
                                logprobs=args.logprobs, structured_outputs=structured)
    except ValueError as e:
        raise NanoserveError(str(e)) from None
    check_model_name(args.model)
    t0 = time.perf_counter()
    from nanoserve.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_batch_size=args.max_running_rows,
              lora=args.lora)
    load_s = time.perf_counter() - t0
    if structured is not None:
        try:
            llm.grammars.check(structured)
        except ValueError as e:
            raise NanoserveError(f"{_structured_flag(args)}: {e}") from None
    tok = llm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p
             for p in prompts]
    ids = [tok.encode(t) for t in texts]
    adapters = llm.lora_names or (None,)  # each prompt under each adapter (or the base)
    rows = [(p, t, name) for p, t in zip(prompts, ids) for name in adapters]
    t1 = time.perf_counter()
    outs = llm.generate([t for _, t, _ in rows], params, lora=[name for _, _, name in rows])
    generate_s = time.perf_counter() - t1
    for i, (p, _, name) in enumerate(rows):
        print(f"=== [{i}] {p}" + (f" (LoRA {name})" if name is not None else ""))
        for out in outs[i * args.n:(i + 1) * args.n]:
            if args.n > 1:
                print(f"--- sample {out.sample_index}")
            print(out.text if out.finish_reason != "error" else f"(error: {out.error})")
            print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
            if out.logprobs is not None:
                for entry in out.logprobs:
                    print("    " + _logprob_line(tok, entry))
    tokens = sum(len(out.token_ids) for out in outs)
    print(f"nanoserve: {tokens} tokens for {len(prompts)} prompt(s) in {generate_s:.1f} s "
          f"({tokens / max(generate_s, 1e-9):.1f} tokens/s; {llm.device} with "
          f"{_threads(llm)}); model loaded in {load_s:.1f} s", file=sys.stderr)
    return 0


def _threads(llm) -> str:
    if llm.device.type != "cpu":
        return "its GPU"
    import torch

    return f"{torch.get_num_threads()} thread(s)"


def _structured_flag(args) -> str:
    if args.json_schema is not None:
        return f"--json-schema {args.json_schema}"
    return "--regex" if args.regex is not None else "--choice"


def _structured_output(args):
    """The constraint the flags ask for (a StructuredOutputs), or None; NanoserveError with
    one line for a file that cannot be read or a malformed constraint."""
    import json

    from nanoserve.sampling.structured import StructuredOutputs

    asked = [a for a, v in (("--json-schema", args.json_schema), ("--regex", args.regex),
                            ("--choice", args.choice)) if v is not None and v != []]
    if not asked:
        return None
    if len(asked) > 1:
        raise NanoserveError(f"give at most one structured output, not {' and '.join(asked)}")
    if args.json_schema is not None:
        try:
            text = args.json_schema.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else f"not UTF-8 text ({e.reason})"
            raise NanoserveError(f"--json-schema {args.json_schema}: cannot read it "
                                 f"({reason})") from None
        try:
            json.loads(text)
        except ValueError as e:
            raise NanoserveError(f"--json-schema {args.json_schema}: not valid JSON ({e})") from None
        so = StructuredOutputs(json=text)
    else:
        so = StructuredOutputs(regex=args.regex, choice=tuple(args.choice) or None)
    problems = so.problems()
    if problems:
        raise NanoserveError(f"{_structured_flag(args)}: {problems[0]}")
    return so


def _logprob_line(tok, entry) -> str:
    """One generated token's logprob compactly: the token, its logprob and rank, then the
    most likely tokens at its place."""
    def text(token_id: int) -> str:
        return repr(tok.decode([token_id], skip_special_tokens=False))

    line = f"{text(entry.token_id)} {entry.logprob:.4f} (rank {entry.rank})"
    if entry.top:
        line += "; top: " + ", ".join(f"{text(t)} {lp:.4f}" for t, lp in entry.top)
    return line


def _run_fetch_model(args) -> int:
    from nanoserve.weights.model_store import fetch_default_model

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
    Ctrl-C is 130 (with a hint to rerun when the command resumes), after the summary of what
    was done when the interruption carries one (a job's: `summary.format()`)."""
    try:
        return run(args)
    except NanoserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if getattr(e, "summary", None) is not None:
            print(e.summary.format())
        resume = " (rerun the same command to resume)" if resumable else ""
        print(f"interrupted{resume}", file=sys.stderr)
        return 130


