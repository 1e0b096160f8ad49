"""Every entry point takes its options from one declaration: `nanoserve.options` (what the
engine shares: sampling, structured output, the engine's settings) and `ray_jobs.options.JOB`
(the job's own: shards, columns, the cluster, reruns, the Ray Data stage's pool, the
prefill-only tasks' options). The `generate`, `batch`, `embed`, `classify` and `score`
commands' flags (default, help, choices), `SamplingParams`' and `JobOptions`' fields, the
tasks' defaults of the job's, `LLM`'s and the Ray Data stage's keyword arguments. And no
default is written twice: the source holds none of the declared defaults beside the
option's name anywhere else."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from nanoserve.options import ENGINE, OPTIONS, SAMPLING, STRUCTURED, Option
from ray_jobs.options import JOB, PREFILL_TASKS

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("nanoserve", "ray_jobs", "nanoserve_cli")
DECLARATIONS = ("nanoserve/options.py", "ray_jobs/options.py")  # where defaults are written
DECLARED = {**OPTIONS, **JOB}

# The job's flags every task's command has.
JOB_SHARED = ("prompt_column", "id_column", "batch_size", "max_batch_tokens", "num_workers",
              "worker_start_timeout_s", "address", "overwrite", "retry_errors", "progress")
INPUT_LIMIT = ("max_input_tokens", "truncate")
# The options each command has (every one of them from the declarations).
COMMAND_OPTIONS = {
    "generate": ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n",
                 "logprobs", "json_schema", "regex", "choice", "dtype", "quantization",
                 "kv_cache_dtype", "max_running_rows", "lora"),
    "batch": (*(name for name in OPTIONS if name != "kv_cache_bytes"), *JOB_SHARED,
              "input_format", "output_format", "chat_template_kwargs", "kv_cache_memory"),
    "embed": ("model", "dtype", *JOB_SHARED, *INPUT_LIMIT, "pooling", "normalize",
              "dimensions", "instruction", "embedding_dtype"),
    "classify": ("model", "dtype", *JOB_SHARED, *INPUT_LIMIT),
    "score": ("model", "dtype", *(n for n in JOB_SHARED if n != "prompt_column"), *INPUT_LIMIT,
              "instruction"),
}
# Flags of a shape `add_option` does not make, written beside the declaration with its
# default and help: (command, option) -> the flags.
OTHER_SHAPES = {("embed", "normalize"): ["--normalize", "--no-normalize"],
                ("embed", "embedding_dtype"): ["--float16"]}
# The encoder commands' model is required (a checkpoint folder): no default to compare.
REQUIRED = {("classify", "model"), ("score", "model")}
# `LLM`'s keyword argument for each engine option it takes.
LLM_ARGUMENTS = {"model": "model", "dtype": "dtype", "quantization": "quantization",
                 "kv_cache_dtype": "kv_cache_dtype", "kv_cache_fraction": "kv_cache_fraction",
                 "kv_cache_bytes": "kv_cache_bytes", "max_running_rows": "max_batch_size",
                 "scheduler": "scheduler", "prefix_caching": "enable_prefix_caching",
                 "reasoning_parser": "reasoning_parser", "lora": "lora"}
# Keyword arguments of the Ray Data stage that are no option: the actor's CPU threads (its
# share of the pool's `num_cpus`, set by the pool), the sampling defaults as one dict.
NOT_OPTIONS = {"num_threads", "sampling"}


@pytest.fixture(scope="module")
def commands():
    from nanoserve_cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices


def _actions(parser) -> dict[str, list]:
    """The parser's flags by option name (a name may have two switches: `--[no-]normalize`)."""
    out: dict[str, list] = {}
    for a in parser._actions:
        if a.dest in DECLARED:
            out.setdefault(a.dest, []).append(a)
    return out


def test_the_tables_name_each_option_once():
    assert not set(OPTIONS) & set(JOB)


