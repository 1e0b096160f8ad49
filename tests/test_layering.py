"""Imports go one way: nanoserve_kernels <- nanoserve (engine) <- ray_jobs (job) <- nanoserve_cli
(the command line), and no two modules of a package import each other, however indirectly.
Inside ray_jobs, one subpackage per stage a row goes through, each importing only the stages
before it, above a base at the top level (the job's options, `ray_jobs.options`):

    base <- input <- preparation <- output <- workers <- tasks <- report <- dispatch <- entry points

(input: listing, scanning, reading a shard's rows, filesystems; preparation: rows to
requests; output: the manifest and the parts' names, below the workers that write them;
workers: a shard's walk on the engine's worker, the job's options; tasks: generation and
embedding; report: phases and the HTML report; dispatch: the driver and the actor pool; the
entry points, `ray_jobs.cli` and `ray_jobs.data_processor`, and the package's own
`__init__`, at the top level, above every stage). Every import counts, function-local and
TYPE_CHECKING ones included (read from the source with `ast`, nothing imported); modules in
subpackages too. And the job and the command line see the engine only through its public
API: `import nanoserve` or `from nanoserve import <a name in nanoserve.__all__>`.

Inside the engine (nanoserve), one subpackage per subsystem, each importing only those below
it, between a base at the top level (errors, options, CPU threads) and the top level's rest:

    base <- multimodal <- cache <- model <- weights <- sampling <- static <- scheduling <- top
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["nanoserve_kernels", "nanoserve", "ray_jobs", "nanoserve_cli"]  # each may import those before it


def imports_of(path: Path) -> set[str]:
    """Every module name `path` imports, absolute."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def modules(package: str) -> dict[str, Path]:
    """Every module of `package`, its subpackages' included, by dotted name (a package's
    `__init__` under the package's own name)."""
    found = {}
    for p in sorted((REPO / package).rglob("*.py")):
        parts = p.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return found


def test_modules_are_found_in_subpackages():
    mods = modules("ray_jobs")
    assert {"ray_jobs", "ray_jobs.cli", "ray_jobs.input", "ray_jobs.input.io",
            "ray_jobs.tasks.generate", "ray_jobs.dispatch.driver"} <= set(mods)


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_reaches_a_layer_above(layer):
    above = LAYERS[LAYERS.index(layer) + 1:] + (["ray"] if layer in ("nanoserve_kernels", "nanoserve") else [])
    bad = [(name, imp) for name, path in modules(layer).items() for imp in imports_of(path)
           if imp.split(".")[0] in above]
    assert bad == []


@pytest.mark.parametrize("package", LAYERS)
def test_no_import_cycle_inside_a_package(package):
    mods = modules(package)
    graph = {name: {imp for imp in imports_of(path) if imp in mods and imp != name}
             for name, path in mods.items() if name != package}
    for edges in graph.values():
        edges.discard(package)  # the package's __init__ imports lazily, by name
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


# The job's stage packages, first to last: each imports only those before it (and its own).
STAGES = ["input", "preparation", "output", "workers", "tasks", "report", "dispatch"]
ENTRY_POINTS = {"ray_jobs", "ray_jobs.cli", "ray_jobs.data_processor"}  # the top level
JOB_BASE = {"ray_jobs.options"}  # at the top level, below every stage: the job's options


def stage_of(name: str) -> int:
    """The stage of a ray_jobs module (or of a name in it): its index in STAGES, -1 for the
    base (JOB_BASE), or len(STAGES) for the top level (the entry points and the package's
    `__init__`)."""
    parts = name.split(".")
    if ".".join(parts[:2]) in JOB_BASE:
        return -1
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else len(STAGES)


def test_every_job_module_is_in_a_stage_or_an_entry_point():
    top = {name for name in modules("ray_jobs") if stage_of(name) == len(STAGES)}
    assert top == ENTRY_POINTS
    assert {name for name in modules("ray_jobs") if stage_of(name) < 0} == JOB_BASE
    subpackages = {p.parent.name for p in (REPO / "ray_jobs").glob("*/__init__.py")}
    assert subpackages == set(STAGES)


