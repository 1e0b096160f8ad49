"""Imports go one way: nanoserve_kernels <- nanoserve (engine) <- ray_jobs (job) <- nanoserve_cli
(the command line), and no two modules of a package import each other, however indirectly.
Every import counts, function-local and TYPE_CHECKING ones included (read from the source
with `ast`, nothing imported)."""

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
    return {f"{package}.{p.stem}" if p.stem != "__init__" else package: p
            for p in sorted((REPO / package).glob("*.py"))}


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


# Inside the job (ray_jobs), from the top: the entry points, the driver (the one job), the
# two tasks, then the shard walk and everything it reads. Modules not named: the bottom.
JOB_LEVELS = {"ray_jobs.cli": 0, "ray_jobs.data_processor": 0, "ray_jobs.dispatch.driver": 1,
              "ray_jobs.tasks.generate": 2, "ray_jobs.tasks.embed": 2}
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
