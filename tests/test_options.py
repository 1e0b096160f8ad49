"""Every entry point takes the options it shares from one declaration, `nanoserve.options`:
the `generate`, `batch` and `embed` commands' flags (default, help, choices),
`SamplingParams`' and `JobOptions`' fields, `LLM`'s and the Ray Data stage's keyword
arguments. And no default is written twice: the source holds none of the declared
defaults beside the option's name anywhere else."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from nanoserve.options import ENGINE, OPTIONS, SAMPLING, STRUCTURED, Option

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("nanoserve", "ray_jobs", "nanoserve_cli")

# The options each command has (every one of them from the declaration).
COMMAND_OPTIONS = {
    "generate": ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n",
                 "logprobs", "json_schema", "regex", "choice", "dtype", "quantization",
                 "kv_cache_dtype", "max_running_rows", "lora"),
    "batch": tuple(OPTIONS),
    "embed": ("model", "dtype"),
}
# `LLM`'s keyword argument for each engine option it takes.
LLM_ARGUMENTS = {"model": "model", "dtype": "dtype", "quantization": "quantization",
                 "kv_cache_dtype": "kv_cache_dtype", "kv_cache_fraction": "kv_cache_fraction",
                 "max_running_rows": "max_batch_size", "scheduler": "scheduler",
                 "prefix_caching": "enable_prefix_caching", "lora": "lora"}
STAGE_ARGUMENTS = ("model", "dtype", "kv_cache_fraction", "scheduler")


@pytest.fixture(scope="module")
def commands():
    from nanoserve_cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


def _actions(parser) -> dict[str, object]:
    return {a.dest: a for a in parser._actions if a.dest in OPTIONS}


@pytest.mark.parametrize("command", sorted(COMMAND_OPTIONS))
def test_command_flags_are_the_declarations(commands, command):
    actions = _actions(commands[command])
    assert sorted(actions) == sorted(COMMAND_OPTIONS[command])
    for name, action in actions.items():
        option: Option = OPTIONS[name]
        default = action.default
        if option.repeat:
            assert isinstance(default, list)
            default = tuple(default)
        assert default == option.default_for(command), name
        assert type(default) is type(option.default_for(command)), name
        assert action.help == option.help, name
        assert action.option_strings == [option.flag], name
        if option.type is bool:
            assert action.nargs == 0, name
        else:
            assert action.type is option.type, name
            assert action.choices == (option.choices if option.parse_choices else None), name


def test_sampling_params_fields_are_the_declarations():
    from nanoserve.sampling.params import SamplingParams

    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name, option in {**SAMPLING, "choice_scores": STRUCTURED["choice_scores"]}.items():
        assert fields[name].default == option.default_for("SamplingParams"), name


def test_job_options_fields_are_the_declarations():
    from ray_jobs.workers.options import JobOptions

    fields = {f.name: f for f in dataclasses.fields(JobOptions)}
    for name, option in OPTIONS.items():
        assert fields[name].default == option.default_for("JobOptions"), name


def test_llm_and_the_ray_data_stage_take_the_declared_defaults():
    from nanoserve.llm import LLM
    from ray_jobs.data_processor import DatasetGenerator, build_processor

    llm = inspect.signature(LLM.__init__).parameters
    for name, argument in LLM_ARGUMENTS.items():
        assert llm[argument].default == ENGINE[name].default_for("LLM"), name
    for function in (build_processor, DatasetGenerator.__init__):
        parameters = inspect.signature(function).parameters
        for name in STAGE_ARGUMENTS:
            assert parameters[name].default == ENGINE[name].default_for("build_processor"), name


def test_overrides_are_named_and_explained():
    """A default that differs at an entry point is a deliberate, documented exception."""
    overridden = {name: o for name, o in OPTIONS.items() if o.overrides}
    assert set(overridden) == {"max_tokens", "kv_cache_fraction"}
    for option in overridden.values():
        assert option.why, option.name
    assert SAMPLING["max_tokens"].default_for("generate") == 64
    assert SAMPLING["max_tokens"].default_for("batch") == 256


def test_checks_say_what_is_wrong_once():
    assert SAMPLING["max_tokens"].problem(0) == "max_tokens must be an integer >= 1, got 0"
    assert SAMPLING["max_tokens"].problem(1) is None
    assert SAMPLING["seed"].problem(None) is None
    assert ENGINE["scheduler"].problem("fifo") == \
        "unknown scheduler 'fifo'; choose auto, static, continuous"
    thinking = SAMPLING["max_thinking_tokens"]
    assert thinking.problem(-1, thinking.flag) == \
        "--max-thinking-tokens must be an integer >= 0, got -1"


def _defaults_in(tree: ast.AST) -> list[tuple[str, object, int]]:
    """(name, default, line) for each default written in `tree`: a function's keyword
    argument (`def f(max_tokens=256)`), a class's field (`max_tokens: int = 256`), a dict
    entry (`{"max_tokens": 256}`) and a flag's (`add_argument("--max-tokens", default=256)`,
    named by the flag's option name). Calls that pass a value are not defaults."""
    out = []

    def constant(node):
        return node.value if isinstance(node, ast.Constant) else _NO

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            out += [(a.arg, constant(d), d.lineno) for a, d in pairs]
        elif isinstance(node, ast.ClassDef):
            out += [(f.target.id, constant(f.value), f.lineno) for f in node.body
                    if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                    and f.value is not None]
        elif isinstance(node, ast.Dict):
            out += [(k.value, constant(v), v.lineno) for k, v in zip(node.keys, node.values)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "add_argument" and node.args
              and isinstance(node.args[0], ast.Constant)):
            flag = str(node.args[0].value)
            name = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
            out += [(name, constant(k.value), k.value.lineno) for k in node.keywords
                    if k.arg == "default"]
    return [(n, v, line) for n, v, line in out if v is not _NO]