def test_a_stage_imports_only_the_stages_before_it():
    """base <- input <- preparation <- output <- workers <- tasks <- report <- dispatch: a
    module of a stage package imports from its own stage and those before it, never from a
    later stage nor from the top level (the entry points, or `ray_jobs` itself); the base
    imports no stage."""
    bad = [(name, imp) for name, path in modules("ray_jobs").items()
           if stage_of(name) < len(STAGES)
           for imp in sorted(imports_of(path))
           if imp.split(".")[0] == "ray_jobs" and stage_of(imp) > stage_of(name)]
    assert bad == []


# Inside the job (ray_jobs), from the top: the entry points, the driver (the one job), the
# two tasks, then the shard walk and everything it reads. Modules not named: the bottom.
JOB_LEVELS = {"ray_jobs.cli": 0, "ray_jobs.data_processor": 0, "ray_jobs.dispatch.driver": 1,
              "ray_jobs.tasks.generate": 2, "ray_jobs.tasks.embed": 2,
              "ray_jobs.tasks.classify": 2}
BOTTOM = max(JOB_LEVELS.values()) + 1


def test_the_tasks_plug_into_one_job_from_above():
    """A ray_jobs module imports only from the levels below its own (the package's
    `__init__`, which imports lazily by name, aside): the driver from no entry point, a task
    from neither the driver nor the other task, the shard walk, the pool and the workers
    from no task."""
    def level(name: str) -> int:
        return JOB_LEVELS.get(name, BOTTOM)

    mods = modules("ray_jobs")
    bad = [(name, imp) for name, path in mods.items() if name != "ray_jobs"
           for imp in imports_of(path) if imp in mods and imp not in (name, "ray_jobs")
           and (level(imp) < level(name) or level(imp) == level(name) < BOTTOM)]
    assert bad == []


# The engine's public API: `nanoserve.__all__`. The job and the command line import only
# `nanoserve` itself or those names from it, never a module of the engine (its internals:
# the KV pool's block count, the engine loop's class, label log-probabilities over a model
# and a pool, the tokenizer's private tables, ...). No exceptions.
API_USERS = ["ray_jobs", "nanoserve_cli"]


