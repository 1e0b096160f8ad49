"""One declaration of the options the entry points share: a request's sampling values, its
structured output, and the engine's settings. `nanoserve generate`, `nanoserve batch` and
`nanoserve embed` add their flags from it (`add_option`), and `SamplingParams`,
`JobOptions`, the Ray Data stage (`build_processor`) and `LLM` take their defaults and
checks from it.

Invariants:
- an option's default is written once, here. An entry point that needs another default
  names it in the option's `overrides` (`nanoserve generate`'s shorter `max_tokens`, `LLM`'s
  larger KV share), and reads it with `default_for(entry)`;
- an option's value is checked in one place, `Option.problem`: its `choices`, else its
  `check`. Every entry point refuses a value with that one message (under its own error
  type and prefix);
- torch-free and free of the job: the job's driver and the CLIs read it without loading
  the engine (tests/test_layering.py keeps `nanoserve` below `ray_jobs`).

tests/test_options.py holds every entry point to this table (defaults, help, choices).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"  # fetched and prepared by nanoserve.weights.model_store
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
MAX_N = 128  # samples per prompt
MAX_LOGPROBS = 20  # alternatives per token

# Entry points that may override a default or a help text (`Option.overrides`, `helps`):
# the commands, the dataclasses, `LLM` and the Ray Data stage.
ENTRY_POINTS = ("generate", "batch", "embed", "classify", "score", "JobOptions",
                "SamplingParams", "LLM", "build_processor")


@dataclass(frozen=True)
class Option:
    """One option: `name` is the Python name (a `SamplingParams` / `JobOptions` field, a
    keyword argument), `flag` the command line's (`--max-tokens`; a switch whose default is
    True is `--no-<name>`). `type`: what argparse turns the flag's text into (`bool`: a
    switch that takes no value). `repeat`: given once per value (`--stop A --stop B`), held
    as a tuple. `choices`: the values allowed (argparse refuses others unless
    `parse_choices` is False: then the entry point's check says so, in its words).
    `check(value)`: None, or what is wrong, said after the name (`must be ... got ...`).
    `overrides`: (entry point, default) pairs, each a deliberate exception, said in `why`.
    `flag_name`: the flag's words where they are not the name's (`worker-start-timeout` for
    `worker_start_timeout_s`). `helps`: (entry point, help) pairs where a command says more
    of its own (which column `--prompt-column` names)."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple | None = None
    parse_choices: bool = True
    metavar: str | None = None
    repeat: bool = False
    check: Callable[[Any], str | None] | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    why: str = ""  # why an override differs
    flag_name: str | None = None
    helps: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        assert all(entry in ENTRY_POINTS for entry, _ in self.overrides + self.helps), \
            (self.overrides, self.helps)

    @property
    def flag(self) -> str:
        dashed = self.flag_name or self.name.replace("_", "-")
        return f"--no-{dashed}" if self.type is bool and self.default is True else f"--{dashed}"

    def default_for(self, entry: str | None = None) -> Any:
        """The default at `entry` (one of ENTRY_POINTS): its override, else `default`."""
        return dict(self.overrides).get(entry, self.default)

    def help_for(self, entry: str | None = None) -> str:
        """The help at `entry`: its own, else `help`."""
        return dict(self.helps).get(entry, self.help)

    def problem(self, value: Any, label: str | None = None) -> str | None:
        """What is wrong with `value` in one line naming the option as `label` (default:
        its name), or None. A None value is always allowed where the default is None."""
        label = label or self.name
        if value is None and self.default is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"unknown {label} {value!r}; choose {', '.join(map(str, self.choices))}"
        if self.check is not None and (tail := self.check(value)) is not None:
            return f"{label} {tail}"
        return None


def add_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, option: Option,
               entry: str) -> argparse.Action:
    """Add `option`'s flag to `parser` (or an argument group), with the default and help of
    `entry` (a command: 'generate', 'batch', 'embed', 'classify', 'score') and the option's
    choices; its value lands in `args.<name>` (a repeated option's as a list)."""
    default = option.default_for(entry)
    kwargs: dict[str, Any] = {"dest": option.name, "help": option.help_for(entry)}
    if option.type is bool:
        kwargs["action"] = "store_false" if default is True else "store_true"
        return parser.add_argument(option.flag, **kwargs)
    if option.repeat:
        kwargs["action"] = "append"
        default = list(default)  # argparse appends to a copy of it
    kwargs["type"] = option.type
    if option.choices is not None and option.parse_choices:
        kwargs["choices"] = option.choices
    if option.metavar is not None:
        kwargs["metavar"] = option.metavar
    return parser.add_argument(option.flag, default=default, **kwargs)


