"""The GPU-only test files, checked on the CPU: each parses, and every name that one of them
imports (at module level or inside a test, from a test helper module or from the packages)
exists, so a renamed helper fails here rather than on the next GPU run. The GPU files skip
themselves without CUDA, before their imports run; this reads their imports with `ast`
and resolves each one."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GPU_FILES = sorted(p for p in TESTS.glob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text() and p.name != Path(__file__).name)
OURS = ("nanoserve", "nanoserve_kernels", "ray_jobs", "nanoserve_cli", "benchmarks")


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) for every `from module import name` of ours or of tests/."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        top = node.module.split(".")[0]
        if top in OURS or (TESTS / f"{top}.py").is_file():
            out.extend((node.module, a.name, node.lineno) for a in node.names)
    return out


def test_every_gpu_file_is_found():
    names = {p.name for p in GPU_FILES}
    assert {"test_fused_moe_gpu.py", "test_kernels_gpu.py", "test_engine_gpu.py"} <= names


@pytest.mark.parametrize("path", GPU_FILES, ids=[p.name for p in GPU_FILES])
def test_gpu_file_imports_resolve(path):
    missing = []
    for module, name, line in _imports(path):
        mod = importlib.import_module(module)
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, "imports that no longer exist:\n" + "\n".join(missing)