def public_api() -> set[str]:
    """The names in `nanoserve/__init__.py`'s `__all__` (read with `ast`, nothing imported)."""
    tree = ast.parse((REPO / "nanoserve" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("nanoserve/__init__.py has no literal __all__")


def engine_imports_outside_the_api(path: Path, api: set[str]) -> list[str]:
    """Each import in `path` of the engine that is not `import nanoserve` or
    `from nanoserve import <a name in api>`, as written (`nanoserve.x`, `nanoserve:name`)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names
                    if a.name.split(".")[0] == "nanoserve" and a.name != "nanoserve"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "nanoserve":
                bad += [f"nanoserve:{a.name}" for a in node.names if a.name not in api]
            elif node.module.split(".")[0] == "nanoserve":
                bad.append(node.module)
    return bad


def test_the_public_api_is_what_the_package_exports():
    """`__all__` lists every name the package resolves lazily, and only those; `import
    nanoserve` stays free of torch (each name imports its module at its first use)."""
    import subprocess
    import sys

    code = ("import sys, nanoserve; assert 'torch' not in sys.modules; "
            "assert set(nanoserve.__all__) == set(nanoserve._PUBLIC), "
            "set(nanoserve.__all__) ^ set(nanoserve._PUBLIC)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    assert public_api() and "LLM" in public_api() and "SamplingParams" in public_api()


@pytest.mark.parametrize("package", API_USERS)
def test_the_job_uses_only_the_engines_public_api(package):
    api = public_api()
    bad = [(name, imp) for name, path in modules(package).items()
           for imp in engine_imports_outside_the_api(path, api)]
    assert bad == []


def test_an_import_outside_the_api_is_caught(tmp_path):
    """The rule's own check: an internal module, a private name, a name not exported."""
    src = tmp_path / "m.py"
    src.write_text("import nanoserve\nfrom nanoserve import LLM\n"
                   "from nanoserve.static.generate import blocks_for_batch\nimport nanoserve.llm\n"
                   "def f():\n    from nanoserve import EngineLoop\n")
    assert sorted(engine_imports_outside_the_api(src, public_api())) == [
        "nanoserve.llm", "nanoserve.static.generate", "nanoserve:EngineLoop"]


# Inside the engine (nanoserve), one subpackage per subsystem, from the bottom: a module
# imports from its own subsystem and those below it, never from one above (function-local
# and TYPE_CHECKING imports included). The top-level modules are split in two: the base
# below every subsystem (the errors, the options every entry point shares, torch's CPU
# threads), and the top above them all (the engine as one object, its command line, the
# embedder, the test helpers, the package's own `__init__`).
#
#   base <- multimodal <- cache <- model <- weights <- sampling <- static <- scheduling <- top
#
# (multimodal: images, the vision tower and M-RoPE positions, run by the model; cache: the
# KV pool the model's attention reads and writes; model: its configuration, families and
# layers; weights: the model's files, loaded into the model, and its tokenizer; sampling:
# choosing tokens, structured outputs, a row's sequence; static: the static engine, whose
# batch counters the continuous one keeps; scheduling: the continuous engine.)
ENGINE_BASE = {"nanoserve.errors", "nanoserve.options", "nanoserve.cpu_threads"}
SUBSYSTEMS = ["multimodal", "cache", "model", "weights", "sampling", "static", "scheduling"]
# Packages at the top level beside `llm` and `embed`: the encoders (`nanoserve/encoder/`, their
# own forward, weights, tokenizer and `Encoder`, used by `Embedder` and the job's tasks).
TOP_PACKAGES = {"encoder"}


def subsystem_of(name: str) -> int:
    """The level of a nanoserve module (or of a name in it): 0 for the base, 1 + its index in
    SUBSYSTEMS for a subsystem's, len(SUBSYSTEMS) + 1 for the top."""
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in SUBSYSTEMS:
        return 1 + SUBSYSTEMS.index(parts[1])
    if ".".join(parts[:2]) in ENGINE_BASE:
        return 0
    return len(SUBSYSTEMS) + 1


def imports_of_engine(name: str, path: Path) -> list[tuple[str, str]]:
    """Each engine import in `path` that reaches a subsystem above the module's own, with
    `from nanoserve import <module>` read as that module."""
    bad = []
    for imp in sorted(imports_of(path)):
        if imp.split(".")[0] == "nanoserve" and subsystem_of(imp) > subsystem_of(name):
            bad.append((name, imp))
    return bad


def test_every_engine_module_is_in_a_subsystem_or_at_the_top_level():
    subpackages = {p.parent.name for p in (REPO / "nanoserve").glob("*/__init__.py")}
    assert subpackages == set(SUBSYSTEMS) | TOP_PACKAGES
    assert ENGINE_BASE <= set(modules("nanoserve"))
    nested = {name for name in modules("nanoserve") if name.count(".") > 1}
    assert all(name.split(".")[1] in set(SUBSYSTEMS) | TOP_PACKAGES for name in nested)


def test_a_subsystem_imports_only_the_subsystems_below_it():
    """base <- multimodal <- cache <- model <- weights <- sampling <- static <- scheduling <-
    top: no engine module imports from a level above its own."""
    bad = [b for name, path in modules("nanoserve").items() for b in imports_of_engine(name, path)]
    assert bad == []


def test_an_import_from_a_higher_subsystem_is_caught(tmp_path):
    """The rule's own check: the cache reaching up into the model (a function-local import),
    the base into a subsystem, the model under TYPE_CHECKING into the static engine."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom nanoserve.errors import ModelError\n"
                   "def f():\n    from nanoserve.model.config import ModelConfig\n"
                   "if TYPE_CHECKING:\n    from nanoserve.static.generate import BatchStats\n")
    assert [imp for _, imp in imports_of_engine("nanoserve.cache.pool", src)] == [
        "nanoserve.model.config", "nanoserve.model.config.ModelConfig",
        "nanoserve.static.generate", "nanoserve.static.generate.BatchStats"]
    assert imports_of_engine("nanoserve.scheduling.scheduler", src) == []
    assert imports_of_engine("nanoserve.errors", src) != []