@pytest.mark.parametrize("command", sorted(COMMAND_OPTIONS))
def test_command_flags_are_the_declarations(commands, command):
    actions = _actions(commands[command])
    assert sorted(actions) == sorted(COMMAND_OPTIONS[command])
    for name, found in actions.items():
        if (command, name) in REQUIRED:
            assert [a.required for a in found] == [True]
            continue
        option: Option = DECLARED[name]
        for action in found:
            default = action.default
            if option.repeat:
                assert isinstance(default, list)
                default = tuple(default)
            assert default == option.default_for(command), name
            assert type(default) is type(option.default_for(command)), name
        action = found[0]
        assert action.help == option.help_for(command), name
        if (command, name) in OTHER_SHAPES:
            assert [a.option_strings[0] for a in found] == OTHER_SHAPES[command, name]
            continue
        assert len(found) == 1 and action.option_strings == [option.flag], name
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
    """Every field of `JobOptions` is declared (the engine's tables or `JOB`), with its
    default; the engine's options all are fields, and so are the job's own but those of the
    Ray Data stage's pool and the prefill-only tasks (`take_options` pops those)."""
    from ray_jobs.workers.options import JobOptions

    fields = {f.name: f for f in dataclasses.fields(JobOptions)}
    assert set(fields) <= set(DECLARED), set(fields) - set(DECLARED)
    for name, field in fields.items():
        assert field.default == DECLARED[name].default_for("JobOptions"), name
    assert set(OPTIONS) <= set(fields)
    assert set(JOB) - set(fields) == {"concurrency", "num_gpus", "num_cpus", "kv_cache_memory",
                                      *INPUT_LIMIT, "pooling", "normalize", "dimensions",
                                      "instruction", "embedding_dtype"}


def test_job_options_checks_are_the_declarations():
    """A bad value of a job option is refused with the declaration's one message."""
    from nanoserve import InputError
    from ray_jobs.workers.options import JobOptions

    for name, value in (("batch_size", 0), ("max_batch_tokens", -1), ("chunk_rows", 0),
                        ("worker_start_timeout_s", 0.0), ("max_in_flight_per_worker", 0),
                        ("max_deaths_in_a_row", -1), ("input_format", "csv"),
                        ("output_format", "csv")):
        with pytest.raises(InputError) as e:
            JobOptions(**{name: value})
        assert str(e.value) == JOB[name].problem(value), name


def test_the_tasks_set_their_declared_defaults_of_the_jobs():
    """The prefill-only tasks' larger shards and token-bound batches, as `run_job` takes
    them (`TaskKind.take_options`) and the commands give them."""
    from ray_jobs.tasks.classify import take_options as classify_options
    from ray_jobs.tasks.embed import take_options as embed_options

    for task, take in (("embed", embed_options), ("classify", classify_options),
                       ("score", classify_options)):
        options: dict = {}
        take(options)
        for name in ("batch_size", "max_batch_tokens"):
            assert options[name] == JOB[name].default_for(task) != JOB[name].default, name


def test_llm_and_the_ray_data_stage_take_the_declared_defaults():
    """`LLM`'s engine options, and every keyword argument with a default of the Ray Data
    stage (`build_processor`, and each task's actor class at its task's defaults)."""
    from nanoserve.llm import LLM
    from ray_jobs.data_processor import (
        DatasetClassifier,
        DatasetEmbedder,
        DatasetGenerator,
        build_processor,
    )

    llm = inspect.signature(LLM.__init__).parameters
    for name, argument in LLM_ARGUMENTS.items():
        assert llm[argument].default == ENGINE[name].default_for("LLM"), name
    for function, entry in ((build_processor, "build_processor"),
                            (DatasetGenerator.__init__, "build_processor"),
                            (DatasetEmbedder.__init__, "embed"),
                            (DatasetClassifier.__init__, "classify")):
        parameters = inspect.signature(function).parameters.values()
        given = [p for p in parameters if p.default is not p.empty and p.name not in NOT_OPTIONS]
        assert given, function
        for p in given:
            assert p.name in DECLARED, (function.__qualname__, p.name)
            assert p.default == DECLARED[p.name].default_for(entry), (function, p.name)


