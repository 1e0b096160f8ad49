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