def problems(options: dict[str, Option], values: dict[str, Any]) -> list[str]:
    """Each problem of `values` (name -> value) under the options of the same names."""
    return [p for name, value in values.items() if name in options
            and (p := options[name].problem(value)) is not None]


def _int_at_least(low: int, what: str = "an integer") -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            return f"must be {what} >= {low}, got {v!r}"
        return None
    return check


def _int_in(low: int, high: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            return f"must be an integer in [{low}, {high}], got {v!r}"
        return None
    return check


def _temperature(t: Any) -> str | None:
    if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
        return f"must be a finite number >= 0, got {t!r}"
    return None


def _top_p(p: Any) -> str | None:
    if not isinstance(p, (int, float)) or math.isnan(p) or not (0 < p <= 1):
        return f"must be in (0, 1], got {p!r}"
    return None


def _top_k(k: Any) -> str | None:
    if not isinstance(k, int) or k < -1:
        return f"must be an integer >= 0 (or -1 for none), got {k!r}"
    return None


def _seed(s: Any) -> str | None:
    if not isinstance(s, int):
        return f"must be an integer, got {s!r}"
    if not SEED_RANGE[0] <= s < SEED_RANGE[1]:
        return f"must be in [-2**63, 2**64), got {s}"
    return None


def _stop(stop: Any) -> str | None:
    if any(not isinstance(s, str) or s == "" for s in stop or ()):
        return "strings must be non-empty strings"
    return None


def _fraction(f: Any) -> str | None:
    if not isinstance(f, (int, float)) or not 0 < f <= 1:
        return f"must be in (0, 1], got {f}"
    return None


def _lora_specs(specs: Any) -> str | None:
    bad = [s for s in specs or () if not isinstance(s, str) or "=" not in s[1:-1]]
    if bad:
        return f"must be NAME=PATH (an adapter's name and its PEFT folder), got {bad[0]!r}"
    return None


def _table(*options: Option) -> dict[str, Option]:
    return {o.name: o for o in options}


# A request's sampling values: `SamplingParams`' fields, the commands' sampling flags, the
# job's defaults (per-row columns override them).
SAMPLING = _table(
    Option("max_tokens", int, 256,
           "tokens to generate at most; fewer when the model's context has less room "
           "(default: %(default)s)",
           check=_int_at_least(1),
           overrides=(("generate", 64),),
           why="`nanoserve generate` prints its completions to a terminal: a short answer "
               "comes back quickly on a CPU"),
    Option("temperature", float, 0.0, "0 is greedy (default: 0)", check=_temperature),
    Option("top_k", int, 0, "0: no cut (default: 0)", check=_top_k),
    Option("top_p", float, 1.0, "nucleus mass kept, in (0, 1] (default: 1.0)", check=_top_p),
    Option("seed", int, None, "sampling seed of every prompt (default: a fresh one for each)",
           check=_seed),
    Option("stop", str, (), "stop string (repeatable)", metavar="TEXT", repeat=True,
           check=_stop),
    Option("ignore_eos", bool, False, "generate past end-of-sequence"),
    Option("n", int, 1,
           f"samples per prompt, 1-{MAX_N}, sample i drawing with seed + i (greedy rows, "
           f"temperature 0, give n equal samples); the job writes one output row each "
           f"(column 'sample_index') (default: 1)",
           metavar="N", check=_int_in(1, MAX_N)),
    Option("logprobs", int, None,
           f"per generated token: its logprob and rank and the K (0-{MAX_LOGPROBS}) most "
           f"likely tokens at its place (the job's output column 'logprobs') (default: none)",
           metavar="K", check=_int_in(0, MAX_LOGPROBS)),
    Option("prompt_logprobs", int, None,
           "the same for each prompt token after the first, in the column "
           "'prompt_logprobs' (default: none)",
           metavar="K", check=_int_in(0, MAX_LOGPROBS)),
    Option("max_thinking_tokens", int, None,
           "with a reasoning parser: at N tokens of thinking the engine closes the think "
           "block and the answer follows (a row's 'max_thinking_tokens' column overrides it)",
           metavar="N", check=_int_at_least(0)),
)

# A structured output given for every prompt (at most one of them). `SamplingParams` holds
# it as one `structured_outputs`; the commands and `JobOptions` as these three.
STRUCTURED = _table(
    Option("json_schema", Path, None,
           "a JSON schema file: the text is JSON valid under it", metavar="FILE"),
    Option("regex", str, None, "the whole text matches this regular expression",
           metavar="REGEX"),
    Option("choice", str, (),
           "the text is one of these: the flag once for each choice, --choice yes "
           "--choice no", metavar="TEXT", repeat=True),
    Option("choice_scores", bool, False,
           "with --choice: each row's probability of every label in the column "
           "'choice_scores' (from forward passes, not sampling); its text the most likely "
           "label"),
)

# The engine's settings, as `LLM` takes them (`max_running_rows` is its `max_batch_size`,
# `prefix_caching` its `enable_prefix_caching`) and the commands and `JobOptions` give them.
# (`reasoning_parser`'s choices are `nanoserve.sampling.reasoning`'s parsers, "auto" and
# "none": tests/test_options.py holds them equal.)
ENGINE = _table(
    Option("model", str, DEFAULT_MODEL,
           "model name, Hugging Face folder, or .gguf file (default: %(default)s)"),
    Option("dtype", str, "auto",
           "auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16",
           choices=("auto", "float32", "bfloat16", "float16"), parse_choices=False),
    Option("quantization", str, None,
           "fp8: the model's projections quantized to FP8 at load (GPUs of compute "
           "capability 8.9+; FP8 checkpoints need no flag)",
           choices=("fp8",)),
    Option("kv_cache_dtype", str, "auto",
           "auto (the model's dtype) or fp8: keys and values stored as float8 e4m3 with "
           "per-layer scales, twice the tokens per byte; GPUs of compute capability 8.9 or "
           "newer (default: auto)",
           choices=("auto", "fp8", "fp8_e4m3")),
    Option("kv_cache_fraction", float, 0.5,
           "share of each GPU's free memory for the KV block pool (default: 0.5)",
           check=_fraction,
           overrides=(("LLM", 0.8),),
           why="`LLM` alone in a process owns its GPU; a job's worker leaves room for the "
               "batches it holds and the Ray object store"),
    Option("kv_cache_bytes", int, None,
           "the KV pool's exact size in bytes, instead of the fraction (default on the CPU: "
           "1 GiB); the job's flag is --kv-cache-memory, in GiB",
           check=_int_at_least(1)),
    Option("max_running_rows", int, None,
           "the most rows an engine decodes at once (default: on a GPU as many as its KV "
           "pool holds at 512 tokens a row, 256 to 1,024; 256 on the CPU); a job's worker "
           "is sent three times that many rows",
           metavar="N", check=_int_at_least(1, "an int")),
    Option("scheduler", str, "auto",
           "the engine's batching: continuous (rows join as others finish, and the next "
           "batch's rows as this batch's finish; decode steps replayed as CUDA graphs on a "
           "GPU), static (each batch runs to its longest row), or auto: continuous "
           "(default: auto)",
           choices=("auto", "static", "continuous")),
    Option("reasoning_parser", str, "auto",
           "split the think block from the answer: columns 'reasoning' and "
           "'num_reasoning_tokens', 'generated_text' the answer only; a structured output "
           "applies after the block (default auto: picked from the model family where "
           "certain, stated in the summary)",
           choices=("auto", "none", "qwen3", "deepseek_r1")),
    Option("prefix_caching", bool, True,
           "prefill every row's whole prompt, even a prefix that an earlier row's KV blocks "
           "already hold (default: shared prefixes are computed and stored once per "
           "engine)"),
    Option("lora", str, (),
           "a LoRA adapter, NAME=PATH: a local PEFT folder (adapter_config.json, "
           "adapter_model.safetensors); repeatable. batch: a row picks one by name in its "
           "'lora' column (an OpenAI request by its 'model'), null the base model; generate: "
           "each prompt is completed under each",
           metavar="NAME=PATH", repeat=True, check=_lora_specs),
)

OPTIONS = {**SAMPLING, **STRUCTURED, **ENGINE}


def default(name: str, entry: str | None = None) -> Any:
    """The default of option `name` at `entry` (see `Option.default_for`)."""
    return OPTIONS[name].default_for(entry)


__all__ = ["ENGINE", "ENTRY_POINTS", "MAX_LOGPROBS", "MAX_N", "OPTIONS", "Option", "SAMPLING",
           "SEED_RANGE", "STRUCTURED", "add_option", "default", "problems"]