_NO = object()


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def _declared_again(source: str) -> list[tuple[str, object, int]]:
    """The declared defaults (an option's default or override) that `source` writes again,
    as (option name, value, line); None, booleans and empty values are too common to
    tell apart and are left out."""
    found = []
    for name, value, line in _defaults_in(ast.parse(source)):
        option = OPTIONS.get(name)
        if option is None or value is None or isinstance(value, bool) or value in ((), ""):
            continue
        if any(_same(value, d) for d in (option.default, *dict(option.overrides).values())):
            found.append((name, value, line))
    return found


# Values that equal a declared default without being it: (file, option name) -> why.
NOT_THE_OPTION = {
    ("ray_jobs/input/openai_requests.py", "top_p"): "OpenAI's own default, for its requests",
    ("ray_jobs/preparation/prepare.py", "n"): "a row's count of output rows (1 for an error)",
    ("ray_jobs/tasks/embed.py", "n"): "a row's count of output rows: one vector",
    ("ray_jobs/tasks/classify.py", "n"): "a row's count of output rows: one result",
    ("ray_jobs/workers/worker.py", "n"): "error rows' count: one unless the row asked more",
}


def test_no_declared_default_is_written_twice():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path != REPO / "nanoserve" / "options.py":
                where = str(path.relative_to(REPO))
                found += [(where, *hit) for hit in _declared_again(path.read_text())
                          if (where, hit[0]) not in NOT_THE_OPTION]
    assert not found, found


def test_the_scan_finds_a_default_written_again():
    """The scan above can fail: each way of writing a default is found, a call is not."""
    for source in ("class A:\n    max_tokens: int = 256\n", "def f(max_tokens=256): ...",
                   "def f(*, max_tokens=64): ...", 'sampling = {"max_tokens": 256, **s}',
                   's.add_argument("--max-tokens", type=int, default=256, help="x")',
                   'def f(scheduler="auto"): ...'):
        assert _declared_again(source), source
    for source in ("class A:\n    max_tokens: int = 2560\n", "f(max_tokens=256)",
                   "def f(max_tokens=256.0): ..."):
        assert not _declared_again(source), source


def test_the_declaration_is_torch_free():
    """The CLIs and the job's driver read it without loading the engine."""
    import subprocess
    import sys

    code = "import sys, nanoserve.options; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