def test_overrides_are_named_and_explained():
    """A default that differs at an entry point is a deliberate, documented exception."""
    overridden = {name: o for name, o in DECLARED.items() if o.overrides}
    assert set(overridden) == {"max_tokens", "kv_cache_fraction", "batch_size",
                               "max_batch_tokens"}
    for option in overridden.values():
        assert option.why, option.name
    assert SAMPLING["max_tokens"].default_for("generate") == 64
    assert SAMPLING["max_tokens"].default_for("batch") == 256
    for task in PREFILL_TASKS:
        assert JOB["batch_size"].default_for(task) == 1024
    assert JOB["batch_size"].default_for("batch") == JOB["batch_size"].default == 64


def test_checks_say_what_is_wrong_once():
    assert SAMPLING["max_tokens"].problem(0) == "max_tokens must be an integer >= 1, got 0"
    assert SAMPLING["max_tokens"].problem(1) is None
    assert SAMPLING["seed"].problem(None) is None
    assert ENGINE["scheduler"].problem("fifo") == \
        "unknown scheduler 'fifo'; choose auto, static, continuous"
    thinking = SAMPLING["max_thinking_tokens"]
    assert thinking.problem(-1, thinking.flag) == \
        "--max-thinking-tokens must be an integer >= 0, got -1"
    assert JOB["batch_size"].problem(0) == "batch_size must be an integer >= 1, got 0"
    memory = JOB["kv_cache_memory"]
    assert memory.problem(0.0, memory.flag) == "--kv-cache-memory must be > 0 GiB, got 0.0"
    assert JOB["worker_start_timeout_s"].flag == "--worker-start-timeout"


def test_the_reasoning_parsers_are_the_declared_choices():
    from nanoserve.sampling.reasoning import CHOICES, PARSERS

    assert CHOICES == ENGINE["reasoning_parser"].choices == ("auto", "none", *PARSERS)
    assert PARSERS == ("qwen3", "deepseek_r1")


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
            name = FLAG_NAMES.get(flag) or \
                flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
            out += [(name, constant(k.value), k.value.lineno) for k in node.keywords
                    if k.arg == "default"]
    return [(n, v, line) for n, v, line in out if v is not _NO]


_NO = object()
FLAG_NAMES = {o.flag: name for name, o in DECLARED.items()}  # `--worker-start-timeout`, ...


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def _declared_again(source: str) -> list[tuple[str, object, int]]:
    """The declared defaults (an option's default or override) that `source` writes again,
    as (option name, value, line); None, booleans and empty values are too common to
    tell apart and are left out."""
    found = []
    for name, value, line in _defaults_in(ast.parse(source)):
        option = DECLARED.get(name)
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
    ("ray_jobs/dispatch/pool.py", "num_gpus"): "a job worker's one GPU (Ray's actor option)",
}


def test_no_declared_default_is_written_twice():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            where = str(path.relative_to(REPO))
            if where not in DECLARATIONS:
                found += [(where, *hit) for hit in _declared_again(path.read_text())
                          if (where, hit[0]) not in NOT_THE_OPTION]
    assert not found, found


def test_the_scan_finds_a_default_written_again():
    """The scan above can fail: each way of writing a default is found, a call is not."""
    for source in ("class A:\n    max_tokens: int = 256\n", "def f(max_tokens=256): ...",
                   "def f(*, max_tokens=64): ...", 'sampling = {"max_tokens": 256, **s}',
                   's.add_argument("--max-tokens", type=int, default=256, help="x")',
                   'def f(scheduler="auto"): ...',
                   # the job's own: the shard rows of `JobOptions` and of the Ray Data stage
                   "class JobOptions:\n    batch_size: int = 64\n",
                   "def build_processor(model, *, batch_size: int = 64): ...",
                   's.add_argument("--batch-size", type=int, default=1024)',
                   'options = {"max_batch_tokens": 65536}',
                   's.add_argument("--worker-start-timeout", default=600.0)'):
        assert _declared_again(source), source
    for source in ("class A:\n    max_tokens: int = 2560\n", "f(max_tokens=256)",
                   "def f(max_tokens=256.0): ...", "run_job(batch_size=64)"):
        assert not _declared_again(source), source


def test_the_declaration_is_torch_free():
    """The CLIs and the job's driver read them without loading the engine."""
    import subprocess
    import sys

    code = ("import sys, nanoserve.options, ray_jobs.options; "
            "assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
